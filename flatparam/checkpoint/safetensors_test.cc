#include "flatparam/checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TestDataPath(const std::string& relative) {
  const std::string path =
      absl::StrCat("flatparam/checkpoint/testdata/", relative);
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace, "/", path);
}

std::string ReadTestData(const std::string& relative) {
  absl::StatusOr<std::string> s =
      ReadFileToString(PosixFileSystem(), TestDataPath(relative), 1 << 20);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? *s : "";
}

// Writes `tensors` to an in-memory file and returns its bytes.
std::string WriteToString(
    absl::Span<const TensorSource> tensors,
    const std::map<std::string, std::string>& metadata = {},
    uint64_t chunk_bytes = kDefaultChunkBytes) {
  FaultInjectionFileSystem fs;
  auto file = fs.NewWritableFile("f.safetensors");
  EXPECT_THAT(file, IsOk());
  if (!file.ok()) return "";
  EXPECT_THAT(
      WriteSafetensors(**file, "f.safetensors", tensors, metadata, chunk_bytes),
      IsOk());
  EXPECT_THAT((*file)->Close(), IsOk());
  absl::StatusOr<std::string> bytes =
      ReadFileToString(fs, "f.safetensors", uint64_t{1} << 30);
  EXPECT_THAT(bytes, IsOk());
  return bytes.ok() ? *bytes : "";
}

absl::StatusOr<SafetensorsReader> OpenBytes(
    std::string bytes, std::string name = "mem.safetensors",
    SafetensorsReadOptions options = {}) {
  return SafetensorsReader::Open(
      NewStringRandomAccessFile(std::move(bytes), std::move(name)), options);
}

TEST(SafetensorsDTypeTest, NamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16,
                  DType::kBFloat16, DType::kInt8, DType::kUInt8, DType::kInt16,
                  DType::kInt32, DType::kInt64, DType::kBool}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        DType parsed, ParseSafetensorsDType(SafetensorsDTypeName(d)));
    EXPECT_EQ(parsed, d);
  }
  EXPECT_EQ(SafetensorsDTypeName(DType::kBFloat16), "BF16");
  EXPECT_THAT(ParseSafetensorsDType("f32"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'f32'")));
}

// The golden files are the byte arrays of the reference implementation's
// own serialization tests (see testdata/make_safetensors_seeds.py).
TEST(SafetensorsGoldenTest, MatchesReferenceImplementationBytes) {
  const float values[] = {0, 1, 2, 3, 4, 5};
  const TensorSource attn0 =
      TensorSourceFromBytes("attn0", DType::kFloat32, {1, 1, 2, 3}, values);
  EXPECT_EQ(WriteToString({attn0}), ReadTestData("golden/attn0.safetensors"));
  EXPECT_EQ(WriteToString({}), ReadTestData("golden/empty.safetensors"));
  EXPECT_EQ(WriteToString({}, {{"framework", "pt"}}),
            ReadTestData("golden/metadata_only.safetensors"));
}

TEST(SafetensorsGoldenTest, HeaderIsPaddedWithSpacesToAMultipleOf8) {
  for (int length = 1; length <= 16; ++length) {
    const std::string name(length, 'x');
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        std::string header,
        BuildSafetensorsHeader({{name, DType::kFloat16, {3}}}, {}));
    EXPECT_EQ(header.size() % 8, 0u) << name;
    const std::string json = absl::StrCat(
        "{\"", name,
        "\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}");
    EXPECT_EQ(header.substr(0, json.size()), json);
    EXPECT_EQ(header.substr(json.size()),
              std::string(header.size() - json.size(), ' '));
    EXPECT_LT(header.size() - json.size(), 8u);
  }
}

// One tensor of every dtype, 0-d and zero-size ones included.
std::vector<HostTensor> EveryKindOfTensor() {
  std::vector<HostTensor> tensors;
  int seed = 1;
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16,
                  DType::kBFloat16, DType::kInt8, DType::kUInt8, DType::kInt16,
                  DType::kInt32, DType::kInt64, DType::kBool}) {
    for (std::vector<int64_t> shape :
         {std::vector<int64_t>{}, {5}, {2, 3}, {0}, {3, 0, 2}}) {
      HostTensor t(d, shape);
      auto* bytes = static_cast<unsigned char*>(t.data());
      for (size_t i = 0; i < t.nbytes(); ++i) {
        bytes[i] = static_cast<unsigned char>(seed * 31 + i * 7);
        if (d == DType::kBool) bytes[i] &= 1;
      }
      ++seed;
      tensors.push_back(std::move(t));
    }
  }
  return tensors;
}

TEST(SafetensorsRoundTripTest, EveryDTypeAndShape) {
  const std::vector<HostTensor> tensors = EveryKindOfTensor();
  std::vector<TensorSource> sources;
  for (size_t i = 0; i < tensors.size(); ++i) {
    sources.push_back(TensorSourceFromHostTensor(
        absl::StrCat("t", i, ".", DTypeName(tensors[i].dtype())), tensors[i]));
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"note", "ünïcode"}};
  // A chunk of 3 bytes splits every tensor and element.
  const std::string bytes = WriteToString(sources, metadata, /*chunk_bytes=*/3);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, OpenBytes(bytes));
  EXPECT_EQ(reader.metadata(), metadata);
  EXPECT_EQ(reader.data_offset() % 8, 0u);
  EXPECT_EQ(reader.file_size(), bytes.size());
  ASSERT_EQ(reader.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = sources[i].name;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* e,
                                   reader.Find(name));
    EXPECT_EQ(e->dtype, tensors[i].dtype());
    EXPECT_EQ(e->shape, tensors[i].shape());
    EXPECT_EQ(e->nbytes(), tensors[i].nbytes());
    EXPECT_EQ(e->numel(), tensors[i].numel());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor back,
                                   reader.ReadHostTensor(name));
    EXPECT_EQ(back, tensors[i]) << name;
    // Byte ranges of the tensor.
    if (tensors[i].nbytes() >= 3) {
      char piece[2];
      ASSERT_THAT(reader.ReadRange(name, 1, absl::MakeSpan(piece, 2)), IsOk());
      EXPECT_EQ(
          0, std::memcmp(piece, static_cast<const char*>(tensors[i].data()) + 1,
                         2));
    }
  }
  // Data order: largest elements first, so every tensor is aligned.
  for (size_t i = 0; i + 1 < reader.tensors().size(); ++i) {
    EXPECT_GE(DTypeSize(reader.tensors()[i].dtype),
              DTypeSize(reader.tensors()[i + 1].dtype));
  }
  for (const SafetensorsEntry& e : reader.tensors()) {
    EXPECT_EQ((reader.data_offset() + e.begin) % DTypeSize(e.dtype), 0u)
        << e.name;
  }
}

TEST(SafetensorsRoundTripTest, StoresLargestElementsFirstOtherwiseAsDeclared) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string header, BuildSafetensorsHeader({{"h", DType::kFloat16, {1}},
                                                  {"f", DType::kFloat32, {1}},
                                                  {"d", DType::kFloat64, {1}},
                                                  {"u", DType::kUInt8, {3}},
                                                  {"g", DType::kFloat32, {2}}},
                                                 {}));
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            "{\"d\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
            "\"f\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
            "\"g\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
            "\"h\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[20,22]},"
            "\"u\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[22,25]}}");
}

TEST(SafetensorsRoundTripTest, HeaderIsPlainJsonWithTheSpecsFields) {
  const float v[2] = {1, 2};
  const std::string bytes = WriteToString(
      {TensorSourceFromBytes("a.b", DType::kFloat32, {2}, v)}, {{"k", "v"}});
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const nlohmann::json header =
      nlohmann::json::parse(bytes.substr(8, n));  // spaces are whitespace
  EXPECT_EQ(header["__metadata__"]["k"], "v");
  EXPECT_EQ(header["a.b"]["dtype"], "F32");
  EXPECT_EQ(header["a.b"]["shape"], nlohmann::json::array({2}));
  EXPECT_EQ(header["a.b"]["data_offsets"], nlohmann::json::array({0, 8}));
  // "__metadata__" comes first, as the reference implementation writes it.
  EXPECT_EQ(bytes.substr(8, 15), "{\"__metadata__\"");
}

TEST(SafetensorsReaderTest, ReadsAFileWrittenByAnIndependentWriter) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r,
      SafetensorsReader::Open(
          PosixFileSystem(),
          TestDataPath("safetensors/valid_all_dtypes.safetensors")));
  std::vector<std::string> names;
  for (const SafetensorsEntry& e : r.tensors()) names.push_back(e.name);
  // Data order, whatever the header's order.
  EXPECT_THAT(names, ElementsAre("f64", "f32", "f16", "bf16", "i64", "i32",
                                 "i16", "i8", "u8", "bool", "empty"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor f64, r.ReadHostTensor("f64"));
  EXPECT_EQ(f64.GetDouble(0), 1.5);
  EXPECT_EQ(f64.GetDouble(1), -2.25);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor f32, r.ReadHostTensor("f32"));
  EXPECT_TRUE(f32.shape().empty());
  EXPECT_EQ(f32.GetDouble(0), 7.0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor f16, r.ReadHostTensor("f16"));
  EXPECT_EQ(f16.GetDouble(0), 0.5);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor bf16, r.ReadHostTensor("bf16"));
  EXPECT_EQ(bf16.GetDouble(0), -1.0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor i64, r.ReadHostTensor("i64"));
  EXPECT_EQ(i64.data_as<int64_t>()[0], -3);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor u8, r.ReadHostTensor("u8"));
  EXPECT_EQ(u8.data_as<uint8_t>()[0], 200);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* empty,
                                 r.Find("empty"));
  EXPECT_EQ(empty->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(empty->nbytes(), 0u);
}

struct MalformedCase {
  const char* file;
  absl::StatusCode code;
  const char* message;
};

class SafetensorsMalformedTest
    : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(SafetensorsMalformedTest, GivesAPreciseError) {
  const MalformedCase& c = GetParam();
  const std::string path = TestDataPath(absl::StrCat("safetensors/", c.file));
  EXPECT_THAT(SafetensorsReader::Open(PosixFileSystem(), path),
              StatusIs(c.code, ::testing::AllOf(HasSubstr(c.file),
                                                HasSubstr(c.message))));
}

constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

INSTANTIATE_TEST_SUITE_P(
    Seeds, SafetensorsMalformedTest,
    ::testing::Values(
        MalformedCase{"truncated.safetensors", kDataLoss,
                      "tensor 'b': data_offsets [24, 28] run past the end of "
                      "the data section (24 bytes; is the file truncated?)"},
        MalformedCase{"too_short.safetensors", kDataLoss,
                      "file has 5 bytes, too few for the 8-byte header length"},
        MalformedCase{"length_past_end.safetensors", kDataLoss,
                      "header length 1000000 runs past the end of the file "
                      "(180 bytes)"},
        MalformedCase{"length_too_large.safetensors", kDataLoss,
                      "header length 1099511627776 exceeds the limit of "
                      "100000000 bytes"},
        MalformedCase{"bad_json.safetensors", kDataLoss,
                      "header:1:26: malformed JSON"},
        MalformedCase{"not_object.safetensors", kDataLoss,
                      "header does not start with '{'"},
        MalformedCase{"no_brace.safetensors", kDataLoss,
                      "header does not start with '{'"},
        MalformedCase{"offsets_out_of_range.safetensors", kDataLoss,
                      "tensor 't': data_offsets [0, 1000] run past the end"},
        MalformedCase{"offsets_reversed.safetensors", kDataLoss,
                      "tensor 't': data_offsets [8, 4] end before they begin"},
        MalformedCase{"overlapping.safetensors", kDataLoss,
                      "tensor 'b': data_offsets [4, 12] overlap: the previous "
                      "tensor ends at byte 8"},
        MalformedCase{"gap.safetensors", kDataLoss,
                      "tensor 'b': data_offsets [12, 20] leave a gap: the "
                      "previous tensor ends at byte 8"},
        MalformedCase{"trailing_bytes.safetensors", kDataLoss,
                      "the tensors cover 4 bytes but the data section has 8"},
        MalformedCase{"wrong_dtype_size.safetensors", kDataLoss,
                      "tensor 't': dtype F32 and shape [3] need 12 bytes, but "
                      "data_offsets [0, 8] hold 8"},
        MalformedCase{"unknown_dtype.safetensors", kDataLoss,
                      "tensor 't': unsupported dtype 'F8_E4M3'"},
        MalformedCase{"huge_shape.safetensors", kDataLoss,
                      "tensor 't': shape [4294967296, 4294967296, 4294967296] "
                      "overflows 64 bits"},
        MalformedCase{"negative_shape.safetensors", kDataLoss,
                      "tensor 't': 'shape'[0] is -1, not a non-negative"},
        MalformedCase{"missing_offsets.safetensors", kDataLoss,
                      "tensor 't': missing 'data_offsets'"},
        MalformedCase{"unknown_key.safetensors", kDataLoss,
                      "tensor 't': unknown key 'x'"},
        MalformedCase{"metadata_not_string.safetensors", kDataLoss,
                      "'__metadata__' value of key 'epoch' is a number, not a "
                      "string"},
        MalformedCase{"duplicate_key.safetensors", kDataLoss,
                      "header has key 't' twice"}),
    [](const ::testing::TestParamInfo<MalformedCase>& info) {
      std::string name = info.param.file;
      return name.substr(0, name.find('.'));
    });

TEST(SafetensorsReaderTest, HonoursTheHeaderLimit) {
  const std::string bytes = ReadTestData("safetensors/valid_small.safetensors");
  SafetensorsReadOptions options;
  options.max_header_bytes = 16;
  EXPECT_THAT(OpenBytes(bytes, "small", options),
              StatusIs(kDataLoss, HasSubstr("exceeds the limit of 16 bytes")));
}

TEST(SafetensorsReaderTest, LookupAndBufferErrors) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r,
      OpenBytes(ReadTestData("safetensors/valid_small.safetensors"), "small"));
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_TRUE(r.Contains("w"));
  EXPECT_FALSE(r.Contains("nope"));
  EXPECT_THAT(r.Find("nope"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("small: no tensor named 'nope'")));
  char buf[24];
  EXPECT_THAT(r.Read("w", absl::MakeSpan(buf, 20)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w' has 24 bytes (F32 [2, 3]) but the "
                                 "buffer has 20")));
  EXPECT_THAT(r.ReadRange("w", 20, absl::MakeSpan(buf, 8)),
              StatusIs(absl::StatusCode::kOutOfRange,
                       HasSubstr("bytes [20, 28) are not within tensor 'w'")));
  EXPECT_THAT(r.ReadRange("w", ~uint64_t{0}, absl::MakeSpan(buf, 8)),
              StatusIs(absl::StatusCode::kOutOfRange));
  ASSERT_THAT(r.Read("w", absl::MakeSpan(buf, 24)), IsOk());
  float w[6];
  std::memcpy(w, buf, 24);
  EXPECT_EQ(w[5], 5.0f);
}

TEST(SafetensorsReaderTest, FileShrunkAfterOpenIsDataLoss) {
  FaultInjectionFileSystem fs;
  const float v[4] = {1, 2, 3, 4};
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(auto f, fs.NewWritableFile("x"));
    ASSERT_THAT(
        WriteSafetensors(*f, "x",
                         {TensorSourceFromBytes("t", DType::kFloat32, {4}, v)}),
        IsOk());
    ASSERT_THAT(f->Close(), IsOk());
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(SafetensorsReader r,
                                 SafetensorsReader::Open(fs, "x"));
  {
    // Truncate: re-create the file with only its header.
    FLATPARAM_ASSERT_OK_AND_ASSIGN(auto f, fs.NewWritableFile("x"));
    ASSERT_THAT(f->Close(), IsOk());
  }
  char buf[16];
  EXPECT_THAT(r.Read("t", absl::MakeSpan(buf, 16)),
              StatusIs(kDataLoss, HasSubstr("tensor 't'")));
}

TEST(SafetensorsWriterTest, RejectsBadDeclarations) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto f, fs.NewWritableFile("x"));
  auto begin = [&](std::vector<TensorDecl> decls) {
    return SafetensorsWriter::Begin(f.get(), "x.safetensors", std::move(decls))
        .status();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(
      begin({{"a", DType::kFloat32, {1}}, {"a", DType::kFloat32, {2}}}),
      StatusIs(kInvalid,
               HasSubstr("x.safetensors: tensor 'a' is declared twice")));
  EXPECT_THAT(begin({{"", DType::kFloat32, {1}}}),
              StatusIs(kInvalid, HasSubstr("empty name")));
  EXPECT_THAT(begin({{"__metadata__", DType::kFloat32, {1}}}),
              StatusIs(kInvalid, HasSubstr("__metadata__")));
  EXPECT_THAT(begin({{"n", DType::kFloat32, {2, -1}}}),
              StatusIs(kInvalid,
                       HasSubstr("tensor 'n': shape [2, -1] has a negative")));
  EXPECT_THAT(
      begin({{"big", DType::kFloat64, {int64_t{1} << 40, int64_t{1} << 40}}}),
      StatusIs(kInvalid, HasSubstr("tensor 'big': shape")));
  EXPECT_THAT(begin({{"big", DType::kFloat64, {int64_t{1} << 61}}}),
              StatusIs(kInvalid, HasSubstr("too large")));
  EXPECT_THAT(begin({{"bad\xff utf8", DType::kFloat32, {1}}}),
              StatusIs(kInvalid, HasSubstr("UTF-8")));
  // Nothing was written by the failed attempts.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(uint64_t size, fs.GetFileSize("x"));
  EXPECT_EQ(size, 0u);
}

TEST(SafetensorsWriterTest, AppendAndFinishCheckTheByteCount) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto f, fs.NewWritableFile("x"));
  // Data order puts the float32 tensor first.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsWriter w,
      SafetensorsWriter::Begin(
          f.get(), "x",
          {{"a", DType::kFloat16, {2}}, {"b", DType::kFloat32, {1}}}));
  ASSERT_EQ(w.entries().size(), 2u);
  EXPECT_EQ(w.entries()[0].name, "b");
  EXPECT_EQ(w.data_size(), 8u);
  ASSERT_THAT(w.Append("abc"), IsOk());
  EXPECT_THAT(w.Finish(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("tensor 'b' has 3 of its 4 bytes")));
  ASSERT_THAT(w.Append("d"), IsOk());
  EXPECT_THAT(w.Finish(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("tensor 'a' has 0 of its 4 bytes")));
  EXPECT_THAT(w.Append("efghi"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("appending 5 bytes, but only 4")));
  ASSERT_THAT(w.Append("efgh"), IsOk());
  EXPECT_THAT(w.Finish(), IsOk());
  ASSERT_THAT(f->Close(), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(uint64_t size, fs.GetFileSize("x"));
  EXPECT_EQ(size, w.file_size());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(SafetensorsReader r,
                                 SafetensorsReader::Open(fs, "x"));
  char b[4];
  ASSERT_THAT(r.Read("a", absl::MakeSpan(b, 4)), IsOk());
  EXPECT_EQ(std::string(b, 4), "efgh");
  ASSERT_THAT(r.Read("b", absl::MakeSpan(b, 4)), IsOk());
  EXPECT_EQ(std::string(b, 4), "abcd");
}

TEST(SafetensorsWriterTest, SourceErrorsNameTheTensor) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto f, fs.NewWritableFile("x"));
  TensorSource failing;
  failing.name = "w";
  failing.shape = {8};
  failing.fill = [](uint64_t offset, absl::Span<char> out) {
    if (offset >= 16) return absl::UnavailableError("device lost");
    std::fill(out.begin(), out.end(), 0);
    return absl::OkStatus();
  };
  EXPECT_THAT(WriteSafetensors(*f, "m.safetensors", {failing}, {}, 8),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("m.safetensors: tensor 'w' bytes [16, 24): "
                                 "device lost")));
  // Sizing a file needs only the declarations, never the bytes.
  EXPECT_THAT(SafetensorsFileSize({failing}), IsOk());
}

// A tensor larger than anything held in memory: bytes are generated from
// their offset, written in 1 MiB chunks and read back in 1 MiB ranges.
TEST(SafetensorsLargeTensorTest, StreamsInChunks) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path =
      JoinPath(tmp != nullptr ? tmp : "/tmp", "large.safetensors");
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  constexpr int64_t kNumel = int64_t{12} << 20;  // 48 MiB of float32
  auto pattern = [](uint64_t byte) {
    return static_cast<char>((byte * 2654435761u) >> 13);
  };
  TensorSource big;
  big.name = "big";
  big.shape = {kNumel / 1024, 1024};
  uint64_t next = 0;
  uint64_t largest = 0;
  int calls = 0;
  big.fill = [&](uint64_t offset, absl::Span<char> out) {
    EXPECT_EQ(offset, next);  // adjacent, increasing
    next = offset + out.size();
    largest = std::max<uint64_t>(largest, out.size());
    ++calls;
    for (size_t i = 0; i < out.size(); ++i) out[i] = pattern(offset + i);
    return absl::OkStatus();
  };
  const float small[2] = {1, 2};
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(auto f,
                                   PosixFileSystem().NewWritableFile(path));
    ASSERT_THAT(
        WriteSafetensors(
            *f, path,
            {TensorSourceFromBytes("head", DType::kFloat32, {2}, small), big},
            {}, kChunk),
        IsOk());
    ASSERT_THAT(f->Close(), IsOk());
  }
  EXPECT_EQ(next, uint64_t{kNumel} * 4);
  EXPECT_EQ(largest, kChunk);
  EXPECT_EQ(calls, 48);

  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r, SafetensorsReader::Open(PosixFileSystem(), path));
  std::vector<char> buffer(kChunk);
  int mismatches = 0;
  for (uint64_t at = 0; at < uint64_t{kNumel} * 4; at += kChunk) {
    ASSERT_THAT(r.ReadRange("big", at, absl::MakeSpan(buffer)), IsOk());
    for (uint64_t i = 0; i < kChunk; i += 4093) {
      mismatches += buffer[i] != pattern(at + i);
    }
  }
  EXPECT_EQ(mismatches, 0);
  ASSERT_THAT(PosixFileSystem().RemoveFile(path), IsOk());
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
