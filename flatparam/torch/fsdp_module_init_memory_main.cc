// Peak host memory per rank while FsdpModule::Wrap initialises a model ten
// times one rank's shard, run under mpirun by fsdp_module_init_memory_test
// with 10 ranks (one process each, so each rank's resident set is its own):
//
//   fsdp_module_init_memory_main --init=eager|deferred|rank0
//
//   eager     every rank builds the model initialised (PyTorch's default
//             without meta init): the whole model is resident on every
//             rank before Wrap shards it;
//   deferred  every rank builds it with uninitialised storage (torch::empty
//             touches no page) and FsdpOptions::param_init_fn initialises
//             each unit as Wrap makes it;
//   rank0     only rank 0 has param_init_fn; sync_module_states sends each
//             unit's values to the others as Wrap makes it.
//
// The model: 10 blocks "h.i" of one 1024 x 1024 float32 weight (4 MiB),
// each a unit: 40 MiB in all, a 4 MiB shard per rank at 10 ranks. Each rank
// resets its peak resident set (/proc/self/clear_refs), builds the model,
// wraps it, and prints the peak's growth ("init_memory: rank R init=M:
// peak +X MiB ..."). It fails (exit 1) when deferred or rank0 initialisation
// grows the peak by more than the shard plus two units plus 4 MiB of slack
// (allocator and MPI buffers), and when eager initialisation grows it by
// less than the model: the measurement must see what it claims to bound.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"

ABSL_FLAG(std::string, init, "deferred", "eager, deferred or rank0");

namespace flatparam {
namespace libtorch {
namespace {

constexpr int kBlocks = 10;
constexpr int64_t kDim = 1024;
constexpr int64_t kMiB = 1 << 20;

// One weight, registered initialised or with uninitialised storage.
struct WeightBlockImpl : torch::nn::Module {
  explicit WeightBlockImpl(bool initialise) {
    weight =
        register_parameter("weight", initialise ? torch::randn({kDim, kDim})
                                                : torch::empty({kDim, kDim}));
  }
  torch::Tensor weight;
};
TORCH_MODULE(WeightBlock);

struct BigNetImpl : torch::nn::Module {
  explicit BigNetImpl(bool initialise) {
    h = register_module("h", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) h->push_back(WeightBlock(initialise));
  }
  torch::nn::ModuleList h{nullptr};
};
TORCH_MODULE(BigNet);

// "VmHWM" or "VmRSS" of /proc/self/status, in bytes; -1 if unreadable.
int64_t StatusBytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      return std::stoll(line.substr(key.size() + 1)) * 1024;
    }
  }
  return -1;
}

absl::Status Run(Communicator& world) {
  const std::string init = absl::GetFlag(FLAGS_init);
  if (init != "eager" && init != "deferred" && init != "rank0") {
    return absl::InvalidArgumentError(
        absl::StrCat("--init=", init, ": expected eager, deferred or rank0"));
  }
  // The peak from here on (Linux >= 4.0: "5" resets VmHWM to VmRSS).
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
  }
  const int64_t before = StatusBytes("VmHWM");
  if (before < 0) return absl::UnavailableError("no /proc/self/status");

  BigNet net(init == "eager");
  FsdpOptions options;
  options.wrap = {"h.*"};
  const auto initialise = [](torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters(/*recurse=*/false)) {
      p.normal_(0.0, 0.02);
    }
  };
  if (init == "deferred" || (init == "rank0" && world.rank() == 0)) {
    options.param_init_fn = initialise;
  }
  options.sync_module_states = init == "rank0";
  HostDeviceOps device;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, options));
  const int64_t growth = StatusBytes("VmHWM") - before;

  const int64_t model = kBlocks * kDim * kDim * 4;
  const int64_t unit = kDim * kDim * 4;
  const int64_t shard = model / world.size();
  std::printf(
      "init_memory: rank %d init=%s: peak +%.1f MiB (model %.0f MiB, "
      "shard %.1f MiB, largest unit %.0f MiB, %d ranks)\n",
      world.rank(), init.c_str(), static_cast<double>(growth) / kMiB,
      static_cast<double>(model) / kMiB, static_cast<double>(shard) / kMiB,
      static_cast<double>(unit) / kMiB, world.size());
  std::fflush(stdout);
  if (init == "eager" && growth < model) {
    return absl::InternalError(absl::StrFormat(
        "eager initialisation grew the peak by %d bytes, less than the "
        "model's %d: the measurement does not see the parameters",
        growth, model));
  }
  const int64_t bound = shard + 2 * unit + 4 * kMiB;
  if (init != "eager" && growth > bound) {
    return absl::InternalError(absl::StrFormat(
        "%s initialisation grew the peak by %d bytes, more than the shard "
        "plus two units plus 4 MiB (%d)",
        init, growth, bound));
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  absl::StatusOr<MpiSession> session = MpiSession::Start(&argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "init_memory: %s\n",
                 session.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
      MpiCommunicator::CreateWorld(MpiOptions());
  absl::Status status = world.status();
  int rank = -1;
  if (world.ok()) {
    rank = (*world)->rank();
    status = Run(**world);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "init_memory: rank %d: %s\n", rank,
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam

int main(int argc, char** argv) {
  return flatparam::libtorch::Main(argc, argv);
}
