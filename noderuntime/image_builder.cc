#include "noderuntime/image_builder.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "noderuntime/build_sandbox.h"
#include "snapshot/layer_writer.h"

namespace sg {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kDefaultMirror = "http://deb.debian.org/debian";
constexpr std::string_view kSuite = "bookworm";
constexpr std::string_view kDefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

std::string join(const std::vector<std::string>& v, std::string_view sep) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : std::string(sep)) + s;
  return out;
}

// K=V over `env`, replacing an earlier K.
void set_env(std::vector<std::string>& env, const std::string& kv) {
  std::string key = kv.substr(0, kv.find('=') + 1);
  auto it = std::find_if(env.begin(), env.end(), [&](const std::string& e) { return e.starts_with(key); });
  if (it != env.end()) *it = kv;
  else env.push_back(kv);
}

struct Step {
  enum class Kind { kBase, kApt, kCopy, kRun } kind;
  const BuildStep* given = nullptr;  // kCopy, kRun: the request's step
  std::string what;
};

std::string quote_tail(const std::deque<std::string>& tail) {
  if (tail.empty()) return " (it printed nothing)";
  std::string out = "; its last output lines:";
  for (const std::string& l : tail) out += "\n  | " + l;
  return out;
}

class Build {
 public:
  Build(snapshot::ImageStore* store, const BuilderOptions& options, const BuildRequest& request,
        const BuildProgress& progress, snapshot::IdShift ids)
      : store_(store), options_(options), request_(request), progress_(progress), ids_(ids),
        deadline_(Clock::now() + std::chrono::seconds(request.timeout_secs)) {}

  ~Build() {
    store_->unpin(pinned_);
    if (!temp_.empty()) {
      std::error_code ec;
      fs::remove_all(temp_, ec);
    }
  }

  Result<snapshot::Image> run() {
    auto temp = store_->layers().make_temp_dir("build-");
    if (!temp) return temp.failure();
    temp_ = *temp;
    snapshot::Image image;
    image.name = request_.name;
    image.format = "build";
    image.parent = request_.from;
    if (!request_.from.empty()) {
      auto parent = store_->get_and_pin(request_.from);
      if (!parent) return parent.failure();
      pinned_ = parent->layers;
      // Each layer the build stacks on is re-hashed first: a blob damaged on disk is refused, not built on.
      for (const std::string& d : parent->layers)
        if (auto s = store_->layers().verify(d); !s)
          return fail(s.error(), "image " + request_.from + " (--from): " + s.message());
      image.layers = parent->layers;
      image.config = parent->config;
    } else {
      image.config.env = {std::string(kDefaultPath)};
    }
    for (const std::string& kv : request_.env) set_env(image.config.env, kv);
    if (!request_.workdir.empty()) image.config.working_dir = request_.workdir;

    std::vector<Step> steps;
    if (request_.from.empty())
      steps.push_back({Step::Kind::kBase, nullptr,
                       "debian " + std::string(kSuite) + " (mmdebstrap --variant=" + request_.variant +
                           (request_.packages.empty() ? "" : " --include=" + join(request_.packages, ",")) + ")"});
    else if (!request_.packages.empty())
      steps.push_back({Step::Kind::kApt, nullptr, "apt-get install " + join(request_.packages, " ")});
    for (const BuildStep& given : request_.steps) {
      if (given.kind == BuildStep::Kind::kCopy)
        steps.push_back({Step::Kind::kCopy, &given, "copy " + given.copy.host_path + " " + given.copy.dest});
      else
        steps.push_back({Step::Kind::kRun, &given, "run: " + given.run});
    }

    for (size_t n = 0; n < steps.size(); ++n) {
      const Step& s = steps[n];
      const std::string label = "step " + std::to_string(n + 1) + "/" + std::to_string(steps.size()) + " (" + s.what + ")";
      progress_({BuildEvent::Kind::kStep, n + 1, steps.size(), s.what, 0});
      auto output = [&](std::string_view line) {
        progress_({BuildEvent::Kind::kOutput, n + 1, steps.size(), std::string(line), 0});
      };
      Result<std::string> layer = s.kind == Step::Kind::kBase ? base(label, output)
                                  : s.kind == Step::Kind::kCopy
                                      ? copy(label, s.given->copy, n)
                                      : sandboxed(label, s.kind == Step::Kind::kApt ? apt_command() : s.given->run,
                                                  image, n, output);
      if (!layer) return layer.failure();
      uint64_t size = 0;
      if (!layer->empty()) {
        struct stat st{};
        if (::stat((store_->layers().layer_dir(*layer) + "/blob").c_str(), &st) == 0) size = static_cast<uint64_t>(st.st_size);
        image.layers.push_back(*layer);
      }
      progress_({BuildEvent::Kind::kLayer, n + 1, steps.size(), *layer, size});
    }
    if (image.layers.empty())
      return fail(Error::kInvalidArgument, "the build made no layer: give --from or build a Debian base");
    return store_->create(std::move(image));
  }

 private:
  Status check_deadline(const std::string& label) const {
    if (Clock::now() >= deadline_)
      return fail(Error::kTimeout, label + " did not start: the build passed its timeout of " +
                                       std::to_string(request_.timeout_secs) + " s");
    return {};
  }

  Status check_outcome(const std::string& label, const CommandOutcome& o) const {
    if (o.timed_out)
      return fail(Error::kTimeout, label + " was killed: the build passed its timeout of " +
                                       std::to_string(request_.timeout_secs) + " s" + quote_tail(o.tail));
    if (o.signal != 0)
      return fail(Error::kInvalidArgument, label + " was killed by signal " + std::to_string(o.signal) + quote_tail(o.tail));
    if (o.exit_code != 0)
      return fail(Error::kInvalidArgument, label + " failed with exit code " + std::to_string(o.exit_code) + quote_tail(o.tail));
    return {};
  }

  Result<std::string> add(const std::string& blob, const std::string& digest, const std::string& label) {
    auto added = store_->add_pinned_layer(blob, digest, label);
    if (!added) return added.failure();
    pinned_.push_back(*added);
    return added;
  }

  Result<std::string> base(const std::string& label, const OutputLine& output) {
    if (auto s = check_deadline(label); !s) return s.failure();
    std::string mirror = options_.mirror.empty() ? debian_mirror(host_apt_source_files()) : options_.mirror;
    std::string tar = temp_ + "/base.tar";
    std::vector<std::string> argv = {options_.mmdebstrap, "--mode=unshare", "--variant=" + request_.variant};
    if (!request_.packages.empty()) argv.push_back("--include=" + join(request_.packages, ","));
    argv.insert(argv.end(), {std::string(kSuite), tar, mirror});
    output("mmdebstrap from " + mirror);
    // TMPDIR: mmdebstrap's root is unpacked in the store's tmp/, never in the host's /tmp.
    auto outcome = run_host_command(argv, {"TMPDIR=" + temp_}, deadline_, {}, output);
    if (!outcome) return fail(outcome.error(), label + ": " + outcome.message());
    if (auto s = check_outcome(label, *outcome); !s) return s.failure();
    auto digest = snapshot::sha256_file(tar);
    if (!digest) return digest.failure();
    return add(tar, *digest, label);
  }

  std::string apt_command() const {
    return "command -v apt-get >/dev/null || { echo 'this image has no apt-get (a --variant=essential base?)'; exit 127; }; "
           "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends " +
           join(request_.packages, " ") + " && apt-get clean && rm -rf /var/lib/apt/lists/*";
  }

  Result<std::string> copy(const std::string& label, const BuildCopy& c, size_t n) {
    if (auto s = check_deadline(label); !s) return s.failure();
    std::string tar = temp_ + "/copy" + std::to_string(n) + ".tar";
    snapshot::LayerSource source{snapshot::LayerSource::Kind::kCopy, c.host_path, c.dest, {}, kMaxBuildLayerEntries};
    auto written = snapshot::write_layer(source, tar);
    if (!written) return fail(written.error(), label + ": " + written.message());
    if (written->entries == 0) return std::string();
    return add(tar, written->digest, label);
  }

  Result<std::string> sandboxed(const std::string& label, const std::string& command, const snapshot::Image& image,
                                size_t n, const OutputLine& output) {
    if (auto s = check_deadline(label); !s) return s.failure();
    if (image.layers.empty()) return fail(Error::kInvalidArgument, label + ": there is no image to run in");
    SandboxStep step;
    step.step_dir = temp_ + "/step" + std::to_string(n);
    std::error_code ec;
    fs::create_directory(step.step_dir, ec);
    if (ec) return fail(Error::kIo, "create " + step.step_dir + ": " + ec.message());
    for (const std::string& d : image.layers) step.lower_trees.push_back(store_->layers().tree_path(d));
    step.ids = ids_;
    step.command = command;
    step.env = image.config.env;
    if (std::none_of(step.env.begin(), step.env.end(), [](const std::string& e) { return e.starts_with("PATH="); }))
      step.env.emplace_back(kDefaultPath);
    if (std::none_of(step.env.begin(), step.env.end(), [](const std::string& e) { return e.starts_with("HOME="); }))
      step.env.emplace_back("HOME=/root");
    step.workdir = image.config.working_dir.empty() ? "/" : image.config.working_dir;
    auto outcome = run_in_sandbox(step, deadline_, {}, output);
    if (!outcome) return fail(outcome.error(), label + ": " + outcome.message());
    if (auto s = check_outcome(label, *outcome); !s) return s.failure();
    std::string tar = step.step_dir + "/layer.tar";
    snapshot::LayerSource source{snapshot::LayerSource::Kind::kOverlayUpper, step.step_dir + "/upper", "", ids_,
                                 kMaxBuildLayerEntries};
    auto written = snapshot::write_layer(source, tar);
    if (!written) return fail(written.error(), label + ": sealing its changes: " + written.message());
    Result<std::string> layer = written->entries == 0 ? Result<std::string>(std::string()) : add(tar, written->digest, label);
    fs::remove_all(step.step_dir, ec);  // the next step starts from the sealed layers, not from this upper dir
    return layer;
  }

  snapshot::ImageStore* store_;
  const BuilderOptions& options_;
  const BuildRequest& request_;
  const BuildProgress& progress_;
  snapshot::IdShift ids_;
  Clock::time_point deadline_;
  std::string temp_;
  std::vector<std::string> pinned_;
};

}  // namespace

std::string debian_mirror(const std::vector<std::string>& files) {
  for (const std::string& file : files) {
    std::ifstream in(file);
    std::string line, uris, suites;
    auto has_suite = [](const std::string& list) {
      std::istringstream words(list);
      std::string w;
      while (words >> w)
        if (w == kSuite) return true;
      return false;
    };
    auto first_word = [](const std::string& list) {
      std::istringstream words(list);
      std::string w;
      words >> w;
      return w;
    };
    bool deb822 = file.ends_with(".sources");
    while (std::getline(in, line)) {
      if (deb822) {
        if (line.find_first_not_of(" \t") == std::string::npos) {
          if (has_suite(suites) && !uris.empty()) return first_word(uris);
          uris.clear();
          suites.clear();
        } else if (line.starts_with("URIs:")) {
          uris = line.substr(5);
        } else if (line.starts_with("Suites:")) {
          suites = line.substr(7);
        }
        continue;
      }
      std::istringstream words(line);
      std::string kind, uri, suite;
      words >> kind;
      if (kind != "deb") continue;
      words >> uri;
      if (uri.starts_with("[")) {  // [arch=amd64 signed-by=...] options
        while (!uri.ends_with("]") && words >> uri) {
        }
        words >> uri;
      }
      words >> suite;
      if (suite == kSuite && !uri.empty()) return uri;
    }
    if (deb822 && has_suite(suites) && !uris.empty()) return first_word(uris);
  }
  return std::string(kDefaultMirror);
}

std::vector<std::string> host_apt_source_files() {
  std::vector<std::string> out;
  if (::access("/etc/apt/sources.list", R_OK) == 0) out.push_back("/etc/apt/sources.list");
  std::error_code ec;
  std::vector<std::string> more;
  for (const auto& e : fs::directory_iterator("/etc/apt/sources.list.d", ec)) {
    std::string p = e.path().string();
    if (p.ends_with(".list") || p.ends_with(".sources")) more.push_back(p);
  }
  std::sort(more.begin(), more.end());
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

Result<snapshot::Image> ImageBuilder::build(const BuildRequest& request, const BuildProgress& progress) {
  if (auto s = check_build_request(request); !s) return s.failure();
  if (auto existing = store_->get(request.name); existing)
    return fail(Error::kAlreadyExists, "image " + request.name + " already exists (sandgate image rm " + request.name +
                                           " first)");
  uint32_t slot = next_slot_.fetch_add(1) % kBuildIdSlots;
  snapshot::IdShift ids{kBuildIdBase + slot * kBuildIdCount, kBuildIdCount};
  Build build(store_, options_, request, progress, ids);
  return build.run();
}

}  // namespace sg
