"""Main job: train a small GPT-style transformer with offload_adam.AdamW, next to torch's AdamW.

Both optimizers train the same model from the same initialization on the same batches, in the
same process, so the script can say whether the loss curves agree and how the optimizer step
times compare. The data is made here: sentences of sums ("17+5=22;") to learn by heart and by
rule, so nothing is downloaded.

With CUDA the model trains on the GPU and offload_adam offloads the optimizer (state in pinned
host memory, gradients streamed during backward, weights streamed back); the script then also
prints the GPU memory each optimizer needed and the offload's time breakdown.

With --offload-weights the model's weights are streamed too (offload_adam.offload_weights:
pinned host copy, blocks copied to the device in forward and again in backward, the optimizer's
step writing the host copy); the script prints the bytes each way per step, the streamer's device
peak and its stalls. Without CUDA that runs through the simulated device, and says so.

    python examples/train_gpt.py [--steps 250] [--device auto|cpu|cuda] [--async-step]
                                 [--plot breakdown.png] [--simulate] [--offload-weights [--prefetch 2]]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import offload_adam

VOCAB = "0123456789+=; "


def make_corpus(n_sentences: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 100, (n_sentences,), generator=g)
    b = torch.randint(0, 100, (n_sentences,), generator=g)
    text = "".join(f"{x}+{y}={x + y};" for x, y in zip(a.tolist(), b.tolist()))
    lut = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([lut[c] for c in text], dtype=torch.long)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(ctx, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def param_groups(model: torch.nn.Module, wd: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--ctx", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--d-model", type=int, default=128, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate (both optimizers)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads of our kernel and of torch")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--async-step", action="store_true", help="offload: let step() return at once")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the per-step time breakdown")
    ap.add_argument("--offload", default="cpu", choices=["cpu", "nvme"], help="where the optimizer state lives")
    ap.add_argument("--nvme-dir", help="--offload nvme: the directory (on an SSD) that holds the state")
    ap.add_argument("--host-budget-gb", type=float, default=0.0, help="--offload nvme: state kept in RAM")
    ap.add_argument(
        "--simulate", action="store_true",
        help="on the CPU, stream as to a GPU: through offload_adam.testing's simulated device (no delays)",
    )  # fmt: skip
    ap.add_argument(
        "--state-dtype", default="float32", choices=["float32", "bfloat16", "uint8", "float8_e4m3fn"],
        help="the moments' dtype: uint8 is 8-bit block-quantized (torchao's AdamW8bit), float8_e4m3fn fp8 blocks "
        "(torchao's AdamWFp8); compared with torch's fp32 run",
    )  # fmt: skip
    ap.add_argument(
        "--master-dtype", default="float32", choices=["float32", "bfloat16"],
        help="bfloat16: our model in bf16 without fp32 masters (Kahan compensation); torch's twin stays fp32",
    )  # fmt: skip
    ap.add_argument("--offload-weights", action="store_true", help="stream the weights too (offload_weights)")
    ap.add_argument("--prefetch", type=int, default=2, help="--offload-weights: blocks copied ahead")
    ap.add_argument(
        "--save", metavar="DIR", default="runs/sums",
        help="save the trained model there (model.safetensors and config.json): examples/generate.py --sums DIR answers sums with it",
    )  # fmt: skip
    args = ap.parse_args()
    if args.offload_weights and not args.simulate and not (args.device != "cpu" and torch.cuda.is_available()):
        print("--offload-weights without CUDA: streaming to the simulated device (figures are of this CPU, not a GPU)")
        args.simulate = True
    if args.simulate:
        from offload_adam import testing

        with testing.simulated_device(max_delay_s=0.0, host_memory=True, lazy=False, keep_open=True):
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu"))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    data = make_corpus(20_000, args.seed).to(dev)
    model = GPT(len(VOCAB), args.ctx, args.d_model, args.layers, args.heads)
    twin = copy.deepcopy(model).to(dev)
    if args.master_dtype == "bfloat16":
        model = model.to(torch.bfloat16)  # bf16 weights, no fp32 master: Kahan compensation
    streamed = None
    if args.offload_weights:
        # Before the optimizer: it then trains the host copies the streamer reads.
        streamed = offload_adam.offload_weights(model, device=dev if dev.type == "cuda" else None, prefetch=args.prefetch)
    else:
        model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {n_params / 1e6:.2f}M parameters in {n_tensors} tensors; "
        f"on {dev}; offload_adam SIMD path {offload_adam.simd_path()}, {args.threads} threads"
    )
    cuda = dev.type == "cuda"
    nvme = {"nvme_dir": args.nvme_dir, "host_budget_gb": args.host_budget_gb, "bucket_mb": 1} if args.offload == "nvme" else {}
    ours = offload_adam.AdamW(
        param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), num_threads=args.threads, async_step=args.async_step,
        offload=args.offload, state_dtype=getattr(torch, args.state_dtype), master_dtype=getattr(torch, args.master_dtype),
        **nvme,
    )  # fmt: skip
    ref = torch.optim.AdamW(param_groups(twin, 0.1), lr=args.lr, betas=(0.9, 0.95), fused=True)
    peak = {"offload_adam": 0, "torch": 0}
    breakdown: list[dict[str, float]] = []
    weights_steps: list[dict[str, float]] = []
    warmup = max(1, args.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_at) for o in (ours, ref)]

    g = torch.Generator(device=dev).manual_seed(args.seed + 1)
    losses: dict[str, list[float]] = {"offload_adam": [], "torch": []}
    step_times: dict[str, list[float]] = {"offload_adam": [], "torch": []}
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g, device=dev).tolist()
        x = torch.stack([data[s : s + args.ctx] for s in starts])
        y = torch.stack([data[s + 1 : s + args.ctx + 1] for s in starts])
        for name, m, opt, sched in (("offload_adam", model, ours, scheds[0]), ("torch", twin, ref, scheds[1])):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if streamed is not None and m is model:
                streamed.reset_stats()
            opt.zero_grad()
            if m is model and args.master_dtype == "bfloat16":
                # bf16 weights, computed in fp32 (this CPU's bf16 matmuls are slow); the
                # gradients reach the bf16 parameters in bf16.
                tensors = {k: v.float() for k, v in [*m.named_parameters(), *m.named_buffers()] if v.is_floating_point()}
                logits = torch.func.functional_call(m, tensors, (x,))
            else:
                logits = m(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"{name}.step"):
                opt.step()
            if cuda:
                torch.cuda.synchronize()
            step_times[name].append(time.perf_counter() - t0)
            sched.step()
            losses[name].append(loss.item())
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
        breakdown.append({**ours.last_step_stats, "step_s": step_times["offload_adam"][-1]})
        if streamed is not None:
            weights_steps.append(streamed.report())
        bar.set_postfix(loss=f"{losses['offload_adam'][-1]:.3f}", torch=f"{losses['torch'][-1]:.3f}")

    tail = max(1, args.steps // 10)
    final = {k: statistics.mean(v[-tail:]) for k, v in losses.items()}
    t_ours = statistics.median(step_times["offload_adam"]) * 1e3
    t_ref = statistics.median(step_times["torch"]) * 1e3
    print(
        f"\nloss: start {losses['offload_adam'][0]:.3f}, final (mean of last {tail} steps) "
        f"offload_adam {final['offload_adam']:.4f}, torch {final['torch']:.4f}"
    )
    print(
        f"optimizer step, median: offload_adam {t_ours:.2f} ms, torch.optim.AdamW(fused=True) {t_ref:.2f} ms "
        f"({t_ref / t_ours:.2f}x)"
    )
    if cuda:
        saved = peak["torch"] - peak["offload_adam"]
        print(
            f"peak GPU memory: offload_adam {peak['offload_adam'] / 2**20:.1f} MiB, torch {peak['torch'] / 2**20:.1f} MiB "
            f"(saved {saved / 2**20:.1f} MiB); optimizer host memory {ours.memory_report()['host_bytes'] / 2**20:.1f} MiB"
        )
    if breakdown and "d2h_wait_s" in breakdown[-1]:
        keys = ("d2h_wait_s", "cpu_step_s", "h2d_issue_s", "forward_wait_s")
        med = {k: statistics.median(b.get(k, 0.0) for b in breakdown) * 1e3 for k in keys}
        print("offload breakdown per step (median ms): " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in med.items()))
    if args.offload == "nvme":
        rep = ours.memory_report()
        med = {k: statistics.median(b.get(k, 0.0) for b in breakdown) for k in ("read_bytes", "write_bytes", "io_wait_s", "cpu_step_s")}
        print(
            f"NVMe tier ({offload_adam._native.io_backend()}): {rep['nvme_bytes'] / 2**20:.1f} MiB of state on disk, "
            f"window {rep['window_bytes'] / 2**20:.1f} MiB; per step (median): read {med['read_bytes'] / 2**20:.1f} MiB, "
            f"written {med['write_bytes'] / 2**20:.1f} MiB, kernel {med['cpu_step_s'] * 1e3:.2f} ms, "
            f"waited for I/O {med['io_wait_s'] * 1e3:.2f} ms"
        )
    if streamed is not None:
        ours.synchronize()
        rep = streamed.report()
        med = {k: statistics.median(float(r[k]) for r in weights_steps) for k in ("h2d_bytes", "stall_s", "on_demand_loads")}
        down = statistics.median(b.get("d2h_bytes", 0.0) for b in breakdown)
        up_opt = statistics.median(b.get("h2d_bytes", 0.0) for b in breakdown)
        where = "simulated device" if not cuda else str(dev)
        print(
            f"weights streamed ({where}, prefetch {args.prefetch}): {rep['streamed_blocks']} of {rep['blocks']} blocks, "
            f"{rep['streamed_bytes'] / 2**20:.2f} MiB; per step (median): up {med['h2d_bytes'] / 2**20:.2f} MiB of weights "
            f"({med['h2d_bytes'] / max(1, rep['streamed_bytes']):.2f}x the streamed bytes) + {up_opt / 2**20:.2f} MiB "
            f"copied back by the step, down {down / 2**20:.2f} MiB of gradients; streamer device peak "
            f"{rep['gpu_peak_bytes'] / 2**20:.2f} MiB (ring {rep['ring_bytes'] / 2**20:.2f} MiB, whole model "
            f"{rep['weights_bytes'] / 2**20:.2f} MiB); compute stalled for weights {med['stall_s'] * 1e3:.2f} ms, "
            f"{med['on_demand_loads']:.0f} loads not prefetched"
        )
    host_bytes = ours.memory_report()["host_bytes"]
    ours.close()
    if streamed is not None:
        streamed.close()
    if args.save:
        save(model, args)
    if args.plot:
        plot(args.plot, breakdown, step_times)
    # Two fp32 optimizers that round differently drift apart step by step (training amplifies
    # any difference), so the curves are compared smoothed: a 10-step moving average.
    w = 10
    smooth = {k: [statistics.mean(v[i : i + w]) for i in range(len(v) - w + 1)] for k, v in losses.items()}
    rel = max(abs(a - b) / abs(b) for a, b in zip(smooth["offload_adam"], smooth["torch"]))
    first = max(abs(a - b) for a, b in zip(losses["offload_adam"][:w], losses["torch"][:w]))
    if args.state_dtype == "float32" and args.master_dtype == "float32":
        agree = rel < 0.02 and first < 1e-3
        print(
            f"loss curves {'agree' if agree else 'DIFFER'}: max relative gap of the {w}-step moving averages {rel:.2e}, "
            f"max gap over the first {w} steps {first:.1e}"
        )
    else:  # compact moments: the final loss against torch's fp32 run, the target within 2%
        gap = abs(final["offload_adam"] - final["torch"]) / final["torch"]
        agree = gap < 0.02
        print(
            f"{args.state_dtype} moments, {args.master_dtype} weights: final loss {final['offload_adam']:.4f} against fp32 state (torch) "
            f"{final['torch']:.4f}, {gap * 100:.2f}% apart ({'within' if agree else 'NOT within'} 2%); "
            f"max relative gap of the {w}-step moving averages {rel:.2e}; "
            f"optimizer host memory {host_bytes / 2**20:.2f} MiB"
        )
    if not agree:
        raise SystemExit(1)

def save(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """The trained model as a safetensors checkpoint (the tied embedding and head stored once) and
    the config that rebuilds it."""
    import json
    import os

    from safetensors.torch import save_model

    os.makedirs(args.save, exist_ok=True)
    save_model(model.cpu(), os.path.join(args.save, "model.safetensors"))
    cfg = {"vocab": len(VOCAB), "ctx": args.ctx, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
           "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}  # fmt: skip
    with open(os.path.join(args.save, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"saved the trained model in {args.save}/ (model.safetensors, config.json): make generate answers sums with it")


def plot(path: str, breakdown: list[dict[str, float]], step_times: dict[str, list[float]]) -> None:
    """Per-step optimizer time of both optimizers, and the offload's breakdown when there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(step_times["torch"]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    keys = [k for k in ("d2h_wait_s", "cpu_step_s", "h2d_issue_s", "forward_wait_s") if breakdown and k in breakdown[0]]
    if keys:
        bottom = [0.0] * len(breakdown)
        for k in keys:
            vals = [b.get(k, 0.0) * 1e3 for b in breakdown]
            ax.bar(steps, vals, bottom=bottom, width=1.0, label=f"offload_adam {k[:-2].replace('_', ' ')}")
            bottom = [x + y for x, y in zip(bottom, vals)]
    else:
        ax.plot(steps, [t * 1e3 for t in step_times["offload_adam"]], lw=1, label="offload_adam step")
    ax.plot(steps, [t * 1e3 for t in step_times["torch"]], color="black", lw=1, label="torch.optim.AdamW(fused=True) step")
    ax.set_xlabel("training step")
    ax.set_ylabel("ms")
    ax.set_title("optimizer step time per training step")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
