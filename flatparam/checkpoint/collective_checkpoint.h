// A sharded checkpoint (checkpoint_dir.h) written collectively by the ranks
// of a job, each writing its own files into a shared directory, with the
// same crash safety and the same bytes as the single-process
// WriteShardedCheckpoint.
//
//   // On every rank of `world`, with this rank's shard-group content:
//   FLATPARAM_ASSIGN_OR_RETURN(RankContent mine,
//                              MakeRankContent(layout, shard_rank, state));
//   FLATPARAM_RETURN_IF_ERROR(WriteShardedCheckpointCollective(
//       PosixFileSystem(), "/ckpt/step100", layout, world.size(), mine,
//       world));
//
// The protocol (checkpoint_dir.h's steps, spread over the ranks):
//   a. Rank 0 settles an interrupted earlier write (RecoverCheckpointDir),
//      creates the temporary directory DIR.tmp-<random> and sends its name
//      to every rank. Every rank sends a digest of its layout and world
//      size, so ranks that disagree on what they save fail here.
//   b. Each rank r of the first shard group (world ranks 0..G-1, G the
//      layout's world size) writes its own rank{r}.safetensors and
//      rank{r}.json into it, each fsynced, and sends rank 0 their sizes and
//      XXH3 checksums. The hybrid strategies' other replicas hold identical
//      shards and write nothing.
//   c. Rank 0 writes layout.json, fsyncs the directory, writes manifest.json
//      from every rank's entries and swaps the directory in (steps 2-5).
// Between the phases the ranks exchange their statuses (AllGatherBytes), so
// every rank returns the same result: OK, or the error of the lowest rank
// that failed, prefixed "rank R: ", with that rank's status code. When any
// rank fails, rank 0 removes the temporary directory and DIR keeps the
// previous checkpoint. A rank that dies or stalls makes the exchanges fail
// with the communicator's error (its timeout: options.collective), not hang;
// then each rank returns its own communicator error.
//
// The file system must be one that every rank sees (a shared or parallel
// file system for MPI jobs; one FileSystem for the simulator's ranks), with
// renames and fsyncs of one rank visible to the others once the exchange
// after them has completed. Crash safety is checkpoint_dir.h's: at any
// crash DIR resolves to the previous or the new complete checkpoint.
//
// Ownership: `layout` and `mine` are borrowed for the call. Thread-safety:
// collective over `world` (every rank calls it, from its own thread, with
// the same dir, layout and world size).
#ifndef FLATPARAM_CHECKPOINT_COLLECTIVE_CHECKPOINT_H_
#define FLATPARAM_CHECKPOINT_COLLECTIVE_CHECKPOINT_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace checkpoint {

struct CollectiveWriteOptions {
  // Chunk size of the tensor writes; `progress` reports this rank's own
  // bytes (its rank files; rank 0 also layout.json); `outcome` is set on
  // rank 0 only (the rank that publishes).
  CheckpointWriteOptions write;
  // Timeout of each status exchange (the ranks wait there for the slowest
  // writer, so it must cover a rank's whole write).
  CollectiveOptions collective;
  // CollectiveLayoutDigest(layout, world_size), when the caller has it:
  // ranks that save the same layout often (or, in a simulation, many ranks
  // in one process) compute it once. Empty: computed at each Begin.
  std::string layout_digest;
};

// What the ranks compare in phase a: a checksum of `layout`'s layout.json
// document for `world_size` ranks and of its model. Costs a serialisation
// of the layout (milliseconds for a 70B model's).
std::string CollectiveLayoutDigest(const ModelLayout& layout,
                                   int64_t world_size);

// Writes a sharded checkpoint of `layout` saved on `world_size` ranks to
// `dir`, collectively over `world` (see the file comment). `world_size`
// must equal world.size() (W; for the hybrid strategies a multiple of the
// layout's shard group size G, otherwise G). `mine` is this rank's content
// as shard-group rank `world.rank() % G` (ignored on ranks >= G).
// Errors, agreed by every rank: InvalidArgument for a world size that does
// not fit, ranks whose layouts or world sizes differ, or content that does
// not fit the layout (naming the rank and tensor); the file system's errors
// otherwise; the communicator's when the exchange itself fails.
absl::Status WriteShardedCheckpointCollective(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    int64_t world_size, const RankContent& mine, Communicator& world,
    const CollectiveWriteOptions& options = {});

// The same protocol in its three phases, for writers that put phase b
// somewhere else (AsyncCheckpointSaver writes it on a background thread).
// WriteShardedCheckpointCollective is Begin, WriteCollectiveRankFiles and
// Finish in a row.
struct CollectiveWrite {
  int rank = 0;
  // Rank 0: the normalised target directory; every rank: the temporary one.
  std::string target;
  std::string tmp;
  const ModelLayout* layout = nullptr;  // borrowed from Begin's caller
  int64_t world_size = 0;
  // This rank's written files (manifest entries), for Finish.
  nlohmann::json entries = nlohmann::json::array();
};
// Phase a, collective: the agreed temporary directory, or the agreed error
// (then nothing is left behind). A non-OK `local` (this rank cannot take
// part, e.g. its content does not fit) fails every rank here.
absl::StatusOr<CollectiveWrite> BeginCollectiveWrite(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    int64_t world_size, Communicator& world,
    const CollectiveWriteOptions& options = {},
    const absl::Status& local = absl::OkStatus());
// Phase b, local (no communication; may run on another thread than the
// collectives): this rank's files into the temporary directory.
absl::Status WriteCollectiveRankFiles(
    FileSystem& fs, CollectiveWrite& w, const RankContent& mine,
    const CollectiveWriteOptions& options = {});
// Phase b without the data, for simulating a save at a scale this machine
// cannot hold (`fsdp plan --simulate --simulate-save`): sets w.entries to
// the files WriteCollectiveRankFiles would write, at their exact sizes
// (the same layout.json, rank files and headers), without calling `mine`'s
// sources, hashing anything or touching a file system; the entries carry
// no checksums. Returns the bytes this rank would write (0 on ranks >= G).
// A FinishCollectiveWrite after it publishes a manifest of files that were
// never written: use it only on a scratch file system (the simulation's
// FaultInjectionFileSystem). Errors: RankFiles' (content that does not fit
// the layout).
absl::StatusOr<uint64_t> SimulateCollectiveRankFiles(
    CollectiveWrite& w, const RankContent& mine,
    const CollectiveWriteOptions& options = {});
// Phase c, collective: every rank's phase-b status and files; rank 0
// publishes. Returns the agreed status; on failure the temporary directory
// is removed and `dir` keeps the previous checkpoint.
absl::Status FinishCollectiveWrite(FileSystem& fs, const CollectiveWrite& w,
                                   const absl::Status& written_status,
                                   Communicator& world,
                                   const CollectiveWriteOptions& options = {});
// Local: gives a begun write up (rank 0 removes the temporary directory).
// Not needed for crash safety -- the next write to `dir` recovers -- only to
// free the space early.
void AbandonCollectiveWrite(FileSystem& fs, const CollectiveWrite& w);

// A load's verdict agreed by every rank of `world`, so that one rank's
// damaged or missing file fails every rank instead of leaving the others
// waiting in their first collective: exchanges every rank's `mine` and
// returns OK if all are, `mine` if every rank failed alike, else the
// lowest failing rank's error, "rank R: ...", with its code; when other
// ranks found what it did not (NotFound), says that the ranks see
// different file systems. Collective over `world`; the communicator's
// error if the exchange fails.
absl::Status AgreeOnLoad(Communicator& world, const absl::Status& mine,
                         const CollectiveOptions& options = {});

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_COLLECTIVE_CHECKPOINT_H_
