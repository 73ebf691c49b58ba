#include "comm/desync_check.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace {

std::string Buffer(ConstBufferRef b) {
  return absl::StrFormat("count %d %s", b.count, DTypeName(b.dtype));
}

std::string Reduce(const ReduceOptions& o) {
  std::string s(ReduceOpName(o.op));
  if (o.pre_divide_factor != 1.0 || o.post_divide_factor != 1.0) {
    absl::StrAppendFormat(&s, " pre/post divide %g/%g", o.pre_divide_factor,
                          o.post_divide_factor);
  }
  return s;
}

}  // namespace

absl::Status DesyncCheckingCommunicator::Check(
    std::string call, const CollectiveOptions& options) {
  const int64_t seq = seq_++;
  std::string context;
  if (const FlightRecorder* recorder = inner().flight_recorder()) {
    context = DescribeContext(recorder->context());
  }
  const std::string mine =
      absl::StrCat(call, " #", seq, context.empty() ? "" : " from ", context);
  absl::StatusOr<std::vector<std::string>> all =
      inner().AllGatherBytes(mine, options);
  if (!all.ok()) {
    return absl::Status(
        all.status().code(),
        absl::StrCat("rank ", rank(), ": the desync check of ", mine,
                     " failed: ", all.status().message()));
  }
  std::map<std::string, std::vector<int>> by_call;
  for (int r = 0; r < static_cast<int>(all->size()); ++r) {
    by_call[(*all)[r]].push_back(r);
  }
  if (by_call.size() == 1) return absl::OkStatus();
  std::vector<std::string> sides;
  for (const auto& [text, ranks] : by_call) {
    sides.push_back(absl::StrFormat("rank%s %s called %s",
                                    ranks.size() > 1 ? "s" : "",
                                    absl::StrJoin(ranks, ","), text));
  }
  return absl::InternalError(absl::StrFormat(
      "rank %d: %s: the group is desynchronised (%s); no data was exchanged",
      rank(), mine, absl::StrJoin(sides, "; ")));
}

std::unique_ptr<Work> DesyncCheckingCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  absl::Status checked =
      Check(absl::StrCat(CollectiveOpName(CollectiveOp::kAllGather), " ",
                         Buffer(input)),
            options);
  if (!checked.ok()) return CompletedWork(std::move(checked));
  return inner().AllGather(input, output, options);
}

std::unique_ptr<Work> DesyncCheckingCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  absl::Status checked =
      Check(absl::StrCat(CollectiveOpName(CollectiveOp::kReduceScatter), " ",
                         Buffer(output), " ", Reduce(options)),
            options);
  if (!checked.ok()) return CompletedWork(std::move(checked));
  return inner().ReduceScatter(input, output, options);
}

std::unique_ptr<Work> DesyncCheckingCommunicator::AllReduce(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  absl::Status checked =
      Check(absl::StrCat(CollectiveOpName(CollectiveOp::kAllReduce), " ",
                         Buffer(input), " ", Reduce(options)),
            options);
  if (!checked.ok()) return CompletedWork(std::move(checked));
  return inner().AllReduce(input, output, options);
}

std::unique_ptr<Work> DesyncCheckingCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  absl::Status checked =
      Check(absl::StrCat(CollectiveOpName(CollectiveOp::kBroadcast), " ",
                         Buffer(buffer), " root ", options.root),
            options);
  if (!checked.ok()) return CompletedWork(std::move(checked));
  return inner().Broadcast(buffer, options);
}

absl::StatusOr<std::vector<std::string>>
DesyncCheckingCommunicator::AllGatherBytes(absl::string_view bytes,
                                           const CollectiveOptions& options) {
  absl::Status checked = Check(
      std::string(CollectiveOpName(CollectiveOp::kAllGatherBytes)), options);
  if (!checked.ok()) return checked;
  return inner().AllGatherBytes(bytes, options);
}

absl::Status DesyncCheckingCommunicator::Barrier(
    const CollectiveOptions& options) {
  absl::Status checked =
      Check(std::string(CollectiveOpName(CollectiveOp::kBarrier)), options);
  if (!checked.ok()) return checked;
  return inner().Barrier(options);
}

absl::StatusOr<std::unique_ptr<Communicator>> DesyncCheckingCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  absl::Status checked =
      Check(std::string(CollectiveOpName(CollectiveOp::kSplit)), options);
  if (!checked.ok()) return checked;
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      inner().Split(color, key, options);
  if (!child.ok() || *child == nullptr) return child;
  return std::unique_ptr<Communicator>(
      new DesyncCheckingCommunicator(*std::move(child)));
}

}  // namespace flatparam
