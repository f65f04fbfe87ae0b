// Who this sandbox is, as the node told the guest, and the guest RNG's reseed after a memory snapshot.
//
// A guest restored from a memory snapshot continues its source's processes, hostname and kernel RNG state.
// The QEMU driver therefore sends each guest, after every start, resume and restore, its sandbox id,
// hostname and 32 random bytes (deploy/build-guest-image.sh: the init's clock listener). The init records
// the id in kIdentityFile, which /health reports, and runs `sandgate-agent --reseed-rng HEX`: the bytes are
// credited to the kernel's input pool (RNDADDENTROPY) and the kernel is made to reseed its CRNG at once
// (RNDRESEEDCRNG), so two forks of one snapshot read different /dev/urandom streams from then on. (QEMU's
// vmgenid device would do this from the hypervisor, but it needs the ACPI tables of the pc/q35 machines,
// which microvm does not build.)
#pragma once

#include <string>
#include <string_view>

#include "common/error.h"

namespace sg::agent {

inline constexpr const char* kIdentityFile = "/run/sandgate-id";
inline constexpr size_t kMaxSeedBytes = 256;

// The sandbox id in `path` (its first line, trimmed), or "" when there is none or it is not an id-like word.
std::string sandbox_identity(const char* path = kIdentityFile);

// Decodes `hex` (an even number of hex digits, 16 to 2 * kMaxSeedBytes of them) and reseeds the kernel's RNG
// with it. kInvalidArgument for a malformed seed; the errno of a refused ioctl otherwise (CAP_SYS_ADMIN).
Status reseed_rng(std::string_view hex);
// The decoding alone (exposed for its test).
Result<std::string> decode_seed(std::string_view hex);

}  // namespace sg::agent
