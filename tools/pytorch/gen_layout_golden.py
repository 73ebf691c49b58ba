#!/usr/bin/python3
"""Generates verify/testdata/pytorch_layouts.json from real PyTorch FSDP.

The golden data lets //verify/conformance:pytorch_conformance_test check
flatparam's layout, sharding and flattening against PyTorch without needing
torch at test time.

How to run (from the repository root):

    /usr/bin/python3 tools/pytorch/gen_layout_golden.py \
        [--out verify/testdata/pytorch_layouts.json]

Requirements: PyTorch 1.13 (Debian bookworm's `python3-torch`, CPU-only;
`apt-get install python3-torch`) with its own Python, /usr/bin/python3
(3.11). The script uses `torch.distributed.fsdp.flat_param.FlatParamHandle`
directly on `torch.device("cpu")` in one process, with a stand-in process
group that only answers rank() and size(); no distributed backend is started.
It refuses other torch versions because it reads 1.13's private shard
metadata (`_shard_param_offsets`, `_shard_indices`, `_shard_numel_padded`),
which PyTorch 2.x replaced by `_shard_param_infos`.

Python 3.11 cannot import torch 1.13's `torch.distributed.fsdp`: the dataclass
`ShardedTensorMetadata` uses a `TensorProperties()` instance as a field
default, which 3.11 rejects ("mutable default ... use default_factory"). An
import hook below loads that one module with the default changed to
`default_factory=TensorProperties`, the fix PyTorch itself made later. Nothing
on disk is modified.

The output is deterministic: running the script twice gives identical bytes.

Every model's parameter values are (-1)^k * (k + 1) / 4 for a running element
counter k, so every element of a model is distinct and exactly representable in
all four dtypes (the script checks this), and a shard's bytes identify which
elements it holds.

What is recorded is what torch computes; where torch 1.13 does not expose a
value that the 2.x reference (/work/shared/reference/flat_param.py) defines,
the value is derived from torch's own outputs by the 2.x formula, and the
field's name in the schema (see SCHEMA below, also written into the JSON)
says so. Where torch 1.13 behaves differently from the 2.x reference, the
JSON's "divergences_from_2x" says how; the C++ test follows the 2.x reference.
"""

import argparse
import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

# --------------------------------------------------------------------------
# Importing torch.distributed.fsdp on Python 3.11 (see the module docstring).
# --------------------------------------------------------------------------
_METADATA_MODULE = "torch.distributed._shard.sharded_tensor.metadata"
_METADATA_PATH = os.path.join(
    os.path.dirname(torch.distributed.__file__),
    "_shard",
    "sharded_tensor",
    "metadata.py",
)
_MUTABLE_DEFAULT = "field(default=TensorProperties())"
_FIXED_DEFAULT = "field(default_factory=TensorProperties)"


class _TensorPropertiesDefaultFix(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads torch's sharded_tensor/metadata.py with the 3.11-safe default."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _METADATA_MODULE:
            return None
        return importlib.util.spec_from_file_location(
            fullname, _METADATA_PATH, loader=self
        )

    def create_module(self, spec):
        return None  # The default module object.

    def exec_module(self, module):
        with open(_METADATA_PATH, encoding="utf-8") as f:
            source = f.read()
        if source.count(_MUTABLE_DEFAULT) != 1:
            raise RuntimeError(
                f"{_METADATA_PATH}: expected one '{_MUTABLE_DEFAULT}'; this "
                "script is written for torch 1.13"
            )
        source = source.replace(_MUTABLE_DEFAULT, _FIXED_DEFAULT)
        exec(compile(source, _METADATA_PATH, "exec"), module.__dict__)


def _import_flat_param():
    if sys.version_info >= (3, 11):
        sys.meta_path.insert(0, _TensorPropertiesDefaultFix())
    from torch.distributed.fsdp import flat_param  # pylint: disable=g-import-not-at-top

    return flat_param


if not torch.__version__.startswith("1.13"):
    sys.exit(
        f"gen_layout_golden.py needs torch 1.13 (found {torch.__version__}): "
        "it reads 1.13's private shard metadata attributes"
    )
fp = _import_flat_param()

WORLD_SIZES = range(1, 9)
STRATEGIES = ("FULL_SHARD", "NO_SHARD")

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

SCHEMA = """\
Top level: format, generator, torch_version, python_version, schema (this
text), divergences_from_2x (list of {what, torch_1_13, reference_2x,
evidence}), models, cases, rejected_models.

models[]: name, description, dtype, and
  params: flatparam::ParamSpec list in torch's traversal order
    (module.named_modules() pre-order, then named_parameters(recurse=False)):
    {fqn, shape, dtype, requires_grad, tied_to ("" or the primary's fqn)}.
  param_data_hex: {fqn: hex of the parameter's raw little-endian bytes} for
    every non-tied parameter.
  layout (identical for every world size and strategy; the generator checks):
    param_infos[]: {fqn (flat_param._prefixed_param_names), module_name,
      param_name (ParamInfo), shape (_shapes), numel (_numels), requires_grad
      (the original parameter's)}.
    shared_param_infos[]: {fqn, module_name, param_name, prim_fqn,
      prim_module_name, prim_param_name} (SharedParamInfo; fqn = module_name
      + "." + param_name, or param_name at the root).
    flat_param_offsets: handle._get_flat_param_offsets(), [start, end]
      inclusive per parameter.
    unpadded_unsharded_numel: flat_param._unpadded_unsharded_size.
    requires_grad: flat_param.requires_grad.
    flat_hex: the unsharded flat parameter's bytes before shard().

cases[]: name ("<model>/<strategy>/world_size=<W>"), model, strategy
  (FULL_SHARD | NO_SHARD), world_size,
  metadata_source: how the shard metadata was produced: "shard()" (FULL_SHARD)
    or "_init_shard_metadata(numel, 0, 0)" (NO_SHARD: 1.13's shard() returns
    early; 2.x's shard() makes the equivalent _init_shard_metadata(0, 0,
    numel - 1) call).
  sharded_numel: every rank's flat_param.numel() after shard() (equal on all
    ranks; the unsharded numel for NO_SHARD).
  padded_unsharded_numel: the sum of all ranks' shard numels (the all-gather
    output) for FULL_SHARD; the unsharded numel for NO_SHARD.
  ranks[]: one per rank:
    rank;
    shard_start, shard_end: the inclusive interval torch passed to
      _get_shard_metadata (captured, not recomputed);
    numel_padded: flat_param._shard_numel_padded;
    unpadded_shard: FULL_SHARD only (null for NO_SHARD):
      FlatParamHandle._get_unpadded_shard(flat, rank, W) as {numel (of the
      chunk), numel_to_pad, begin (the chunk's storage offset in the flat
      parameter, or null when the chunk is empty, which torch returns as a
      fresh empty tensor)};
    shard_param_offsets, shard_indices: 1.13's raw _shard_param_offsets and
      _shard_indices;
    shard_param_infos[] (one per param_infos entry; 2.x's _ShardParamInfo
      derived from the two raw values above): null when not in_shard, else
      [offset_in_shard, numel_in_shard, intra_param_start_idx,
      intra_param_end_idx]. Parameter i is in_shard when the offsets are
      non-empty and shard_indices[0] <= i <= shard_indices[1]; its
      intra_param_start_idx and intra_param_end_idx are its offsets entry;
      numel_in_shard = end - start + 1; offset_in_shard =
      flat_param_offsets[i][0] + intra_param_start_idx - shard_start. The
      generator checks each against the shard's bytes.
    shard_metadata: handle.shard_metadata() as {param_names, param_shapes,
      param_numels, param_offsets}, raw (see divergences_from_2x for ranks
      holding no parameter element).
    shard_hex: the rank's padded shard (flat_param after shard()) as hex of
      its raw little-endian bytes.

rejected_models[]: models the 2.x reference rejects but torch 1.13 accepts:
  name, params (ParamSpec), and torch_1_13 (what 1.13 produced).
"""


class _FakeProcessGroup:
    """What FlatParamHandle.shard() asks of a process group in torch 1.13."""

    def __init__(self, rank: int, world_size: int):
        self._rank = rank
        self._world_size = world_size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world_size


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
# A model is a list of (fqn, shape) for new parameters and (fqn, "=primary")
# for a parameter registered as the same nn.Parameter object as `primary`.
# Registration order is the list order; torch's traversal order (what FSDP
# flattens by) can differ, and the JSON records the traversal order.
MODELS: List[Dict[str, Any]] = [
    {
        "name": "linear_stack_f32",
        "description": "two linear layers with odd (prime) sizes",
        "dtype": "float32",
        "params": [
            ("l0.weight", (7, 5)),
            ("l0.bias", (7,)),
            ("l1.weight", (3, 7)),
            ("l1.bias", (3,)),
        ],
    },
    {
        "name": "tied_embedding_f32",
        "description": (
            "an embedding tied to the output head, a block weight shared by "
            "two blocks, and a 0-d scale registered on the root after its "
            "children (traversal puts it first)"
        ),
        "dtype": "float32",
        "params": [
            ("embed.weight", (11, 3)),
            ("blocks.0.weight", (5, 3)),
            ("blocks.0.bias", (5,)),
            ("blocks.1.weight", "=blocks.0.weight"),
            ("blocks.1.bias", (5,)),
            ("head.weight", "=embed.weight"),
            ("head.bias", (11,)),
            ("scale", ()),
        ],
    },
    {
        "name": "scalars_f64",
        "description": "mostly 0-d scalars; 6 elements, so ranks hold only "
        "padding for several world sizes",
        "dtype": "float64",
        "params": [
            ("a", ()),
            ("sub.b", ()),
            ("sub.c", (2,)),
            ("sub.deeper.d", ()),
            ("e", ()),
        ],
    },
    {
        "name": "big_weight_f16",
        "description": "a 13x17 weight larger than any shard for world size "
        ">= 2, then a bias and a 0-d gate",
        "dtype": "float16",
        "params": [
            ("proj.weight", (13, 17)),
            ("proj.bias", (13,)),
            ("proj.gate", ()),
        ],
    },
    {
        "name": "primes_bf16",
        "description": "prime-sized parameters in bfloat16",
        "dtype": "bfloat16",
        "params": [
            ("a", (2, 3)),
            ("b.x", (5,)),
            ("b.y", (7,)),
            ("c.z", (11,)),
            ("c.w", (13, 1)),
            ("d", (17,)),
        ],
    },
    {
        "name": "single_scalar_bf16",
        "description": "one 0-d parameter: every rank but 0 holds only padding",
        "dtype": "bfloat16",
        "params": [("w", ())],
    },
    {
        "name": "tiny_tied_f16",
        "description": "3 elements (fewer than ranks) with a tied alias",
        "dtype": "float16",
        "params": [
            ("v", (3,)),
            ("alias.v", "=v"),
        ],
    },
    {
        "name": "zero_dims_f32",
        "description": (
            "zero-size-dim parameters first, in the middle and last, around "
            "7 elements"
        ),
        "dtype": "float32",
        "params": [
            ("empty0", (0,)),
            ("a", (3,)),
            ("mid.z", (2, 0)),
            ("mid.b", (4,)),
            ("tail", (0, 5)),
        ],
    },
    {
        "name": "zero_dims_boundaries_f64",
        "description": (
            "zero-size-dim parameters at offsets 2, 4 and 6 of 6 elements, on "
            "shard boundaries for world sizes 2 and 3"
        ),
        "dtype": "float64",
        "params": [
            ("p0", (2,)),
            ("z0", (0, 3)),
            ("p1", (2,)),
            ("z1", (0,)),
            ("p2", (1, 2)),
            ("z2", (4, 0)),
        ],
    },
    {
        "name": "frozen_f64",
        "description": "requires_grad=False everywhere",
        "dtype": "float64",
        "requires_grad": False,
        "params": [
            ("w", (4, 4)),
            ("b", (4,)),
        ],
    },
    {
        "name": "nested_f32",
        "description": (
            "a deeper module tree, parameters at several depths registered "
            "in an order that differs from traversal order, a tie across depths"
        ),
        "dtype": "float32",
        "params": [
            ("enc.layer.w", (3, 3)),
            ("enc.bias", (2,)),
            ("enc.layer.inner.k", (5,)),
            ("dec.k", "=enc.layer.inner.k"),
            ("dec.out", (1, 1, 3)),
            ("root_param", (2, 1)),
        ],
    },
]

# The 2.x reference rejects a flat parameter with no elements (its
# `_init_shard_metadata` asserts start <= end); torch 1.13 accepts it.
REJECTED_MODELS: List[Dict[str, Any]] = [
    {
        "name": "all_zero_numel_f32",
        "description": "every parameter has a zero-size dimension",
        "dtype": "float32",
        "params": [("a", (0,)), ("b.c", (0, 3))],
    },
]


def _value(k: int) -> float:
    return (-1.0) ** k * (k + 1) / 4.0


def _submodule(root: nn.Module, path: List[str]) -> nn.Module:
    m = root
    for name in path:
        if not hasattr(m, name):
            m.add_module(name, nn.Module())
        m = getattr(m, name)
    return m


def build_model(model: Dict[str, Any]) -> nn.Module:
    """A fresh nn.Module with the model's parameters and deterministic values."""
    dtype = DTYPES[model["dtype"]]
    requires_grad = model.get("requires_grad", True)
    root = nn.Module()
    by_fqn: Dict[str, nn.Parameter] = {}
    k = 0
    for fqn, shape in model["params"]:
        *path, name = fqn.split(".")
        owner = _submodule(root, path)
        if isinstance(shape, str):
            param = by_fqn[shape[1:]]
        else:
            numel = 1
            for d in shape:
                numel *= d
            values = [_value(k + i) for i in range(numel)]
            k += numel
            data = torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)
            # Exactly representable: the round trip gives the same values.
            assert data.to(torch.float64).reshape(-1).tolist() == values, fqn
            param = nn.Parameter(data, requires_grad=requires_grad)
        owner.register_parameter(name, param)
        by_fqn[fqn] = param
    return root


def traversal(root: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(fqn, parameter) in FlatParamHandle's order, shared ones included."""
    out = []
    for module_name, module in root.named_modules():
        for name, param in module.named_parameters(recurse=False):
            out.append((f"{module_name}.{name}" if module_name else name, param))
    return out


def param_specs(model: Dict[str, Any], root: nn.Module) -> List[Dict[str, Any]]:
    specs = []
    first_fqn: Dict[int, str] = {}
    for fqn, param in traversal(root):
        tied_to = first_fqn.get(id(param), "")
        first_fqn.setdefault(id(param), fqn)
        specs.append(
            {
                "fqn": fqn,
                "shape": list(param.shape),
                "dtype": model["dtype"],
                "requires_grad": param.requires_grad,
                "tied_to": tied_to,
            }
        )
    return specs


def to_hex(t: torch.Tensor) -> str:
    """Raw little-endian bytes of a tensor (any dtype, bfloat16 included)."""
    # A copy, so that nothing keeps a reference into the handle's storage,
    # which shard() frees.
    t = t.detach().clone().reshape(-1)
    assert sys.byteorder == "little"
    if t.numel() == 0:
        return ""
    return bytes(t.view(torch.uint8).tolist()).hex()


def join_fqn(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def make_handle(model: Dict[str, Any], strategy: str):
    """A FlatParamHandle over a fresh model, and each parameter's original
    requires_grad by fqn (the handle replaces the modules' parameters)."""
    root = build_model(model)
    requires_grad = {fqn: p.requires_grad for fqn, p in traversal(root)}
    config = fp.HandleConfig(
        sharding_strategy=fp.HandleShardingStrategy[strategy],
        offload_params=False,
        param_dtype=None,
        reduce_dtype=None,
    )
    handle = fp.FlatParamHandle(
        list(root.parameters()), root, torch.device("cpu"), config
    )
    return handle, requires_grad


def layout_record(handle, requires_grad: Dict[str, bool]) -> Dict[str, Any]:
    flat = handle.flat_param
    return {
        "param_infos": [
            {
                "fqn": fqn,
                "module_name": info.module_name,
                "param_name": info.param_name,
                "shape": list(shape),
                "numel": numel,
                "requires_grad": requires_grad[fqn],
            }
            for fqn, info, shape, numel in zip(
                flat._prefixed_param_names,
                flat._param_infos,
                flat._shapes,
                flat._numels,
            )
        ],
        "shared_param_infos": [
            {
                "fqn": join_fqn(s.module_name, s.param_name),
                "module_name": s.module_name,
                "param_name": s.param_name,
                "prim_fqn": join_fqn(s.prim_module_name, s.prim_param_name),
                "prim_module_name": s.prim_module_name,
                "prim_param_name": s.prim_param_name,
            }
            for s in flat._shared_param_infos
        ],
        "flat_param_offsets": [list(o) for o in handle._get_flat_param_offsets()],
        "unpadded_unsharded_numel": flat._unpadded_unsharded_size.numel(),
        "requires_grad": flat.requires_grad,
        "flat_hex": to_hex(flat),
    }


def derive_shard_param_infos(
    layout: Dict[str, Any],
    offsets: Tuple[Tuple[int, int], ...],
    indices: Tuple[int, int],
    shard_start: int,
) -> List[Optional[List[int]]]:
    """2.x's _ShardParamInfo from 1.13's _shard_param_offsets/_shard_indices."""
    infos: List[Optional[List[int]]] = []
    for i, (param_start, _) in enumerate(layout["flat_param_offsets"]):
        if offsets and indices[0] <= i <= indices[1]:
            start_idx, end_idx = offsets[i - indices[0]]
            infos.append(
                [
                    param_start + start_idx - shard_start,  # offset_in_shard
                    end_idx - start_idx + 1,  # numel_in_shard
                    start_idx,  # intra_param_start_idx
                    end_idx,  # intra_param_end_idx (inclusive)
                ]
            )
        else:
            infos.append(None)  # in_shard is False
    return infos


def check_against_data(
    case_name: str,
    layout: Dict[str, Any],
    infos: List[Optional[List[int]]],
    flat_unsharded: torch.Tensor,
    shard: torch.Tensor,
) -> None:
    """Every derived shard info must point at the parameter's own elements."""
    for i, (info, (p_start, p_end)) in enumerate(
        zip(infos, layout["flat_param_offsets"])
    ):
        if info is None:
            continue
        offset_in_shard, n, start_idx, end_idx = info
        assert n >= 0, (case_name, i, info)
        if n == 0:
            assert p_end == p_start - 1, (case_name, i, info)
            continue
        got = shard[offset_in_shard : offset_in_shard + n]
        want = flat_unsharded[p_start : p_end + 1][start_idx : end_idx + 1]
        assert torch.equal(got, want), (case_name, i, info)


def run_case(
    model: Dict[str, Any], strategy: str, world_size: int, layout: Dict[str, Any]
) -> Dict[str, Any]:
    case_name = f"{model['name']}/{strategy}/world_size={world_size}"
    ranks = []
    for rank in range(world_size):
        handle, requires_grad = make_handle(model, strategy)
        rec = layout_record(handle, requires_grad)
        assert rec == layout, f"{case_name} rank {rank}: layout differs"
        flat_unsharded = handle.flat_param.detach().clone()

        captured: List[Tuple[int, int]] = []
        original = handle._get_shard_metadata

        def capture(start, end, original=original, captured=captured):
            captured.append((start, end))
            return original(start, end)

        handle._get_shard_metadata = capture
        unpadded = None
        if strategy == "NO_SHARD":
            handle.shard(_FakeProcessGroup(rank, world_size))  # A no-op in 1.13.
            assert not hasattr(handle.flat_param, "_shard_param_offsets")
            numel = handle.flat_param.numel()
            handle._init_shard_metadata(numel, 0, 0)
            source = "_init_shard_metadata(numel, 0, 0)"
        else:
            chunk, numel_to_pad = fp.FlatParamHandle._get_unpadded_shard(
                flat_unsharded, rank, world_size
            )
            unpadded = {
                "begin": chunk.storage_offset() if chunk.numel() > 0 else None,
                "numel": chunk.numel(),
                "numel_to_pad": numel_to_pad,
            }
            handle.shard(_FakeProcessGroup(rank, world_size))
            source = "shard()"
        del handle._get_shard_metadata  # Breaks the handle -> capture cycle.
        assert len(captured) == 1, case_name
        shard_start, shard_end = captured[0]
        flat = handle.flat_param
        offsets = flat._shard_param_offsets
        indices = flat._shard_indices
        infos = derive_shard_param_infos(layout, offsets, indices, shard_start)
        check_against_data(case_name, layout, infos, flat_unsharded, flat.detach())
        md = handle.shard_metadata()
        ranks.append(
            {
                "rank": rank,
                "shard_start": shard_start,
                "shard_end": shard_end,
                "numel_padded": flat._shard_numel_padded,
                "unpadded_shard": unpadded,
                "shard_param_offsets": [list(o) for o in offsets],
                "shard_indices": list(indices),
                "shard_param_infos": infos,
                "shard_metadata": {
                    "param_names": list(md.param_names),
                    "param_shapes": [list(s) for s in md.param_shapes],
                    "param_numels": list(md.param_numels),
                    "param_offsets": [list(o) for o in md.param_offsets],
                },
                "shard_numel": flat.numel(),
                "shard_hex": to_hex(flat),
                "_source": source,
            }
        )
    sources = {r.pop("_source") for r in ranks}
    numels = {r.pop("shard_numel") for r in ranks}
    assert len(sources) == 1 and len(numels) == 1, case_name
    sharded_numel = numels.pop()
    return {
        "name": case_name,
        "model": model["name"],
        "strategy": strategy,
        "world_size": world_size,
        "metadata_source": sources.pop(),
        "sharded_numel": sharded_numel,
        "padded_unsharded_numel": (
            sharded_numel * world_size
            if strategy == "FULL_SHARD"
            else layout["unpadded_unsharded_numel"]
        ),
        "ranks": ranks,
    }


def run_rejected(model: Dict[str, Any]) -> Dict[str, Any]:
    """What torch 1.13 does with a model the 2.x reference rejects."""
    root = build_model(model)
    outcome = {}
    for strategy in STRATEGIES:
        per_rank = []
        for rank in range(2):
            handle, _ = make_handle(model, strategy)
            if strategy == "NO_SHARD":
                handle._init_shard_metadata(handle.flat_param.numel(), 0, 0)
            else:
                handle.shard(_FakeProcessGroup(rank, 2))
            md = handle.shard_metadata()
            per_rank.append(
                {
                    "rank": rank,
                    "shard_numel": handle.flat_param.numel(),
                    "numel_padded": handle.flat_param._shard_numel_padded,
                    "shard_param_offsets": [
                        list(o) for o in handle.flat_param._shard_param_offsets
                    ],
                    "shard_metadata_param_names": list(md.param_names),
                }
            )
        outcome[f"{strategy}/world_size=2"] = per_rank
    return {
        "name": model["name"],
        "description": model["description"],
        "params": param_specs(model, root),
        "torch_1_13": outcome,
    }


DIVERGENCES = [
    {
        "what": "shard_metadata() on a rank whose shard holds no parameter "
        "element (only sharding padding)",
        "torch_1_13": "_shard_indices is (0, 0) and _shard_param_offsets is "
        "empty, and shard_metadata() slices names/shapes/numels with "
        "[0:1], so it returns the FIRST parameter's name, shape and numel "
        "with an empty param_offsets",
        "reference_2x": "shard_metadata() lists only parameters with "
        "in_shard=True, so all four tuples are empty",
        "evidence": "cases[*].ranks[*] with empty shard_param_offsets, e.g. "
        "single_scalar_bf16/FULL_SHARD/world_size=2 rank 1",
    },
    {
        "what": "a flat parameter with no elements (every parameter has a "
        "zero-size dimension)",
        "torch_1_13": "accepted: FULL_SHARD gives 0-element shards with "
        "numel_padded 0 and no parameter in any shard; NO_SHARD keeps the "
        "empty flat parameter",
        "reference_2x": "_init_shard_metadata asserts unsharded_start_idx <= "
        "unsharded_end_idx, which start 0 / end -1 fails, for every strategy",
        "evidence": "rejected_models",
    },
    {
        "what": "shard metadata under NO_SHARD",
        "torch_1_13": "shard() returns before setting any shard metadata",
        "reference_2x": "shard() calls _init_shard_metadata(0, 0, numel - 1)",
        "evidence": "NO_SHARD cases: metadata_source",
    },
    {
        "what": "alignment padding (use_orig_params=True) and mixed "
        "requires_grad",
        "torch_1_13": "FlatParamHandle has neither: no alignment padding, "
        "and it raises ValueError unless requires_grad is uniform",
        "reference_2x": "aligns when use_orig_params=True; mixed "
        "requires_grad allowed with use_orig_params=True",
        "evidence": "not covered by this data: every case uses "
        "align_addresses=false and uniform requires_grad",
    },
]


def compact(obj: Any, indent: int = 0, width: int = 100) -> str:
    """JSON with short values on one line, so diffs of the file stay readable."""
    flat = json.dumps(obj, separators=(", ", ": "))
    if len(flat) + indent <= width or not isinstance(obj, (dict, list)) or not obj:
        return flat
    pad = " " * (indent + 1)
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return flat
        items = [pad + compact(v, indent + 1, width) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    items = [
        pad + json.dumps(k) + ": " + compact(v, indent + 1, width) for k, v in obj.items()
    ]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="verify/testdata/pytorch_layouts.json")
    args = parser.parse_args()

    models_out = []
    cases = []
    for model in MODELS:
        handle, requires_grad = make_handle(model, "FULL_SHARD")
        layout = layout_record(handle, requires_grad)
        fresh = build_model(model)
        models_out.append(
            {
                "name": model["name"],
                "description": model["description"],
                "dtype": model["dtype"],
                "params": param_specs(model, fresh),
                "param_data_hex": {
                    fqn: to_hex(p)
                    for fqn, p in traversal(fresh)
                    if fqn in layout_fqns(layout)
                },
                "layout": layout,
            }
        )
        for strategy in STRATEGIES:
            for world_size in WORLD_SIZES:
                cases.append(run_case(model, strategy, world_size, layout))

    out = {
        "format": "flatparam.pytorch_layouts.v1",
        "generator": "tools/pytorch/gen_layout_golden.py",
        "torch_version": torch.__version__,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "schema": SCHEMA.splitlines(),
        "divergences_from_2x": DIVERGENCES,
        "models": models_out,
        "cases": cases,
        "rejected_models": [run_rejected(m) for m in REJECTED_MODELS],
    }
    text = compact(out) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}: {len(models_out)} models, {len(cases)} cases, "
          f"{len(text)} bytes")


def layout_fqns(layout: Dict[str, Any]) -> set:
    return {p["fqn"] for p in layout["param_infos"]}


if __name__ == "__main__":
    main()
