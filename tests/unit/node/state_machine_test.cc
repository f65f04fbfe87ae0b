#include "noderuntime/state_machine.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

namespace sg {
namespace {

using S = SandboxState;

constexpr S kAll[] = {S::kCreating, S::kRunning, S::kSuspending, S::kSuspended,
                      S::kResuming, S::kTerminated, S::kFailed};

// The lifecycle, written out independently of the implementation's table.
const std::set<std::pair<S, S>> kLegal = {
    {S::kCreating, S::kRunning},      {S::kCreating, S::kFailed},       {S::kCreating, S::kTerminated},
    {S::kRunning, S::kSuspending},    {S::kRunning, S::kTerminated},    {S::kRunning, S::kFailed},
    {S::kSuspending, S::kSuspended},  {S::kSuspending, S::kRunning},    {S::kSuspending, S::kTerminated},
    {S::kSuspending, S::kFailed},     {S::kSuspended, S::kResuming},    {S::kSuspended, S::kTerminated},
    {S::kSuspended, S::kFailed},      {S::kSuspended, S::kSuspending}, {S::kResuming, S::kRunning},      {S::kResuming, S::kFailed},
    {S::kResuming, S::kTerminated},   {S::kFailed, S::kTerminated},
};

TEST(StateMachine, EveryPair) {
  int checked = 0;
  for (S from : kAll) {
    for (S to : kAll) {
      Status s = check_transition(from, to);
      bool legal = kLegal.count({from, to}) != 0;
      EXPECT_EQ(s.ok(), legal) << state_name(from) << " -> " << state_name(to);
      if (!legal) {
        EXPECT_EQ(s.error(), Error::kConflict);
        EXPECT_NE(s.message().find(std::string(state_name(from))), std::string::npos) << s.message();
        EXPECT_NE(s.message().find(std::string(state_name(to))), std::string::npos) << s.message();
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 49);
}

TEST(StateMachine, TerminatedIsFinal) {
  for (S to : kAll) {
    Status s = check_transition(S::kTerminated, to);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("final"), std::string::npos);
  }
}

TEST(StateMachine, NoSelfTransitions) {
  for (S s : kAll) EXPECT_FALSE(check_transition(s, s).ok()) << state_name(s);
}

TEST(StateMachine, EveryLiveStateCanBeTerminated) {
  for (S s : kAll) {
    if (s == S::kTerminated) continue;
    EXPECT_TRUE(check_transition(s, S::kTerminated).ok()) << state_name(s);
  }
}

TEST(StateMachine, StateNamesRoundTrip) {
  for (S s : kAll) EXPECT_EQ(parse_state(state_name(s)), s);
  EXPECT_FALSE(parse_state("paused").has_value());
}

}  // namespace
}  // namespace sg
