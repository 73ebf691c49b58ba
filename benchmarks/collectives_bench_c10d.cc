// MakeC10dWorld() in a build with c10d's gloo group.
#include "benchmarks/collectives_bench_c10d.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "comm/c10d/c10d_communicator.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace bench {
namespace {

// A port the kernel has free now (bound, then released).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace

// A c10d work as a Work.
class RawWork final : public Work {
 public:
  explicit RawWork(c10::intrusive_ptr<c10d::Work> work)
      : work_(std::move(work)) {}
  absl::Status Wait() override {
    try {
      // A hung peer fails the benchmark instead of hanging it.
      if (!work_->wait(std::chrono::minutes(5))) {
        return absl::DeadlineExceededError("c10d's own collective timed out");
      }
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::InternalError(e.what());
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

absl::StatusOr<C10dWorld> MakeC10dWorld(Communicator& bootstrap) {
  // torchrun's environment, made here: rank 0 picks the store's port.
  double port = bootstrap.rank() == 0 ? FreePort() : 0;
  BroadcastOptions root;
  FLATPARAM_RETURN_IF_ERROR(
      bootstrap.Broadcast({&port, 1, DType::kFloat64}, root)->Wait());
  setenv("RANK", std::to_string(bootstrap.rank()).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(bootstrap.size()).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(static_cast<int>(port)).c_str(), 1);
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<C10dCommunicator> world,
                             C10dCommunicator::FromEnvironment());
  C10dWorld made;
  c10::intrusive_ptr<c10d::ProcessGroup> group = world->process_group();
  const int n = world->size();
  made.comm = std::move(world);
  made.raw = [group, n](CollectiveKind kind, const void* in, void* out,
                        int64_t count) -> std::unique_ptr<Work> {
    auto floats = [](const void* p, int64_t c) {
      return at::from_blob(const_cast<void*>(p), {c},
                           at::TensorOptions().dtype(at::kFloat));
    };
    try {
      switch (kind) {
        case CollectiveKind::kAllGather: {
          std::vector<at::Tensor> inputs = {floats(in, count)};
          std::vector<std::vector<at::Tensor>> outputs(1);
          for (int r = 0; r < n; ++r) {
            outputs[0].push_back(
                floats(static_cast<const float*>(out) + r * count, count));
          }
          return std::make_unique<RawWork>(group->allgather(outputs, inputs));
        }
        case CollectiveKind::kReduceScatter: {
          // 1.13's gloo has no reduce-scatter: its all-reduce of the input.
          std::vector<at::Tensor> tensors = {floats(in, n * count)};
          return std::make_unique<RawWork>(group->allreduce(tensors));
        }
        case CollectiveKind::kAllReduce: {
          std::vector<at::Tensor> tensors = {floats(out, count)};
          return std::make_unique<RawWork>(group->allreduce(tensors));
        }
        case CollectiveKind::kBroadcast: {
          std::vector<at::Tensor> tensors = {floats(out, count)};
          return std::make_unique<RawWork>(group->broadcast(tensors));
        }
      }
    } catch (const std::exception& e) {
      return CompletedWork(absl::InternalError(e.what()));
    }
    return CompletedWork(absl::InternalError("unknown collective"));
  };
  return made;
}

}  // namespace bench
}  // namespace flatparam
