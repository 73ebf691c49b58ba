// A small FSDP trainer written the way another team would write one: in its
// own workspace, against flatparam's public targets only
// (@flatparam//flatparam and the MPI backend,
// @flatparam//comm/mpi:mpi_communicator). Run it on every rank of an MPI job
// with a checkpoint directory that every rank sees:
//
//   mpirun -np 2 bazel-bin/trainer /shared/ckpt
//
// The model is a toy of three FSDP units (the root owns the embedding and
// the head; "layers.0" and "layers.1" are units of their own), sharded
// FULL_SHARD over the job's ranks with use_orig_params-style alignment.
//   1. Lay the model out (ModelLayout) and create one FlatParamHandle per
//      unit on the MPI communicator, with host memory (HostDeviceOps).
//   2. Train kSteps steps. Per unit, the forward unshards (PreForward) and
//      reads the parameters; the backward (PreBackward) adds the gradient
//      of a synthetic loss 0.5 * |p - target|^2, whose target differs per
//      rank as a rank's data would, and PostBackward reduce-scatters it: each
//      rank gets its shard of the gradient averaged over the ranks. Then SGD
//      with momentum updates each rank's shard in place.
//   3. Save a sharded checkpoint collectively (the shards, the momentum
//      buffers as optimizer state, the step), read this rank's part back
//      and require it to equal what was saved bit for bit; restore a second
//      trainer from it (handles over the loaded shards) and require one
//      more step of it to equal one more step of the original, bit for bit.
// An error or a mismatch on any rank makes every rank exit with status 1.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/handle.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

// This program's own error plumbing (flatparam's macros are internal).
#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (0)

namespace {

using flatparam::BufferRef;
using flatparam::Communicator;
using flatparam::ConstBufferRef;
using flatparam::Device;
using flatparam::DeviceOps;
using flatparam::DType;
using flatparam::FlatParamHandle;
using flatparam::FlatParamLayout;
using flatparam::HostDeviceOps;
using flatparam::HostTensor;
using flatparam::ModelLayout;
using flatparam::ModelSpec;
using flatparam::checkpoint::RankState;

constexpr int kSteps = 3;
constexpr float kLr = 0.1f;
constexpr float kMomentum = 0.9f;
constexpr char kMomentumBuffer[] = "momentum_buffer";

ModelSpec TinyModel() {
  ModelSpec spec;
  spec.name = "tiny_mlp";
  spec.params = {
      {"embed.weight", {10, 4}}, {"layers.0.weight", {4, 4}},
      {"layers.0.bias", {4}},    {"layers.1.weight", {4, 4}},
      {"layers.1.bias", {4}},    {"head.weight", {3, 4}},
      {"head.bias", {3}},
  };
  spec.wrap = {"layers.0", "layers.1"};
  return spec;
}

// The same initial value on every rank: a small function of the name and
// the element index.
float InitialValue(const std::string& fqn, int64_t i) {
  uint32_t h = 2166136261u;  // FNV-1a of the name
  for (unsigned char c : fqn) h = (h ^ c) * 16777619u;
  return 0.01f * static_cast<float>((h + 7 * i) % 41) - 0.2f;
}

// What rank `rank`'s data pulls element i of a parameter towards.
float Target(int rank, int64_t i) {
  return 0.25f * static_cast<float>(rank + 1) - 0.01f * static_cast<float>(i);
}

float* Floats(BufferRef b) { return static_cast<float*>(b.data); }

HostTensor CopyToHost(ConstBufferRef b) {
  HostTensor t = HostTensor::Flat(b.dtype, b.count);
  std::memcpy(t.data(), b.data, t.nbytes());
  return t;
}

BufferRef HostBuffer(HostTensor& t) {
  return {t.data(), t.numel(), t.dtype(), Device::Host()};
}

// First difference between two tensors that should be bitwise equal.
std::optional<std::string> Difference(const std::string& what,
                                      const HostTensor& a,
                                      const HostTensor& b) {
  if (a == b) return std::nullopt;
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return absl::StrCat(what, ": dtype or shape differs");
  }
  const uint32_t* x = a.data_as<uint32_t>();
  const uint32_t* y = b.data_as<uint32_t>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (x[i] != y[i]) {
      return absl::StrFormat(
          "%s: element %d is %.9g (0x%08x), expected %.9g "
          "(0x%08x)",
          what, i, b.GetDouble(i), y[i], a.GetDouble(i), x[i]);
    }
  }
  return absl::StrCat(what, ": differs");
}

// One rank's trainer: a handle per unit and the momentum of its shard.
class Trainer {
 public:
  // Fresh parameters (InitialValue), each rank flattening its own shard.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const ModelLayout& layout, Communicator& world, DeviceOps& device) {
    auto trainer = std::unique_ptr<Trainer>(new Trainer(world));
    for (const FlatParamLayout& unit : layout.flat_params()) {
      std::vector<HostTensor> values;
      for (const flatparam::ParamInfo& p : unit.params()) {
        values.emplace_back(unit.dtype(), p.shape);
        for (int64_t i = 0; i < p.numel; ++i) {
          values.back().SetDouble(i, InitialValue(p.fqn, i));
        }
      }
      std::vector<flatparam::ConstBufferRef> refs;
      for (const HostTensor& v : values) refs.push_back(v.cref());
      absl::StatusOr<std::unique_ptr<FlatParamHandle>> handle =
          FlatParamHandle::Create(unit, refs, &world,
                                  /*replicate_group=*/nullptr, &device);
      if (!handle.ok()) return handle.status();
      trainer->handles_.push_back(*std::move(handle));
      trainer->momentum_.push_back(
          HostTensor::Flat(DType::kFloat32, unit.sharded_numel()));
    }
    return trainer;
  }

  // From a rank's state read from a checkpoint: the handles use the loaded
  // shards in place (CreateWithLocalShard), which the trainer keeps.
  static absl::StatusOr<std::unique_ptr<Trainer>> Restore(
      const ModelLayout& layout, RankState state, Communicator& world,
      DeviceOps& device) {
    auto trainer = std::unique_ptr<Trainer>(new Trainer(world));
    trainer->shards_ = std::move(state.flat_params);
    for (size_t u = 0; u < layout.flat_params().size(); ++u) {
      absl::StatusOr<std::unique_ptr<FlatParamHandle>> handle =
          FlatParamHandle::CreateWithLocalShard(
              layout.flat_params()[u], HostBuffer(trainer->shards_[u]), &world,
              /*replicate_group=*/nullptr, &device);
      if (!handle.ok()) return handle.status();
      trainer->handles_.push_back(*std::move(handle));
      const auto& values = state.optim.state[static_cast<int64_t>(u)];
      auto it = values.find(kMomentumBuffer);
      if (it == values.end() ||
          !std::holds_alternative<HostTensor>(it->second)) {
        return absl::DataLossError(
            absl::StrCat("no momentum_buffer tensor for flat parameter ", u));
      }
      trainer->momentum_.push_back(std::get<HostTensor>(it->second));
    }
    trainer->step_ = state.extra.value("step", 0);
    return trainer;
  }

  // One training step; returns this rank's loss before it.
  absl::StatusOr<double> Step() {
    const int rank = world_.rank();
    double loss = 0;
    // Forward, units in order. The root (unit 0) keeps its unsharded
    // parameters for the backward that follows at once.
    for (size_t u = 0; u < handles_.size(); ++u) {
      FlatParamHandle& h = *handles_[u];
      RETURN_IF_ERROR(h.PreForward());
      for (size_t i = 0; i < h.layout().params().size(); ++i) {
        absl::StatusOr<flatparam::OrigParamView> p = h.Param(i);
        if (!p.ok()) return p.status();
        for (int64_t k = 0; k < p->data.count; ++k) {
          const double d = Floats(p->data)[k] - Target(rank, k);
          loss += 0.5 * d * d;
        }
      }
      RETURN_IF_ERROR(h.PostForward(/*is_root=*/u == 0));
    }
    // Backward, units in reverse: d loss / d p = p - target.
    for (size_t u = handles_.size(); u-- > 0;) {
      FlatParamHandle& h = *handles_[u];
      RETURN_IF_ERROR(h.PreBackward());
      for (size_t i = 0; i < h.layout().params().size(); ++i) {
        absl::StatusOr<flatparam::OrigParamView> p = h.Param(i);
        if (!p.ok()) return p.status();
        std::vector<float> grad(p->data.count);
        for (int64_t k = 0; k < p->data.count; ++k) {
          grad[k] = Floats(p->data)[k] - Target(rank, k);
        }
        RETURN_IF_ERROR(
            h.AccumulateGrad(static_cast<int>(i),
                             ConstBufferRef{grad.data(), p->data.count,
                                            DType::kFloat32, Device::Host()}));
      }
      RETURN_IF_ERROR(h.PostBackward(/*sync_gradients=*/true));
    }
    for (auto& h : handles_) {
      RETURN_IF_ERROR(h->FinalizeBackward(/*sync_gradients=*/true));
    }
    // SGD with momentum on this rank's shards (padding has zero gradient
    // and stays as it is).
    for (size_t u = 0; u < handles_.size(); ++u) {
      FlatParamHandle& h = *handles_[u];
      const std::optional<BufferRef> grad = h.sharded_grad();
      if (!grad.has_value()) {
        return absl::InternalError(
            absl::StrCat("unit ", u, " has no sharded gradient"));
      }
      float* param = Floats(h.sharded_param());
      float* buf = momentum_[u].data_as<float>();
      for (int64_t k = 0; k < grad->count; ++k) {
        buf[k] = kMomentum * buf[k] + Floats(*grad)[k];
        param[k] = param[k] - kLr * buf[k];
      }
      RETURN_IF_ERROR(h.ZeroGrad());
    }
    ++step_;
    return loss;
  }

  // What a checkpoint of this rank holds: its shards, the momentum as the
  // flat path's sharded optimizer state (PyTorch's SGD names), the step.
  RankState State() const {
    RankState state;
    flatparam::optim::ParamGroup group;
    group.hyperparams["lr"] = static_cast<double>(kLr);
    group.hyperparams["momentum"] = static_cast<double>(kMomentum);
    for (size_t u = 0; u < handles_.size(); ++u) {
      state.flat_params.push_back(CopyToHost(handles_[u]->sharded_param()));
      const int64_t key = static_cast<int64_t>(u);
      state.optim.state[key][kMomentumBuffer] = momentum_[u];
      group.params.push_back(key);
    }
    state.optim.param_groups.push_back(std::move(group));
    state.extra = {{"step", step_}};
    return state;
  }

 private:
  explicit Trainer(Communicator& world) : world_(world) {}

  Communicator& world_;
  // Restored trainers: the local shards the handles use in place.
  std::vector<HostTensor> shards_;
  std::vector<std::unique_ptr<FlatParamHandle>> handles_;
  std::vector<HostTensor> momentum_;
  int64_t step_ = 0;
};

// Where `actual` differs from `expected`, or nullopt.
std::optional<std::string> StateDifference(const RankState& expected,
                                           const RankState& actual) {
  if (actual.flat_params.size() != expected.flat_params.size()) {
    return absl::StrCat(actual.flat_params.size(),
                        " flat parameters, expected ",
                        expected.flat_params.size());
  }
  for (size_t u = 0; u < expected.flat_params.size(); ++u) {
    if (auto d = Difference(absl::StrCat("flat parameter ", u),
                            expected.flat_params[u], actual.flat_params[u])) {
      return d;
    }
  }
  if (auto d =
          flatparam::optim::FirstDifference(expected.optim, actual.optim)) {
    return absl::StrCat("optimizer state: ", *d);
  }
  if (actual.extra != expected.extra) {
    return absl::StrCat("extra: ", actual.extra.dump(), ", expected ",
                        expected.extra.dump());
  }
  return std::nullopt;
}

// Every rank learns every rank's verdict, so that all fail together.
absl::Status Agree(Communicator& world, const std::optional<std::string>& mine,
                   const std::string& what) {
  absl::StatusOr<std::vector<std::string>> all =
      world.AllGatherBytes(mine.value_or(""), flatparam::CollectiveOptions());
  if (!all.ok()) return all.status();
  for (size_t r = 0; r < all->size(); ++r) {
    if (!(*all)[r].empty()) {
      return absl::DataLossError(
          absl::StrCat(what, ": rank ", r, ": ", (*all)[r]));
    }
  }
  return absl::OkStatus();
}

absl::Status Run(Communicator& world, const std::string& dir) {
  const int rank = world.rank();
  flatparam::LayoutOptions options;
  options.world_size = world.size();
  options.strategy = flatparam::ShardingStrategy::kFullShard;
  options.align_addresses = true;
  absl::StatusOr<ModelLayout> layout =
      ModelLayout::Create(TinyModel(), options);
  if (!layout.ok()) return layout.status();
  if (rank == 0) {
    std::printf(
        "trainer: %d ranks, %zu units, %lld parameters, %lld per rank\n",
        world.size(), layout->flat_params().size(),
        static_cast<long long>(layout->param_numel()),
        static_cast<long long>(layout->sharded_numel()));
  }

  HostDeviceOps device;
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(*layout, world, device);
  if (!trainer.ok()) return trainer.status();
  for (int step = 1; step <= kSteps; ++step) {
    absl::StatusOr<double> loss = (*trainer)->Step();
    if (!loss.ok()) return loss.status();
    if (rank == 0) std::printf("step %d: rank 0 loss %.6f\n", step, *loss);
  }

  // Save, collectively; every rank writes its own rank file.
  flatparam::checkpoint::FileSystem& fs =
      flatparam::checkpoint::PosixFileSystem();
  const RankState saved = (*trainer)->State();
  absl::StatusOr<flatparam::checkpoint::RankContent> content =
      flatparam::checkpoint::MakeRankContent(*layout, rank, saved);
  if (!content.ok()) return content.status();
  RETURN_IF_ERROR(flatparam::checkpoint::WriteShardedCheckpointCollective(
      fs, dir, *layout, world.size(), *content, world));

  // Load this rank's part back; it must be what was saved, bit for bit.
  absl::StatusOr<flatparam::checkpoint::ShardedCheckpointReader> reader =
      flatparam::checkpoint::ShardedCheckpointReader::Open(fs, dir);
  if (!reader.ok()) return reader.status();
  RETURN_IF_ERROR(reader->CheckFits(*layout, world.size()));
  absl::StatusOr<RankState> loaded =
      flatparam::checkpoint::ReadRankState(*reader, rank);
  if (!loaded.ok()) return loaded.status();
  RETURN_IF_ERROR(Agree(world, StateDifference(saved, *loaded),
                        "loaded checkpoint differs from the saved state"));
  if (rank == 0) {
    std::printf("saved %s and loaded it back: equal bit for bit\n",
                dir.c_str());
  }

  // Resume from it: one more step of the restored trainer equals one more
  // step of the original.
  absl::StatusOr<std::unique_ptr<Trainer>> restored =
      Trainer::Restore(*layout, *std::move(loaded), world, device);
  if (!restored.ok()) return restored.status();
  absl::StatusOr<double> loss = (*trainer)->Step();
  if (!loss.ok()) return loss.status();
  absl::StatusOr<double> restored_loss = (*restored)->Step();
  if (!restored_loss.ok()) return restored_loss.status();
  std::optional<std::string> difference =
      StateDifference((*trainer)->State(), (*restored)->State());
  if (!difference.has_value() && *loss != *restored_loss) {
    difference =
        absl::StrFormat("loss %.9g, expected %.9g", *restored_loss, *loss);
  }
  RETURN_IF_ERROR(
      Agree(world, difference, "the resumed step differs from the original's"));
  if (rank == 0) {
    std::printf(
        "step %d after resuming: equal bit for bit (rank 0 loss %.6f)\n",
        kSteps + 1, *loss);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: mpirun -np N %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int rank = -1;
  const absl::Status status =
      flatparam::RunOnMpiWorld([&](flatparam::MpiCommunicator& world) {
        rank = world.rank();
        return Run(world, dir);
      });
  if (!status.ok()) {
    // RunOnMpiWorld printed it as it happened, before ending the job.
    if (!flatparam::IsReported(status)) {
      std::fprintf(stderr, "trainer: rank %d: %s\n", rank,
                   status.ToString().c_str());
    }
    return 1;
  }
  if (rank == 0) std::printf("trainer: OK\n");
  return 0;
}
