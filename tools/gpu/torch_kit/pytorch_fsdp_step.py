#!/usr/bin/env python3
"""PyTorch's own FSDP on the GPT of refmodel/torch_gpt.h, timed as
torch_step_compare times flatparam's FsdpModule (benchmarks/torch_step_compare.cc),
so that run.sh's torch_bench step can report flatparam's step time as a
ratio of PyTorch's.

    python3 pytorch_fsdp_step.py --layers=12 --width=768 --heads=12 \
        --seq=512 --batch=8 --steps=20 --warmup=5

One rank on GPU 0 over NCCL: FullyShardedDataParallel (FULL_SHARD, each
block a unit by ModuleWrapPolicy, its default BACKWARD_PRE prefetch),
AdamW (lr 1e-4), the same model as refmodel's GPT (learned token and
position embeddings; per block a pre-norm causal self-attention with a
fused q/k/v Conv1D projection and an output projection, and a pre-norm
4x MLP with tanh GELU; a final layer norm; the head tied to the token
embedding), on one batch of random bytes. Each of `steps` timed steps
(after `warmup` untimed ones) is forward, backward, step and zero_grad,
timed on the host with the device synchronized at the step's end. Prints
one JSON object with the median step in ms. Exit status 1 with the error
on stderr.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time


def build_model(nn, torch, layers, width, heads, positions):
    class Conv1D(nn.Module):
        # GPT-2's Conv1D: weight [in, out], y = x @ weight + bias.
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(n_in, n_out).normal_(0, 0.02))
            self.bias = nn.Parameter(torch.zeros(n_out))

        def forward(self, x):
            shape = x.shape[:-1] + (self.weight.shape[1],)
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(width, 3 * width)
            self.c_proj = Conv1D(width, width)

        def forward(self, x):
            b, s, e = x.shape
            d = e // heads
            q, k, v = self.c_attn(x).split(e, dim=2)
            q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(d)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
            y = torch.softmax(scores, -1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, e))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = Conv1D(width, 4 * width)
            self.c_proj = Conv1D(4 * width, width)

        def forward(self, x):
            return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(width)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(width)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(256, width)
            self.wpe = nn.Embedding(positions, width)
            # GPT-2's (and refmodel's) initialization, not nn.Embedding's.
            nn.init.normal_(self.wte.weight, 0, 0.02)
            nn.init.normal_(self.wpe.weight, 0, 0.02)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, tokens):
            positions_ = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(positions_)
            for block in self.h:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.t()

    return Gpt(), Block


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        sys.exit("pytorch_fsdp_step: want --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 2")

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if not torch.cuda.is_available():
        sys.exit("pytorch_fsdp_step: PyTorch sees no GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(1)
        model, block = build_model(nn, torch, args.layers, args.width, args.heads, args.seq)
        fsdp = FullyShardedDataParallel(
            model.cuda(),
            auto_wrap_policy=ModuleWrapPolicy({block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=0,
        )
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
        torch.manual_seed(0)
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), device="cuda")
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        times = []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = fsdp(inputs)
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps({
            "pytorch": torch.__version__,
            "layers": args.layers, "width": args.width, "heads": args.heads,
            "seq": args.seq, "batch": args.batch, "steps": args.steps,
            "pytorch_fsdp_ms_median": statistics.median(times),
        }))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
