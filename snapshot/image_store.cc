#include "snapshot/image_store.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "common/fd.h"
#include "snapshot/tar_reader.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr size_t kCopyBlock = 64 * 1024;
constexpr int kMaxSymlinkHops = 8;
constexpr int kMaxIndexDepth = 2;  // index.json -> (an image index ->) a manifest

// An archive member's name: old `docker save` links name "../<id>/layer.tar", so ".." is resolved, never above
// the archive root.
std::optional<std::string> clean_member(std::string_view path) { return normalize_relative(path, true); }

// The outer archive's members, staged as files in a temp dir of the layer store (so a layer blob is then
// renamed into the store, not copied). Links (old `docker save` links repeated layers) are kept as names.
class Staged {
 public:
  Staged(std::string archive_path, std::string dir, const LayerStore& layers)
      : archive_path_(std::move(archive_path)), dir_(std::move(dir)), layers_(layers) {}

  Status read_archive() {
    auto reader = TarReader::open(archive_path_, archive_path_, kMaxArchiveMembers);
    if (!reader) return reader.failure();
    std::vector<char> buf(kCopyBlock);
    for (;;) {
      auto next = reader->next();
      if (!next) return next.failure();
      archive_entry* e = *next;
      if (e == nullptr) break;
      ++count_;
      std::string shown = archive_entry_pathname(e) != nullptr ? archive_entry_pathname(e) : "";
      auto rel = clean_member(shown);
      if (!rel)
        return fail(Error::kInvalidArgument,
                    archive_path_ + ": member '" + shown + "' is an absolute path or climbs out with '..' (refused)");
      if (rel->empty()) continue;
      if (const char* hard = archive_entry_hardlink(e); hard != nullptr) {
        auto target = clean_member(hard);
        if (!target)
          return fail(Error::kInvalidArgument, archive_path_ + ": member '" + shown + "' links outside the archive");
        links_[*rel] = *target;
        continue;
      }
      mode_t type = archive_entry_filetype(e);
      if (type == AE_IFDIR) continue;
      if (type == AE_IFLNK) {
        std::string parent = fs::path(*rel).parent_path().string();
        const char* to = archive_entry_symlink(e);
        std::string joined = (to != nullptr && to[0] == '/') ? std::string(to) : parent + "/" + (to ? to : "");
        auto target = clean_member(joined);
        if (!target)
          return fail(Error::kInvalidArgument, archive_path_ + ": member '" + shown + "' is a symlink out of the archive");
        links_[*rel] = *target;
        continue;
      }
      if (type != AE_IFREG)
        return fail(Error::kInvalidArgument, archive_path_ + ": member '" + shown + "' is not a file, directory or link");
      // Staged members stay until their layers are unpacked, so they count against the store's reserve too.
      if (auto s = layers_.check_free_space(static_cast<uint64_t>(std::max<la_int64_t>(archive_entry_size(e), 0)),
                                            archive_path_ + ": member '" + shown + "'");
          !s)
        return s;
      std::string staged = dir_ + "/m" + std::to_string(count_);
      int raw = ::open(staged.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (raw < 0) return fail_errno("create " + staged, errno);
      UniqueFd fd(raw);
      uint64_t size = 0;
      for (;;) {
        la_ssize_t n = archive_read_data(reader->get(), buf.data(), buf.size());
        if (n == 0) break;
        if (n < 0)
          return fail(Error::kInvalidArgument, archive_path_ + ": member '" + shown + "': " + TarReader::message(reader->get()));
        if (auto s = write_all(fd.get(), buf.data(), static_cast<size_t>(n), staged); !s) return s;
        size += static_cast<uint64_t>(n);
      }
      files_[*rel] = File{staged, size};
    }
    return {};
  }

  // The staged file for `member` (links followed), or kInvalidArgument naming what refers to it.
  Result<std::pair<std::string, uint64_t>> file(const std::string& member, std::string_view referrer) const {
    std::string cur = member;
    for (int hop = 0; hop <= kMaxSymlinkHops; ++hop) {
      if (auto f = files_.find(cur); f != files_.end()) return std::make_pair(f->second.path, f->second.size);
      auto l = links_.find(cur);
      if (l == links_.end()) break;
      cur = l->second;
    }
    return fail(Error::kInvalidArgument,
                archive_path_ + ": member '" + member + "' (" + std::string(referrer) + ") is missing from the archive");
  }
  bool has(const std::string& member) const { return files_.count(member) > 0 || links_.count(member) > 0; }

  // A JSON member, bounded by kMaxJsonBytes; if `digest` is given, the bytes must hash to it.
  Result<json> read_json(const std::string& member, std::string_view referrer, const std::string& digest = "") const {
    auto f = file(member, referrer);
    if (!f) return f.failure();
    std::string label = archive_path_ + ": " + member;
    if (f->second > kMaxJsonBytes)
      return fail(Error::kLimitExceeded,
                  label + ": " + std::to_string(f->second) + " bytes, over the " + std::to_string(kMaxJsonBytes) + " limit");
    if (!digest.empty()) {
      auto got = sha256_file(f->first);
      if (!got) return got.failure();
      if (*got != digest)
        return fail(Error::kInvalidArgument,
                    label + ": digest mismatch: expected " + digest + ", the content is " + *got + " (corrupted archive)");
    }
    int raw = ::open(f->first.c_str(), O_RDONLY | O_CLOEXEC);
    if (raw < 0) return fail_errno("open " + f->first, errno);
    UniqueFd fd(raw);
    auto text = read_at_most(fd.get(), kMaxJsonBytes, f->first);
    if (!text) return text.failure();
    json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail(Error::kInvalidArgument, label + ": not valid JSON");
    return j;
  }

  const std::string& archive() const { return archive_path_; }

 private:
  struct File {
    std::string path;
    uint64_t size = 0;
  };
  static Status write_all(int fd, const char* data, size_t len, const std::string& path) {
    while (len > 0) {
      ssize_t n = ::write(fd, data, len);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail_errno("write " + path, errno);
      data += n;
      len -= static_cast<size_t>(n);
    }
    return {};
  }

  std::string archive_path_;
  std::string dir_;
  const LayerStore& layers_;
  size_t count_ = 0;
  std::map<std::string, File> files_;
  std::map<std::string, std::string> links_;
};

struct LayerRef {
  std::string member;
  std::string digest;
};

struct Parsed {
  std::string format;
  std::string config_digest;
  json config;
  std::vector<LayerRef> layers;
};

// Fields of untrusted JSON read without json::value(), which throws when the field has another type.
std::string string_field(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : std::string();
}
json any_field(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() ? *it : json();
}

std::string blob_member(const std::string& digest) { return "blobs/sha256/" + digest.substr(7); }

Result<std::vector<std::string>> string_array(const json& j, std::string_view field, const std::string& where) {
  std::vector<std::string> out;
  if (j.is_null()) return out;
  if (!j.is_array()) return fail(Error::kInvalidArgument, where + ": " + std::string(field) + " is not an array");
  for (const json& v : j) {
    if (!v.is_string()) return fail(Error::kInvalidArgument, where + ": " + std::string(field) + " has a non-string");
    out.push_back(v.get<std::string>());
  }
  return out;
}

// The image config's "config" object (Env, Entrypoint, Cmd, WorkingDir); every field optional.
Result<ImageConfig> parse_config(const json& config, const std::string& where) {
  ImageConfig out;
  if (!config.is_object()) return fail(Error::kInvalidArgument, where + ": the image config is not an object");
  auto c = config.find("config");
  if (c == config.end() || c->is_null()) return out;
  if (!c->is_object()) return fail(Error::kInvalidArgument, where + ": \"config\" is not an object");
  auto field = [&](const char* name) { return c->contains(name) ? (*c)[name] : json(); };
  auto env = string_array(field("Env"), "Env", where);
  if (!env) return env.failure();
  auto entrypoint = string_array(field("Entrypoint"), "Entrypoint", where);
  if (!entrypoint) return entrypoint.failure();
  auto cmd = string_array(field("Cmd"), "Cmd", where);
  if (!cmd) return cmd.failure();
  json wd = field("WorkingDir");
  if (!wd.is_null() && !wd.is_string()) return fail(Error::kInvalidArgument, where + ": WorkingDir is not a string");
  out.env = std::move(*env);
  out.entrypoint = std::move(*entrypoint);
  out.cmd = std::move(*cmd);
  out.working_dir = wd.is_string() ? wd.get<std::string>() : "";
  return out;
}

// "<64 hex>.json" (old docker save) or "blobs/sha256/<hex>" (new): the config's own digest, else "".
std::string digest_from_member(const std::string& member) {
  std::string name = member;
  if (member.starts_with("blobs/sha256/")) name = member.substr(13);
  else if (member.size() == 69 && member.ends_with(".json")) name = member.substr(0, 64);
  std::string d = "sha256:" + name;
  return valid_digest(d) ? d : "";
}

Result<Parsed> parse_docker_save(const Staged& staged) {
  const std::string where = staged.archive() + ": manifest.json";
  auto manifest = staged.read_json("manifest.json", "the docker save manifest");
  if (!manifest) return manifest.failure();
  if (!manifest->is_array() || manifest->empty())
    return fail(Error::kInvalidArgument, where + ": not a non-empty array of images");
  if (manifest->size() > 1)
    return fail(Error::kUnsupported, where + ": holds " + std::to_string(manifest->size()) +
                                         " images; save and import one image per archive");
  const json& m = (*manifest)[0];
  if (!m.is_object() || !m.contains("Config") || !m["Config"].is_string() || !m.contains("Layers"))
    return fail(Error::kInvalidArgument, where + ": the image has no \"Config\" string or no \"Layers\"");
  auto layer_members = string_array(m["Layers"], "Layers", where);
  if (!layer_members) return layer_members.failure();
  if (layer_members->size() > kMaxImageLayers)
    return fail(Error::kLimitExceeded, where + ": " + std::to_string(layer_members->size()) + " layers, over the " +
                                           std::to_string(kMaxImageLayers) + " limit");
  Parsed out;
  out.format = "docker-save";
  auto config_member = clean_member(m["Config"].get<std::string>());
  if (!config_member) return fail(Error::kInvalidArgument, where + ": Config climbs out of the archive");
  out.config_digest = digest_from_member(*config_member);
  auto config = staged.read_json(*config_member, "the image config", out.config_digest);
  if (!config) return config.failure();
  if (out.config_digest.empty()) {
    auto f = staged.file(*config_member, "the image config");
    if (!f) return f.failure();
    auto d = sha256_file(f->first);
    if (!d) return d.failure();
    out.config_digest = *d;
  }
  out.config = std::move(*config);
  // The config's rootfs.diff_ids are the digests of the uncompressed layer tars, the form docker save writes.
  std::vector<std::string> diff_ids;
  if (auto r = out.config.find("rootfs"); r != out.config.end() && r->is_object() && r->contains("diff_ids")) {
    auto ids = string_array((*r)["diff_ids"], "rootfs.diff_ids", staged.archive() + ": " + *config_member);
    if (!ids) return ids.failure();
    diff_ids = std::move(*ids);
  }
  if (diff_ids.size() != layer_members->size())
    return fail(Error::kInvalidArgument, staged.archive() + ": " + *config_member + ": rootfs.diff_ids lists " +
                                             std::to_string(diff_ids.size()) + " layers, manifest.json " +
                                             std::to_string(layer_members->size()));
  for (size_t i = 0; i < layer_members->size(); ++i) {
    auto member = clean_member((*layer_members)[i]);
    if (!member) return fail(Error::kInvalidArgument, where + ": layer '" + (*layer_members)[i] + "' climbs out");
    // A content-addressed member (new docker save) is checked against its own name, which is also right when
    // the layer is compressed; an old-style "<id>/layer.tar" against its diff_id.
    std::string named = member->starts_with("blobs/sha256/") ? digest_from_member(*member) : "";
    out.layers.push_back({*member, named.empty() ? diff_ids[i] : named});
  }
  return out;
}

// The manifest an index names: the only entry, else the one for linux on this machine's architecture.
Result<json> pick_manifest(const Staged& staged, const json& index, const std::string& where, int depth) {
  if (!index.is_object() || !index.contains("manifests") || !index["manifests"].is_array() ||
      index["manifests"].empty())
    return fail(Error::kInvalidArgument, where + ": no \"manifests\" array");
  const json& list = index["manifests"];
#if defined(__aarch64__)
  constexpr std::string_view kArch = "arm64";
#else
  constexpr std::string_view kArch = "amd64";
#endif
  const json* chosen = list.size() == 1 ? &list[0] : nullptr;
  for (const json& d : list) {
    if (chosen != nullptr) break;
    if (!d.is_object() || !d.contains("platform") || !d["platform"].is_object()) continue;
    const json& p = d["platform"];
    if (string_field(p, "os") == "linux" && string_field(p, "architecture") == kArch) chosen = &d;
  }
  if (chosen == nullptr)
    return fail(Error::kUnsupported, where + ": " + std::to_string(list.size()) +
                                         " manifests and none for linux/" + std::string(kArch));
  if (!chosen->is_object() || !chosen->contains("digest") || !(*chosen)["digest"].is_string() ||
      !valid_digest((*chosen)["digest"].get<std::string>()))
    return fail(Error::kInvalidArgument, where + ": a manifest entry has no valid sha256 \"digest\"");
  std::string digest = (*chosen)["digest"].get<std::string>();
  auto manifest = staged.read_json(blob_member(digest), "named by " + where, digest);
  if (!manifest) return manifest.failure();
  // An image index (multi-platform image) names the per-platform manifests in turn.
  if (manifest->is_object() && manifest->contains("manifests")) {
    if (depth >= kMaxIndexDepth) return fail(Error::kLimitExceeded, where + ": image indexes nest too deep");
    return pick_manifest(staged, *manifest, staged.archive() + ": " + blob_member(digest), depth + 1);
  }
  return manifest;
}

Result<Parsed> parse_oci(const Staged& staged) {
  auto index = staged.read_json("index.json", "the OCI layout index");
  if (!index) return index.failure();
  auto manifest = pick_manifest(staged, *index, staged.archive() + ": index.json", 0);
  if (!manifest) return manifest.failure();
  const std::string where = staged.archive() + ": the image manifest";
  auto descriptor_digest = [&](const json& d, const char* what) -> Result<std::string> {
    if (!d.is_object() || !d.contains("digest") || !d["digest"].is_string() ||
        !valid_digest(d["digest"].get<std::string>()))
      return fail(Error::kInvalidArgument, where + ": " + what + " has no valid sha256 \"digest\"");
    return d["digest"].get<std::string>();
  };
  if (!manifest->is_object() || !manifest->contains("config") || !manifest->contains("layers") ||
      !(*manifest)["layers"].is_array())
    return fail(Error::kInvalidArgument, where + ": no \"config\" or no \"layers\" array");
  const json& layers = (*manifest)["layers"];
  if (layers.size() > kMaxImageLayers)
    return fail(Error::kLimitExceeded, where + ": " + std::to_string(layers.size()) + " layers, over the " +
                                           std::to_string(kMaxImageLayers) + " limit");
  Parsed out;
  out.format = "oci";
  auto config_digest = descriptor_digest((*manifest)["config"], "config");
  if (!config_digest) return config_digest.failure();
  out.config_digest = *config_digest;
  auto config = staged.read_json(blob_member(out.config_digest), "the image config", out.config_digest);
  if (!config) return config.failure();
  out.config = std::move(*config);
  for (const json& l : layers) {
    auto d = descriptor_digest(l, "a layer");
    if (!d) return d.failure();
    out.layers.push_back({blob_member(*d), *d});
  }
  return out;
}

ordered_json to_json(const Image& image) {
  return ordered_json{{"name", image.name},
                      {"format", image.format},
                      {"parent", image.parent},
                      {"config_digest", image.config_digest},
                      {"layers", image.layers},
                      {"config",
                       {{"env", image.config.env},
                        {"entrypoint", image.config.entrypoint},
                        {"cmd", image.config.cmd},
                        {"working_dir", image.config.working_dir}}},
                      {"size_bytes", image.size_bytes},
                      {"created_at_ms", image.created_at_ms}};
}

// The node's own image file; still parsed defensively (a disk can be edited or damaged).
Result<Image> from_json(const std::string& text, const std::string& where) {
  json j = json::parse(text, nullptr, false);
  auto bad = [&] { return fail(Error::kIo, where + ": damaged image record"); };
  if (!j.is_object()) return bad();
  Image out;
  if (!j.contains("name") || !j["name"].is_string() || !j.contains("layers") || !j.contains("config") ||
      !j["config"].is_object())
    return bad();
  out.name = j["name"].get<std::string>();
  out.format = string_field(j, "format");
  out.parent = string_field(j, "parent");
  out.config_digest = string_field(j, "config_digest");
  auto layers = string_array(j["layers"], "layers", where);
  if (!layers) return layers.failure();
  out.layers = std::move(*layers);
  const json& c = j["config"];
  auto env = string_array(any_field(c, "env"), "env", where);
  auto entrypoint = string_array(any_field(c, "entrypoint"), "entrypoint", where);
  auto cmd = string_array(any_field(c, "cmd"), "cmd", where);
  if (!env || !entrypoint || !cmd) return bad();
  out.config = {std::move(*env), std::move(*entrypoint), std::move(*cmd), string_field(c, "working_dir")};
  json size = any_field(j, "size_bytes"), created = any_field(j, "created_at_ms");
  out.size_bytes = size.is_number_unsigned() ? size.get<uint64_t>() : 0;
  out.created_at_ms = created.is_number_integer() ? created.get<int64_t>() : 0;
  return out;
}

}  // namespace

Result<std::unique_ptr<ImageStore>> ImageStore::open(const std::string& state_dir, LayerHolders holders) {
  std::error_code ec;
  std::string images = state_dir + "/images";
  fs::create_directories(images, ec);
  if (ec) return fail(Error::kIo, "create " + images + ": " + ec.message());
  auto layers = LayerStore::open(state_dir + "/layers");
  if (!layers) return layers.failure();
  std::unique_ptr<ImageStore> store(new ImageStore(images, std::move(*layers), std::move(holders)));
  std::lock_guard lock(store->mu_);
  // A damaged image record must not stop the node: its layers stay (they may be its), the API names the file.
  if (auto s = store->collect_garbage(); !s)
    spdlog::warn("image store: unused layers not collected: {}", s.message());
  return store;
}

Result<Image> ImageStore::import(const std::string& archive_path, const std::string& name) {
  if (auto s = check_image_name(name); !s) return s.failure();
  struct stat st{};
  if (::stat(archive_path.c_str(), &st) != 0) {
    if (errno == ENOENT) return fail(Error::kNotFound, "archive " + archive_path + " does not exist (on the node)");
    return fail_errno("stat " + archive_path, errno);
  }
  if (!S_ISREG(st.st_mode)) return fail(Error::kInvalidArgument, "archive " + archive_path + " is not a regular file");
  std::lock_guard lock(mu_);
  if (::access(image_file(name).c_str(), F_OK) == 0)
    return fail(Error::kAlreadyExists, "image " + name + " already exists (sandgate image rm " + name + " first)");

  auto dir = layers_.make_temp_dir("import-");
  if (!dir) return dir.failure();
  RemovedOnExit cleanup{*dir};

  Staged staged(archive_path, *dir, layers_);
  if (auto s = staged.read_archive(); !s) return s.failure();
  Result<Parsed> parsed = staged.has("manifest.json") ? parse_docker_save(staged)
                          : staged.has("index.json")  ? parse_oci(staged)
                                                      : Result<Parsed>(fail(Error::kInvalidArgument,
                                                            archive_path + ": neither a docker save archive "
                                                                           "(manifest.json) nor an OCI image layout "
                                                                           "(index.json)"));
  if (!parsed) return parsed.failure();
  auto config = parse_config(parsed->config, archive_path + ": the image config");
  if (!config) return config.failure();

  Image image;
  image.name = name;
  image.format = parsed->format;
  image.config_digest = parsed->config_digest;
  image.config = std::move(*config);
  std::set<std::string> added;
  for (size_t i = 0; i < parsed->layers.size(); ++i) {
    const LayerRef& l = parsed->layers[i];
    std::string label = archive_path + ": layer " + std::to_string(i + 1) + " (" + l.member + ")";
    if (added.insert(l.digest).second) {
      auto f = staged.file(l.member, "layer " + std::to_string(i + 1));
      if (!f) return f.failure();
      auto d = layers_.add(f->first, l.digest, label);
      if (!d) return d.failure();
    }
    struct stat bst{};
    if (::stat((layers_.layer_dir(l.digest) + "/blob").c_str(), &bst) == 0)
      image.size_bytes += static_cast<uint64_t>(bst.st_size);
    image.layers.push_back(l.digest);
  }
  image.created_at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch()).count();
  // The record last: until it is renamed into place the layers are unreferenced and open() collects them.
  if (auto s = write_file_atomic(image_file(name), to_json(image).dump(2) + "\n"); !s) return s.failure();
  return image;
}

Result<Image> ImageStore::get(const std::string& name) const {
  if (auto s = check_image_name(name); !s) return s.failure();
  std::string path = image_file(name);
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) {
    if (errno == ENOENT) return fail(Error::kNotFound, "no image named " + name);
    return fail_errno("open " + path, errno);
  }
  UniqueFd fd(raw);
  auto text = read_at_most(fd.get(), kMaxJsonBytes, path);
  if (!text) return text.failure();
  return from_json(*text, path);
}

Result<std::vector<Image>> ImageStore::list() const {
  std::vector<Image> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(images_dir_, ec)) {
    std::string file = entry.path().filename().string();
    if (file.starts_with(".") || !file.ends_with(".json")) continue;  // temp files of a write in progress
    auto image = get(file.substr(0, file.size() - 5));
    if (!image) return image.failure();
    out.push_back(std::move(*image));
  }
  if (ec) return fail(Error::kIo, "read " + images_dir_ + ": " + ec.message());
  std::sort(out.begin(), out.end(), [](const Image& a, const Image& b) { return a.name < b.name; });
  return out;
}

Result<std::vector<std::string>> ImageStore::names() const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(images_dir_, ec)) {
    std::string file = entry.path().filename().string();
    if (file.starts_with(".") || !file.ends_with(".json")) continue;
    out.push_back(file.substr(0, file.size() - 5));
  }
  if (ec) return fail(Error::kIo, "read " + images_dir_ + ": " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

Result<Image> ImageStore::remove(const std::string& name) {
  std::lock_guard lock(mu_);
  auto image = get(name);
  if (!image) return image.failure();
  if (claim_) {
    if (auto user = claim_(name))
      return fail(Error::kConflict, "image " + name + " is in use by " + *user + "; remove that first");
  }
  // Released on every way out, the refusals below included: only while this call runs is the image claimed.
  struct Release {
    const ReleaseRemoval& release;
    const std::string& name;
    ~Release() {
      if (release) release(name);
    }
  } released{release_, name};
  auto images = list();
  if (!images) return images.failure();
  for (const Image& other : *images)
    if (other.parent == name)
      return fail(Error::kConflict, "image " + name + " is the parent of image " + other.name +
                                        " (built --from it, sharing its layers); remove " + other.name + " first");
  if (::unlink(image_file(name).c_str()) != 0) return fail_errno("remove " + image_file(name), errno);
  if (auto s = fsync_dir(images_dir_); !s) return s.failure();
  // The image is gone either way; layers left behind are collected by a later rm or the next start.
  if (auto s = collect_garbage(); !s) spdlog::warn("image store: unused layers not collected: {}", s.message());
  return image;
}

Result<Image> ImageStore::get_and_pin(const std::string& name) {
  std::lock_guard lock(mu_);
  auto image = get(name);
  if (!image) return image.failure();
  pinned_.insert(image->layers.begin(), image->layers.end());
  return image;
}

Result<std::string> ImageStore::add_pinned_layer(const std::string& blob_path, std::string_view digest,
                                                 std::string_view label) {
  std::lock_guard lock(mu_);
  auto added = layers_.add(blob_path, digest, label);
  if (added) pinned_.insert(*added);
  return added;
}

void ImageStore::unpin(const std::vector<std::string>& layers) {
  std::lock_guard lock(mu_);
  for (const std::string& d : layers)
    if (auto it = pinned_.find(d); it != pinned_.end()) pinned_.erase(it);
  // A failed build's layers are nobody's now: gone at once rather than at the next rm or start.
  if (auto s = collect_garbage(); !s) spdlog::warn("image store: unused layers not collected: {}", s.message());
}

Result<Image> ImageStore::create(Image image) {
  if (auto s = check_image_name(image.name); !s) return s.failure();
  if (image.layers.size() > kMaxImageLayers)
    return fail(Error::kLimitExceeded, "image " + image.name + ": " + std::to_string(image.layers.size()) +
                                           " layers, over the " + std::to_string(kMaxImageLayers) + " limit");
  std::lock_guard lock(mu_);
  if (::access(image_file(image.name).c_str(), F_OK) == 0)
    return fail(Error::kAlreadyExists, "image " + image.name + " already exists (sandgate image rm " + image.name +
                                           " first)");
  if (!image.parent.empty() && ::access(image_file(image.parent).c_str(), F_OK) != 0)
    return fail(Error::kNotFound, "image " + image.parent + " (the --from image) was removed during the build");
  image.size_bytes = 0;
  for (const std::string& d : image.layers) {
    struct stat st{};
    if (::stat((layers_.layer_dir(d) + "/blob").c_str(), &st) != 0)
      return fail(Error::kInternal, "image " + image.name + ": layer " + d + " is not in the store");
    image.size_bytes += static_cast<uint64_t>(st.st_size);
  }
  image.created_at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch()).count();
  if (auto s = write_file_atomic(image_file(image.name), to_json(image).dump(2) + "\n"); !s) return s.failure();
  return image;
}

Status ImageStore::pin_existing(const std::vector<std::string>& layers) {
  std::lock_guard lock(mu_);
  for (const std::string& d : layers)
    if (!layers_.contains(d)) return fail(Error::kNotFound, "layer " + d + " is not in the store");
  pinned_.insert(layers.begin(), layers.end());
  return {};
}

Status ImageStore::collect_unused() {
  std::lock_guard lock(mu_);
  return collect_garbage();
}

Status ImageStore::collect_garbage() {
  auto images = list();
  if (!images) return images.failure();
  std::set<std::string> used;
  if (holders_) {
    auto held = holders_();
    if (!held) return held.failure();
    used = std::move(*held);
  }
  for (const Image& i : *images) used.insert(i.layers.begin(), i.layers.end());
  auto stored = layers_.list();
  if (!stored) return stored.failure();
  for (const std::string& d : *stored)
    if (used.count(d) == 0 && pinned_.count(d) == 0)
      if (auto s = layers_.remove(d); !s) return s;
  return {};
}

}  // namespace sg::snapshot
