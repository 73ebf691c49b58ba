#!/usr/bin/env python3
"""Writes the DCP fixtures of //flatparam/interop/dcp:dcp_test.

Run with Debian's python3-torch 1.13 (/usr/bin/python3), from this folder:
    /usr/bin/python3 make_fixtures.py

  w2/, w4/  PyTorch 1.13's own DCP (torch.distributed._shard.checkpoint),
            saved by 2 and 4 gloo ranks: each weight a ShardedTensor
            chunked on dim 0 as FSDP's SHARDED_STATE_DICT chunks it
            (torch.chunk; with 4 ranks, rank 3 holds no chunk of a
            5-row tensor), a replicated plain tensor, and an int (a bytes
            item). One .distcp file per item (1.13's default).
  v2/       The PyTorch 2.x layout, written here from 2.x's source
            (torch/distributed/checkpoint/metadata.py and filesystem.py):
            the Metadata classes under torch.distributed.checkpoint, the
            state dict flattened ("model.<fqn>", "optim.state.<fqn>.<name>",
            "optim.param_groups" a bytes item), each rank's items
            concatenated into __{rank}_0.distcp, TensorProperties pickled by
            its __getstate__ tuple with the _MEM_FORMAT_ENCODING enum,
            planner_data, storage_meta and version.
  titan/    torchtitan's layout in the 2.x format (2 ranks): model keys at
            the top level, the optimizer under "optimizer." flattened per
            parameter (param_groups.<fqn>.<hyperparameter>; the
            embedding without weight decay), train_state and lr_scheduler
            items.
  bad/<case>/  Hostile or damaged variants of a one-tensor 2.x checkpoint
            ("w", float32 [4, 2] in two chunks of rows 0-1 and 2-3; ok/ is
            the undamaged one): see BAD_CASES.
  ../dcp_seeds/  Seeds of //flatparam/interop/dcp:dcp_metadata_fuzz_test
            (dcp_metadata_fuzz.cc): a mode byte (0 parse, 1 open with v2's
            .distcp files), then a .metadata of the fixtures above.
  expected.json  Every tensor's dtype, shape and values (exact doubles),
            and the bytes items' values, for both.
"""
import dataclasses
import enum
import io
import json
import os
import pickle
import shutil
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_shim  # noqa: F401,E402  (before torch.distributed._shard)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.distributed._shard.checkpoint as dcp113  # noqa: E402
from torch.distributed._shard.sharded_tensor import (  # noqa: E402
    Shard, ShardedTensor)

HERE = os.path.dirname(os.path.abspath(__file__))


def model_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 3, generator=g),
        "layers.0.weight": torch.randn(5, 3, generator=g),
        "layers.0.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "count": torch.tensor([3, 1, 4], dtype=torch.int64),
    }


def save_113(rank, world, out, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sd = {}
    for name, t in model_tensors().items():
        if name == "count":
            sd[name] = t
            continue
        chunks = torch.chunk(t, world, dim=0)
        offset = sum(c.shape[0] for c in chunks[:rank])
        shards = []
        if rank < len(chunks):
            shards = [Shard.from_tensor_and_offsets(
                chunks[rank].clone(), [offset] + [0] * (t.dim() - 1), rank)]
        sd[name] = ShardedTensor._init_from_local_shards(shards, *t.shape)
    sd["step"] = 7
    dcp113.save_state_dict(sd, dcp113.FileSystemWriter(out))
    dist.barrier()
    dist.destroy_process_group()


# --- PyTorch 2.x's classes, by their 2.x module paths ----------------------
def v2_classes():
    meta = types.ModuleType("torch.distributed.checkpoint.metadata")
    fs = types.ModuleType("torch.distributed.checkpoint.filesystem")
    sys.modules[meta.__name__] = meta
    sys.modules[fs.__name__] = fs

    def make(module, name, fields, **kw):
        cls = dataclasses.make_dataclass(name, fields, **kw)
        cls.__module__ = module.__name__
        cls.__qualname__ = name
        setattr(module, name, cls)
        return cls

    class _MEM_FORMAT_ENCODING(enum.Enum):
        TORCH_CONTIGUOUS_FORMAT = 0
        TORCH_CHANNELS_LAST = 1
        TORCH_PRESERVE_FORMAT = 2
    _MEM_FORMAT_ENCODING.__module__ = meta.__name__
    _MEM_FORMAT_ENCODING.__qualname__ = "_MEM_FORMAT_ENCODING"
    meta._MEM_FORMAT_ENCODING = _MEM_FORMAT_ENCODING

    c = types.SimpleNamespace()
    c.Chunk = make(meta, "ChunkStorageMetadata", ["offsets", "sizes"])
    props = make(meta, "TensorProperties",
                 ["dtype", "layout", "requires_grad", "memory_format",
                  "pin_memory"])
    # 2.x's __getstate__: the memory format as the enum.
    props.__getstate__ = lambda self: (
        self.dtype, self.layout, self.requires_grad,
        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, self.pin_memory)
    props.__setstate__ = lambda self, s: None
    c.Props = props
    c.Tensor = make(meta, "TensorStorageMetadata",
                    ["properties", "size", "chunks"])
    c.Bytes = make(meta, "BytesStorageMetadata", [])
    c.StorageMeta = make(meta, "StorageMeta",
                         ["checkpoint_id", "save_id", "load_id", "modules"])
    c.Metadata = make(meta, "Metadata",
                      ["state_dict_metadata", "planner_data", "storage_data",
                       "storage_meta", "version"])
    c.Index = make(meta, "MetadataIndex", ["fqn", "offset", "index"],
                   frozen=True)
    c.Info = make(fs, "_StorageInfo", ["relative_path", "offset", "length"])
    return c


ADAMW_GROUP = {
    "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01,
    "amsgrad": False, "maximize": False, "foreach": None,
    "capturable": False, "differentiable": False, "fused": None}


def v2_state(model_prefix, optim_prefix, titan):
    """The flattened state dict (key -> tensor or value) and planner_data.

    titan: torchtitan's layout -- model keys at the top level, the
    optimizer flattened by get_optimizer_state_dict(...,
    flatten_optimizer_state_dict=True): param_groups.<fqn>.<name> per
    parameter (the embedding without weight decay: two groups) -- and
    torchtitan's other states as bytes items.
    """
    model = {k: v for k, v in model_tensors().items() if k != "count"}
    if titan:
        model["layers.0.bias"] = model["layers.0.bias"].float()
    g = torch.Generator().manual_seed(1)
    flat, planner = {}, {}

    def put(path, value):
        key = ".".join(path)
        flat[key] = value
        planner[key] = tuple(path)

    mp = [model_prefix[:-1]] if model_prefix else []
    op = [optim_prefix[:-1]] if optim_prefix else []
    for name, t in model.items():
        put(mp + [name], t)
    for name, t in model.items():
        # float32 state (mixed precision keeps the optimizer in float32).
        put(op + ["state", name, "exp_avg"], torch.randn(t.shape, generator=g))
        put(op + ["state", name, "exp_avg_sq"], torch.rand(t.shape,
                                                           generator=g))
        put(op + ["state", name, "step"], torch.tensor(3.0))
    if titan:
        for name in model:
            group = dict(ADAMW_GROUP)
            if name == "embed.weight":
                group["weight_decay"] = 0.0
            for k, v in group.items():
                put(op + ["param_groups", name, k], v)
        put(["train_state"], {"step": 3})
        put(["lr_scheduler", "last_epoch"], 3)
    else:
        put(op + ["param_groups"], [dict(ADAMW_GROUP, params=list(model))])
    return flat, planner


def write_v2(out, world, titan=False):
    c = v2_classes()
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    flat, planner = (v2_state("", "optimizer.", True) if titan
                     else v2_state("model.", "optim.", False))
    sdm, storage = {}, {}
    streams = [io.BytesIO() for _ in range(world)]
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            buf = io.BytesIO()
            torch.save(value, buf)
            s = streams[0]
            off = s.tell()
            s.write(buf.getvalue())
            sdm[key] = c.Bytes()
            storage[c.Index(key, None, None)] = c.Info(
                "__0_0.distcp", off, s.tell() - off)
            continue
        chunks = []
        pieces = (torch.chunk(value, world, dim=0) if value.dim() > 0
                  else [value])
        row = 0
        for r, piece in enumerate(pieces):
            offsets = torch.Size(
                [row] + [0] * (value.dim() - 1) if value.dim() > 0 else [])
            row += piece.shape[0] if value.dim() > 0 else 0
            chunks.append(c.Chunk(offsets, torch.Size(piece.shape)))
            s = streams[r]
            off = s.tell()
            torch.save(piece.clone(), s)
            storage[c.Index(key, offsets, len(chunks) - 1)] = c.Info(
                f"__{r}_0.distcp", off, s.tell() - off)
        sdm[key] = c.Tensor(
            c.Props(value.dtype, torch.strided, False,
                    torch.contiguous_format, False),
            torch.Size(value.shape), chunks)
    for r, s in enumerate(streams):
        with open(os.path.join(out, f"__{r}_0.distcp"), "wb") as f:
            f.write(s.getvalue())
    md = c.Metadata(sdm, planner, storage,
                    c.StorageMeta("v2", "save-0", None, []), "1.0.0")
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return flat


class _System:
    """Unpickles as a call of os.system."""
    def __reduce__(self):
        return (os.system, ("echo pwned",))


# case -> what to change in the one-tensor checkpoint.
BAD_CASES = {
    "ok": {},
    "overlap": {"chunks": [((0, 0), (3, 2)), ((1, 0), (1, 2))]},
    "gap": {"chunks": [((0, 0), (2, 2)), ((3, 0), (1, 2))]},
    "beyond": {"chunks": [((0, 0), (2, 2)), ((2, 0), (3, 2))]},
    "huge": {"size": (1 << 40, 1 << 40)},
    "claims_more": {"size": (1 << 20, 2),
                    "chunks": [((0, 0), (1 << 19, 2)),
                               ((1 << 19, 0), (1 << 19, 2))]},
    "slash": {"path": "../__0_0.distcp"},
    "dotdot": {"path": ".."},
    "past_end": {"extra_length": 10},
    "duplicate": {"duplicate": True},
    "missing": {"missing": True},
    "global": {"global": True},
    "zstd": {"transforms": ["zstd"]},
    "wrong_dtype": {"dtype": torch.float64},
    "unknown_key": {"unknown_key": True},
    # Items serialized as safetensors (FileSystemWriter's
    # serialization_format=SAFETENSORS): the file is one safetensors file.
    "safetensors": {"safetensors": True},
}


def safetensors_bytes(tensors):
    """A safetensors file of float32 tensors, by the format's spec."""
    header, data = {}, b""
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text + data


def write_bad(root):
    c = v2_classes()
    fs = sys.modules["torch.distributed.checkpoint.filesystem"]
    info4 = dataclasses.make_dataclass(
        "_StorageInfo", ["relative_path", "offset", "length",
                         "transform_descriptors"])
    info4.__module__ = fs.__name__
    if os.path.exists(root):
        shutil.rmtree(root)
    w = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    for case, change in BAD_CASES.items():
        out = os.path.join(root, case)
        os.makedirs(out)
        stream = io.BytesIO()
        ranges = []
        for piece in (w[0:2], w[2:4]):
            off = stream.tell()
            torch.save(piece.clone(), stream)
            ranges.append((off, stream.tell() - off))
        if change.get("safetensors"):
            blob = safetensors_bytes({"w.0": w[0:2], "w.1": w[2:4]})
            start = len(blob) - 32
            ranges = [(start, 16), (start + 16, 16)]
        else:
            blob = stream.getvalue()
        with open(os.path.join(out, "__0_0.distcp"), "wb") as f:
            f.write(blob)
        chunk_specs = change.get("chunks", [((0, 0), (2, 2)), ((2, 0), (2, 2))])
        chunks = [c.Chunk(torch.Size(o), torch.Size(z)) for o, z in chunk_specs]
        storage = {}
        path = change.get("path", "__0_0.distcp")
        for k, (chunk, (off, length)) in enumerate(zip(chunks, ranges)):
            if change.get("missing") and k == 1:
                continue
            length += change.get("extra_length", 0) if k == 1 else 0
            if "transforms" in change:
                value = info4(path, off, length, change["transforms"])
            else:
                value = c.Info(path, off, length)
            storage[c.Index("w", chunk.offsets, k)] = value
            if change.get("duplicate") and k == 1:
                storage[c.Index("w", chunk.offsets, None)] = value
        if change.get("unknown_key"):
            storage[c.Index("v", None, None)] = c.Info(path, 0, 1)
        props = c.Props(change.get("dtype", torch.float32), torch.strided,
                        False, torch.contiguous_format, False)
        sdm = {"w": c.Tensor(props, torch.Size(change.get("size", (4, 2))),
                             chunks)}
        md = c.Metadata(sdm, None, storage, None, None)
        if change.get("global"):
            md = c.Metadata(sdm, _System(), storage, None, None)
        # (The 4-field _StorageInfo of newer 2.x releases, for zstd.)
        fs._StorageInfo = info4 if "transforms" in change else c.Info
        with open(os.path.join(out, ".metadata"), "wb") as f:
            pickle.dump(md, f)
        fs._StorageInfo = c.Info


def describe(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).replace("torch.", ""),
                "shape": list(value.shape),
                "values": value.double().flatten().tolist()}
    return {"bytes": value}


def main():
    expected = {}
    for world, port in ((2, 29611), (4, 29612)):
        out = os.path.join(HERE, f"w{world}")
        if os.path.exists(out):
            shutil.rmtree(out)
        mp.spawn(save_113, args=(world, out, port), nprocs=world)
    expected["v1"] = {k: describe(v) for k, v in model_tensors().items()}
    expected["v1"]["step"] = {"bytes": 7}
    flat = write_v2(os.path.join(HERE, "v2"), 3)
    titan = write_v2(os.path.join(HERE, "titan"), 2, titan=True)
    write_bad(os.path.join(HERE, "bad"))
    expected["v2"] = {k: describe(v) for k, v in flat.items()}
    expected["titan"] = {k: describe(v) for k, v in titan.items()}
    seeds = os.path.join(HERE, "..", "dcp_seeds")
    os.makedirs(seeds, exist_ok=True)

    def seed(name, mode, fixture):
        with open(os.path.join(HERE, fixture, ".metadata"), "rb") as f:
            data = f.read()
        with open(os.path.join(seeds, name), "wb") as f:
            f.write(bytes([mode]) + data)
    for fixture in ("v2", "w2", "w4", "titan"):
        seed(f"{fixture}_parse", 0, fixture)
    seed("v2_open", 1, "v2")
    seed("bad_ok_open", 1, "bad/ok")
    for case in BAD_CASES:
        seed(f"bad_{case}", 0, f"bad/{case}")
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
