"""The demo GPT trained with FSDP2 (fully_shard) and offload_adam.AdamW.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py                 # CPU, gloo
    torchrun --nproc-per-node 8 examples/train_fsdp2.py --cpu-offload   # GPUs, NCCL, CPUOffloadPolicy
    torchrun --nproc-per-node 8 examples/train_fsdp2.py                 # GPUs, shards on the GPU

The same script runs multi-node (torchrun's --nnodes/--rdzv-endpoint). Each rank holds its shard
of every parameter; FSDP2 all-gathers them for forward and backward and reduce-scatters the
gradients; the optimizer steps each rank's local shard in place with the Rust kernel. With
--cpu-offload (CPUOffloadPolicy) the shards and their gradients live in pinned host
memory, which is what makes a large model fit on few GPUs, and the CPU step is ours. On GPUs
without --cpu-offload the shards stay on the GPU, and the optimizer streams each rank's
gradient shard to the host during backward and the updated shard back (its state in host
memory, as for any offloaded parameter).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, VOCAB, make_corpus, param_groups  # noqa: E402

import offload_adam  # noqa: E402


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks")
    ap.add_argument("--ctx", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--d-model", type=int, default=128, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    ap.add_argument("--cpu-offload", action="store_true", help="FSDP2's CPUOffloadPolicy (GPUs)")
    ap.add_argument("--bf16-moments", action="store_true", help="state_dtype=torch.bfloat16")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    data = make_corpus(20_000, 0).to(dev)
    model = GPT(len(VOCAB), args.ctx, args.d_model, args.layers, args.heads).to(dev)
    kw = {"offload_policy": CPUOffloadPolicy()} if args.cpu_offload else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = offload_adam.AdamW(
        param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95),
        state_dtype=torch.bfloat16 if args.bf16_moments else torch.float32,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    g = torch.Generator(device=dev).manual_seed(1)
    per_rank = args.batch // world
    times, losses = [], []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g, device=dev)
        starts = starts[rank * per_rank : (rank + 1) * per_rank].tolist()
        x = torch.stack([data[s : s + args.ctx] for s in starts])
        y = torch.stack([data[s + 1 : s + args.ctx + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.clip_grad_norm_(1.0)  # the total norm over every rank's shards
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
        sched.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(float(avg) / world)
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"FSDP2 over {world} ranks ({'NCCL' if cuda else 'gloo'}{', CPUOffloadPolicy' if args.cpu_offload else ''}), "
            f"{n / 1e6:.2f}M parameters: loss {losses[0]:.3f} -> {statistics.mean(losses[-10:]):.4f}; "
            f"optimizer step on the local shards, median {statistics.median(times) * 1e3:.2f} ms"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
