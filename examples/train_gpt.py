"""Main job: train a small GPT-style transformer with offload_adam.AdamW, next to torch's AdamW.

Both optimizers train the same model from the same initialization on the same batches, in the
same process, so the script can say whether the loss curves agree and how the optimizer step
times compare. The task is made here, nothing is downloaded: sums of two numbers below 100,
written "07+05=" and answered with the sum's three digits lowest first ("210;": 12), the loss on
the answer only. Written lowest digit first, each digit needs only the digits above it and the
carry the model has just written, a rule a 0.4M-parameter model learns in a few hundred steps
(the default run: 400 steps, about 2-3 minutes on 2 cores; the model answers 100 random sums,
and `make generate` asks the saved model the same way). It writes both loss curves and the step
times to runs/demo.png.

With CUDA the model trains on the GPU and offload_adam offloads the optimizer (state in pinned
host memory, gradients streamed during backward, weights streamed back); the script then also
prints the GPU memory each optimizer needed and the offload's time breakdown.

With --offload-weights the model's weights are streamed too (offload_adam.offload_weights:
pinned host copy, blocks copied to the device in forward and again in backward, the optimizer's
step writing the host copy); the script prints the bytes each way per step, the streamer's device
peak and its stalls. Without CUDA that runs through the simulated device, and says so.

    python examples/train_gpt.py [--steps 400] [--device auto|cpu|cuda] [--async-step] [--storage cpu|nvme]
                                 [--plot runs/demo.png] [--simulate] [--offload-weights [--prefetch 2]]
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
DIGITS = 2  # the operands: 0 to 99
PROMPT_LEN = 2 * DIGITS + 2  # "07+05="
ANSWER_LEN = DIGITS + 2  # "210;": the sum's DIGITS + 1 digits, lowest first, then ";"
SEQ = PROMPT_LEN + ANSWER_LEN


def sum_prompt(a: int, b: int) -> str:
    """The question as the model reads it: both operands zero-padded ("07+05=")."""
    return f"{a:0{DIGITS}d}+{b:0{DIGITS}d}="


def sum_answer(c: int) -> str:
    """The answer as the model writes it: the sum's digits reversed, lowest first, then ";"
    (12 is "210;"). Written lowest digit first, each digit needs only the two digits above it
    and the carry the model has just written: a rule a small model learns in minutes, where
    the highest digit first needs the carry of every digit below it before it is written."""
    return f"{c:0{DIGITS + 1}d}"[::-1] + ";"


def read_answer(text: str) -> int | None:
    """The sum the model wrote (the inverse of sum_answer), None where it is no well-formed answer."""
    digits, sep, _ = text.partition(";")
    if not sep or len(digits) != DIGITS + 1 or not digits.isdigit():
        return None
    return int(digits[::-1])


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def sums_batch(n: int, g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """n random sums as whole sequences: the input (all but the last token) and the targets (the
    next token), with the loss on the answer only (-100, cross_entropy's ignore_index, on the
    prompt: its digits are random, nothing to learn)."""
    ab = torch.randint(0, 10**DIGITS, (n, 2), generator=g)
    seq = torch.tensor([encode(sum_prompt(a, b) + sum_answer(a + b)) for a, b in ab.tolist()], device=device)
    y = seq[:, 1:].clone()
    y[:, : PROMPT_LEN - 1] = -100
    return seq[:, :-1], y


@torch.no_grad()
def answer_sums(model: torch.nn.Module, pairs: list[tuple[int, int]], device: torch.device | str) -> list[str]:
    """The model's greedy answers to the sums, as it writes them (ANSWER_LEN characters each)."""
    x = torch.tensor([encode(sum_prompt(a, b)) for a, b in pairs], device=device)
    for _ in range(ANSWER_LEN):
        x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], 1)
    return ["".join(VOCAB[i] for i in row[PROMPT_LEN:]) for row in x.tolist()]


def make_corpus(n_sentences: int, seed: int) -> torch.Tensor:
    """A stream of sums written as people write them ("17+5=22;"): train_fsdp2.py's data."""
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
        # Positions drawn as the tokens are: from zeros every position looked the same, and the
        # sums model sat on a plateau for hundreds of steps before its attention told the digits'
        # places apart (measured: 1% of sums right at step 150 from zeros, 60% from this).
        torch.nn.init.normal_(self.pos, std=0.02)

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
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=128, help="sums per step")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks")
    ap.add_argument("--d-model", type=int, default=128, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate (both optimizers)")
    ap.add_argument(
        "--threads", type=int, default=1,
        help="threads of our kernel and of torch (1: this model's matmuls are small, and on a shared machine torch's "
        "thread team waiting for a busy core made the same steps 20x slower)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--async-step", action="store_true", help="offload: let step() return at once")
    ap.add_argument(
        "--plot", metavar="FILE.png", default="runs/demo.png",
        help="draw both loss curves on one axis, and the optimizer step times ('' for none)",
    )  # fmt: skip
    ap.add_argument(
        "--storage", "--offload", default="cpu", choices=["cpu", "nvme"],
        help="AdamW(storage=...): where the optimizer state lives (--offload: the former name)",
    )  # fmt: skip
    ap.add_argument("--nvme-dir", help="--storage nvme: the directory (on an SSD) that holds the state")
    ap.add_argument("--host-budget-gb", type=float, default=0.0, help="--storage nvme: state kept in RAM")
    ap.add_argument(
        "--simulate", action="store_true",
        help="on the CPU, train as on a GPU: the model and batches on offload_adam.testing's simulated device (no delays)",
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

        with testing.simulated_device(max_delay_s=0.0, lazy=False, keep_open=True) as sim:
            run(args, sim.torch_device)
    else:
        run(args)


def run(args: argparse.Namespace, dev: torch.device | None = None) -> None:
    """``dev``: where the model and the batches go (default: ``--device``; the simulated device's
    with ``--simulate``, as to a GPU)."""
    if dev is None:
        dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu"))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model = GPT(len(VOCAB), SEQ - 1, args.d_model, args.layers, args.heads)
    twin = copy.deepcopy(model).to(dev)
    if args.master_dtype == "bfloat16":
        model = model.to(torch.bfloat16)  # bf16 weights, no fp32 master: Kahan compensation
    streamed = None
    if args.offload_weights:
        # Before the optimizer: it then trains the host copies the streamer reads.
        streamed = offload_adam.offload_weights(model, device=dev if dev.type != "cpu" else None, prefetch=args.prefetch)
    else:
        model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {n_params / 1e6:.2f}M parameters in {n_tensors} tensors; "
        f"on {dev}; offload_adam SIMD path {offload_adam.simd_path()}, {args.threads} thread{'s' if args.threads != 1 else ''}"
    )
    cuda = dev.type == "cuda"
    nvme = {"nvme_dir": args.nvme_dir, "host_budget_gb": args.host_budget_gb, "bucket_mb": 1} if args.storage == "nvme" else {}
    ours = offload_adam.AdamW(
        param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), num_threads=args.threads, async_step=args.async_step,
        storage=args.storage, state_dtype=getattr(torch, args.state_dtype), master_dtype=getattr(torch, args.master_dtype),
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

    g = torch.Generator().manual_seed(args.seed + 1)
    losses: dict[str, list[float]] = {"offload_adam": [], "torch": []}
    step_times: dict[str, list[float]] = {"offload_adam": [], "torch": []}
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        x, y = sums_batch(args.batch, g, dev)
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
    faster = "offload_adam" if t_ours < t_ref else "torch's"
    ratio = max(t_ours, t_ref) / min(t_ours, t_ref)
    print(
        f"optimizer step, median: offload_adam {t_ours:.2f} ms, torch.optim.AdamW(fused=True) {t_ref:.2f} ms: {faster} is "
        f"{ratio:.2f}x faster here. No benchmark: this model has {n_params / 1e6:.2f}M parameters in {n_tensors} tensors, "
        f"too few for a step's time to show more than each call's fixed costs and this machine's load; "
        f"the benchmark is python -m offload_adam bench (large and many-tensor models, peers in the same process)"
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
    if args.storage == "nvme":
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
        where = str(dev) if cuda else f"simulated device, {dev}"
        print(
            f"weights streamed ({where}, prefetch {args.prefetch}): {rep['streamed_blocks']} of {rep['blocks']} blocks, "
            f"{rep['streamed_bytes'] / 2**20:.2f} MiB; per step (median): up {med['h2d_bytes'] / 2**20:.2f} MiB of weights "
            f"({med['h2d_bytes'] / max(1, rep['streamed_bytes']):.2f}x the streamed bytes) + {up_opt / 2**20:.2f} MiB "
            f"copied back by the step, down {down / 2**20:.2f} MiB of gradients; streamer device peak "
            f"{rep['gpu_peak_bytes'] / 2**20:.2f} MiB (ring {rep['ring_bytes'] / 2**20:.2f} MiB, whole model "
            f"{rep['weights_bytes'] / 2**20:.2f} MiB); compute stalled for weights {med['stall_s'] * 1e3:.2f} ms, "
            f"{med['on_demand_loads']:.0f} loads not prefetched"
        )
    answers: dict[str, int] = {}
    if streamed is None:  # (streamed weights read NaN outside their forward: the model is asked below, after close)
        answers = {"offload_adam": ask(model, dev), "torch": ask(twin, dev)}
    host_bytes = ours.memory_report()["host_bytes"]
    print(ours.summary())
    ours.close()
    if streamed is not None:
        streamed.close()
        answers = {"offload_adam": ask(model, torch.device("cpu")), "torch": ask(twin, dev)}
    print(
        f"the trained models answer 100 random sums: offload_adam {answers['offload_adam']}/100, "
        f"torch {answers['torch']}/100"
    )
    if args.save:
        save(model, args)
    if args.plot:
        plot(args.plot, losses, breakdown, step_times)
    # Two fp32 optimizers that round differently drift apart step by step, and training amplifies
    # any difference: where a run crosses a plateau (this task has one, before the model finds
    # which digits to add) the two may cross it some steps apart. So the curves are compared
    # where that cannot hide a fault: the first steps (the same arithmetic: equal to rounding)
    # and the end (the same place: the final losses within 2% of the starting loss, which a
    # relative gap of two losses near 0 could not say), and the plot shows them in between.
    w = 10
    smooth = {k: [statistics.mean(v[i : i + w]) for i in range(len(v) - w + 1)] for k, v in losses.items()}
    widest = max(abs(a - b) for a, b in zip(smooth["offload_adam"], smooth["torch"]))
    first = max(abs(a - b) for a, b in zip(losses["offload_adam"][:w], losses["torch"][:w]))
    start = losses["torch"][0]
    gap = abs(final["offload_adam"] - final["torch"]) / start
    if args.state_dtype == "float32" and args.master_dtype == "float32":
        agree = first < 1e-3 and gap < 0.02
        print(
            f"loss curves {'agree' if agree else 'DIFFER'}: over the first {w} steps within {first:.1e} (the same arithmetic), "
            f"final losses {final['offload_adam']:.4f} and {final['torch']:.4f}, {gap * 100:.2f}% of the starting loss apart "
            f"(at most 2%); widest gap of the {w}-step moving averages in between {widest:.3f}"
        )
    else:  # compact moments: the final loss against torch's fp32 run
        agree = gap < 0.02
        print(
            f"{args.state_dtype} moments, {args.master_dtype} weights: final loss {final['offload_adam']:.4f} against fp32 state (torch) "
            f"{final['torch']:.4f}, {gap * 100:.2f}% of the starting loss apart ({'within' if agree else 'NOT within'} 2%); "
            f"widest gap of the {w}-step moving averages {widest:.3f}; optimizer host memory {host_bytes / 2**20:.2f} MiB"
        )
    if not agree:
        raise SystemExit(1)


def ask(model: torch.nn.Module, dev: torch.device) -> int:
    """How many of 100 random sums (drawn with a seed of their own) the model answers right."""
    was = model.training
    model.eval()
    pairs = [(a, b) for a, b in torch.randint(0, 10**DIGITS, (100, 2), generator=torch.Generator().manual_seed(12345)).tolist()]
    got = answer_sums(model, pairs, dev)
    model.train(was)
    return sum(read_answer(o) == a + b for o, (a, b) in zip(got, pairs))


def save(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """The trained model as a safetensors checkpoint (the tied embedding and head stored once) and
    the config that rebuilds it."""
    import json
    import os

    from safetensors.torch import save_model

    os.makedirs(args.save, exist_ok=True)
    save_model(model.cpu(), os.path.join(args.save, "model.safetensors"))
    cfg = {"vocab": len(VOCAB), "ctx": SEQ - 1, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
           "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}  # fmt: skip
    with open(os.path.join(args.save, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"saved the trained model in {args.save}/ (model.safetensors, config.json): make generate answers sums with it")


def plot(path: str, losses: dict[str, list[float]], breakdown: list[dict[str, float]], step_times: dict[str, list[float]]) -> None:
    """Two panels: both loss curves on one axis (offload_adam's and torch's, log scale), and the
    per-step optimizer time of both (with the offload's breakdown when there is one)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(step_times["torch"]))
    fig, (top, ax) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(steps, losses["torch"], color="black", lw=2.5, alpha=0.35, label="torch.optim.AdamW(fused=True)")
    top.plot(steps, losses["offload_adam"], color="tab:blue", lw=1, label="offload_adam.AdamW")
    top.set_yscale("log")
    top.set_ylabel("training loss (answer digits)")
    top.set_title("the same model, data and start: the two optimizers' loss curves")
    top.legend(loc="upper right", fontsize=8)
    keys = [k for k in ("d2h_wait_s", "cpu_step_s", "h2d_issue_s", "forward_wait_s") if breakdown and k in breakdown[0]]
    if "d2h_wait_s" in keys:  # offloaded parameters: the step's parts (on the CPU it is the kernel's time only)
        bottom = [0.0] * len(breakdown)
        for k in keys:
            vals = [b.get(k, 0.0) * 1e3 for b in breakdown]
            ax.bar(steps, vals, bottom=bottom, width=1.0, label=f"offload_adam {k[:-2].replace('_', ' ')}")
            bottom = [x + y for x, y in zip(bottom, vals)]
    else:
        ax.plot(steps, [t * 1e3 for t in step_times["offload_adam"]], color="tab:blue", lw=1, label="offload_adam step")
    ax.plot(steps, [t * 1e3 for t in step_times["torch"]], color="black", lw=1, alpha=0.6, label="torch.optim.AdamW(fused=True) step")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("optimizer step (ms)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}: both loss curves on one axis, and the optimizer step times")


if __name__ == "__main__":
    main()
