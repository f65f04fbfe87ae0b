#include "agent/code_context.h"

#include <gtest/gtest.h>

#include "agent/code_service.h"

namespace sg::agent {
namespace {

TEST(FrameReader, SplitsFramesAcrossAnyReadBoundary) {
  std::string stream = encode_frame("{\"a\":1}") + encode_frame("") + encode_frame(std::string(300, 'x'));
  for (size_t step : {size_t{1}, size_t{3}, size_t{7}, stream.size()}) {
    FrameReader reader(1024);
    std::vector<std::string> frames;
    for (size_t i = 0; i < stream.size(); i += step)
      ASSERT_TRUE(reader.feed(std::string_view(stream).substr(i, step), frames).ok());
    ASSERT_EQ(frames.size(), 3u) << step;
    EXPECT_EQ(frames[0], "{\"a\":1}");
    EXPECT_EQ(frames[1], "");
    EXPECT_EQ(frames[2], std::string(300, 'x'));
  }
}

TEST(FrameReader, AFrameOverTheLimitBreaksTheStreamForGood) {
  FrameReader reader(100);
  std::vector<std::string> frames;
  ASSERT_TRUE(reader.feed(encode_frame(std::string(100, 'a')), frames).ok());
  auto s = reader.feed(encode_frame(std::string(101, 'b')).substr(0, 4), frames);  // the length alone tells
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), Error::kLimitExceeded);
  EXPECT_NE(s.message().find("101 bytes"), std::string::npos) << s.message();
  EXPECT_FALSE(reader.feed(encode_frame("ok"), frames).ok());
  EXPECT_EQ(frames.size(), 1u);
}

TEST(EncodeFrame, IsBigEndianLengthThenPayload) {
  EXPECT_EQ(encode_frame(std::string(258, 'z')).substr(0, 4), std::string("\0\0\x01\x02", 4));
}

TEST(RunRequest, ParsesEveryField) {
  auto r = parse_run_request(R"({"code":"x = 1","context":"abc-1_2","timeout_secs":5,"language":"bash"})", 100);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r->code, "x = 1");
  EXPECT_EQ(r->context, "abc-1_2");
  EXPECT_EQ(r->timeout_secs, 5u);
  EXPECT_EQ(r->language, "bash");
  auto null_context = parse_run_request(R"({"code":"","context":null})", 100);
  ASSERT_TRUE(null_context.ok());
  EXPECT_EQ(null_context->context, "");
}

TEST(RunRequest, RejectsBadInputWithAClearMessage) {
  struct Case {
    std::string_view body;
    Error error;
    std::string_view mentions;
  };
  for (const Case& c : {Case{"{", Error::kInvalidArgument, "not valid JSON"},
                        Case{"[]", Error::kInvalidArgument, "JSON object"},
                        Case{"{}", Error::kInvalidArgument, "code is required"},
                        Case{R"({"code":1})", Error::kInvalidArgument, "must be a string"},
                        Case{R"({"code":"12345678901"})", Error::kLimitExceeded, "exceeds the limit of 10"},
                        Case{R"({"code":"","context":7})", Error::kInvalidArgument, "context id"},
                        Case{R"({"code":"","context":""})", Error::kInvalidArgument, "not a context id"},
                        Case{R"({"code":"","timeout_secs":1.5})", Error::kInvalidArgument, "timeout_secs"},
                        Case{R"({"code":"","timeout_secs":1000000001})", Error::kInvalidArgument, "timeout_secs"},
                        Case{R"({"code":"","language":"ruby"})", Error::kInvalidArgument, "supported: python, bash"},
                        Case{R"({"code":"","language":null})", Error::kInvalidArgument, "language: must be a string"},
                        Case{R"({"code":"","x":1})", Error::kInvalidArgument, "unknown field 'x'"}}) {
    auto r = parse_run_request(c.body, 10);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.error(), c.error) << c.body;
    EXPECT_NE(r.message().find(c.mentions), std::string::npos) << c.body << ": " << r.message();
  }
}

TEST(ContextRequest, PythonIsTheDefaultAndBashTheOther) {
  EXPECT_EQ(parse_context_request("").value(), "python");
  EXPECT_EQ(parse_context_request("{}").value(), "python");
  EXPECT_EQ(parse_context_request(R"({"language":"python"})").value(), "python");
  EXPECT_EQ(parse_context_request(R"({"language":"bash"})").value(), "bash");
  auto node = parse_context_request(R"({"language":"node"})");
  ASSERT_FALSE(node.ok());
  EXPECT_NE(node.message().find("supported: python, bash"), std::string::npos) << node.message();
  EXPECT_FALSE(parse_context_request(R"({"language":1})").ok());
  EXPECT_FALSE(parse_context_request(R"({"lang":"python"})").ok());
  EXPECT_FALSE(parse_context_request("[").ok());
}

TEST(ContextState, Names) {
  EXPECT_EQ(context_state_name(ContextState::kIdle), "idle");
  EXPECT_EQ(context_state_name(ContextState::kInterrupting), "interrupting");
}

TEST(CodeDriver, IsEmbeddedWhole) {
  std::string_view src = code_driver_source();
  EXPECT_NE(src.find("MAX_EVENT_BYTES = int(sys.argv[1])"), std::string_view::npos);
  EXPECT_NE(src.rfind("main()"), std::string_view::npos);
}

}  // namespace
}  // namespace sg::agent
