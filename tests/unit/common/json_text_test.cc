// JSON written without a tree: what nlohmann reads back is what went in (or U+FFFD for what is not UTF-8).
#include "common/json_text.h"

#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

namespace sg {
namespace {

std::string as_json(std::string_view s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

TEST(JsonText, StringsReadBackAsWritten) {
  for (std::string_view s : {std::string_view(""), std::string_view("8080-demo.sandbox.localhost"),
                             std::string_view("quote \" backslash \\ slash /"),
                             std::string_view("controls \x01\x1f\n\t\r and a NUL \0 inside", 33),
                             std::string_view("UTF-8: é ✓ 𝄞 \xF4\x8F\xBF\xBF")}) {
    auto j = nlohmann::json::parse(as_json(s));
    EXPECT_EQ(j.get<std::string>(), std::string(s)) << as_json(s);
  }
}

TEST(JsonText, WhatIsNotUtf8BecomesReplacementCharacters) {
  const std::string fffd = "\xEF\xBF\xBD";
  const std::pair<std::string_view, std::string> cases[] = {
      {"\xff\xfe bad", fffd + fffd + " bad"},
      {"cut \xE2\x9C", "cut " + fffd + fffd},                   // a sequence cut short
      {"\xC0\xAF", fffd + fffd},                                // overlong
      {"\xED\xA0\x80", fffd + fffd + fffd},                     // a UTF-16 surrogate
      {"\xF4\x90\x80\x80", fffd + fffd + fffd + fffd},          // past U+10FFFF
      {"ok \xC3\xA9 \x80 end", "ok \xC3\xA9 " + fffd + " end"},  // a stray continuation byte
  };
  for (const auto& [in, want] : cases) {
    std::string out = as_json(in);
    auto j = nlohmann::json::parse(out);  // throws on invalid UTF-8: the output always parses
    EXPECT_EQ(j.get<std::string>(), want) << out;
  }
}

TEST(JsonText, Numbers) {
  std::string out;
  append_json_number(out, uint64_t{0});
  out += ',';
  append_json_number(out, std::numeric_limits<uint64_t>::max());
  out += ',';
  append_json_double(out, 1.25);
  out += ',';
  append_json_double(out, 0.1);
  out += ',';
  append_json_double(out, std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(out, "0,18446744073709551615,1.25,0.1,null");
}

}  // namespace
}  // namespace sg
