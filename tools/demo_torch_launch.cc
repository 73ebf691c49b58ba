// The `fsdp demo` side of its LibTorch stage (see demo_torch.h): the
// result's JSON form and running fsdp_torch_demo as a child process.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tools/demo_torch.h"
#include "tools/helper_binary.h"

extern char** environ;

namespace flatparam {
namespace tools {
namespace {

using json = nlohmann::json;

constexpr char kBinary[] = "fsdp_torch_demo";

// Where fsdp_torch_demo is, or "" (see RunTorchDemoProcess).
std::string FindBinary() {
  return FindHelperBinary(kBinary, "FLATPARAM_TORCH_DEMO");
}

}  // namespace

std::string TorchDemoResultToJson(const TorchDemoResult& r) {
  return json{{"ran", r.ran},
              {"skipped", r.skipped},
              {"text_path", r.text_path},
              {"world_size", r.world_size},
              {"parameters", r.parameters},
              {"losses", r.losses},
              {"reference_losses", r.reference_losses},
              {"params_equal", r.params_equal},
              {"seconds", r.seconds}}
      .dump();
}

absl::StatusOr<TorchDemoResult> TorchDemoResultFromJson(
    const std::string& text) {
  TorchDemoResult r;
  try {
    const json j = json::parse(text);
    r.ran = j.at("ran").get<bool>();
    r.skipped = j.at("skipped").get<std::string>();
    r.text_path = j.at("text_path").get<std::string>();
    r.world_size = j.at("world_size").get<int>();
    r.parameters = j.at("parameters").get<int64_t>();
    r.losses = j.at("losses").get<std::vector<float>>();
    r.reference_losses = j.at("reference_losses").get<std::vector<float>>();
    r.params_equal = j.at("params_equal").get<bool>();
    r.seconds = j.at("seconds").get<double>();
  } catch (const json::exception& e) {
    return absl::DataLossError(
        absl::StrCat("the LibTorch stage's result is not valid: ", e.what()));
  }
  return r;
}

absl::StatusOr<TorchDemoResult> RunTorchDemoProcess(
    int steps, uint64_t seed, const std::string& result_file) {
  const std::string binary = FindBinary();
  if (binary.empty()) {
    TorchDemoResult skipped;
    skipped.skipped =
        "no fsdp_torch_demo beside this binary or in its runfiles (it is "
        "built where the build finds LibTorch: tools/setup.sh installs "
        "Debian's libtorch-dev, or set LIBTORCH_HOME, and rebuild)";
    return skipped;
  }
  std::remove(result_file.c_str());
  std::vector<std::string> args = {binary, absl::StrCat("--steps=", steps),
                                   absl::StrCat("--seed=", seed),
                                   absl::StrCat("--result=", result_file)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned =
      posix_spawn(&pid, binary.c_str(), nullptr, nullptr, argv.data(), environ);
  if (spawned != 0) {
    return absl::InternalError(
        absl::StrCat("cannot run ", binary, ": ", std::strerror(spawned)));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      return absl::InternalError(
          absl::StrCat("waiting for ", binary, ": ", std::strerror(errno)));
    }
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(
        binary, " failed (",
        WIFEXITED(status) ? absl::StrCat("exit status ", WEXITSTATUS(status))
                          : absl::StrCat("signal ", WTERMSIG(status)),
        "); its error is above"));
  }
  std::ifstream in(result_file);
  std::stringstream text;
  text << in.rdbuf();
  return TorchDemoResultFromJson(text.str());
}

}  // namespace tools
}  // namespace flatparam
