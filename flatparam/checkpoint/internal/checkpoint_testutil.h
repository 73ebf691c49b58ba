// Test-only fixtures shared by the checkpoint tests: a small model with
// every kind of parameter, layouts of it, checkpoint content whose bytes
// are a function of (version, rank, tensor, element) so that a reader can
// tell which version it sees, and FileSystem shortcuts that report errors
// as test failures.
//
//   const ModelLayout layout = MakeTestLayout(TinyModelSpec(),
//                                             TestLayoutOptions(2));
//   const ShardedFixture v1 = MakeShardedFixture(layout, 2, /*version=*/1);
//   ASSERT_THAT(WriteShardedCheckpoint(fs, "ckpt", v1.content), IsOk());
//
// Ownership: a fixture owns the tensors its content's sources read from;
// keep it alive while the content is written. Fixtures move (a std::deque
// keeps its elements in place) but do not copy.
//
// Thread-safety: functions of their arguments.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_TESTUTIL_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_TESTUTIL_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {

// Model "tiny": emb.weight [11, 3]; seq.0.weight [5, 3], seq.0.bias [5];
// seq.2.weight [7, 5], seq.2.bias [7] (the wrapped unit seq.2, so two flat
// parameters); norm.scale, 0-d; head.weight tied to emb.weight.
ModelSpec TinyModelSpec();

LayoutOptions TestLayoutOptions(
    int64_t world_size,
    ShardingStrategy strategy = ShardingStrategy::kFullShard,
    bool align_addresses = false);

// ModelLayout::Create(spec, options). REQUIRES: it succeeds (a failure is
// reported as a test failure, and then the StatusOr's value() fails).
ModelLayout MakeTestLayout(const ModelSpec& spec, const LayoutOptions& options);

// t[i] = base + i for every element.
void FillSequence(HostTensor& t, double base);

// The content of version `version` of a full checkpoint of `spec`: every
// untied parameter, its "exp_avg" (float32) and "step" (0-d) state, and an
// optim.json with one parameter group, a non-tensor state and "version".
struct FullFixture {
  FullFixture() = default;
  FullFixture(FullFixture&&) = default;
  FullFixture& operator=(FullFixture&&) = default;

  std::deque<HostTensor> storage;  // what content's sources read
  FullCheckpointContent content;
};
FullFixture MakeFullFixture(const ModelSpec& spec, int version);

// The content of version `version` of a sharded checkpoint of `layout` for
// a job of `world_size` ranks: on every shard-group rank, each flat
// parameter's shard, its "exp_avg" and "step" state, and a sidecar with
// "param_groups", "rank" and "version".
struct ShardedFixture {
  ShardedFixture() = default;
  ShardedFixture(ShardedFixture&&) = default;
  ShardedFixture& operator=(ShardedFixture&&) = default;

  std::deque<HostTensor> storage;  // what content's sources read
  ShardedCheckpointContent content;
};
ShardedFixture MakeShardedFixture(const ModelLayout& layout, int64_t world_size,
                                  int version);

// Model "big", for the memory-bound tests: 8 float32 parameters of 6 MiB
// (layers.{0..3}.w [1536, 1024] and .v [1024, 1536]) in 4 units, 48 MiB.
ModelSpec BigModelSpec();

// Model "bn": parameters a.w [4, 3], a.b [4], c.w [5] (unit "a") and
// three buffers of three dtypes: a.bn.running_mean (float32 [3]),
// a.bn.num_batches_tracked (int64, 0-d), c.scale (float64 [2]).
ModelSpec BufferModelSpec();

// Buffer values that say which rank they came from: every element of rank
// r's buffers is 10 * (r + 1) plus the element's index.
std::map<std::string, HostTensor> RankBuffers(const ModelSpec& spec, int r);

// One RankState per rank of `layout`: zeroed flat parameters and
// RankBuffers(layout.spec(), rank).
std::vector<RankState> RankStatesWithBuffers(const ModelLayout& layout);

// Same dtype, shape and bytes.
bool SameTensorBytes(const HostTensor& a, const HostTensor& b);

// `got` holds exactly RankBuffers(spec, r); a test failure otherwise.
void ExpectRanksBuffers(const ModelSpec& spec,
                        const std::map<std::string, HostTensor>& got, int r);

// The process's peak resident set (VmHWM) in bytes; 0 where
// /proc/self/status does not say.
int64_t PeakResidentBytes();

// A sharded checkpoint of `ranks` (one per shard-group rank of `layout`)
// at `dir`: MakeRankContent for each, then WriteShardedCheckpoint.
absl::Status WriteRankStates(FileSystem& fs, const std::string& dir,
                             const ModelLayout& layout,
                             const std::vector<RankState>& ranks);

// fs.GetChildren(dir), or {} and a test failure.
std::vector<std::string> ListDir(FileSystem& fs, const std::string& dir);

// The whole file at `path` (up to 1 GiB), or "" and a test failure.
std::string ReadWholeFile(FileSystem& fs, const std::string& path);

// Directories `a` and `b` hold the same file names with the same bytes; a
// test failure otherwise (naming each file that differs). Wrap a call in
// SCOPED_TRACE to say which comparison failed.
void ExpectSameDirectory(FileSystem& fs, const std::string& a,
                         const std::string& b);

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_TESTUTIL_H_
