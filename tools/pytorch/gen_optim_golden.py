#!/usr/bin/python3
"""Generates verify/testdata/pytorch_optim_state.json from real PyTorch FSDP.

The golden data lets //verify/conformance:pytorch_optim_conformance_test check
flatparam's optimizer-state functions (flatparam/optim/fsdp_optim.h) against
PyTorch 1.13's `FSDP.full_optim_state_dict` and
`FSDP.shard_full_optim_state_dict` without needing torch at test time.

How to run (from the repository root; about 15 s on 2 cores):

    /usr/bin/python3 tools/pytorch/gen_optim_golden.py \
        [--out verify/testdata/pytorch_optim_state.json]

Requirements: PyTorch 1.13 (Debian bookworm's CPU-only `python3-torch`) with
its own Python, /usr/bin/python3. The Python 3.11 import fix for
`torch.distributed.fsdp` is gen_layout_golden.py's (imported from there).

What runs: for each world size W in 1..4, W processes (torch.multiprocessing,
gloo over a FileStore in a temporary directory; nothing beyond the local
machine) build each model, wrap it with the real
`FullyShardedDataParallel` (flat-parameter path: 1.13 has no
`use_orig_params`), train it for two steps with each optimizer on per-rank
random inputs, and record
  * every rank's `optim.state_dict()` (the sharded state FSDP's optimizer
    really holds; keyed by parameter ID, one per flat parameter),
  * `FSDP.full_optim_state_dict(model, optim)` (rank0_only=True; the
    generator checks that rank0_only=False gives the same dict on every rank
    and that rank0_only=True gives {} on the others),
  * per rank, `FSDP.shard_full_optim_state_dict(full, model)` (or the
    exception it raised), also for edited full dicts ("variants"),
  * the model spec (parameters in traversal order, ties, the wrapped module
    prefixes, ignored parameters) needed to rebuild the same
    flatparam::ModelLayout, and the optimizer's parameter-ID table.

FSDP on CPU-only torch 1.13: the wrapper's CUDA calls are neutralised
(`torch.cuda.is_available/current_device/synchronize/Stream/Event/stream/
current_stream`, `Tensor.record_stream` a no-op, and `torch.device("cuda", i)`
mapped to the CPU inside the FSDP modules), and gloo's missing
`_all_gather_base` / `_reduce_scatter_base` are emulated with `all_gather` /
`all_reduce`. FSDP's own flattening, sharding and optimizer-state code runs
unchanged.

The output is deterministic: running the script twice gives identical bytes
(fixed seeds; gloo's reductions are deterministic for a fixed world size).
"""

import argparse
import base64
import contextlib
import json
import os
import re
import sys
import tempfile
import types
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Installs the Python 3.11 import fix and checks the torch version.
import gen_layout_golden  # pylint: disable=g-import-not-at-top,unused-import

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 2

SCHEMA = """\
Top level: format, generator, torch_version, python_version, schema (this
text), deviations (list of {what, torch_1_13, flatparam, evidence}),
generator_workarounds (what the generator changes around torch and why),
cases.

Values (optimizer state and hyperparameters) are typed objects:
  {"t": "none"} | {"t": "bool", "v": b} | {"t": "int", "v": i} |
  {"t": "float", "v": x} | {"t": "str", "v": s} |
  {"t": "tuple", "v": [floats]} (hyperparameters such as betas) |
  {"t": "tensor", "dtype": "float32", "shape": [..], "data": base64 of the
   raw little-endian bytes} (a 0-d tensor has shape []).
An optimizer state dict is {"state": [{"key": int ID or str FQN, "state":
{name: value}}] (sorted by key), "param_groups": [{"hyper": {name: value},
"params": [keys]}]}.

cases[]: name ("<model>/<optimizer>/world_size=<W>"), model, optimizer,
  world_size, strategy ("FULL_SHARD"),
  spec: {params: flatparam::ParamSpec list in module traversal order
    ({fqn, shape, dtype, requires_grad, tied_to}), wrap: module prefixes
    wrapped by their own FSDP instance (the root is always one), unmanaged:
    FQNs of parameters of ignored modules (not in params)},
  param_ids: the optimizer's parameter IDs in order: {"flat": [FQNs of the
    flat parameter's original parameters]} or {"unmanaged": FQN},
  full: FSDP.full_optim_state_dict (rank 0, rank0_only=True),
  ranks[]: {rank, optimizer: that rank's optim.state_dict() after training,
    shard: FSDP.shard_full_optim_state_dict(full, model) on that rank, or
    {"error": "<exception type>: <message>"}},
  variants[]: {what, full: an edited copy of `full`, ranks[]: {rank, shard}}
    (same shard encoding) for edits that training cannot produce.
"""

DEVIATIONS = [
    {
        "what": "sharding a full state dict whose state is None for every "
        "parameter of a flat parameter (SGD without momentum stores "
        "momentum_buffer=None)",
        "torch_1_13": "shard_full_optim_state_dict raises ValueError "
        "('Differing optimizer state types for state momentum_buffer, values "
        "[], ...'): it drops the Nones and then requires exactly one type",
        "flatparam": "the state is None for the flat parameter, as the 2.x "
        "reference (_flatten_optim_state: 'If all ranks have None, this is a "
        "None value') and as the optimizer itself holds it",
        "evidence": "cases '*/sgd/*': ranks[*].shard.error, and "
        "ranks[*].optimizer holds momentum_buffer None per flat parameter",
    },
    {
        "what": "sharding a full state dict in which no parameter of a flat "
        "parameter has state (a frozen unit, a unit the forward never used, "
        "or an edited dict)",
        "torch_1_13": "shard_full_optim_state_dict gives the flat parameter "
        "an empty entry {} (_flatten_optim_state returns {} and the caller "
        "stores it unconditionally)",
        "flatparam": "no entry, as documented in fsdp_optim.h and as the 2.x "
        "reference ('if flat_state: flat_osd_state[key] = flat_state'); an "
        "optimizer treats a missing entry and {} alike (it initialises the "
        "state on its next step)",
        "evidence": "cases 'frozen/*' (units enc and unused) and the 'mlp/"
        "sgd_momentum' variant without l1's state: ranks[*].shard.state "
        "entries whose state is {}",
    },
]

WORKAROUNDS = [
    "torch 1.13's _ConsolidatedOptimState keeps tensor_state, "
    "zero_dim_tensor_state and non_tensor_state as class attributes shared "
    "by every instance, so full_optim_state_dict leaks state names from "
    "earlier calls in the same process (an earlier Adam run made a later SGD "
    "consolidation fail in _get_unflat_views); the generator clears them "
    "before each call, which is what a fresh process has",
    "FSDP leaves ignored modules' gradients alone: the generator averages "
    "them over the ranks (as DDP would), so every rank holds the same "
    "unmanaged state",
]

# --------------------------------------------------------------------------
# FSDP on CPU-only torch 1.13
# --------------------------------------------------------------------------


class _NoCuda:
    """Stands in for torch.cuda.Stream and torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _all_gather_base(output, input_, group=None, async_op=False):
    assert not async_op
    world_size = dist.get_world_size(group)
    dist.all_gather(list(output.chunk(world_size)), input_, group=group)


def _reduce_scatter_base(
    output, input_, op=dist.ReduceOp.SUM, group=None, async_op=False
):
    assert not async_op
    world_size = dist.get_world_size(group)
    reduced = input_.clone()
    dist.all_reduce(reduced, op=op, group=group)
    output.copy_(reduced.chunk(world_size)[dist.get_rank(group)])


def neutralise_cuda() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _NoCuda
    torch.cuda.Event = _NoCuda
    torch.cuda.current_stream = lambda *args, **kwargs: _NoCuda()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    dist._all_gather_base = _all_gather_base
    dist._reduce_scatter_base = _reduce_scatter_base

    real_device = torch.device

    def cpu_for_cuda(*args, **kwargs):
        d = real_device(*args, **kwargs)
        return real_device("cpu") if d.type == "cuda" else d

    class _TorchWithCpuDevices(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    shim = _TorchWithCpuDevices("torch")
    shim.device = cpu_for_cuda
    # pylint: disable=g-import-not-at-top
    import torch.distributed.fsdp._optim_utils as optim_utils
    import torch.distributed.fsdp._shard_utils as shard_utils
    import torch.distributed.fsdp.flat_param as flat_param
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp

    for module in (fsdp, optim_utils, flat_param, shard_utils):
        module.torch = shim


# --------------------------------------------------------------------------
# Models: (module factory, prefixes to wrap, ignored module names, input dim)
# --------------------------------------------------------------------------


class Mlp(nn.Module):
    """Three linear layers with prime sizes; the head stays in the root."""

    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(5, 7)
        self.l1 = nn.Linear(7, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


class Tied(nn.Module):
    """An input projection tied to the output head (both in the root unit),
    a zero-numel parameter, and a wrapped block."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 3, bias=False)  # weight (3, 7)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.blk = nn.Linear(3, 3)
        self.head = nn.Linear(3, 7)
        self.out = nn.Module()
        self.out.weight = self.inp.weight  # tied: a shared parameter

    def forward(self, x):
        h = torch.tanh(self.blk(self.inp(x) + self.empty.sum()))
        return self.head(h) + h @ self.out.weight


class Frozen(nn.Module):
    """A frozen wrapped encoder, a wrapped module the forward never uses
    (no gradient, so no state), and a trainable root; float64."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.enc.requires_grad_(False)
        self.unused = nn.Linear(2, 3)
        self.dec = nn.Linear(4, 3)

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))


class Scalar(nn.Module):
    """A 0-d parameter next to a weight in one unit."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(3, 2)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.w(x) * self.gate


class Ignored(nn.Module):
    """A wrapped body and an ignored module whose parameters the optimizer
    holds unsharded (flatparam's unmanaged_params)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 5)
        self.side = nn.Linear(5, 2)
        self.top = nn.Linear(2, 2)

    def forward(self, x):
        return self.top(self.side(torch.tanh(self.body(x))))


MODELS: Dict[str, Dict[str, Any]] = {
    "mlp": {"cls": Mlp, "wrap": ["l0", "l1"], "ignored": [], "in": 5,
            "dtype": torch.float32},
    "tied": {"cls": Tied, "wrap": ["blk"], "ignored": [], "in": 7,
             "dtype": torch.float32},
    "frozen": {"cls": Frozen, "wrap": ["enc", "unused"], "ignored": [],
               "in": 4, "dtype": torch.float64},
    "scalar": {"cls": Scalar, "wrap": [], "ignored": [], "in": 3,
               "dtype": torch.float32},
    "ignored": {"cls": Ignored, "wrap": ["body"], "ignored": ["side"],
                "in": 3, "dtype": torch.float32},
}

OPTIMIZERS: Dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01,
                                              weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1,
                                                   momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
}

# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------


def encode_value(v: Any) -> Dict[str, Any]:
    if v is None:
        return {"t": "none"}
    if isinstance(v, bool):
        return {"t": "bool", "v": v}
    if isinstance(v, int):
        return {"t": "int", "v": v}
    if isinstance(v, float):
        return {"t": "float", "v": v}
    if isinstance(v, str):
        return {"t": "str", "v": v}
    if isinstance(v, tuple):
        assert all(isinstance(x, float) for x in v), v
        return {"t": "tuple", "v": list(v)}
    if torch.is_tensor(v):
        assert sys.byteorder == "little"
        t = v.detach().cpu().contiguous().clone()
        raw = bytes(t.reshape(-1).view(torch.uint8).tolist()) if t.numel() else b""
        return {
            "t": "tensor",
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data": base64.b64encode(raw).decode("ascii"),
        }
    raise TypeError(f"cannot encode {type(v)}: {v!r}")


def encode_osd(osd: Dict[str, Any]) -> Dict[str, Any]:
    state = []
    keys = sorted(osd["state"].keys(), key=lambda k: (isinstance(k, str), k))
    for key in keys:
        state.append(
            {
                "key": key,
                "state": {
                    name: encode_value(value)
                    for name, value in sorted(osd["state"][key].items())
                },
            }
        )
    groups = []
    for g in osd["param_groups"]:
        groups.append(
            {
                "hyper": {
                    k: encode_value(v) for k, v in sorted(g.items()) if k != "params"
                },
                "params": list(g["params"]),
            }
        )
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------


def build(model_name: str):
    """The FSDP-wrapped model, its spec and the unwrapped module's traversal."""
    # pylint: disable=g-import-not-at-top
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = MODELS[model_name]
    torch.manual_seed(1234)
    module = m["cls"]().to(m["dtype"])
    ignored = [module.get_submodule(n) for n in m["ignored"]]
    ignored_fqns = [
        f"{n}.{p}" for n in m["ignored"] for p, _ in
        module.get_submodule(n).named_parameters()
    ]
    specs = []
    first: Dict[int, str] = {}
    for module_name, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{name}" if module_name else name
            if fqn in ignored_fqns:
                continue
            tied_to = first.get(id(param), "")
            first.setdefault(id(param), fqn)
            specs.append(
                {
                    "fqn": fqn,
                    "shape": list(param.shape),
                    "dtype": _DTYPE_NAMES[param.dtype],
                    "requires_grad": param.requires_grad,
                    "tied_to": tied_to,
                }
            )
    for prefix in m["wrap"]:
        parent_name, _, child = prefix.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, FSDP(getattr(parent, child)))
    model = FSDP(module, ignored_modules=ignored or None)
    spec = {"params": specs, "wrap": m["wrap"], "unmanaged": ignored_fqns}
    return model, spec


def param_id_table(model, optim) -> List[Dict[str, Any]]:
    # pylint: disable=g-import-not-at-top
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_module
    from torch.distributed.fsdp.flat_param import FlatParameter

    names = fsdp_module._get_param_to_unflat_param_names(model)
    table = []
    for group in optim.param_groups:
        for p in group["params"]:
            if isinstance(p, FlatParameter):
                table.append({"flat": list(names[p])})
            else:
                assert len(names[p]) == 1
                table.append({"unmanaged": names[p][0]})
    return table


def shard_or_error(full, model) -> Dict[str, Any]:
    # pylint: disable=g-import-not-at-top
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    try:
        return encode_osd(FSDP.shard_full_optim_state_dict(full, model))
    except (ValueError, RuntimeError, AssertionError) as e:
        # The values torch prints (tensor reprs) are cut: the type, the state
        # and the parameter names identify the error.
        message = re.sub(
            r", values \[.+\], and unflattened",
            ", values [...], and unflattened",
            str(e),
            flags=re.DOTALL,
        )
        return {"error": f"{type(e).__name__}: {message}"}


def variants(model_name: str, optim_name: str, full: Dict[str, Any],
             spec: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """Edited full dicts that training cannot produce: a parameter without
    state inside a flat parameter (zeros), and a flat parameter none of
    whose parameters has state (no entry)."""
    if optim_name != "sgd_momentum" or model_name != "mlp":
        return []
    out = []
    drop_one = {"state": dict(full["state"]), "param_groups": full["param_groups"]}
    del drop_one["state"]["l0.bias"]
    out.append(("l0.bias has no state: its part of the flat state is zeros",
                drop_one))
    drop_unit = {"state": dict(full["state"]), "param_groups": full["param_groups"]}
    del drop_unit["state"]["l1.weight"]
    del drop_unit["state"]["l1.bias"]
    out.append(("no parameter of unit l1 has state: no entry for it",
                drop_unit))
    return out


def reset_consolidated_state() -> None:
    """Gives full_optim_state_dict the state a fresh process has.

    torch 1.13's `_ConsolidatedOptimState` declares its three dicts as class
    attributes, and `_communicate_optim_state` fills `state.tensor_state` etc.
    of a new instance, i.e. the shared class-level dicts: state names left by
    an earlier call (another model or optimizer in this process) leak into
    the next one (seen: Adam's exp_avg of another flat parameter's size made
    SGD's consolidation fail in `_get_unflat_views`). Within one call every
    flat parameter here has the same state names, which overwrite each other,
    so clearing before each call reproduces a first call.
    """
    # pylint: disable=g-import-not-at-top
    import torch.distributed.fsdp._optim_utils as optim_utils

    cls = optim_utils._ConsolidatedOptimState
    cls.tensor_state = {}
    cls.zero_dim_tensor_state = {}
    cls.non_tensor_state = {}


def run_case(model_name: str, optim_name: str, rank: int, world_size: int):
    # pylint: disable=g-import-not-at-top
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model, spec = build(model_name)
    optim = OPTIMIZERS[optim_name](model.parameters())
    m = MODELS[model_name]
    gen = torch.Generator().manual_seed(1000 * world_size + rank)
    for _ in range(STEPS):
        x = torch.randn(4, m["in"], generator=gen).to(m["dtype"])
        model(x).square().sum().backward()
        # FSDP leaves ignored modules' gradients alone; average them as DDP
        # would, so that every rank holds the same unmanaged state.
        for fqn in spec["unmanaged"]:
            grad = model.module.get_submodule(fqn.rpartition(".")[0]).get_parameter(
                fqn.rpartition(".")[2]).grad
            dist.all_reduce(grad)
            grad.div_(world_size)
        optim.step()
        optim.zero_grad()

    reset_consolidated_state()
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=True)
    reset_consolidated_state()
    full_all = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    # rank0_only=False is the same dict on every rank; rank0_only=True
    # leaves the others empty.
    gathered = [None] * world_size
    dist.all_gather_object(gathered, encode_osd(full_all))
    assert all(g == gathered[0] for g in gathered), (model_name, optim_name)
    if rank == 0:
        assert encode_osd(full) == gathered[0]
    else:
        assert full == {}, full
    full = full_all  # Every rank shards the same full dict.

    record = {
        "rank": rank,
        "optimizer": encode_osd(optim.state_dict()),
        "shard": shard_or_error(full, model),
    }
    variant_records = [
        {"what": what, "full": encode_osd(edited),
         "ranks": [{"rank": rank, "shard": shard_or_error(edited, model)}]}
        for what, edited in variants(model_name, optim_name, full, spec)
    ]
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, (record, variant_records))
    if rank != 0:
        return None
    variants_out = []
    for i, v in enumerate(per_rank[0][1]):
        v = dict(v)
        v["ranks"] = [per_rank[r][1][i]["ranks"][0] for r in range(world_size)]
        variants_out.append(v)
    return {
        "name": f"{model_name}/{optim_name}/world_size={world_size}",
        "model": model_name,
        "optimizer": optim_name,
        "world_size": world_size,
        "strategy": "FULL_SHARD",
        "spec": spec,
        "param_ids": param_id_table(model, optim),
        "full": gathered[0],
        "ranks": [r for r, _ in per_rank],
        "variants": variants_out,
    }


def worker(rank: int, world_size: int, store_path: str, out_path: str) -> None:
    neutralise_cuda()
    import warnings  # pylint: disable=g-import-not-at-top

    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank,
        world_size=world_size,
    )
    cases = []
    for model_name in MODELS:
        for optim_name in OPTIMIZERS:
            try:
                case = run_case(model_name, optim_name, rank, world_size)
            except Exception:
                print(f"rank {rank}/{world_size}: {model_name}/{optim_name} "
                      "failed", file=sys.stderr)
                raise
            if case is not None:
                cases.append(case)
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(cases, f)
    # Every rank waits for the others before exiting (gloo sees a closed
    # connection otherwise).
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="verify/testdata/pytorch_optim_state.json")
    args = parser.parse_args()

    # torch 1.13 iterates a set of state names when flattening, so which
    # state an error names depends on string hashing: fix it for the workers.
    os.environ["PYTHONHASHSEED"] = "0"
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for world_size in WORLD_SIZES:
            out_path = os.path.join(tmp, f"cases_{world_size}.json")
            mp.spawn(
                worker,
                args=(world_size, os.path.join(tmp, f"store_{world_size}"),
                      out_path),
                nprocs=world_size,
            )
            with open(out_path, encoding="utf-8") as f:
                cases.extend(json.load(f))

    out = {
        "format": "flatparam.pytorch_optim_state.v1",
        "generator": "tools/pytorch/gen_optim_golden.py",
        "torch_version": torch.__version__,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "schema": SCHEMA.splitlines(),
        "deviations": DEVIATIONS,
        "generator_workarounds": WORKAROUNDS,
        "cases": cases,
    }
    text = gen_layout_golden.compact(out) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    errors = sum(
        1 for c in cases for r in c["ranks"] if "error" in r["shard"]
    )
    print(f"wrote {args.out}: {len(cases)} cases "
          f"({len(MODELS)} models x {len(OPTIMIZERS)} optimizers x world sizes "
          f"{list(WORLD_SIZES)}), {errors} rank shards where torch raised, "
          f"{len(text)} bytes, torch {torch.__version__}")


if __name__ == "__main__":
    main()
