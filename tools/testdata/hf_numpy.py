#!/usr/bin/env python3
"""Hugging Face safetensors checkpoints with nothing but numpy and json: an
independent writer and reader for the tests of `fsdp checkpoint shard`
(import) and `fsdp checkpoint export`. It follows the safetensors
specification (8-byte little-endian header length, JSON header, data
section) and huggingface_hub's index format; it shares no code with
flatparam.

  hf_numpy.py make --spec=MODEL.json --out=DIR [--dtype=F32|F16|BF16]
      [--shards=K] [--seed=N] [--wrap] [--tied-copy] [--inv-freq]
      [--optimizer]
    Writes a checkpoint of the model file's untied parameters with
    pseudo-random values: model.safetensors (--shards=0, the default) or K
    files model-0000i-of-0000K.safetensors plus model.safetensors.index.json.
    --wrap stores names as FSDP / activation checkpointing / torch.compile
    wrappers leave them; --tied-copy also writes tied parameters (a copy of
    their target); --inv-freq adds a rotary_emb.inv_freq buffer;
    --optimizer adds an optimizer.pt file.

  hf_numpy.py compare --expected=DIR --actual=DIR [--cast=DTYPE]
      [--skip=NAME ...]
    Every tensor of ACTUAL must be in EXPECTED (names cleaned as PyTorch's
    clean_tensor_name does) with the same shape and the same bits (or, with
    --cast, EXPECTED's values cast to DTYPE with round to nearest even);
    every tensor of EXPECTED must be in ACTUAL except --skip ones and
    rotary_emb.inv_freq buffers.

  hf_numpy.py check --dir=DIR --max-shard-size=BYTES [--files=K]
      [--dtype=DTYPE] [--tensors=N]
    Checks an exported directory: each file's header and data, the
    {"format": "pt"} metadata, the index (total_size, weight_map) and the
    size cap.

Exits non-zero with a message on the first difference.
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

DTYPES = {  # safetensors name -> (numpy dtype of the bits, element size)
    "F64": (np.float64, 8),
    "F32": (np.float32, 4),
    "F16": (np.float16, 2),
    "BF16": (np.uint16, 2),
    "I64": (np.int64, 8),
}
TORCH_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32",
               "float64": "F64"}
INDEX = "model.safetensors.index.json"


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def clean(name):
    """torch.distributed.fsdp's clean_tensor_name, plus torch.compile's
    _orig_mod component."""
    name = name.replace("_fsdp_wrapped_module.", "")
    name = name.replace("_checkpoint_wrapped_module.", "")
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def f32_to_bf16_bits(x):
    """Round to nearest even, as torch's float -> bfloat16 cast."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(
        np.float32)


def to_float32(dtype, array):
    if dtype == "BF16":
        return bf16_bits_to_f32(array)
    return array.astype(np.float32)


def from_float32(dtype, values):
    """float32 values -> the bits of `dtype` (torch's casts)."""
    if dtype == "BF16":
        return f32_to_bf16_bits(values)
    return values.astype(DTYPES[dtype][0])


# ---------------------------------------------------------------------------
# Writing


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype, shape, numpy array of the bits)."""
    # As the reference writer: by element size, largest first, then name.
    order = sorted(tensors, key=lambda t: (-DTYPES[t[1]][1], t[0]))
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in order:
        nbytes = data.nbytes
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in order:
            f.write(np.ascontiguousarray(data).tobytes())


def wrapped(name):
    """A name as nested wrappers leave it: torch.compile around FSDP around
    an activation-checkpointed module."""
    parts = name.split(".")
    inner = ".".join(parts[:-1] + ["_checkpoint_wrapped_module", parts[-1]])
    return "_orig_mod._fsdp_wrapped_module." + inner


def make(args):
    with open(args.spec) as f:
        spec = json.load(f)
    rng = np.random.default_rng(args.seed)
    tensors = []
    values = {}
    for p in spec["params"]:
        if "tied_to" in p:
            continue
        shape = p["shape"]
        v = rng.standard_normal(int(np.prod(shape, dtype=np.int64)))
        v = v.astype(np.float32).reshape(shape)
        bits = from_float32(args.dtype, v)
        values[p["fqn"]] = bits
        tensors.append([p["fqn"], args.dtype, shape, bits])
    if args.tied_copy:
        for p in spec["params"]:
            if "tied_to" in p:
                target = values[p["tied_to"]]
                tensors.append([p["fqn"], args.dtype, list(target.shape),
                                target.copy()])
    if args.inv_freq:
        freq = (1.0 / (10000 ** (np.arange(0, 8, 2) / 8))).astype(np.float32)
        tensors.append(["model.layers.0.self_attn.rotary_emb.inv_freq", "F32",
                        [4], freq])
    if args.wrap:
        for t in tensors:
            t[0] = wrapped(t[0])
    os.makedirs(args.out, exist_ok=True)
    if args.optimizer:
        with open(os.path.join(args.out, "optimizer.pt"), "wb") as f:
            f.write(b"not a flatparam file")
    if args.shards == 0:
        write_safetensors(os.path.join(args.out, "model.safetensors"), tensors)
        return
    k = args.shards
    groups = [tensors[i * len(tensors) // k:(i + 1) * len(tensors) // k]
              for i in range(k)]
    weight_map = {}
    total = 0
    for i, group in enumerate(groups):
        name = "model-%05d-of-%05d.safetensors" % (i + 1, k)
        write_safetensors(os.path.join(args.out, name), group)
        for t in group:
            weight_map[t[0]] = name
            total += t[3].nbytes
    with open(os.path.join(args.out, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": weight_map}, f, indent=2, sort_keys=True)


# ---------------------------------------------------------------------------
# Reading


def read_safetensors(path):
    """name -> (dtype, shape, numpy array of the bits); checks the layout."""
    with open(path, "rb") as f:
        blob = f.read()
    check(len(blob) >= 8, "%s: shorter than 8 bytes" % path)
    (n,) = struct.unpack("<Q", blob[:8])
    check(8 + n <= len(blob), "%s: header runs past the end" % path)
    check((8 + n) % 8 == 0, "%s: data does not start 8-aligned" % path)
    text = blob[8:8 + n].decode("utf-8")
    check(text.startswith("{"), "%s: header does not start with {" % path)
    header = json.loads(text)
    metadata = header.pop("__metadata__", None)
    data = blob[8 + n:]
    spans = sorted(tuple(e["data_offsets"]) for e in header.values())
    end = 0
    for begin, stop in spans:
        check(begin == end, "%s: gap or overlap at %d" % (path, begin))
        end = stop
    check(end == len(data), "%s: data is %d bytes, tensors end at %d"
          % (path, len(data), end))
    out = {}
    for name, e in header.items():
        check(set(e) == {"dtype", "shape", "data_offsets"},
              "%s: %s has keys %s" % (path, name, sorted(e)))
        np_dtype, size = DTYPES[e["dtype"]]
        begin, stop = e["data_offsets"]
        count = int(np.prod(e["shape"], dtype=np.int64))
        check(stop - begin == count * size,
              "%s: %s has %d bytes for %s %s" % (path, name, stop - begin,
                                                 e["dtype"], e["shape"]))
        array = np.frombuffer(data[begin:stop], dtype=np_dtype)
        out[name] = (e["dtype"], list(e["shape"]), array.reshape(e["shape"]))
    return metadata, out


def read_checkpoint(directory):
    """file name -> (metadata, tensors), and the index (or None)."""
    index_path = os.path.join(directory, INDEX)
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
    else:
        index = None
        files = ["model.safetensors"]
    return {f: read_safetensors(os.path.join(directory, f)) for f in files}, \
        index


def all_tensors(directory):
    files, _ = read_checkpoint(directory)
    out = {}
    for _, (_, tensors) in files.items():
        for name, t in tensors.items():
            key = clean(name)
            check(key not in out, "%s: %s twice" % (directory, key))
            out[key] = t
    return out


def compare(args):
    expected = all_tensors(args.expected)
    actual = all_tensors(args.actual)
    skip = set(args.skip or [])
    for name in expected:
        if name in skip or name.endswith(".rotary_emb.inv_freq"):
            continue
        check(name in actual, "%s lacks %s" % (args.actual, name))
    for name, (dtype, shape, bits) in actual.items():
        check(name in expected, "%s has unexpected %s" % (args.actual, name))
        e_dtype, e_shape, e_bits = expected[name]
        check(shape == e_shape, "%s: shape %s, expected %s"
              % (name, shape, e_shape))
        if args.cast:
            want_dtype = TORCH_NAMES[args.cast]
            want = from_float32(want_dtype, to_float32(e_dtype, e_bits))
        else:
            want_dtype, want = e_dtype, e_bits
        check(dtype == want_dtype, "%s: dtype %s, expected %s"
              % (name, dtype, want_dtype))
        got = bits.view(np.uint8)
        want = np.ascontiguousarray(want).view(np.uint8)
        if not np.array_equal(got, want):
            first = int(np.argmax(got != want))
            fail("%s: bytes differ from byte %d on" % (name, first))
    print("OK: %d tensors equal bit for bit" % len(actual))


def check_export(args):
    files, index = read_checkpoint(args.dir)
    names = sorted(os.listdir(args.dir))
    total = 0
    where = {}
    for f, (metadata, tensors) in files.items():
        check(metadata == {"format": "pt"},
              "%s: __metadata__ is %s" % (f, metadata))
        size = sum(t[2].nbytes for t in tensors.values())
        total += size
        check(size <= args.max_shard_size or len(tensors) == 1,
              "%s: %d bytes of %d tensors, over the cap %d"
              % (f, size, len(tensors), args.max_shard_size))
        for name, t in tensors.items():
            where[name] = f
            if args.dtype:
                check(t[0] == TORCH_NAMES[args.dtype],
                      "%s: %s is %s" % (f, name, t[0]))
    if index is None:
        check(names == ["model.safetensors"],
              "single-file export holds %s" % names)
    else:
        n = len(files)
        check(n > 1, "an index for one file")
        want = ["model-%05d-of-%05d.safetensors" % (i + 1, n)
                for i in range(n)]
        check(sorted(files) == want, "files %s, expected %s"
              % (sorted(files), want))
        check(names == sorted(want + [INDEX]), "directory holds %s" % names)
        check(set(index) == {"metadata", "weight_map"}, "index keys %s"
              % sorted(index))
        check(index["metadata"] == {"total_size": total},
              "index metadata %s, tensors hold %d bytes"
              % (index["metadata"], total))
        check(index["weight_map"] == where, "weight_map differs from files")
    if args.files:
        check(len(files) == args.files, "%d files, expected %d"
              % (len(files), args.files))
    if args.tensors:
        check(len(where) == args.tensors, "%d tensors, expected %d"
              % (len(where), args.tensors))
    print("OK: %d files, %d tensors, %d bytes" % (len(files), len(where),
                                                   total))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--spec", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", default="F32", choices=["F32", "F16", "BF16"])
    m.add_argument("--shards", type=int, default=0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--wrap", action="store_true")
    m.add_argument("--tied-copy", action="store_true")
    m.add_argument("--inv-freq", action="store_true")
    m.add_argument("--optimizer", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("--expected", required=True)
    c.add_argument("--actual", required=True)
    c.add_argument("--cast", choices=sorted(TORCH_NAMES))
    c.add_argument("--skip", action="append")
    k = sub.add_parser("check")
    k.add_argument("--dir", required=True)
    k.add_argument("--max-shard-size", type=int, required=True)
    k.add_argument("--files", type=int, default=0)
    k.add_argument("--tensors", type=int, default=0)
    k.add_argument("--dtype", choices=sorted(TORCH_NAMES))
    args = parser.parse_args()
    {"make": make, "compare": compare, "check": check_export}[args.command](
        args)


if __name__ == "__main__":
    main()
