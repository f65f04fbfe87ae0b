// The marks by which sandgate-node vouches for the network namespaces of its running sandboxes to the
// proxy's socket maker (common/vouched_netns.h): one per sandbox whose namespace it sent a proxy, removed
// as soon as anything about the sandbox changes (every route event about it). One per node, on its loop.
#pragma once

#include <map>
#include <string>

#include "common/error.h"

namespace sg {

class NetnsVouchers {
 public:
  // `dir` "": vouch for nothing (a node without a unix socket has no proxy maker to tell).
  explicit NetnsVouchers(std::string dir) : dir_(std::move(dir)) {}

  // At node start: the directory made (0755, root's) or emptied of what an earlier node vouched for, and
  // checked as the maker will check it (check_marks_dir): a directory others could write vouches nothing.
  Status reset();
  // The sandbox's namespace is the one `sock` (a socket made inside it) lives in: its mark is made (the
  // sandbox's older one removed).
  Status vouch(const std::string& sandbox_id, int sock);
  // Something about the sandbox changed (it stopped running, a new token, removed): its mark goes.
  void revoke(const std::string& sandbox_id);

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::map<std::string, std::string> marks_;  // sandbox id -> mark file name
};

}  // namespace sg
