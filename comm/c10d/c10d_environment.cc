// C10dCommunicator::FromEnvironment: the gloo group torchrun's workers
// make (torch/distributed/rendezvous.py's env:// handler, in C++).
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "comm/c10d/c10d_communicator.h"
#include "comm/c10d/internal/shared.h"

namespace flatparam {
namespace {

absl::StatusOr<std::string> Env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    return absl::InvalidArgumentError(absl::StrCat(
        "C10dCommunicator::FromEnvironment: ", name,
        " is not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT for its workers; set them when launching otherwise)"));
  }
  return std::string(value);
}

absl::StatusOr<int64_t> EnvInt(const char* name, int64_t low, int64_t high) {
  absl::StatusOr<std::string> text = Env(name);
  if (!text.ok()) return text.status();
  int64_t value = 0;
  if (!absl::SimpleAtoi(*text, &value) || value < low || value > high) {
    return absl::InvalidArgumentError(
        absl::StrCat("C10dCommunicator::FromEnvironment: ", name, "=\"", *text,
                     "\" is not an integer in [", low, ", ", high, "]"));
  }
  return value;
}

// TCPStoreOptions::useLibUV, where the LibTorch has it (2.x, default on):
// set as torch.distributed's rendezvous sets it, from USE_LIBUV ("0" turns
// it off; a LibTorch built without libuv, as Debian's, needs that).
template <typename StoreOptions>
auto SetUseLibUv(StoreOptions& o, int) -> decltype(o.useLibUV = true, void()) {
  const char* value = std::getenv("USE_LIBUV");
  o.useLibUV = value == nullptr || std::string(value) != "0";
}
// 1.13: no libuv backend, nothing to set.
template <typename StoreOptions>
void SetUseLibUv(StoreOptions&, long) {}

}  // namespace

absl::StatusOr<std::unique_ptr<C10dCommunicator>>
C10dCommunicator::FromEnvironment(const C10dOptions& options) {
  absl::StatusOr<int64_t> world_size = EnvInt("WORLD_SIZE", 1, 1 << 20);
  if (!world_size.ok()) return world_size.status();
  absl::StatusOr<int64_t> rank = EnvInt("RANK", 0, *world_size - 1);
  if (!rank.ok()) return rank.status();
  absl::StatusOr<std::string> addr = Env("MASTER_ADDR");
  if (!addr.ok()) return addr.status();
  absl::StatusOr<int64_t> port = EnvInt("MASTER_PORT", 0, 65535);
  if (!port.ok()) return port.status();
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent != nullptr && std::string(agent) == "True";
  std::string attempt;
  if (agent_store) {
    absl::StatusOr<std::string> restarts = Env("TORCHELASTIC_RESTART_COUNT");
    if (!restarts.ok()) return restarts.status();
    attempt = *restarts;
  }
  const std::string where =
      absl::StrCat("rank ", *rank, " of ", *world_size, ", store ", *addr, ":",
                   *port, agent_store ? " (torchrun's agent)" : "");
  try {
    // As rendezvous.py's _create_c10d_store: the agent's store under the
    // restart's prefix, or one rank 0 hosts.
    // Every connection but the probe counts itself in, as Python's
    // TCPStore(wait_for_workers=True) does; the host waits for them all.
    auto connect = [&](absl::Duration timeout, bool server,
                       bool wait_workers) -> c10::intrusive_ptr<c10d::Store> {
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(*port);
      o.isServer = server;
      o.timeout = Millis(timeout);
      if (wait_workers) o.numWorkers = static_cast<size_t>(*world_size);
      o.waitWorkers = wait_workers;
      o.multiTenant = !agent_store;
      SetUseLibUv(o, 0);
      c10::intrusive_ptr<c10d::Store> store =
          c10::make_intrusive<c10d::TCPStore>(*addr, o);
      if (agent_store) {
        store = c10::make_intrusive<c10d::PrefixStore>(
            absl::StrCat("/worker/attempt_", attempt), store);
      }
      return store;
    };
    c10::intrusive_ptr<c10d::Store> store = connect(
        options.start_timeout, !agent_store && *rank == 0, !agent_store);
    // A second connection for the diagnosis of a failed collective, with a
    // short timeout: if the rank hosting the store is the one that stopped,
    // asking it must not wait the store's start timeout.
    c10::intrusive_ptr<c10d::Store> probe =
        connect(options.diagnosis_grace + absl::Seconds(1), false, false);
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    std::shared_ptr<::gloo::transport::Device> device =
        ifname != nullptr && *ifname != '\0'
            ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
            : c10d::ProcessGroupGloo::createDefaultDevice();
    auto gloo_options =
        c10d::ProcessGroupGloo::Options::create(Millis(options.start_timeout));
    gloo_options->devices = {device};
    gloo_options->threads = 2;
    c10::intrusive_ptr<c10d::ProcessGroup> group = MakeGlooGroup(
        c10::make_intrusive<c10d::PrefixStore>("flatparam/world", store),
        static_cast<int>(*rank), static_cast<int>(*world_size), gloo_options);
    auto comm = absl::WrapUnique(
        new C10dCommunicator(store, group, "flatparam/world/", options));
    comm->shared_->probe_store = probe;
    comm->shared_->device = device;
    return comm;
  } catch (...) {
    const std::string message = ExceptionMessage(std::current_exception());
    const std::string text = absl::StrCat("C10dCommunicator::FromEnvironment (",
                                          where, "): ", message);
    if (absl::StrContains(message, "imed out") ||
        absl::StrContains(message, "imeout")) {
      return absl::DeadlineExceededError(
          absl::StrCat(text, " (the group did not form within ",
                       absl::FormatDuration(options.start_timeout), ")"));
    }
    return absl::UnavailableError(text);
  }
}

}  // namespace flatparam
