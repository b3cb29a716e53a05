"""Main job: train a small GPT-style transformer with offload_adam.AdamW, next to torch's AdamW.

Both optimizers train the same model from the same initialization on the same batches, in the
same process, so the script can say whether the loss curves agree and how the optimizer step
times compare. The data is made here: sentences of sums (``"17+5=22;"``) to learn by heart and by
rule, so nothing is downloaded.

    python examples/train_gpt.py [--steps 300] [--layers 4] [--d-model 128] [--threads N]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    data = make_corpus(20_000, args.seed)
    model = GPT(len(VOCAB), args.ctx, args.d_model, args.layers, args.heads)
    twin = copy.deepcopy(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {n_params / 1e6:.2f}M parameters in {n_tensors} tensors; "
        f"offload_adam SIMD path {offload_adam.simd_path()}, {args.threads} threads"
    )

    ours = offload_adam.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), num_threads=args.threads)
    ref = torch.optim.AdamW(param_groups(twin, 0.1), lr=args.lr, betas=(0.9, 0.95), fused=True)
    warmup = max(1, args.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_at) for o in (ours, ref)]

    g = torch.Generator().manual_seed(args.seed + 1)
    losses: dict[str, list[float]] = {"offload_adam": [], "torch": []}
    step_times: dict[str, list[float]] = {"offload_adam": [], "torch": []}
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g)
        x = torch.stack([data[s : s + args.ctx] for s in starts])
        y = torch.stack([data[s + 1 : s + args.ctx + 1] for s in starts])
        for name, m, opt, sched in (("offload_adam", model, ours, scheds[0]), ("torch", twin, ref, scheds[1])):
            opt.zero_grad()
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            t0 = time.perf_counter()
            opt.step()
            step_times[name].append(time.perf_counter() - t0)
            sched.step()
            losses[name].append(loss.item())
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
    # Two fp32 optimizers that round differently drift apart step by step (training amplifies
    # any difference), so the curves are compared smoothed: a 10-step moving average.
    w = 10
    smooth = {k: [statistics.mean(v[i : i + w]) for i in range(len(v) - w + 1)] for k, v in losses.items()}
    rel = max(abs(a - b) / abs(b) for a, b in zip(smooth["offload_adam"], smooth["torch"]))
    first = max(abs(a - b) for a, b in zip(losses["offload_adam"][:w], losses["torch"][:w]))
    agree = rel < 0.02 and first < 1e-3
    print(
        f"loss curves {'agree' if agree else 'DIFFER'}: max relative gap of the {w}-step moving averages {rel:.2e}, "
        f"max gap over the first {w} steps {first:.1e}"
    )
    if not agree:
        raise SystemExit(1)

if __name__ == "__main__":
    main()
