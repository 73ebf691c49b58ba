// RunTrainC10d() and RunCollectivesC10d() in `fsdp`, which does not link
// LibTorch: the command goes on in fsdp_c10d, the build of `fsdp` that
// does (tools/helper_binary.h), which replaces this process with the same
// command line, so that to torchrun it is the same worker (its pid,
// signals and exit status).
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tools/collectives.h"
#include "tools/helper_binary.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {

namespace {

// Replaces this process with fsdp_c10d and the same arguments; returns
// only on failure.
absl::Status ContinueInFsdpC10d() {
  const std::string helper =
      FindHelperBinary("fsdp_c10d", "FLATPARAM_FSDP_C10D");
  if (helper.empty()) {
    return absl::UnimplementedError(
        "--backend=c10d runs in fsdp_c10d (the build of fsdp that links "
        "LibTorch's c10d), and there is none beside this binary or in its "
        "runfiles: build //tools:fsdp_c10d (it needs libtorch-dev and "
        "libgloo-dev; tools/setup.sh installs them), or set "
        "FLATPARAM_FSDP_C10D to its path");
  }
  // This process's own command line, NUL-separated.
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t at = 0; at < cmdline.size();) {
    const size_t end = cmdline.find('\0', at);
    args.push_back(cmdline.substr(at, end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  if (args.empty()) {
    return absl::InternalError("cannot read this process's command line");
  }
  args[0] = helper;
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(helper.c_str(), argv.data());
  return absl::InternalError(absl::StrCat(
      "cannot run ", helper, " for --backend=c10d: ", std::strerror(errno)));
}

}  // namespace

absl::Status RunTrainC10d(const TrainCommandOptions&, std::ostream&) {
  return ContinueInFsdpC10d();
}

absl::Status RunCollectivesC10d(const CollectivesOptions&, std::ostream&) {
  return ContinueInFsdpC10d();
}

}  // namespace tools
}  // namespace flatparam
