// Fuzz target for the optimizer sidecar schema (training_state.h): any byte
// string, read as a rank{r}.json or optim.json, must be rejected with
// DataLoss or accepted, and never crash, hang or allocate without bound.
// Every input that is accepted must also round-trip:
//
//   - ParseOptimSidecar: serialising what was parsed (OptimSidecarToJson)
//     succeeds, and parsing that gives a bitwise-equal sidecar and the same
//     bytes again.
//   - ReadRankState, with the input as rank00000.json of a small sharded
//     checkpoint: the state it returns can be written again
//     (MakeRankContent), and that sidecar parses to the same thing.
//   - ReadFullState, with the parsed input as optim.json of a full
//     checkpoint whose optim.safetensors holds a tensor under every name
//     the input lists: likewise through MakeFullContent.
// So the readers accept nothing the writers cannot write back.
//
// Under Bazel it runs as the ordinary test optim_sidecar_fuzz_test (GCC has
// no libFuzzer), over the checked-in seeds in testdata/optim_sidecar,
// seeds made by the real writers, and deterministic mutations of them;
// with --config=asan that run is sanitized too.
//
// With clang, run_optim_sidecar_fuzzer.sh (next to this file) builds it as
// a real coverage-guided libFuzzer binary with ASan and UBSan and runs it
// from the seeds:
//
//   flatparam/checkpoint/run_optim_sidecar_fuzzer.sh [seconds] [flags]
//
// New crashers go into testdata/optim_sidecar as regression seeds.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

// How many inputs each reader accepted, so the test can tell that the
// round-trip checks ran. Not thread-safe (libFuzzer runs one input at a
// time).
struct OptimSidecarFuzzStats {
  int64_t parsed = 0;
  int64_t rank_read = 0;
  int64_t full_read = 0;
};
OptimSidecarFuzzStats& GetOptimSidecarFuzzStats() {
  static OptimSidecarFuzzStats stats;
  return stats;
}

namespace {

using json = nlohmann::json;
using ::flatparam::DType;
using ::flatparam::HostTensor;
using ::flatparam::ModelLayout;
using ::flatparam::checkpoint::FaultInjectionFileSystem;
using ::flatparam::checkpoint::FullCheckpointContent;
using ::flatparam::checkpoint::FullCheckpointReader;
using ::flatparam::checkpoint::FullState;
using ::flatparam::checkpoint::OptimSidecar;
using ::flatparam::checkpoint::RankContent;
using ::flatparam::checkpoint::RankState;
using ::flatparam::checkpoint::ShardedCheckpointReader;
using ::flatparam::checkpoint::SidecarValue;
using ::flatparam::optim::ParamKey;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "optim_sidecar_fuzz: %s\n", what.c_str());
  std::abort();
}

void Check(bool condition, const std::string& what) {
  if (!condition) Fail(what);
}

void CheckDataLoss(const absl::Status& status, const std::string& what) {
  Check(
      status.code() == absl::StatusCode::kDataLoss,
      what + " rejected with a code other than DataLoss: " + status.ToString());
}

bool SameSidecar(const OptimSidecar& a, const OptimSidecar& b) {
  if (a.param_groups.size() != b.param_groups.size() ||
      a.state.size() != b.state.size() || a.extra != b.extra) {
    return false;
  }
  for (size_t g = 0; g < a.param_groups.size(); ++g) {
    if (a.param_groups[g] != b.param_groups[g]) return false;
  }
  for (auto ia = a.state.begin(), ib = b.state.begin(); ia != a.state.end();
       ++ia, ++ib) {
    if (ia->first != ib->first || ia->second.size() != ib->second.size()) {
      return false;
    }
    for (auto va = ia->second.begin(), vb = ib->second.begin();
         va != ia->second.end(); ++va, ++vb) {
      if (va->first != vb->first || va->second.tensor != vb->second.tensor ||
          !flatparam::optim::BitwiseEqual(va->second.value, vb->second.value)) {
        return false;
      }
    }
  }
  return true;
}

// Serialises `sidecar`, parses the text back and checks both agree.
void CheckRoundTrip(const OptimSidecar& sidecar, bool with_extra,
                    const std::string& what) {
  absl::StatusOr<json> doc =
      flatparam::checkpoint::OptimSidecarToJson(sidecar, with_extra);
  Check(doc.ok(), what + ": accepted sidecar does not serialise: " +
                      doc.status().ToString());
  const std::string text = doc->dump();
  const json reparsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  Check(!reparsed.is_discarded(), what + ": serialised sidecar is not JSON");
  absl::StatusOr<OptimSidecar> again =
      flatparam::checkpoint::ParseOptimSidecar(reparsed, "again.json");
  Check(again.ok(), what + ": serialised sidecar does not parse: " +
                        again.status().ToString() + "\n" + text);
  OptimSidecar want = sidecar;
  if (!with_extra) want.extra = json::object();
  Check(SameSidecar(want, *again),
        what + ": sidecar differs after a round trip:\n" + text);
  absl::StatusOr<json> doc2 =
      flatparam::checkpoint::OptimSidecarToJson(*again, with_extra);
  Check(doc2.ok() && doc2->dump() == text,
        what + ": second serialisation differs");
}

// Model "fuzz": two flat parameters (units "" and "b") on 2 ranks.
const ModelLayout& Layout() {
  static const ModelLayout* layout = [] {
    flatparam::ModelSpec spec;
    spec.name = "fuzz";
    spec.params = {{"a.weight", {3, 2}}, {"b.weight", {5}}, {"b.bias", {}}};
    spec.wrap = {"b"};
    flatparam::LayoutOptions options;
    options.world_size = 2;
    absl::StatusOr<ModelLayout> l = ModelLayout::Create(spec, options);
    Check(l.ok(), "layout: " + l.status().ToString());
    return new ModelLayout(*std::move(l));
  }();
  return *layout;
}

// The rank state every rank of the fixture checkpoint holds: a tensor, a
// 0-d tensor and a non-tensor state for flat parameter 0, one group.
RankState FixtureRank() {
  const ModelLayout& layout = Layout();
  RankState s;
  for (const flatparam::FlatParamLayout& f : layout.flat_params()) {
    s.flat_params.push_back(HostTensor::Flat(f.dtype(), f.sharded_numel()));
  }
  auto& p0 = s.optim.state[ParamKey(int64_t{0})];
  p0["exp_avg"] = HostTensor::Flat(DType::kFloat32,
                                   layout.flat_params()[0].sharded_numel());
  p0["step"] = flatparam::optim::ScalarTensor(DType::kFloat32, 3);
  p0["count"] = int64_t{3};
  s.optim.state[ParamKey(std::string("user"))]["note"] = std::string("x");
  flatparam::optim::ParamGroup group;
  group.params = {ParamKey(int64_t{0}), ParamKey(int64_t{1})};
  group.hyperparams["lr"] = 0.5;
  s.optim.param_groups.push_back(group);
  s.extra = json{{"step", 7}};
  return s;
}

struct RankFixture {
  FaultInjectionFileSystem fs;
  std::unique_ptr<ShardedCheckpointReader> reader;
};

std::unique_ptr<RankFixture> MakeRankFixture() {
  auto f = std::make_unique<RankFixture>();
  const RankState state = FixtureRank();
  flatparam::checkpoint::ShardedCheckpointContent content;
  content.layout = &Layout();
  for (int64_t r = 0; r < 2; ++r) {
    absl::StatusOr<RankContent> c =
        flatparam::checkpoint::MakeRankContent(Layout(), r, state);
    Check(c.ok(), "fixture rank: " + c.status().ToString());
    content.ranks.push_back(*std::move(c));
  }
  absl::Status written =
      flatparam::checkpoint::WriteShardedCheckpoint(f->fs, "ckpt", content);
  Check(written.ok(), "fixture write: " + written.ToString());
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::Open(f->fs, "ckpt");
  Check(reader.ok(), "fixture open: " + reader.status().ToString());
  f->reader = std::make_unique<ShardedCheckpointReader>(*std::move(reader));
  return f;
}

// A sharded checkpoint in memory; each input replaces ckpt/rank00000.json,
// which ReadRankState reads afresh. Remade now and then because the file
// system logs every operation, which would grow without bound over a long
// fuzzing run.
RankFixture& Ranks() {
  static std::unique_ptr<RankFixture> fixture;
  static int64_t uses = 0;
  if (fixture == nullptr || ++uses % 10000 == 0) fixture = MakeRankFixture();
  return *fixture;
}

void FuzzRankState(const std::string& bytes,
                   const absl::StatusOr<OptimSidecar>& parsed) {
  RankFixture& f = Ranks();
  const std::string path = flatparam::checkpoint::JoinPath(
      f.reader->path(), flatparam::checkpoint::RankJsonFileName(0));
  {
    auto file = f.fs.NewWritableFile(path);
    Check(file.ok() && (*file)->Append(bytes).ok() && (*file)->Close().ok(),
          "cannot replace " + path);
  }
  absl::StatusOr<RankState> state =
      flatparam::checkpoint::ReadRankState(*f.reader, 0);
  if (!state.ok()) {
    CheckDataLoss(state.status(), "ReadRankState");
    return;
  }
  ++GetOptimSidecarFuzzStats().rank_read;
  Check(parsed.ok(), "ReadRankState accepts what ParseOptimSidecar rejects: " +
                         parsed.status().ToString());
  absl::StatusOr<RankContent> content =
      flatparam::checkpoint::MakeRankContent(Layout(), 0, *state);
  Check(content.ok(),
        "ReadRankState accepts a state MakeRankContent rejects: " +
            content.status().ToString());
  absl::StatusOr<OptimSidecar> rewritten =
      flatparam::checkpoint::ParseOptimSidecar(content->sidecar, "rewritten");
  Check(rewritten.ok() && SameSidecar(*parsed, *rewritten),
        "rank sidecar differs after ReadRankState + MakeRankContent");
}

void FuzzFullState(const json& doc, const OptimSidecar& parsed) {
  // optim.safetensors holds a 0-d tensor under every name the sidecar
  // lists that the writer takes (the rest the reader must reject).
  std::set<std::string> names;
  for (const auto& [key, values] : parsed.state) {
    for (const auto& [name, v] : values) {
      if (v.tensor.has_value() && absl::StartsWith(*v.tensor, "state.")) {
        names.insert(*v.tensor);
      }
    }
  }
  std::vector<HostTensor> storage;
  storage.reserve(names.size() + 1);
  FullCheckpointContent content;
  storage.push_back(HostTensor::Flat(DType::kFloat32, 2));
  content.model.push_back(
      flatparam::checkpoint::TensorSourceFromHostTensor("w", storage.back()));
  for (const std::string& name : names) {
    storage.push_back(flatparam::optim::ScalarTensor(DType::kFloat32, 1));
    content.optim.push_back(flatparam::checkpoint::TensorSourceFromHostTensor(
        name, storage.back()));
  }
  content.optim_json = doc;
  FaultInjectionFileSystem fs;
  if (!flatparam::checkpoint::WriteFullCheckpoint(fs, "full", content).ok()) {
    return;  // A tensor name safetensors cannot hold; nothing to read.
  }
  absl::StatusOr<FullCheckpointReader> reader =
      FullCheckpointReader::Open(fs, "full");
  Check(reader.ok(),
        "written full checkpoint does not open: " + reader.status().ToString());
  absl::StatusOr<FullState> state =
      flatparam::checkpoint::ReadFullState(*reader);
  if (!state.ok()) {
    CheckDataLoss(state.status(), "ReadFullState");
    return;
  }
  ++GetOptimSidecarFuzzStats().full_read;
  absl::StatusOr<FullCheckpointContent> again =
      flatparam::checkpoint::MakeFullContent(*state);
  Check(again.ok(), "ReadFullState accepts a state MakeFullContent rejects: " +
                        again.status().ToString());
  absl::StatusOr<OptimSidecar> rewritten =
      flatparam::checkpoint::ParseOptimSidecar(again->optim_json, "rewritten");
  OptimSidecar want = parsed;
  want.extra = json::object();
  Check(rewritten.ok() && SameSidecar(want, *rewritten),
        "optim.json differs after ReadFullState + MakeFullContent");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  // As ReadJsonObject (checkpoint_dir.cc) parses a sidecar file.
  flatparam::JsonParseOptions options;
  options.code = absl::StatusCode::kDataLoss;
  const absl::StatusOr<json> doc =
      flatparam::ParseJson(bytes, "fuzz.json", options);
  absl::StatusOr<OptimSidecar> parsed = absl::DataLossError("not JSON");
  if (!doc.ok()) {
    CheckDataLoss(doc.status(), "ParseJson");
    parsed = doc.status();
  } else {
    parsed = flatparam::checkpoint::ParseOptimSidecar(*doc, "fuzz.json");
    if (!parsed.ok()) {
      CheckDataLoss(parsed.status(), "ParseOptimSidecar");
      Check(absl::StrContains(parsed.status().message(), "fuzz.json: "),
            "error does not name the file: " + parsed.status().ToString());
    } else {
      ++GetOptimSidecarFuzzStats().parsed;
      CheckRoundTrip(*parsed, /*with_extra=*/true, "rank sidecar");
      CheckRoundTrip(*parsed, /*with_extra=*/false, "optim.json");
    }
  }
  FuzzRankState(bytes, parsed);
  if (parsed.ok()) FuzzFullState(*doc, *parsed);
  return 0;
}
