// The API's body parsers on their own: the typed requests they make, and the error naming the field for
// each kind of bad input (the server's tests check the same answers through HTTP).
#include "noderuntime/api_request.h"

#include <gtest/gtest.h>

#include <limits>

namespace sg {
namespace {

using json = nlohmann::json;

// check_api_body is the fuzz target's way in (tests/fuzz/api_body_fuzz.cc): it must run the routes' own
// parsers, each with its own fields.
// The activity report is read from the text, without a JSON tree: the same answers as the other bodies, for
// every kind of misplaced value, and the body's reporter applies wherever in the body it stands.
TEST(ApiBodyTest, TheActivityReaderNamesWhatIsWrongAndAppliesTheBodysReporter) {
  auto ok = parse_activity(
      R"({"sandboxes": [{"id": "sb-1", "bytes_in": 1, "bytes_out": 2, "connections": 3},
                        {"id": "sb-2", "reporter": "own"}], "reporter": "w0"})");
  ASSERT_TRUE(ok) << ok.message();
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].id, "sb-1");
  EXPECT_EQ((*ok)[0].reporter, "w0") << "named after the list, still the default";
  EXPECT_EQ((*ok)[0].bytes_in, 1u);
  EXPECT_EQ((*ok)[0].bytes_out, 2u);
  EXPECT_EQ((*ok)[0].connections, 3u);
  EXPECT_EQ((*ok)[1].reporter, "own");
  EXPECT_TRUE(parse_activity(R"({"sandboxes": []})"));

  auto error = [](const std::string& body) {
    auto r = parse_activity(body);
    EXPECT_FALSE(r) << body;
    return r ? std::string() : r.message();
  };
  EXPECT_EQ(error(""), "request body must be a JSON object, got nothing");
  EXPECT_EQ(error("[]"), "request body must be a JSON object, got array");
  EXPECT_EQ(error("7"), "request body must be a JSON object, got number");
  EXPECT_EQ(error(R"({"sandboxes": [)"), "request body is not valid JSON");
  EXPECT_EQ(error(R"({"sandboxes": []} x)"), "request body is not valid JSON");
  EXPECT_EQ(error("{}"), "sandboxes is required (an array of objects)");
  EXPECT_EQ(error(R"({"sandboxes": {}})"), "sandboxes: must be an array of objects, got object");
  EXPECT_EQ(error(R"({"sandboxes": [], "sandboxes": []})"), "sandboxes: given twice");
  EXPECT_EQ(error(R"({"reporter": 1, "sandboxes": []})"), "reporter: must be a string, got number");
  EXPECT_EQ(error(R"({"extra": 1})"), "unknown field 'extra' (allowed: sandboxes, reporter)");
  EXPECT_EQ(error(R"({"sandboxes": ["sb-1"]})"), "sandboxes[]: must be an object, got string");
  EXPECT_EQ(error(R"({"sandboxes": [[]]})"), "sandboxes[]: must be an object, got array");
  EXPECT_EQ(error(R"({"sandboxes": [{"bytes_in": 1}]})"), "sandboxes[].id is required");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": 5}]})"), "sandboxes[].id: must be a string, got number");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": "a", "bytes_in": -1}]})"),
            "sandboxes[].bytes_in: must be a non-negative integer, got number");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": "a", "bytes_out": 1.5}]})"),
            "sandboxes[].bytes_out: must be a non-negative integer, got number");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": "a", "connections": {"deep": [1]}}]})"),
            "sandboxes[].connections: must be a non-negative integer, got object");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": "a", "reporter": null}]})"),
            "sandboxes[].reporter: must be a string, got null");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": "a", "bytes_in": 18446744073709551616}]})"),
            "request body has a malformed number or one beyond 64 bits");
  EXPECT_EQ(error("{\"sandboxes\": [{\"id\": \"\xff\"}]}"), "request body is not valid JSON");
  EXPECT_EQ(error(R"({"sandboxes": [{"id": "a", "port": 1}]})"),
            "unknown field 'sandboxes[].port' (allowed: id, bytes_in, bytes_out, connections, reporter)");
}

TEST(ApiBodyTest, EachRouteParsesItsOwnBody) {
  EXPECT_TRUE(check_api_body(ApiBody::kLookup, R"({"sandbox": "demo", "port": 8080})"));
  EXPECT_TRUE(check_api_body(ApiBody::kOpen, R"({"sandbox": "demo", "port": 3000, "credentials": ["a"], "spare_sockets": 2})"));
  EXPECT_TRUE(check_api_body(ApiBody::kSockets, R"({"sandbox": "demo", "port": 22, "count": 4})"));
  EXPECT_TRUE(check_api_body(ApiBody::kActivity, R"({"sandboxes": [{"id": "sb-1", "bytes_in": 1}]})"));
  EXPECT_TRUE(check_api_body(ApiBody::kCreate, R"({"command": ["sleep", "1"]})"));
  EXPECT_TRUE(check_api_body(ApiBody::kBuild, R"({"name": "web", "steps": [{"run": "true"}]})"));
  EXPECT_TRUE(check_api_body(ApiBody::kCheckpoint, R"({"type": "memory"})"));
  EXPECT_TRUE(check_api_body(ApiBody::kFork, R"({"count": 2})"));

  Status lookup_with_credentials = check_api_body(ApiBody::kLookup, R"({"sandbox": "demo", "port": 1, "credentials": []})");
  EXPECT_EQ(lookup_with_credentials.error(), Error::kInvalidArgument);
  EXPECT_EQ(check_api_body(ApiBody::kCreate, "[]").message(), "request body must be a JSON object, got array");
  EXPECT_EQ(check_api_body(ApiBody::kOpen, R"({"sandbox": "demo", "port": 70000})").message(),
            "port is required and must be between 1 and 65535");
  EXPECT_EQ(check_api_body(ApiBody::kBuild, "{\"name\": ").message(), "request body is not valid JSON");
}

TEST(ApiRequestTest, ACreateBodyBecomesItsRequest) {
  auto req = parse_create(json::parse(R"({"name": "web", "command": ["python3", "-m", "http.server"],
      "env": {"A": "1"}, "ports": [{"port": 8080, "public": true, "protocol": "h2c"}], "memory_mb": 512,
      "cpus": 1.5, "allow_out": ["10.0.0.0/8"], "timeout_secs": 600})"));
  ASSERT_TRUE(req) << req.message();
  EXPECT_EQ(req->name, "web");
  EXPECT_EQ(req->command, (std::vector<std::string>{"python3", "-m", "http.server"}));
  EXPECT_EQ(req->env.at("A"), "1");
  ASSERT_EQ(req->ports.size(), 1u);
  EXPECT_EQ(req->ports[0].port, 8080);
  EXPECT_EQ(req->ports[0].is_public, true);
  EXPECT_EQ(req->ports[0].protocol, "h2c");
  EXPECT_EQ(req->memory_mb, 512);
  EXPECT_EQ(req->cpus, 1.5);
  EXPECT_EQ(req->allow_out, (std::vector<std::string>{"10.0.0.0/8"}));
}

TEST(ApiRequestTest, EachBadFieldIsNamed) {
  auto message = [](const char* body) { return parse_create(json::parse(body)).message(); };
  EXPECT_EQ(message(R"({"command": "ls"})"), "command: must be an array of strings, got string");
  EXPECT_EQ(message(R"({"command": ["ls", 1]})"), "command[]: must be a string, got number");
  EXPECT_EQ(message(R"({"command": ["ls"], "env": {"A": 1}})"), "env.A: must be a string, got number");
  EXPECT_EQ(message(R"({"command": ["ls"], "ports": [{"public": true}]})"), "ports[].port is required");
  EXPECT_NE(message(R"({"command": ["ls"], "colour": "red"})").find("unknown field 'colour' (allowed: name, command"),
            std::string::npos);
  EXPECT_EQ(message(R"({})"), "command is required (an array of strings: argv)");
  EXPECT_TRUE(parse_create(json::parse(R"({"snapshot_id": "snap-1"})")));  // the snapshot's command is the default
  // Huge unsigned integers saturate rather than wrap, so the node's range checks still refuse them.
  auto big = parse_create(json::parse(R"({"command": ["ls"], "timeout_secs": 18446744073709551615})"));
  ASSERT_TRUE(big);
  EXPECT_EQ(big->timeout_secs, std::numeric_limits<int64_t>::max());
}

TEST(ApiRequestTest, AnOpenCarriesAtMostItsCredentialLimit) {
  json open = {{"sandbox", "demo"}, {"port", 443}, {"credentials", json::array()}};
  for (size_t i = 0; i < kMaxCredentialsPerOpen; ++i) open["credentials"].push_back("sgt_" + std::to_string(i));
  auto ok = parse_port_request(open, PortRequestKind::kOpen);
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->credentials.size(), kMaxCredentialsPerOpen);
  open["credentials"].push_back("one-more");
  EXPECT_EQ(parse_port_request(open, PortRequestKind::kOpen).message(), "credentials: at most 4 candidates");
  json many_spares = {{"sandbox", "demo"}, {"port", 443}, {"spare_sockets", Node::kMaxSpareSockets + 1}};
  EXPECT_EQ(parse_port_request(many_spares, PortRequestKind::kOpen).error(), Error::kInvalidArgument);
}

TEST(ApiRequestTest, ALookupMayAskForAPrewakeAndOpensAndLookupsNameTheirClient) {
  auto lookup = parse_port_request(json{{"sandbox", "demo"}, {"port", 443}, {"client", "[::1]"}, {"prewake", true}},
                                   PortRequestKind::kLookup);
  ASSERT_TRUE(lookup) << lookup.message();
  EXPECT_EQ(lookup->client, "[::1]");
  EXPECT_TRUE(lookup->prewake);
  auto open = parse_port_request(json{{"sandbox", "demo"}, {"port", 443}, {"client", "10.0.0.1"}}, PortRequestKind::kOpen);
  ASSERT_TRUE(open) << open.message();
  EXPECT_EQ(open->client, "10.0.0.1");
  EXPECT_FALSE(open->prewake);
  EXPECT_EQ(parse_port_request(json{{"sandbox", "demo"}, {"port", 443}, {"prewake", true}}, PortRequestKind::kOpen).message(),
            "unknown field 'prewake' (allowed: sandbox, port, credentials, spare_sockets, client)");
  EXPECT_EQ(parse_port_request(json{{"sandbox", "demo"}, {"port", 443}, {"prewake", "yes"}}, PortRequestKind::kLookup).error(),
            Error::kInvalidArgument);
  EXPECT_EQ(parse_port_request(json{{"sandbox", "demo"}, {"port", 443}, {"client", 7}}, PortRequestKind::kLookup).error(),
            Error::kInvalidArgument);
  json longest = {{"sandbox", "demo"}, {"port", 443}, {"client", std::string(kMaxClientAddressLength, 'a')}};
  EXPECT_TRUE(parse_port_request(longest, PortRequestKind::kLookup));
  longest["client"] = std::string(kMaxClientAddressLength + 1, 'a');
  EXPECT_EQ(parse_port_request(longest, PortRequestKind::kLookup).message(), "client: at most 64 characters");
}

TEST(ApiRequestTest, ACheckpointWithoutABodyIsAFilesystemOne) {
  EXPECT_EQ(*parse_checkpoint(""), "filesystem");
  EXPECT_EQ(*parse_checkpoint(R"({"type": "memory"})"), "memory");
  EXPECT_EQ(parse_checkpoint(R"({"kind": "memory"})").message(), "unknown field 'kind' (allowed: type)");
}

TEST(ApiRequestTest, AForkTakesACountWithinItsBoundAndAPrefix) {
  auto none = parse_fork("");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->count, 1u);
  EXPECT_FALSE(none->name_prefix);
  auto both = parse_fork(R"({"count": 3, "name_prefix": "branch"})");
  ASSERT_TRUE(both) << both.message();
  EXPECT_EQ(both->count, 3u);
  EXPECT_EQ(both->name_prefix, "branch");
  EXPECT_EQ(parse_fork(R"({"count": 0})").message(), "count: must be between 1 and 64");
  EXPECT_EQ(parse_fork(R"({"count": 65})").message(), "count: must be between 1 and 64");
  EXPECT_EQ(parse_fork(R"({"count": "2"})").error(), Error::kInvalidArgument);
  EXPECT_EQ(parse_fork(R"({"name_prefix": 7})").error(), Error::kInvalidArgument);
  EXPECT_EQ(parse_fork(R"({"n": 1})").message(), "unknown field 'n' (allowed: count, name_prefix)");
  EXPECT_EQ(parse_fork("[1]").error(), Error::kInvalidArgument);
}

TEST(ApiRequestTest, AnExposeTakesAPolicyOrNothing) {
  auto none = parse_expose("");
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->is_public);
  EXPECT_FALSE(none->protocol);
  auto both = parse_expose(R"({"public": true, "protocol": "tcp"})");
  ASSERT_TRUE(both) << both.message();
  EXPECT_EQ(both->is_public, true);
  EXPECT_EQ(both->protocol, "tcp");
  EXPECT_EQ(parse_expose(R"({"public": "yes"})").error(), Error::kInvalidArgument);
  EXPECT_EQ(parse_expose(R"({"protocol": 2})").error(), Error::kInvalidArgument);
  EXPECT_EQ(parse_expose(R"({"port": 1})").message(), "unknown field 'port' (allowed: public, protocol)");
  EXPECT_EQ(parse_expose("{").error(), Error::kInvalidArgument);
}

}  // namespace
}  // namespace sg
