#include "tools/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/presets.h"
#include "tools/paths.h"

namespace flatparam {
namespace tools {
namespace {

using checkpoint::ConvertOptions;
using checkpoint::FileSystem;
using checkpoint::PosixFileSystem;
using Clock = std::chrono::steady_clock;

bool Needs(const std::string& action, absl::string_view what) {
  if (what == "in") return action != "init";
  if (what == "out") return action != "verify";
  if (what == "model") return action == "shard" || action == "init";
  return false;
}

// The target layout options of shard/reshard from the flags alone.
absl::StatusOr<std::pair<LayoutOptions, int64_t>> TargetLayout(
    const LayoutRequest& request) {
  if (request.world_size < 1 || request.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--world-size must be in [1, %d], got %d",
                        kMaxWorldSize, request.world_size));
  }
  LayoutOptions options;
  absl::StatusOr<ShardingStrategy> strategy =
      ParseShardingStrategy(request.strategy);
  if (!strategy.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--strategy: ", strategy.status().message()));
  }
  options.strategy = *strategy;
  options.align_addresses = request.align_addresses;
  if (!request.compute_dtype.empty()) {
    absl::StatusOr<DType> dtype = ParseDType(request.compute_dtype);
    if (!dtype.ok() || !IsFloatingPoint(*dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--compute-dtype must be a floating-point dtype, got '%s'",
          request.compute_dtype));
    }
    options.compute_dtype = *dtype;
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      options.world_size,
      ShardGroupSize(*strategy, request.world_size, request.shard_group_size));
  return std::make_pair(options, request.world_size);
}

// Shows progress. On a terminal: one line, redrawn at most ten times a
// second. Elsewhere (a log file, CI): a plain line at each tenth of the
// work once the operation has run for kQuietPeriod, so that long
// conversions show progress in logs and short ones print nothing.
class ProgressBar {
 public:
  static constexpr std::chrono::seconds kQuietPeriod{5};

  ProgressBar(std::ostream& out, bool terminal, std::string label)
      : out_(out), terminal_(terminal), label_(std::move(label)) {}

  void Update(uint64_t done, uint64_t total) {
    done_ = done;
    const Clock::time_point now = Clock::now();
    const double fraction =
        total == 0 ? 1.0
                   : static_cast<double>(done) / static_cast<double>(total);
    if (!terminal_) {
      const int tenth = static_cast<int>(fraction * 10);
      if (tenth <= last_tenth_ || now - start_ < kQuietPeriod) return;
      last_tenth_ = tenth;
      out_ << absl::StrFormat("%s: %d%% (%.1f/%.1f MB)\n", label_, tenth * 10,
                              done / 1e6, total / 1e6)
           << std::flush;
      return;
    }
    if (done < total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    out_ << "\r" << label_ << " [" << std::string(filled, '#')
         << std::string(kWidth - filled, ' ') << "] "
         << absl::StrFormat("%5.1f%% %.1f/%.1f MB", fraction * 100, done / 1e6,
                            total / 1e6)
         << std::flush;
    drawn_ = true;
  }
  void Finish() {
    if (drawn_) out_ << "\n" << std::flush;
  }
  uint64_t done() const { return done_; }

 private:
  std::ostream& out_;
  bool terminal_;
  std::string label_;
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_;
  int last_tenth_ = 0;
  uint64_t done_ = 0;
  bool drawn_ = false;
};

// export's --max-shard-size and --dtype.
absl::StatusOr<checkpoint::HfExportOptions> ExportOptionsFromCommand(
    const CheckpointCommand& c) {
  checkpoint::HfExportOptions options;
  if (!c.max_shard_size.empty()) {
    absl::StatusOr<uint64_t> bytes =
        checkpoint::ParseByteSize(c.max_shard_size);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--max-shard-size: ", bytes.status().message()));
    }
    options.max_shard_bytes = *bytes;
  }
  if (!c.layout.dtype.empty()) {
    absl::StatusOr<DType> dtype = ParseDType(c.layout.dtype);
    if (!dtype.ok() || !IsFloatingPoint(*dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--dtype must be bfloat16, float16, float32 or float64 for "
          "checkpoint export, got '%s'",
          c.layout.dtype));
    }
    options.dtype = *dtype;
  }
  return options;
}

// The first Hugging Face import flag given, or empty.
std::string HfImportFlag(const CheckpointCommand& c) {
  if (c.cast) return "cast";
  if (c.weights_only) return "weights-only";
  if (!c.add_prefix.empty()) return "add-prefix";
  if (!c.strip_prefix.empty()) return "strip-prefix";
  if (!c.ignore_suffixes.empty()) return "ignore-suffix";
  return "";
}

// "the sharded checkpoint that was there (4 files)"-style report of what a
// write did to an existing directory; empty when it was new or empty.
std::string DescribeOutcome(const checkpoint::DirWriteOutcome& o,
                            absl::string_view kind) {
  if (o.replaced.empty() && o.kept.empty()) return "";
  constexpr size_t kNamed = 8;
  const auto names = [&](const std::vector<std::string>& v) {
    return absl::StrCat(
        v.size(), v.size() == 1 ? " file: " : " files: ",
        absl::StrJoin(v.begin(), v.begin() + std::min(kNamed, v.size()), ", "),
        v.size() > kNamed ? absl::StrFormat(" and %d more", v.size() - kNamed)
                          : "");
  };
  std::string line = AbsolutePath(o.dir);
  if (o.kept.empty()) {
    absl::StrAppend(&line, ": replaced the ", kind, " that was there (",
                    names(o.replaced), ")");
  } else {
    absl::StrAppend(&line, ": replaced ",
                    o.replaced.empty() ? "nothing" : names(o.replaced),
                    "; kept ", names(o.kept));
  }
  return line;
}

absl::StatusOr<checkpoint::InitOptimizer> ParseOptimizer(
    const std::string& name) {
  if (name == "adamw") return checkpoint::InitOptimizer::kAdamW;
  if (name == "sgd") return checkpoint::InitOptimizer::kSgd;
  if (name == "none") return checkpoint::InitOptimizer::kNone;
  return absl::InvalidArgumentError(absl::StrFormat(
      "--optimizer must be adamw, sgd or none for checkpoint init, got '%s'",
      name));
}

}  // namespace

int64_t PeakResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "VmHWM:")) continue;
    std::vector<std::string> parts =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    int64_t kib = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) {
      return kib * 1024;
    }
  }
  return 0;
}

absl::Status ValidateCheckpointCommand(const CheckpointCommand& c) {
  const std::string& a = c.action;
  if (a != "init" && a != "shard" && a != "reshard" && a != "consolidate" &&
      a != "verify" && a != "export") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unknown action '%s'; expected init, shard, reshard, consolidate, "
        "verify or export",
        a));
  }
  const auto check = [&](absl::string_view flag, bool given) -> absl::Status {
    const std::string dashed = absl::StrReplaceAll(flag, {{"_", "-"}});
    if (Needs(a, flag) && !given) {
      return absl::InvalidArgumentError(
          absl::StrFormat("checkpoint %s needs --%s", a, dashed));
    }
    if (!Needs(a, flag) && given) {
      return absl::InvalidArgumentError(
          absl::StrFormat("checkpoint %s does not take --%s", a, dashed));
    }
    return absl::OkStatus();
  };
  FLATPARAM_RETURN_IF_ERROR(check("in", !c.in.empty()));
  FLATPARAM_RETURN_IF_ERROR(check("out", !c.out.empty()));
  FLATPARAM_RETURN_IF_ERROR(check("model", !c.layout.model.empty()));
  // --world-size defaults to 8, as for every layout subcommand.
  if (c.world_size_set && a != "shard" && a != "reshard") {
    return absl::InvalidArgumentError(
        absl::StrFormat("checkpoint %s does not take --world-size", a));
  }
  const bool layout_flags = c.layout.strategy != LayoutRequest().strategy ||
                            c.layout.align_addresses ||
                            !c.layout.compute_dtype.empty() ||
                            c.layout.shard_group_size != 0;
  if (layout_flags && a != "shard" && a != "reshard") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %s does not take layout flags (--strategy, "
        "--shard-group-size, --align-addresses, --compute-dtype)",
        a));
  }
  if (!c.layout.dtype.empty() && a != "init" && a != "shard" && a != "export") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %s does not take --dtype (a checkpoint's dtypes are its "
        "model's)",
        a));
  }
  if (const std::string flag = HfImportFlag(c); !flag.empty() && a != "shard") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %s does not take --%s (shard of a Hugging Face "
        "checkpoint only)",
        a, flag));
  }
  for (const std::string& suffix : c.ignore_suffixes) {
    if (suffix.empty()) {
      return absl::InvalidArgumentError(
          "--ignore-suffix: an empty suffix would skip every tensor");
    }
  }
  if (!c.max_shard_size.empty() && a != "export") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %s does not take --max-shard-size (export only)", a));
  }
  if (!c.copy_from.empty() && a != "export") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %s does not take --copy-from (export only)", a));
  }
  if (c.overwrite && a != "export") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint %s does not take --overwrite: it replaces an earlier "
        "checkpoint of its kind without it, and a checkpoint cannot share "
        "its directory with other files (its readers reject any file its "
        "manifest does not list); give a new or empty --out",
        a));
  }
  if (a == "export") {
    FLATPARAM_RETURN_IF_ERROR(ExportOptionsFromCommand(c).status());
  }
  if (a == "shard" || a == "reshard") {
    FLATPARAM_RETURN_IF_ERROR(TargetLayout(c.layout).status());
  }
  if (a == "init")
    FLATPARAM_RETURN_IF_ERROR(ParseOptimizer(c.optimizer).status());
  if (!c.in.empty() && !c.out.empty() && c.in == c.out) {
    return absl::InvalidArgumentError("--in and --out must differ");
  }
  return absl::OkStatus();
}

absl::Status RunCheckpoint(const CheckpointCommand& c, std::ostream& out,
                           std::ostream& progress, bool progress_is_terminal) {
  FileSystem& fs = PosixFileSystem();
  ProgressBar bar(progress, progress_is_terminal, c.action);
  ConvertOptions options;
  options.chunk_bytes = c.chunk_bytes;
  checkpoint::DirWriteOutcome outcome;
  options.outcome = &outcome;
  options.progress = [&bar](uint64_t done, uint64_t total) {
    bar.Update(done, total);
  };
  const Clock::time_point start = Clock::now();
  absl::Status status;
  std::optional<checkpoint::CheckpointReport> report;
  // Report lines printed before the summary.
  std::vector<std::string> lines;
  std::optional<uint64_t> hf_verified_bytes;
  if (c.action == "init") {
    absl::StatusOr<ResolvedLayout> resolved = ResolveLayout(c.layout);
    if (!resolved.ok()) return resolved.status();
    checkpoint::InitOptions init;
    init.seed = c.seed;
    FLATPARAM_ASSIGN_OR_RETURN(init.optimizer, ParseOptimizer(c.optimizer));
    init.convert = options;
    status =
        checkpoint::InitCheckpoint(fs, resolved->layout.spec(), c.out, init);
  } else if (c.action == "shard") {
    FLATPARAM_ASSIGN_OR_RETURN(ResolvedLayout resolved,
                               ResolveLayout(c.layout));
    FLATPARAM_ASSIGN_OR_RETURN(const bool hf,
                               checkpoint::IsHfCheckpoint(fs, c.in));
    if (hf) {
      checkpoint::HfImportOptions import;
      import.convert = options;
      import.cast = c.cast;
      import.weights_only = c.weights_only;
      import.names.add_prefix = c.add_prefix;
      import.names.strip_prefix = c.strip_prefix;
      import.ignored_suffixes.insert(import.ignored_suffixes.end(),
                                     c.ignore_suffixes.begin(),
                                     c.ignore_suffixes.end());
      absl::StatusOr<checkpoint::HfImportReport> r =
          checkpoint::ImportHfCheckpoint(fs, c.in, resolved.layout.spec(),
                                         resolved.layout.options(),
                                         resolved.world_size, c.out, import);
      status = r.status();
      // A Hugging Face checkpoint against a preset with the model's own
      // names: point at the preset with Hugging Face's names.
      const std::string hf_preset = absl::StrCat(c.layout.model, "-hf");
      if (!status.ok() &&
          absl::StrContains(status.message(), "unexpected tensor") &&
          IsPresetName(c.layout.model) && IsPresetName(hf_preset)) {
        status = absl::Status(
            status.code(),
            absl::StrFormat("did you mean --model=%s? %s is a Hugging Face "
                            "checkpoint, whose parameter names are those of "
                            "%s, not of %s: %s",
                            hf_preset, c.in, hf_preset, c.layout.model,
                            status.message()));
      }
      if (r.ok()) {
        lines.push_back(absl::StrFormat(
            "%s: imported %d tensors of %d Hugging Face file%s into model "
            "%s (%d tied cop%s checked, %d buffer%s skipped, %d cast)%s",
            AbsolutePath(c.out), r->imported, r->files,
            r->files == 1 ? "" : "s", resolved.layout.spec().name,
            r->tied_copies, r->tied_copies == 1 ? "y" : "ies", r->ignored,
            r->ignored == 1 ? "" : "s", r->cast,
            checkpoint::DescribeOptimizerImport(*r)));
      }
    } else if (const std::string flag = HfImportFlag(c); !flag.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--%s applies to Hugging Face checkpoints only, and %s is not one",
          flag, c.in));
    } else {
      status = checkpoint::ShardCheckpoint(fs, c.in, resolved.layout.spec(),
                                           resolved.layout.options(),
                                           resolved.world_size, c.out, options);
    }
  } else if (c.action == "export") {
    FLATPARAM_ASSIGN_OR_RETURN(checkpoint::HfExportOptions exp,
                               ExportOptionsFromCommand(c));
    exp.convert = options;
    exp.convert.overwrite = c.overwrite;
    exp.copy_from = c.copy_from;
    absl::StatusOr<checkpoint::HfExportReport> r =
        checkpoint::ExportHfCheckpoint(fs, c.in, c.out, exp);
    status = r.status();
    if (r.ok()) {
      lines.push_back(absl::StrFormat(
          "%s: %d tensors, total_size %d bytes, in %s%s", AbsolutePath(c.out),
          r->tensors, r->total_size, absl::StrJoin(r->files, ", "),
          r->copied.empty()
              ? ""
              : absl::StrCat("; copied from ", AbsolutePath(c.copy_from), ": ",
                             absl::StrJoin(r->copied, ", "))));
    }
  } else if (c.action == "reshard") {
    FLATPARAM_ASSIGN_OR_RETURN(auto target, TargetLayout(c.layout));
    status = checkpoint::ReshardCheckpoint(fs, c.in, target.first,
                                           target.second, c.out, options);
  } else if (c.action == "consolidate") {
    status = checkpoint::ConsolidateCheckpoint(fs, c.in, c.out, options);
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(const bool hf,
                               checkpoint::IsHfCheckpoint(fs, c.in));
    if (hf) {
      absl::StatusOr<checkpoint::HfCheckpointReader> r =
          checkpoint::HfCheckpointReader::Open(fs, c.in);
      status = r.status();
      if (r.ok()) {
        hf_verified_bytes = r->data_bytes();
        lines.push_back(absl::StrFormat(
            "%s: ok: Hugging Face checkpoint, %d files, %d tensors, %d "
            "bytes of tensors (headers%s checked; no checksums to verify)",
            AbsolutePath(c.in), r->files().size(), r->tensors().size(),
            r->data_bytes(), r->index_path().empty() ? "" : " and index"));
      }
    } else {
      absl::StatusOr<checkpoint::CheckpointReport> r =
          checkpoint::VerifyCheckpoint(fs, c.in, options.progress);
      if (r.ok()) report = *std::move(r);
      status = r.status();
    }
  }
  bar.Finish();
  if (!status.ok()) return status;
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  uint64_t bytes = hf_verified_bytes.value_or(bar.done());
  const char* kind = c.action == "export" ? "Hugging Face export"
                     : c.action == "init" || c.action == "consolidate"
                         ? "full checkpoint"
                         : "sharded checkpoint";
  if (const std::string replaced = DescribeOutcome(outcome, kind);
      !replaced.empty()) {
    lines.insert(lines.begin(), replaced);
  }
  for (const std::string& line : lines) out << line << "\n";
  if (report.has_value()) {
    bytes = report->bytes;
    out << absl::StrFormat("%s: ok: %s checkpoint, %d files, %d tensors",
                           AbsolutePath(report->path),
                           checkpoint::CheckpointKindName(report->kind),
                           report->files, report->tensors);
    if (report->kind == checkpoint::CheckpointKind::kSharded) {
      out << absl::StrFormat(
          ", model %s, world size %d, %s, shard group %d, %s, %d flat "
          "parameters",
          report->model, report->world_size,
          ShardingStrategyName(report->strategy), report->shard_group_size,
          report->align_addresses ? "aligned" : "unaligned",
          report->flat_params);
    }
    out << "\n";
  }
  const std::string what =
      c.action == "verify" ? "verified"
                           : absl::StrCat("wrote ", AbsolutePath(c.out), ":");
  out << absl::StrFormat(
      "checkpoint %s: %s %d bytes in %.2f s (%.1f MB/s), peak RSS %.1f MiB\n",
      c.action, what, bytes, seconds,
      seconds > 0 ? static_cast<double>(bytes) / 1e6 / seconds : 0.0,
      static_cast<double>(PeakResidentBytes()) / (1 << 20));
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace flatparam
