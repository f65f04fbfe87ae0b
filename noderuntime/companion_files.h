// Where sandgate-node finds the files it runs besides itself, when the config does not name them: next to
// the running executable. Installed (deploy/install.sh): sandgate-init and sandgate-agent beside sandgate-node
// in $PREFIX/bin, scripts in $PREFIX/share/sandgate. Build tree: <build>/noderuntime/sandgate-node,
// <build>/agent/sandgate-agent, and the scripts in the source tree's deploy/ (the build directory sits in the
// source tree: <repo>/build).
#pragma once

#include <string>
#include <vector>

#include "common/error.h"

namespace sg {

// The running executable's directory, with a trailing '/'.
Result<std::string> exe_dir();

struct CompanionLookup {
  std::string path;                 // the first executable candidate; empty when none is
  std::vector<std::string> tried;   // every candidate, in order (for messages)
  std::string tried_text() const;   // "a, b", or a note that there were none
};

// `configured` (a config key's value) when not empty, else the default places above.
CompanionLookup find_agent_binary(const std::string& configured);
CompanionLookup find_guest_image_builder(const std::string& configured);

}  // namespace sg
