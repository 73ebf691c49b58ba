#include "flatparam/interop/torch_save/torch_save.h"

#include <caffe2/serialize/inline_container.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace libtorch {
namespace {

using ::flatparam::IsOk;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

checkpoint::FileSystem& Fs() { return checkpoint::PosixFileSystem(); }

std::string Data(const std::string& name) {
  return absl::StrCat("flatparam/interop/torch_save/testdata/", name);
}

std::string Tmp(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

// The model of testdata/make_torch_files.py.
ModelSpec TinySpec() {
  ModelSpec spec;
  spec.name = "tiny";
  spec.params = {{"0.weight", {4, 3}}, {"0.bias", {4}},      {"1.weight", {4}},
                 {"1.bias", {4}},      {"2.weight", {2, 4}}, {"2.bias", {2}}};
  return spec;
}

LayoutOptions Options(int64_t world_size) {
  LayoutOptions o;
  o.world_size = world_size;
  return o;
}

std::vector<double> Values(const HostTensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t.GetDouble(i));
  return out;
}

TEST(TorchSaveTest, ReadsPythonStateDict) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TorchStateDict sd, ReadTorchStateDict(Fs(), Data("tiny_state_dict.pt")));
  const ModelSpec spec = TinySpec();
  ASSERT_EQ(sd.size(), spec.params.size());
  for (size_t i = 0; i < sd.size(); ++i) {
    EXPECT_EQ(sd[i].first, spec.params[i].fqn);
    EXPECT_EQ(sd[i].second.dtype(), DType::kFloat32);
    EXPECT_EQ(sd[i].second.shape(), spec.params[i].shape);
    for (int64_t k = 0; k < sd[i].second.numel(); ++k) {
      EXPECT_EQ(sd[i].second.GetDouble(k), k / 8.0 + 100.0 * i) << sd[i].first;
    }
  }
}

TEST(TorchSaveTest, ReadsStridedAndOffsetViews) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TorchStateDict sd,
                                 ReadTorchStateDict(Fs(), Data("views.pt")));
  ASSERT_EQ(sd.size(), 3u);
  EXPECT_EQ(sd[0].first, "t");
  EXPECT_THAT(sd[0].second.shape(), ElementsAre(3, 2));
  EXPECT_THAT(Values(sd[0].second), ElementsAre(0, 3, 1, 4, 2, 5));
  EXPECT_EQ(sd[1].first, "row");
  EXPECT_THAT(Values(sd[1].second), ElementsAre(3, 4, 5));
  EXPECT_EQ(sd[2].first, "e");
  EXPECT_THAT(sd[2].second.shape(), ElementsAre(2, 3));
  EXPECT_THAT(Values(sd[2].second), ElementsAre(0, 1, 2, 0, 1, 2));
}

TEST(TorchSaveTest, RefusesAViewFarLargerThanTheFile) {
  EXPECT_THAT(ReadTorchStateDict(Fs(), Data("huge_view.pt")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("68719476736 bytes"),
                             HasSubstr("strides [0]"))));
}

TEST(TorchSaveTest, ReadsEveryStorageType) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TorchStateDict sd,
                                 ReadTorchStateDict(Fs(), Data("dtypes.pt")));
  std::vector<std::pair<std::string, DType>> want = {
      {"f64", DType::kFloat64},   {"f16", DType::kFloat16},
      {"bf16", DType::kBFloat16}, {"i64", DType::kInt64},
      {"i32", DType::kInt32},     {"u8", DType::kUInt8},
      {"b", DType::kBool},        {"scalar", DType::kFloat32}};
  ASSERT_EQ(sd.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(sd[i].first, want[i].first);
    EXPECT_EQ(sd[i].second.dtype(), want[i].second) << want[i].first;
  }
  EXPECT_EQ(sd[0].second.GetDouble(0), 1.5);
  EXPECT_EQ(sd[3].second.data_as<int64_t>()[0], -3);
  EXPECT_EQ(sd[4].second.data_as<int32_t>()[0], -3);
  EXPECT_EQ(sd[5].second.data_as<uint8_t>()[0], 3);
  EXPECT_EQ(sd[6].second.data_as<uint8_t>()[0], 1);
  EXPECT_TRUE(sd[7].second.shape().empty());
  EXPECT_EQ(sd[7].second.GetDouble(0), 2.0);
}

TEST(TorchSaveTest, ReadsPythonAdamWState) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      optim::OptimStateDict d,
      ReadTorchOptimStateDict(Fs(), Data("tiny_adamw.pt")));
  const ModelSpec spec = TinySpec();
  ASSERT_EQ(d.state.size(), 6u);
  for (int64_t i = 0; i < 6; ++i) {
    const optim::ParamState& ps = d.state.at(i);
    ASSERT_EQ(ps.size(), 3u);
    const auto& step = std::get<HostTensor>(ps.at("step"));
    EXPECT_TRUE(step.shape().empty());
    EXPECT_EQ(step.GetDouble(0), 1.0);
    EXPECT_EQ(std::get<HostTensor>(ps.at("exp_avg")).shape(),
              spec.params[i].shape);
    EXPECT_EQ(std::get<HostTensor>(ps.at("exp_avg_sq")).shape(),
              spec.params[i].shape);
  }
  ASSERT_EQ(d.param_groups.size(), 1u);
  const optim::ParamGroup& g = d.param_groups[0];
  EXPECT_EQ(g.params, (std::vector<optim::ParamKey>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(std::get<std::vector<double>>(g.hyperparams.at("betas")),
            (std::vector<double>{0.9, 0.999}));
  EXPECT_EQ(std::get<double>(g.hyperparams.at("lr")), 1e-3);
  EXPECT_EQ(std::get<bool>(g.hyperparams.at("amsgrad")), false);
  EXPECT_TRUE(
      std::holds_alternative<std::monostate>(g.hyperparams.at("foreach")));
}

TEST(TorchSaveTest, RefusesForbiddenGlobalsUnexecuted) {
  EXPECT_THAT(
      ReadTorchStateDict(Fs(), Data("evil_os_system.pt")),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("evil_os_system.pt"),
                     HasSubstr("'posix.system'"), HasSubstr("not executed"))));
  EXPECT_THAT(ReadTorchOptimStateDict(Fs(), Data("custom_class.pt")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("'__main__.Custom'")));
}

TEST(TorchSaveTest, RefusesLegacyFormat) {
  EXPECT_THAT(ReadTorchStateDict(Fs(), Data("legacy_format.pt")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("legacy"),
                             HasSubstr("_use_new_zipfile_serialization"))));
}

TEST(TorchSaveTest, RefusesTruncatedAndSurvivesCorruptFiles) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string bytes,
      checkpoint::ReadFileToString(Fs(), Data("tiny_state_dict.pt"), 1 << 20));
  const std::string path = Tmp("damaged.pt");
  for (size_t len = 0; len < bytes.size(); len += len < 64 ? 1 : 13) {
    FLATPARAM_ASSERT_OK(
        checkpoint::WriteFileDurably(Fs(), path, bytes.substr(0, len)));
    EXPECT_THAT(ReadTorchStateDict(Fs(), path),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)))
        << len << " bytes";
  }
  // A flipped byte anywhere: an error or a state dict, never a crash.
  for (size_t pos = 0; pos < bytes.size(); pos += 3) {
    std::string damaged = bytes;
    damaged[pos] ^= 0x5a;
    FLATPARAM_ASSERT_OK(checkpoint::WriteFileDurably(Fs(), path, damaged));
    ReadTorchStateDict(Fs(), path).status().IgnoreError();
  }
}

// The archive's records, by name without the archive's directory.
std::map<std::string, std::string> Records(const std::string& path) {
  caffe2::serialize::PyTorchStreamReader reader(path);
  std::map<std::string, std::string> out;
  for (const std::string& name : reader.getAllRecords()) {
    auto [ptr, size] = reader.getRecord(name);
    out[name] = std::string(static_cast<const char*>(ptr.get()), size);
  }
  return out;
}

void WriteArchive(const std::string& path,
                  const std::map<std::string, std::string>& records) {
  caffe2::serialize::PyTorchStreamWriter writer(path);
  for (const auto& [name, data] : records) {
    if (name != "version") writer.writeRecord(name, data.data(), data.size());
  }
  writer.writeEndOfFile();
}

// Damaged pickles inside intact archives (the zip's CRC would catch a
// damaged record otherwise): every truncation and every flipped byte of
// data.pkl of a state dict and of an optimizer state is an error or a
// value, never a crash (run under --config=asan too).
TEST(TorchSaveTest, SurvivesDamagedPickles) {
  const std::string path = Tmp("damaged_pickle.pt");
  int errors = 0;
  for (const char* file : {"tiny_state_dict.pt", "tiny_adamw.pt"}) {
    const std::map<std::string, std::string> records = Records(Data(file));
    const std::string pickle = records.at("data.pkl");
    for (size_t k = 0; k < 2 * pickle.size(); ++k) {
      std::map<std::string, std::string> damaged = records;
      std::string& p = damaged["data.pkl"];
      if (k < pickle.size()) {
        p.resize(k);
      } else {
        p[k - pickle.size()] ^= 0x41;
      }
      WriteArchive(path, damaged);
      const absl::Status s1 = ReadTorchStateDict(Fs(), path).status();
      const absl::Status s2 = ReadTorchOptimStateDict(Fs(), path).status();
      errors += !s1.ok() + !s2.ok();
      if (k < pickle.size()) {
        EXPECT_THAT(s1, StatusIs(absl::StatusCode::kDataLoss)) << k;
      }
    }
  }
  EXPECT_GT(errors, 0);
}

// Hostile shapes: a value nested 200,000 containers deep (freeing or
// walking it recursively overflowed the stack: SIGSEGV) and containers
// that hold themselves (leaked, and walked forever) are refused with the
// reason; a state dict's few levels are read as before.
TEST(TorchSaveTest, RefusesDeepNestingAndCycles) {
  using namespace std::string_literals;  // NOLINT: NUL bytes in pickles
  const std::string path = Tmp("hostile_shape.pt");
  auto read = [&](const std::string& pickle) {
    WriteArchive(path, {{"data.pkl", pickle}});
    return ReadTorchStateDict(Fs(), path).status();
  };
  const std::string proto = "\x80\x02"s;
  const std::string key_a = "\x8c\x01"s + "a";  // SHORT_BINUNICODE "a"
  constexpr int kDeep = 200000;
  const std::string deep_list =
      std::string(kDeep, ']') + std::string(kDeep - 1, 'a');
  // [[[...]]]: EMPTY_LIST x N, APPEND x N-1.
  EXPECT_THAT(read(proto + deep_list + "."),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("containers nested deeper than 100")));
  // {"a": {"a": ...}}: (EMPTY_DICT, "a") x N, EMPTY_DICT, SETITEM x N.
  std::string dicts = proto;
  for (int i = 0; i < kDeep; ++i) dicts += "}" + key_a;
  dicts += "}" + std::string(kDeep, 's') + ".";
  EXPECT_THAT(read(dicts),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("containers nested deeper than 100")));
  // l = []; l.append(l): EMPTY_LIST, BINPUT 0, BINGET 0, APPEND.
  const std::string cycle = "]q\x00"s + "h\x00"s + "a";
  EXPECT_THAT(read(proto + cycle + "."),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("a list that contains itself")));
  // d = {}; d["a"] = [d]: a cycle through two containers.
  EXPECT_THAT(read(proto + "}q\x00"s + key_a + "]h\x00"s + "as."),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("a dict that contains itself")));
  // {"a": <cycle or deep chain>, "a": {}}: the second value replaces the
  // first, which the memo alone still holds. It is freed without a crash
  // or a leak (ASan's leak check would report one), and the value is
  // judged for what it is.
  for (const std::string& garbage : {cycle, deep_list}) {
    EXPECT_THAT(read(proto + "}(" + key_a + garbage + key_a + "}u."),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("not a tensor")));
  }
  // 99 levels below the root dict are within the limit: refused for what
  // they are (a list where a tensor belongs), not for their depth.
  EXPECT_THAT(read(proto + "}" + key_a + std::string(99, ']') +
                   std::string(98, 'a') + "s."),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not a tensor")));
}

// The peak resident set's growth while `f` runs (Linux: VmHWM after
// resetting it through /proc/self/clear_refs); -1 where unavailable.
int64_t PeakGrowth(const std::function<void()>& f) {
  auto hwm = []() -> int64_t {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("VmHWM:", 0) == 0) {
        return static_cast<int64_t>(std::stoll(line.substr(6))) << 10;
      }
    }
    return -1;
  };
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
  }
  const int64_t before = hwm();
  f();
  return before < 0 ? -1 : hwm() - before;
}

// Storage records are read streaming, never more than their tensors need:
// a deflated record (as Python's zipfile may write one) is read like a
// stored one; one whose size is not its storage's is refused unread, so
// 64 MiB of zeros deflated into 64 KiB is never inflated (LibTorch's
// reader allocated and inflated it whole: 1.2 GB and 6 s for 512 MiB).
TEST(TorchSaveTest, ReadsNoMoreOfARecordThanItsTensorNeeds) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TorchStateDict plain,
      ReadTorchStateDict(Fs(), Data("tiny_state_dict.pt")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TorchStateDict deflated,
                                 ReadTorchStateDict(Fs(), Data("deflated.pt")));
  ASSERT_EQ(deflated.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(std::memcmp(deflated[i].second.data(), plain[i].second.data(),
                          plain[i].second.nbytes()),
              0)
        << plain[i].first;
  }

  absl::Status bomb;
  const int64_t growth = PeakGrowth([&] {
    bomb = ReadTorchStateDict(Fs(), Data("deflate_bomb.pt")).status();
  });
  EXPECT_THAT(bomb, StatusIs(absl::StatusCode::kDataLoss,
                             HasSubstr("storage data/0 holds 67108864 bytes, "
                                       "its 12 float32 elements need 48")));
  if (growth >= 0 && std::getenv("FLATPARAM_SANITIZED") == nullptr) {
    EXPECT_LT(growth, 8 << 20);
  }

  // A stored record larger than its storage is refused too.
  std::map<std::string, std::string> records =
      Records(Data("tiny_state_dict.pt"));
  records["data/0"] += std::string(8, '\0');
  const std::string path = Tmp("long_record.pt");
  WriteArchive(path, records);
  EXPECT_THAT(ReadTorchStateDict(Fs(), path),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("storage data/0 holds 56 bytes, its 12 "
                                 "float32 elements need 48")));
}

TEST(TorchSaveTest, ReadsOnlyLittleEndianStorages) {
  std::map<std::string, std::string> records =
      Records(Data("tiny_state_dict.pt"));
  const std::string path = Tmp("byteorder.pt");
  records["byteorder"] = "little";  // as PyTorch >= 2.1 writes
  WriteArchive(path, records);
  EXPECT_THAT(ReadTorchStateDict(Fs(), path), IsOk());
  records["byteorder"] = "big";
  WriteArchive(path, records);
  EXPECT_THAT(ReadTorchStateDict(Fs(), path),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("byte order 'big'")));
}

TEST(TorchSaveTest, WritesWhatItReads) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TorchStateDict sd,
                                 ReadTorchStateDict(Fs(), Data("dtypes.pt")));
  const std::string path = Tmp("dtypes_copy.pt");
  FLATPARAM_ASSERT_OK(WriteTorchStateDict(Fs(), path, sd));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TorchStateDict back,
                                 ReadTorchStateDict(Fs(), path));
  EXPECT_EQ(back, sd);

  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      optim::OptimStateDict d,
      ReadTorchOptimStateDict(Fs(), Data("tiny_adamw.pt")));
  d.state[0]["none"] = std::monostate();
  d.state[0]["count"] = int64_t{-5'000'000'000};
  d.state[0]["flag"] = true;
  d.state[0]["name"] = std::string("adam");
  d.state[0]["scale"] = -0.0;
  d.param_groups[0].hyperparams["big"] = int64_t{1} << 40;
  const std::string opath = Tmp("adamw_copy.pt");
  FLATPARAM_ASSERT_OK(WriteTorchOptimStateDict(Fs(), opath, d));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(optim::OptimStateDict dback,
                                 ReadTorchOptimStateDict(Fs(), opath));
  EXPECT_EQ(optim::FirstDifference(dback, d), std::nullopt);
}

// A file system whose files fail to append after `limit` bytes (a full
// disk).
class FullDisk : public checkpoint::ForwardingFileSystem {
 public:
  FullDisk(checkpoint::FileSystem& base, uint64_t limit)
      : ForwardingFileSystem(base), limit_(limit) {}
  absl::StatusOr<std::unique_ptr<checkpoint::WritableFile>> NewWritableFile(
      const std::string& path) override {
    FLATPARAM_ASSIGN_OR_RETURN(auto file, base().NewWritableFile(path));
    return std::unique_ptr<checkpoint::WritableFile>(
        new File(std::move(file), limit_));
  }

 private:
  class File : public checkpoint::WritableFile {
   public:
    File(std::unique_ptr<checkpoint::WritableFile> f, uint64_t limit)
        : f_(std::move(f)), left_(limit) {}
    absl::Status Append(absl::string_view data) override {
      if (data.size() > left_) {
        return absl::ResourceExhaustedError("no space left on device");
      }
      left_ -= data.size();
      return f_->Append(data);
    }
    absl::Status Sync() override { return f_->Sync(); }
    absl::Status Close() override { return f_->Close(); }

   private:
    std::unique_ptr<checkpoint::WritableFile> f_;
    uint64_t left_;
  };
  uint64_t limit_;
};

TEST(TorchSaveTest, ReportsAFullDisk) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TorchStateDict sd, ReadTorchStateDict(Fs(), Data("tiny_state_dict.pt")));
  for (uint64_t limit : {0, 10, 100, 1000, 2000}) {
    FullDisk fs(Fs(), limit);
    EXPECT_THAT(
        WriteTorchStateDict(fs, Tmp("full.pt"), sd),
        StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no space")))
        << limit;
    EXPECT_THAT(Fs().Exists(Tmp("full.pt")), IsOkAndHolds(false)) << limit;
  }
}

TEST(TorchSaveTest, RefusesRepeatedNames) {
  TorchStateDict sd;
  sd.emplace_back("w", HostTensor(DType::kFloat32, {2}));
  sd.emplace_back("w", HostTensor(DType::kFloat32, {2}));
  EXPECT_THAT(WriteTorchStateDict(Fs(), Tmp("repeated.pt"), sd),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'w'")));
}

// Import checks against the model, as the Hugging Face import does.
absl::Status ImportTiny(const ModelSpec& spec, const std::string& out) {
  return ImportTorchCheckpoint(Fs(), Data("tiny_state_dict.pt"), spec,
                               Options(2), 0, Tmp(out))
      .status();
}

TEST(TorchSaveTest, ImportValidatesAgainstTheModel) {
  ModelSpec dtype = TinySpec();
  for (ParamSpec& p : dtype.params) p.dtype = DType::kBFloat16;
  EXPECT_THAT(ImportTiny(dtype, "bad_dtype"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("1.weight"), HasSubstr("bfloat16"),
                             HasSubstr("tiny_state_dict.pt: tensor"),
                             Not(HasSubstr(".torch-import.tmp")),
                             HasSubstr("float32"))));
  ModelSpec shape = TinySpec();
  shape.params[4].shape = {4, 2};
  EXPECT_THAT(ImportTiny(shape, "bad_shape"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("2.weight"), HasSubstr("[4, 2]"),
                             HasSubstr("[2, 4]"))));
  ModelSpec missing = TinySpec();
  missing.params.push_back({"3.weight", {2}});
  EXPECT_THAT(
      ImportTiny(missing, "missing"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("3.weight")));
  ModelSpec extra = TinySpec();
  extra.params.pop_back();
  EXPECT_THAT(
      ImportTiny(extra, "extra"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("2.bias")));
  for (const char* out : {"bad_dtype", "bad_shape", "missing", "extra"}) {
    EXPECT_THAT(Fs().Exists(Tmp(out)), IsOkAndHolds(false)) << out;
    EXPECT_THAT(Fs().Exists(Tmp(absl::StrCat(out, ".torch-import.tmp"))),
                IsOkAndHolds(false))
        << out;
  }
}

TEST(TorchSaveTest, ImportValidatesTheOptimizerState) {
  TorchImportOptions options;
  options.optimizer = Data("tiny_state_dict.pt");  // not an optimizer state
  EXPECT_THAT(
      ImportTorchCheckpoint(Fs(), Data("tiny_state_dict.pt"), TinySpec(),
                            Options(2), 0, Tmp("o1"), options)
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("unexpected key ['0.weight']")));
  // IDs beyond the model's parameters.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      optim::OptimStateDict d,
      ReadTorchOptimStateDict(Fs(), Data("tiny_adamw.pt")));
  d.state[6] = d.state[5];
  d.param_groups[0].params.push_back(6);
  options.optimizer = Tmp("seven_ids.pt");
  FLATPARAM_ASSERT_OK(WriteTorchOptimStateDict(Fs(), options.optimizer, d));
  EXPECT_THAT(
      ImportTorchCheckpoint(Fs(), Data("tiny_state_dict.pt"), TinySpec(),
                            Options(2), 0, Tmp("o2"), options)
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("seven_ids.pt"), HasSubstr("6"))));
}

// An index-sharded state dict written by hand: `map` is the index's
// weight_map, `files` what each file holds.
absl::Status WriteIndexed(
    const std::string& dir,
    const std::map<std::string, std::vector<std::string>>& files,
    const std::map<std::string, std::string>& map, int64_t total_size) {
  FLATPARAM_ASSIGN_OR_RETURN(
      TorchStateDict sd, ReadTorchStateDict(Fs(), Data("tiny_state_dict.pt")));
  std::map<std::string, HostTensor> by_name(sd.begin(), sd.end());
  FLATPARAM_RETURN_IF_ERROR(checkpoint::RemoveRecursively(Fs(), dir));
  FLATPARAM_RETURN_IF_ERROR(Fs().CreateDir(dir));
  for (const auto& [file, names] : files) {
    TorchStateDict part;
    for (const std::string& n : names) part.emplace_back(n, by_name.at(n));
    FLATPARAM_RETURN_IF_ERROR(
        WriteTorchStateDict(Fs(), absl::StrCat(dir, "/", file), part));
  }
  nlohmann::json doc;
  doc["metadata"]["total_size"] = total_size;
  doc["weight_map"] = map;
  return checkpoint::WriteFileDurably(
      Fs(), absl::StrCat(dir, "/", kTorchIndexFileName), doc.dump());
}

TEST(TorchSaveTest, ImportChecksTheIndex) {
  const std::vector<std::string> a = {"0.weight", "0.bias", "1.weight"};
  const std::vector<std::string> b = {"1.bias", "2.weight", "2.bias"};
  std::map<std::string, std::string> map;
  for (const auto& n : a) map[n] = "a.bin";
  for (const auto& n : b) map[n] = "b.bin";
  const int64_t total = (12 + 4 + 4 + 4 + 8 + 2) * 4;
  const std::string dir = Tmp("indexed");
  auto import = [&] {
    return ImportTorchCheckpoint(Fs(), dir, TinySpec(), Options(2), 0,
                                 Tmp("indexed_ckpt"))
        .status();
  };
  FLATPARAM_ASSERT_OK(
      WriteIndexed(dir, {{"a.bin", a}, {"b.bin", b}}, map, total));
  EXPECT_THAT(import(), IsOk());

  // Errors of the model checks name the user's file.
  ModelSpec shape = TinySpec();
  shape.params[4].shape = {4, 2};
  EXPECT_THAT(ImportTorchCheckpoint(Fs(), dir, shape, Options(2), 0,
                                    Tmp("indexed_ckpt"))
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr(absl::StrCat(dir,
                                              "/b.bin: tensor '2.weight' "
                                              "has shape [2, 4]"))));

  FLATPARAM_ASSERT_OK(
      WriteIndexed(dir, {{"a.bin", a}, {"b.bin", b}}, map, total + 4));
  EXPECT_THAT(import(), StatusIs(absl::StatusCode::kDataLoss,
                                 AllOf(HasSubstr("total_size is 140"),
                                       HasSubstr("136 bytes"))));
  std::map<std::string, std::string> moved = map;
  moved["2.bias"] = "a.bin";
  FLATPARAM_ASSERT_OK(
      WriteIndexed(dir, {{"a.bin", a}, {"b.bin", b}}, moved, total));
  EXPECT_THAT(import(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'2.bias'")));
  std::map<std::string, std::string> fewer = map;
  fewer.erase("0.bias");
  FLATPARAM_ASSERT_OK(
      WriteIndexed(dir, {{"a.bin", a}, {"b.bin", b}}, fewer, total));
  EXPECT_THAT(import(), StatusIs(absl::StatusCode::kDataLoss,
                                 AllOf(HasSubstr("a.bin holds '0.bias'"),
                                       HasSubstr("does not map to it"))));
  std::map<std::string, std::string> ghost = map;
  ghost["ghost.weight"] = "a.bin";
  FLATPARAM_ASSERT_OK(
      WriteIndexed(dir, {{"a.bin", a}, {"b.bin", b}}, ghost, total));
  EXPECT_THAT(import(), StatusIs(absl::StatusCode::kDataLoss,
                                 HasSubstr("maps 'ghost.weight' to a.bin, "
                                           "which does not hold it")));
  // Both forms in one directory.
  FLATPARAM_ASSERT_OK(
      WriteIndexed(dir, {{"a.bin", a}, {"b.bin", b}}, map, total));
  FLATPARAM_ASSERT_OK(checkpoint::WriteFileDurably(
      Fs(), absl::StrCat(dir, "/", kTorchModelFileName), ""));
  EXPECT_THAT(import(), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("ambiguous")));
}

// Python's files -> checkpoint at W -> torch.save files: the same tensors
// and optimizer state (keyed by ID, and by name).
TEST(TorchSaveTest, ImportExportRoundTrip) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TorchStateDict sd, ReadTorchStateDict(Fs(), Data("tiny_state_dict.pt")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      optim::OptimStateDict opt,
      ReadTorchOptimStateDict(Fs(), Data("tiny_adamw.pt")));
  for (int64_t w : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("world size ", w));
    const std::string ckpt = Tmp(absl::StrCat("ckpt", w));
    TorchImportOptions options;
    options.optimizer = Data("tiny_adamw.pt");
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        checkpoint::HfImportReport report,
        ImportTorchCheckpoint(Fs(), Data("tiny_state_dict.pt"), TinySpec(),
                              Options(w), 0, ckpt, options));
    EXPECT_EQ(report.imported, 6);
    EXPECT_TRUE(report.optimizer);
    EXPECT_EQ(report.optimizer_params, 6);

    TorchExportOptions eo;
    eo.max_shard_bytes = w == 3 ? 64 : checkpoint::kHfDefaultMaxShardBytes;
    const std::string out = Tmp(absl::StrCat("export", w));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(TorchExportReport er,
                                   ExportTorchCheckpoint(Fs(), ckpt, out, eo));
    EXPECT_TRUE(er.optimizer);
    EXPECT_EQ(er.tensors, 6);
    // Read back (through the index when sharded) and compare by name.
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        checkpoint::HfImportReport again,
        ImportTorchCheckpoint(Fs(), out, TinySpec(), Options(2), 0,
                              Tmp(absl::StrCat("again", w))));
    EXPECT_EQ(again.imported, 6);
    if (w == 3) {
      EXPECT_THAT(Fs().Exists(absl::StrCat(out, "/", kTorchIndexFileName)),
                  IsOkAndHolds(true));
    } else {
      FLATPARAM_ASSERT_OK_AND_ASSIGN(
          TorchStateDict back,
          ReadTorchStateDict(Fs(), absl::StrCat(out, "/pytorch_model.bin")));
      std::map<std::string, HostTensor> want(sd.begin(), sd.end());
      std::map<std::string, HostTensor> got(back.begin(), back.end());
      EXPECT_EQ(got, want);
    }
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        optim::OptimStateDict oback,
        ReadTorchOptimStateDict(Fs(), absl::StrCat(out, "/optimizer.bin")));
    EXPECT_EQ(optim::FirstDifference(oback, opt), std::nullopt);

    // Keyed by name, as FSDP.full_optim_state_dict writes it, and back in.
    eo.optimizer_keys = optim::OptimStateKeyType::kParamName;
    eo.convert.overwrite = true;
    FLATPARAM_ASSERT_OK(ExportTorchCheckpoint(Fs(), ckpt, out, eo).status());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        optim::OptimStateDict named,
        ReadTorchOptimStateDict(Fs(), absl::StrCat(out, "/optimizer.bin")));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        optim::OptimStateDict want_named,
        optim::RekeyOptimStateDict(
            opt, optim::OptimStateKeyType::kParamName,
            std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias",
                                     "2.weight", "2.bias"}));
    EXPECT_EQ(optim::FirstDifference(named, want_named), std::nullopt);
    options.optimizer = absl::StrCat(out, "/optimizer.bin");
    FLATPARAM_ASSERT_OK(ImportTorchCheckpoint(Fs(), out, TinySpec(), Options(w),
                                              0, Tmp(absl::StrCat("named", w)),
                                              options)
                            .status());
  }
}

TEST(TorchSaveTest, NeverWritesOverItsInput) {
  const std::string dir = Tmp("in_place");
  FLATPARAM_ASSERT_OK(checkpoint::RemoveRecursively(Fs(), dir));
  FLATPARAM_ASSERT_OK(Fs().CreateDir(dir));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TorchStateDict sd, ReadTorchStateDict(Fs(), Data("tiny_state_dict.pt")));
  FLATPARAM_ASSERT_OK(
      WriteTorchStateDict(Fs(), absl::StrCat(dir, "/pytorch_model.bin"), sd));
  EXPECT_THAT(
      ImportTorchCheckpoint(Fs(), dir, TinySpec(), Options(2), 0, dir + "/")
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is or holds")));
  TorchImportOptions options;
  options.optimizer = absl::StrCat(dir, "/optimizer.pt");
  EXPECT_THAT(
      ImportTorchCheckpoint(Fs(), Data("tiny_state_dict.pt"), TinySpec(),
                            Options(2), 0, dir, options)
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is or holds")));
  const std::string ckpt = Tmp("ckpt_in_place");
  FLATPARAM_ASSERT_OK(ImportTiny(TinySpec(), "ckpt_in_place"));
  TorchExportOptions eo;
  eo.convert.overwrite = true;
  EXPECT_THAT(
      ExportTorchCheckpoint(Fs(), ckpt, ckpt, eo).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is or holds")));
  EXPECT_THAT(Fs().Exists(absl::StrCat(dir, "/pytorch_model.bin")),
              IsOkAndHolds(true));
}

TEST(TorchSaveTest, ExportRefusesAnExistingOutput) {
  const std::string ckpt = Tmp("ckpt_exists");
  FLATPARAM_ASSERT_OK(ImportTiny(TinySpec(), "ckpt_exists"));
  const std::string out = Tmp("exists");
  FLATPARAM_ASSERT_OK(Fs().CreateDir(out));
  EXPECT_THAT(
      ExportTorchCheckpoint(Fs(), ckpt, out).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("overwrite")));
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
