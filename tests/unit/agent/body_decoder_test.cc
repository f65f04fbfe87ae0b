#include "agent/body_decoder.h"

#include <gtest/gtest.h>

namespace sg::agent {
namespace {

// Feeds `input` in pieces of `step` bytes, as a socket might deliver it; returns the body and what was
// left after it, or the failure.
struct Decoded {
  bool ok = true;
  std::string body;
  std::string rest;
  std::string error;
};

Decoded decode(BodyDecoder d, std::string_view input, size_t step) {
  Decoded out;
  size_t pos = 0;
  while (pos < input.size() && !d.done()) {
    std::string_view piece = input.substr(pos, step);
    auto used = d.decode(piece, [&](std::string_view chunk) { out.body.append(chunk); });
    if (!used) return Decoded{false, {}, {}, used.message()};
    pos += *used;
  }
  out.ok = d.done();
  out.rest = std::string(input.substr(pos));
  return out;
}

TEST(BodyDecoder, FixedLengthStopsAtTheEnd) {
  auto r = decode(BodyDecoder::fixed(5), "helloGET / HTTP/1.1", 3);
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(r.body, "hello");
  EXPECT_EQ(r.rest, "GET / HTTP/1.1");
  EXPECT_TRUE(BodyDecoder::fixed(0).done());
}

TEST(BodyDecoder, ChunkedWithExtensionsAndTrailersInEveryPieceSize) {
  std::string wire = "5;name=value\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT";
  for (size_t step = 1; step <= wire.size(); ++step) {
    auto r = decode(BodyDecoder::chunked(), wire, step);
    ASSERT_TRUE(r.ok) << "step " << step << ": " << r.error;
    EXPECT_EQ(r.body, "helloabcdefghijklmnopqrstuvwxyz");
    EXPECT_EQ(r.rest, "NEXT");
  }
}

TEST(BodyDecoder, ChunkedWithoutTrailers) {
  auto r = decode(BodyDecoder::chunked(), "3\r\nabc\r\n0\r\n\r\n", 64);
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(r.body, "abc");
  EXPECT_TRUE(r.rest.empty());
}

TEST(BodyDecoder, MalformedChunkedIsRejected) {
  for (std::string_view bad : {"g\r\n", "\r\n", "3\r\nabcX\r\n", "3\nabc", "1234567890123456\r\n", "3\r\nabc\r\n0\r\nX"}) {
    auto r = decode(BodyDecoder::chunked(), std::string(bad) + std::string(20000, 'y'), 7);
    EXPECT_FALSE(r.ok) << bad;
  }
}

TEST(BodyDecoder, TrailerSectionIsBounded) {
  std::string wire = "0\r\nX: " + std::string(20 * 1024, 'a') + "\r\n\r\n";
  auto r = decode(BodyDecoder::chunked(), wire, 4096);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("trailer"), std::string::npos) << r.error;
}

}  // namespace
}  // namespace sg::agent
