#include "agent/exec.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace sg::agent {
namespace {

using json = nlohmann::json;

TEST(ExecRequest, ParsesEveryField) {
  auto spec = parse_exec_request(
      R"({"command":["sh","-c","x"],"env":{"A":"1"},"cwd":"/tmp","stdin":"in","timeout_secs":5})");
  ASSERT_TRUE(spec.ok()) << spec.message();
  EXPECT_EQ(spec->command, (std::vector<std::string>{"sh", "-c", "x"}));
  ASSERT_EQ(spec->env.size(), 1u);
  EXPECT_EQ(spec->env[0].first, "A");
  EXPECT_EQ(spec->cwd, "/tmp");
  EXPECT_EQ(spec->stdin_data, "in");
  EXPECT_EQ(spec->timeout_secs, 5u);
}

TEST(ExecRequest, RejectsBadInputWithAClearMessage) {
  struct Case {
    std::string_view body;
    std::string_view mentions;
  };
  for (const Case& c : {Case{"{", "not valid JSON"}, Case{"[]", "JSON object"}, Case{"{}", "command is required"},
                        Case{R"({"command":[]})", "non-empty"}, Case{R"({"command":"ls"})", "array"},
                        Case{R"({"command":[1]})", "command[]"}, Case{R"({"command":[""]})", "command[0]"},
                        Case{R"({"command":["a\u0000b"]})", "NUL"}, Case{R"({"command":["ls"],"env":{"A=B":"x"}})", "A=B"},
                        Case{R"({"command":["ls"],"env":{"A":1}})", "env.A"},
                        Case{R"({"command":["ls"],"timeout_secs":-1})", "timeout_secs"},
                        Case{R"({"command":["ls"],"bogus":1})", "unknown field 'bogus'"}}) {
    auto r = parse_exec_request(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.error(), Error::kInvalidArgument);
    EXPECT_NE(r.message().find(c.mentions), std::string::npos) << c.body << " -> " << r.message();
  }
}

TEST(ExecEvents, TextStaysTextAndBinaryIsBase64) {
  json text = json::parse(output_event(false, "h\xc3\xa9llo\n"));
  EXPECT_EQ(text["type"], "stdout");
  EXPECT_EQ(text["data"], "h\xc3\xa9llo\n");
  json binary = json::parse(output_event(true, std::string_view("\xff\xfe\x00z", 4)));
  EXPECT_EQ(binary["type"], "stderr");
  EXPECT_FALSE(binary.contains("data"));
  EXPECT_EQ(binary["data_b64"], "//4Aeg==");
  EXPECT_EQ(exit_event(ExecExit{3, 0, false}), "{\"type\":\"exit\",\"code\":3}\n");
  EXPECT_EQ(exit_event(ExecExit{0, 9, true}), "{\"type\":\"exit\",\"signal\":9,\"timed_out\":true}\n");
  EXPECT_EQ(start_event(42), "{\"type\":\"start\",\"pid\":42}\n");
}

TEST(Utf8, ValidatesStrictly) {
  EXPECT_TRUE(is_valid_utf8("plain \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  for (std::string_view bad : {"\x80", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xc3"})
    EXPECT_FALSE(is_valid_utf8(bad));
}

TEST(Utf8, CarryHoldsBackASplitCharacter) {
  Utf8Carry carry;
  EXPECT_EQ(carry.take("ab\xe2\x82"), "ab");
  EXPECT_EQ(carry.take("\xac!"), "\xe2\x82\xac!");
  EXPECT_EQ(carry.take("\xf0"), "");
  EXPECT_EQ(carry.flush(), "\xf0");
  EXPECT_EQ(carry.take("\xff"), "\xff");  // not a lead byte of anything: passed on, reported as binary
}

}  // namespace
}  // namespace sg::agent
