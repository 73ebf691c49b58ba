#!/usr/bin/env python3
"""Turns Google Benchmark JSON results into BENCHMARKS.md tables.

    report.py DIR [--line-rate-gbps=X]

DIR holds the files run_benchmarks.sh writes, <run>.json for each run:
flatparam, sim, collectives_mpi, handle_sim, handle_mpi, optim_state,
checkpoint_load, step, collectives_nccl. Missing files are reported as
"not run". Every figure is
shown next to the baseline measured in the same run, as a ratio:

  flatparam          each copy's bytes/s over BM_Memcpy's at the same size
  collectives_mpi    mpi/<op> busbw over mpi_raw/<op> busbw (raw MPI)
  handle_*           unshard_reshard over all_gather, reduce_grad over
                     reduce_scatter (bytes/s), same size and communicator
  optim_state        each conversion's bytes/s over plain_read_write's
  checkpoint_load    bytes read per rank over total / W, and load time over
                     a plain pread of the same bytes (the benchmark's own
                     counters; medians over its repetitions)
  step               a whole training step's time over `fsdp plan`'s
                     prediction on the link measured in the same run, with
                     the exposed communication of both
  collectives_nccl   busbw over the link's line rate (--line-rate-gbps, in
                     GB/s; without it busbw alone)
  sim                absolute figures (the simulator has no baseline)

Only the standard library: the input is JSON that Google Benchmark wrote.
"""

import argparse
import json
import os
import re
import sys

GIB = float(1 << 30)


def load(directory, run):
    path = os.path.join(directory, run + ".json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "benchmarks" not in doc:
        raise SystemExit("%s: not Google Benchmark JSON output" % path)
    ok = [b for b in doc["benchmarks"] if not b.get("error_occurred", False)]
    rows = [b for b in ok if b.get("run_type", "iteration") == "iteration"]
    if not rows:
        # A benchmark that reports its repetitions' aggregates only
        # (checkpoint_load): their medians stand for the runs.
        rows = [b for b in ok if b.get("run_type") == "aggregate" and
                b.get("aggregate_name") == "median"]
    return doc.get("context", {}), rows


def size_label(nbytes):
    nbytes = int(nbytes)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return "%d %s" % (nbytes // scale, unit)
    return "%d B" % nbytes


def rate(value):
    """Bytes per second as GB/s (2^30), three significant digits."""
    return "%.3g" % (value / GIB)


def ratio(value, base):
    if not base:
        return "n/a"
    return "%.2f" % (value / base)


def short(name):
    """The benchmark's name without Google Benchmark's run suffixes."""
    return re.sub(r"/(iterations:\d+|real_time|manual_time)", "", name)


def arg(name, key):
    m = re.search(r"(?:^|/)%s:(\d+)" % re.escape(key), name)
    return int(m.group(1)) if m else None


def table(header, rows):
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def context_line(context):
    return "host %s, %s CPUs at %s MHz, run %s" % (
        context.get("host_name", "?"), context.get("num_cpus", "?"),
        context.get("mhz_per_cpu", "?"), context.get("date", "?"))


def report_flatparam(ctx, rows):
    by = {}
    for b in rows:
        base, _, rest = b["name"].partition("/")
        by[(base, rest)] = b
    sizes = sorted({rest for (base, rest) in by if base == "BM_Memcpy"},
                   key=lambda r: arg(r, "bytes") or 0)
    ops = ["BM_Flatten", "BM_Unflatten", "BM_CopyShardAllRanks",
           "BM_FlattenShardAllRanks"]
    out = []
    for rest in sizes:
        memcpy = by[("BM_Memcpy", rest)].get("bytes_per_second", 0)
        cells = [size_label(arg(rest, "bytes") or 0), rate(memcpy)]
        for op in ops:
            b = by.get((op, rest))
            if b is None:
                cells.append("-")
                continue
            v = b.get("bytes_per_second", 0)
            cells.append("%s (%sx)" % (rate(v), ratio(v, memcpy)))
        out.append(cells)
    text = table(["size", "memcpy GB/s", "Flatten", "Unflatten",
                  "CopyShard x8", "FlattenShard x8"], out)
    meta = [b for b in rows if b["name"].startswith(
        "BM_Llama2_70bShardMetadataAllRanks")]
    if meta:
        text += "\n\n" + table(
            ["W", "time", "shard infos/s"],
            [[arg(b["name"], "W"), "%.3g %s" % (b["real_time"], b["time_unit"]),
              "%.3g M/s" % (b.get("shard_param_infos", 0) / 1e6)]
             for b in meta])
    return text


def report_sim(ctx, rows):
    out = []
    for b in rows:
        counters = []
        for key in ("handoffs/s", "busbw", "wrong"):
            if key in b:
                v = b[key]
                counters.append("%s=%s" % (
                    key, "%.3g" % v if key != "busbw" else rate(v) + " GB/s"))
        out.append([short(b["name"]),
                    "%.4g %s" % (b["real_time"], b["time_unit"]),
                    ", ".join(counters)])
    return table(["benchmark", "wall time", "counters"], out)


def pair_rows(rows, pairs, value_key, backend_of):
    """Rows `op` next to `baseline_op` with the same ranks and bytes."""
    index = {}
    for b in rows:
        parts = b["name"].split("/")
        if len(parts) < 4:
            continue
        index[(parts[0], parts[1], parts[2], parts[3])] = b
    out = []
    for (backend, op, ranks, nbytes), b in sorted(
            index.items(), key=lambda kv: (kv[0][1], arg(kv[0][3], "bytes"))):
        for want_op, base_op in pairs:
            if op != want_op:
                continue
            base = index.get((backend_of(backend), base_op, ranks, nbytes))
            if base is None:
                continue
            v, w = b.get(value_key, 0), base.get(value_key, 0)
            out.append([op, base_op, ranks.split(":")[-1],
                        size_label(arg(nbytes, "bytes")), rate(v), rate(w),
                        ratio(v, w), int(b.get("wrong", 0))])
    return out


def report_collectives_mpi(ctx, rows):
    out = []
    index = {b["name"]: b for b in rows}
    for b in rows:
        if not b["name"].startswith("mpi/"):
            continue
        raw = index.get("mpi_raw/" + b["name"][len("mpi/"):])
        if raw is None:
            continue
        parts = b["name"].split("/")
        out.append([parts[1], size_label(arg(b["name"], "bytes")),
                    rate(b.get("busbw", 0)), rate(raw.get("busbw", 0)),
                    ratio(b.get("busbw", 0), raw.get("busbw", 0)),
                    int(b.get("wrong", 0))])
    return table(["op", "bytes", "flatparam busbw GB/s",
                  "raw MPI busbw GB/s", "ratio", "wrong"], out)


def report_handle(ctx, rows):
    out = pair_rows(rows, [("unshard_reshard", "all_gather"),
                           ("reduce_grad", "reduce_scatter")],
                    "bytes_per_second", lambda backend: backend)
    return table(["op", "baseline", "ranks", "unit", "op GB/s",
                  "baseline GB/s", "ratio", "wrong"], out)


def report_optim_state(ctx, rows):
    base = None
    for b in rows:
        if "plain_read_write" in b["name"]:
            base = b
    out = []
    for b in rows:
        v = b.get("bytes_per_second", 0)
        w = base.get("bytes_per_second", 0) if base else 0
        peak = b.get("peak_extra_bytes")
        out.append([short(b["name"]), rate(v), ratio(v, w),
                    "-" if peak is None else size_label(peak)
                    if peak >= 1024 else "%d B" % peak])
    return table(["benchmark", "GB/s",
                  "ratio to plain read+write", "peak extra memory"], out)


def report_checkpoint_load(ctx, rows):
    out = []
    for b in rows:
        name = re.sub(r"_median$", "", short(b["name"]))
        name = re.sub(r"/repeats:\d+", "", name)
        out.append([name, "%.1f MiB" % (b.get("share_bytes", 0) / (1 << 20)),
                    "%.2f" % b.get("read_over_share", 0),
                    "%.3g s" % b.get("baseline_s", 0),
                    "%.2f" % b.get("load_over_baseline", 0)])
    return table(["benchmark", "total / W", "read / (total / W)",
                  "plain read", "load / plain read"], out)


def report_step(ctx, rows):
    out = []
    for b in rows:
        step_ms = b.get("real_time", 0)  # the benchmark reports milliseconds
        out.append([short(b["name"]), "%.0f ms" % step_ms,
                    "%.0f ms" % b.get("exposed_ms", 0),
                    "%.0f ms" % b.get("plan_step_ms", 0),
                    "%.0f ms" % b.get("plan_exposed_ms", 0),
                    "%.2f" % b.get("step_vs_plan", 0)])
    return table(["benchmark", "step", "exposed", "plan step",
                  "plan exposed", "step / plan"], out)


def report_nccl(ctx, rows, line_rate):
    out = []
    for b in rows:
        busbw = b.get("busbw", 0)
        out.append([short(b["name"]), rate(busbw),
                    ratio(busbw / GIB, line_rate) if line_rate else "n/a"])
    return table(["benchmark", "busbw GB/s", "busbw / line rate"], out)


SECTIONS = [
    ("flatparam", "flatparam_bench: flatten, unflatten and shard against "
     "memcpy", report_flatparam),
    ("sim", "sim_bench: the simulator", report_sim),
    ("collectives_mpi", "collectives_bench: MPI backend against raw MPI",
     report_collectives_mpi),
    ("handle_sim", "handle_bench on the simulator", report_handle),
    ("handle_mpi", "handle_bench on MPI", report_handle),
    ("optim_state", "optim_state_bench: checkpoint conversion against plain "
     "read+write", report_optim_state),
    ("checkpoint_load", "checkpoint_load_bench: bytes read per rank and load "
     "time against a plain read of the same bytes (goals: about 1, <= 1.2)",
     report_checkpoint_load),
    ("step", "step_bench: a whole step against fsdp plan", report_step),
]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--line-rate-gbps", type=float, default=0.0)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print("report.py: %s is not a directory" % args.dir, file=sys.stderr)
        return 2
    first = True
    for run, title, fn in SECTIONS + [
            ("collectives_nccl", "collectives_bench: NCCL",
             lambda c, r: report_nccl(c, r, args.line_rate_gbps))]:
        loaded = load(args.dir, run)
        if not first:
            print()
        first = False
        print("### %s" % title)
        print()
        if loaded is None:
            print("not run (no %s.json)" % run)
            continue
        ctx, rows = loaded
        print(context_line(ctx))
        print()
        print(fn(ctx, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
