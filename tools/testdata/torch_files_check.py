"""Python PyTorch's side of torch_files_python_test.sh: an independent party
(Debian's python3-torch) for flatparam's torch.save files.

  torch_files_check.py write DIR   writes, under DIR/py: pytorch_model.bin
                                   (a net with a tied weight and BatchNorm
                                   buffers),
                                   optimizer.pt (AdamW after 3 steps),
                                   model.json (flatparam's model file),
                                   sharded/ (the same state dict split by
                                   hand into two files plus
                                   pytorch_model.bin.index.json)
  torch_files_check.py write_dcp DIR W PORT SHIM_DIR   saves the same
                                   net and AdamW state as a Distributed
                                   Checkpoint in DIR/dcp_wW with PyTorch
                                   1.13's own writer on W gloo ranks, each
                                   tensor a ShardedTensor chunked on dim 0
                                   as FSDP's SHARDED_STATE_DICT chunks it
                                   (0-d tensors replicated), keys flattened
                                   as DCP 2.x flattens {"model": ...,
                                   "optim": ...}: model.<fqn>,
                                   optim.state.<fqn>.<name>,
                                   optim.param_groups (a bytes item naming
                                   parameters by FQN). SHIM_DIR holds
                                   dcp_shim.py (torch 1.13's DCP on Python
                                   3.11).
  torch_files_check.py check_dcp DIR OUT SHIM_DIR [2]  loads the DCP export
                                   DIR/OUT with PyTorch 1.13's
                                   load_state_dict into a state dict of the
                                   same flattened keys and checks every
                                   tensor and the param groups equal DIR/py's
                                   bit for bit; the weights load into a Net
                                   with load_state_dict(strict=True).
  torch_files_check.py check DIR OUT...  loads each export DIR/OUT with
                                   torch.load(weights_only=True) and checks
                                   it equals DIR/py's files bit for bit; the
                                   optimizer state loads into a fresh AdamW.
"""
import json
import os
import pickletools
import sys
import zipfile

import torch


def fail(msg):
    print("MISMATCH:", msg)
    sys.exit(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.ln = torch.nn.LayerNorm(6)
        self.fc = torch.nn.Linear(6, 5)
        # Buffers: running statistics and an int64 batch count, which a
        # strict load_state_dict needs back.
        self.bn = torch.nn.BatchNorm1d(5)
        self.head = torch.nn.Linear(5, 3, bias=False)
        # Tied to the embedding, as GPT-2's lm_head is: state_dict() holds
        # both names over one storage; parameters() holds it once.
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        h = self.ln(self.emb(x))
        y = self.bn(self.fc(h).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.relu(y)), self.out(h)


# Tied name -> the name it is tied to.
TIES = {"out.weight": "emb.weight"}


def trained():
    torch.manual_seed(1234)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randint(0, 11, (4, 7))
        a, b = net(x)
        loss = a.square().mean() + b.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, opt


def write(root):
    py = os.path.join(root, "py")
    os.makedirs(os.path.join(py, "sharded"))
    net, opt = trained()
    sd = net.state_dict()
    torch.save(sd, os.path.join(py, "pytorch_model.bin"))
    torch.save(opt.state_dict(), os.path.join(py, "optimizer.pt"))
    params, first = [], {}
    for prefix, module in net.named_modules():
        for pname, p in module._parameters.items():
            if p is None:  # bias=False
                continue
            fqn = f"{prefix}.{pname}" if prefix else pname
            if id(p) in first:
                params.append({"fqn": fqn, "tied_to": first[id(p)]})
            else:
                first[id(p)] = fqn
                params.append({"fqn": fqn, "shape": list(p.shape),
                               "dtype": "float32"})
    if [q.get("tied_to") for q in params if "tied_to" in q] != \
            list(TIES.values()):
        fail(f"unexpected ties in {params}")
    buffers = [{"fqn": n, "shape": list(b.shape),
                "dtype": str(b.dtype).replace("torch.", "")}
               for n, b in net.named_buffers()]
    if [b["fqn"] for b in buffers] != ["bn.running_mean", "bn.running_var",
                                       "bn.num_batches_tracked"]:
        fail(f"unexpected buffers {buffers}")
    spec = {"name": "net", "wrap": ["fc"], "params": params,
            "buffers": buffers}
    with open(os.path.join(py, "model.json"), "w") as f:
        json.dump(spec, f)
    names = list(sd)
    parts = [names[:2], names[2:]]
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: sd[n] for n in part},
                   os.path.join(py, "sharded", fname))
        for n in part:
            weight_map[n] = fname
            total += sd[n].numel() * sd[n].element_size()
    with open(os.path.join(py, "sharded", "pytorch_model.bin.index.json"),
              "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": weight_map}, f)


def _sharded(t, rank, world):
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    if t.dim() == 0:
        return t
    chunks = torch.chunk(t, world, dim=0)
    offset = sum(c.shape[0] for c in chunks[:rank])
    shards = []
    if rank < len(chunks):
        shards = [Shard.from_tensor_and_offsets(
            chunks[rank].clone(), [offset] + [0] * (t.dim() - 1), rank)]
    return ShardedTensor._init_from_local_shards(shards, *t.shape)


def _import_dcp(shim_dir):
    sys.path.insert(0, shim_dir)
    import dcp_shim  # noqa: F401  (before torch.distributed._shard)
    import torch.distributed._shard.checkpoint as dcp
    return dcp


def _save_dcp(rank, world, out, port, shim_dir):
    import torch.distributed as dist
    dcp = _import_dcp(shim_dir)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    net, opt = trained()
    names = [n for n, _ in net.named_parameters()]
    sd = {f"model.{n}": _sharded(t, rank, world)
          for n, t in net.state_dict().items()}
    osd = opt.state_dict()
    for i, state in osd["state"].items():
        for k, v in state.items():
            sd[f"optim.state.{names[i]}.{k}"] = _sharded(v, rank, world)
    sd["optim.param_groups"] = [
        dict(g, params=[names[i] for i in g["params"]])
        for g in osd["param_groups"]]
    dcp.save_state_dict(sd, dcp.FileSystemWriter(out))
    dist.barrier()
    dist.destroy_process_group()


def write_dcp(root, world, port, shim_dir):
    import torch.multiprocessing as mp
    out = os.path.join(root, f"dcp_w{world}")
    mp.spawn(_save_dcp, args=(world, out, port, shim_dir), nprocs=world)


def check_dcp(root, out, shim_dir, alias_2x=False):
    dcp = _import_dcp(shim_dir)
    if alias_2x:
        # A PyTorch 2.x-layout export read by 1.13: 2.x's module paths
        # resolve to 1.13's classes of the same fields (the extra
        # storage_meta and version become attributes; planner_data is not
        # used by the load). This checks the pickle and the layout, not 2.x's
        # own classes.
        import torch.distributed._shard.checkpoint.filesystem as fs113
        import torch.distributed._shard.checkpoint.metadata as md113
        sys.modules["torch.distributed.checkpoint.metadata"] = md113
        sys.modules["torch.distributed.checkpoint.filesystem"] = fs113
    py = os.path.join(root, "py")
    want = torch.load(os.path.join(py, "pytorch_model.bin"))
    want_opt = torch.load(os.path.join(py, "optimizer.pt"))
    names = [n for n, _ in Net().named_parameters()]
    sd = {f"model.{n}": torch.full_like(t, 7) for n, t in want.items()}
    for i, state in want_opt["state"].items():
        for k, v in state.items():
            sd[f"optim.state.{names[i]}.{k}"] = torch.full_like(v, 7)
    sd["optim.param_groups"] = None
    dcp.load_state_dict(sd, dcp.FileSystemReader(os.path.join(root, out)),
                        no_dist=True)
    for n, t in want.items():
        same_tensor(t, sd[f"model.{n}"], f"{out}: model.{n}")
    for i, state in want_opt["state"].items():
        for k, v in state.items():
            key = f"optim.state.{names[i]}.{k}"
            same_tensor(v, sd[key], f"{out}: {key}")
    groups = [dict(g, params=[names[i] for i in g["params"]])
              for g in want_opt["param_groups"]]
    if sd["optim.param_groups"] != groups:
        fail(f"{out}: param_groups {sd['optim.param_groups']} != {groups}")
    net = Net()
    net.load_state_dict({n: sd[f"model.{n}"] for n in want}, strict=True)
    print(f"{out}: equal after PyTorch's DCP load ({len(sd)} keys)")


def same_tensor(a, b, where):
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or \
            a.shape != b.shape or not torch.equal(a, b):
        fail(f"{where}: {a!r} != {b!r}")


def load_weights(out):
    index = os.path.join(out, "pytorch_model.bin.index.json")
    if not os.path.exists(index):
        return torch.load(os.path.join(out, "pytorch_model.bin"),
                          weights_only=True)
    with open(index) as f:
        doc = json.load(f)
    sd = {}
    for fname in sorted(set(doc["weight_map"].values())):
        part = torch.load(os.path.join(out, fname), weights_only=True)
        for n in part:
            if doc["weight_map"][n] != fname:
                fail(f"{fname} holds {n}, the index says {doc['weight_map'][n]}")
        sd.update(part)
    # Each storage once (a tied name shares its target's).
    storages = {t.data_ptr(): t.numel() * t.element_size() for t in sd.values()}
    if sum(storages.values()) != doc["metadata"]["total_size"]:
        fail(f"{index}: total_size")
    return sd


ALLOWED_GLOBALS = {
    "collections OrderedDict", "torch._utils _rebuild_tensor_v2",
    "torch FloatStorage", "torch DoubleStorage", "torch HalfStorage",
    "torch BFloat16Storage", "torch LongStorage", "torch IntStorage",
    "torch ShortStorage", "torch CharStorage", "torch ByteStorage",
    "torch BoolStorage"}


def check_globals(path):
    with zipfile.ZipFile(path) as z:
        [pkl] = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data = z.read(pkl)
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "NEWOBJ",
                       "NEWOBJ_EX", "EXT1", "EXT2", "EXT4"):
            if op.name != "GLOBAL" or arg not in ALLOWED_GLOBALS:
                fail(f"{path}: pickle uses {op.name} {arg}")


def check(root, outs):
    py = os.path.join(root, "py")
    want = torch.load(os.path.join(py, "pytorch_model.bin"))
    want_opt = torch.load(os.path.join(py, "optimizer.pt"))
    names = [n for n, _ in Net().named_parameters()]
    for out in outs:
        out = os.path.join(root, out)
        for f in os.listdir(out):
            if f.endswith(".bin"):
                check_globals(os.path.join(out, f))
        got = load_weights(out)
        # Every name of state_dict(), a tied one over its target's storage,
        # as torch.save writes a state_dict(): strict loading takes it.
        if sorted(got) != sorted(want):
            fail(f"{out}: names {sorted(got)} != {sorted(want)}")
        for n in want:
            same_tensor(want[n], got[n], f"{out}: {n}")
        for n, target in TIES.items():
            if got[n].data_ptr() != got[target].data_ptr():
                fail(f"{out}: {n} does not share {target}'s storage")
        net = Net()
        net.load_state_dict(got, strict=True)
        same_tensor(want["bn.num_batches_tracked"], net.bn.num_batches_tracked,
                    f"{out}: loaded bn.num_batches_tracked")
        same_tensor(want["out.weight"], net.out.weight.detach(),
                    f"{out}: re-tied out.weight")
        opt_path = os.path.join(out, "optimizer.bin")
        # torch 1.13's weights_only unpickler has no BINFLOAT, so it cannot
        # read any optimizer state (not even Python's own): check the globals
        # by hand instead, then load.
        check_globals(opt_path)
        opt = torch.load(opt_path)
        named = isinstance(next(iter(opt["state"])), str)
        key = (lambda i: names[i]) if named else (lambda i: i)
        if sorted(opt["state"], key=str) != sorted(
                (key(i) for i in want_opt["state"]), key=str):
            fail(f"{opt_path}: state keys {list(opt['state'])}")
        for i, ps in want_opt["state"].items():
            gs = opt["state"][key(i)]
            if sorted(gs) != sorted(ps):
                fail(f"{opt_path}: state[{key(i)}] names {sorted(gs)}")
            for s, v in ps.items():
                same_tensor(v, gs[s], f"{opt_path}: state[{key(i)}][{s}]")
        if len(opt["param_groups"]) != len(want_opt["param_groups"]):
            fail(f"{opt_path}: param_groups")
        for g, wg in zip(opt["param_groups"], want_opt["param_groups"]):
            wg = dict(wg, params=[key(i) for i in wg["params"]])
            if g != wg:
                fail(f"{opt_path}: param group {g} != {wg}")
        if not named:
            # The exported state continues training as the original does.
            fresh = torch.optim.AdamW(net.parameters(), lr=1e-2)
            fresh.load_state_dict(opt)
            if fresh.state_dict()["param_groups"] != \
                    want_opt["param_groups"]:
                fail(f"{opt_path}: load_state_dict")
        print(f"{out}: equal ({len(got)} tensors, "
              f"{len(opt['state'])} optimizer states, "
              f"{'names' if named else 'IDs'})")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "check_dcp":
        check_dcp(sys.argv[2], sys.argv[3], sys.argv[4],
                  len(sys.argv) > 5 and sys.argv[5] == "2")
    elif sys.argv[1] == "write_dcp":
        write_dcp(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                  sys.argv[5])
    else:
        check(sys.argv[2], sys.argv[3:])
