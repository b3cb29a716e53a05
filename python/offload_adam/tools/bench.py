"""Same-process benchmark of the optimizer step against torch's own AdamW.

``python -m offload_adam bench`` runs every case; each round times one step of every contender
in turn (the order rotates from round to round), and the figure reported is the median over
rounds of the per-round ratio ``time(peer) / time(ours)``, so a noisy neighbour slows both sides
of a ratio alike. Throughput is also printed as Mparam/s and as effective GB/s at 28 bytes per
fp32 parameter (4 streams read, 3 written).

Two cases compare our own paths in the same run: ``many`` also times one flat tensor of the same
size (the rate of many small tensors against the memory-bound rate of one big one), and
``offload`` times the offloaded path (on a simulated device without delays: gradients landed
beforehand, as a backward would have streamed them) against the direct one, reporting the
kernel's share of the offloaded step (``last_step_stats['cpu_step_s']``) as a rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native, testing
from ..optim.optimizer import AdamW
from .shapes import Shapes, gpt2_small_shapes

BYTES_PER_PARAM = 28


@dataclass
class Contender:
    name: str
    step: Callable[[], None]
    times: list[float] = field(default_factory=list)
    prepare: Callable[[], None] | None = None  # untimed, before each timed step
    kernel_s: Callable[[], float] | None = None  # the kernel's part of the last step, if known
    kernel_times: list[float] = field(default_factory=list)


def _params(shapes: Shapes, dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float32).to(dtype))
        p.grad = (torch.randn(s, generator=g, dtype=torch.float32) * 1e-2).to(dtype)
        ps.append(p)
    return ps


def _moved(p: torch.nn.Parameter, device: torch.device) -> torch.nn.Parameter:
    """A parameter and its gradient on ``device``."""
    q = torch.nn.Parameter(p.detach().to(device))
    q.grad = None if p.grad is None else p.grad.to(device)
    return q


def _torch_opt(shapes: Shapes, dtype: torch.dtype = torch.float32, **kw: object) -> Callable[[], None]:
    opt = torch.optim.AdamW(_params(shapes, dtype), lr=1e-4, **kw)  # type: ignore[arg-type]
    return opt.step  # type: ignore[return-value]


def _ours(shapes: Shapes, dtype: torch.dtype, threads: int, **kw: object) -> Callable[[], None]:
    opt = AdamW(_params(shapes, dtype), lr=1e-4, num_threads=threads, **kw)  # type: ignore[arg-type]
    return opt.step  # type: ignore[return-value]


def _torchao(shapes: Shapes, name: str) -> Callable[[], None]:
    """torchao's ``AdamW8bit`` or ``AdamWFp8`` (``name``) as its users run it: each parameter's
    step compiled by ``torch.compile`` (Inductor's C++ backend on the CPU), compiled during the
    warm-up."""
    import torchao.optim  # type: ignore[import-untyped]

    opt = getattr(torchao.optim, name)(_params(shapes, torch.float32), lr=1e-4)
    return opt.step  # type: ignore[no-any-return]


def _bnb_8bit(shapes: Shapes) -> Callable[[], None]:
    """bitsandbytes' ``AdamW8bit`` on CPU tensors (its CPU backend, since 0.50)."""
    import bitsandbytes as bnb  # type: ignore[import-untyped]

    opt = bnb.optim.AdamW8bit(_params(shapes, torch.float32), lr=1e-4)
    return opt.step  # type: ignore[no-any-return]


def _peer(name: str, make: Callable[[], Callable[[], None]]) -> Contender | None:
    """A peer that may not be installed or may not run here: None (and why) if it does not."""
    try:
        step = make()
        step()  # the first step: lazy state, compilation
        return Contender(name, step)
    except Exception as e:  # noqa: BLE001 (any failure of a third-party peer: reported, skipped)
        print(f"   (skipped {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return None


def _ours_offloaded(shapes: Shapes, threads: int) -> Contender:
    """The offloaded path on the parameters of a simulated device with no delays whose
    copies run only when waited for (a GPU's copy engine takes none of the cores the kernel
    uses). Before each timed step a backward (untimed) streams the gradients to the host landing
    buffers, and ``clip_grad_norm_(inf)`` waits for their arrival, as after a GPU's backward."""
    with testing.simulated_device(max_delay_s=0.0, lazy=False, copies_on_demand=True, keep_open=True) as sim:
        ps = [_moved(p, sim.torch_device) for p in _params(shapes, torch.float32)]  # as to "cuda"
        opt = AdamW(ps, lr=1e-4, num_threads=threads)
    grads: list[torch.Tensor] = [p.grad for p in ps if p.grad is not None]
    for p in ps:
        p.grad = None

    def prepare() -> None:
        opt.zero_grad()
        torch.autograd.backward([p.view(-1)[:1] for p in ps], [g.view(-1)[:1] for g in grads])
        opt.clip_grad_norm_(float("inf"))

    return Contender(
        "offload_adam offloaded (simulated device)", opt.step, prepare=prepare,  # type: ignore[arg-type]
        kernel_s=lambda: opt.last_step_stats["cpu_step_s"],
    )  # fmt: skip


def _torch_bf16_sequence(shapes: Shapes) -> Callable[[], None]:
    """The best plain-torch way to keep fp32 masters for bf16 params: preallocated fp32 grads
    filled with ``_foreach_copy_``, a fused fp32 step, ``_foreach_copy_`` back to bf16."""
    model = _params(shapes, torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in model]
    grads32 = [torch.empty_like(m) for m in masters]
    for m, g in zip(masters, grads32):
        m.grad = g
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)
    model_data = [p.detach() for p in model]
    model_grads = [p.grad for p in model if p.grad is not None]

    def step() -> None:
        torch._foreach_copy_(grads32, model_grads)
        opt.step()
        torch._foreach_copy_(model_data, [m.detach() for m in masters])

    return step


def run_case(
    title: str, contenders: list[Contender], nparams: int, rounds: int, baseline: str, also: tuple[str, ...] = ()
) -> dict[str, object]:
    """Times the contenders in rotating rounds; ``also``: other contenders whose ratio to
    ``baseline`` is printed too."""
    for c in contenders:  # warm-up: lazy state, page faults, thread start
        for _ in range(2):
            if c.prepare is not None:
                c.prepare()
            c.step()
    for r in range(rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            if c.prepare is not None:
                c.prepare()
            t0 = time.perf_counter()
            c.step()
            c.times.append(time.perf_counter() - t0)
            if c.kernel_s is not None:
                c.kernel_times.append(c.kernel_s())
    ours = next(c for c in contenders if c.name.startswith("offload_adam"))
    rows = []
    print(f"\n== {title}: {nparams / 1e6:.1f}M params, {rounds} rounds")
    print(f"   {'contender':<38} {'median ms':>10} {'Mparam/s':>9} {'GB/s@28B':>9} {'ratio vs ours':>14}")
    result: dict[str, object] = {"case": title, "params": nparams, "rounds": rounds}
    for c in contenders:
        med = statistics.median(c.times)
        ratios = [a / b for a, b in zip(c.times, ours.times)]
        ratio = statistics.median(ratios)
        rows.append((c.name, med, ratio))
        print(
            f"   {c.name:<38} {med * 1e3:10.2f} {nparams / med / 1e6:9.0f} {nparams * BYTES_PER_PARAM / med / 1e9:9.1f}"
            f" {'' if c is ours else f'{ratio:13.2f}x':>14}"
        )
        result[c.name] = {"median_s": med, "ratio_peer_over_ours": ratio}
    for c in contenders:
        if c.kernel_times:
            ratio = statistics.median([a / b for a, b in zip(ours.times, c.kernel_times)])
            med = statistics.median(c.kernel_times)
            print(
                f"   {c.name}: kernel part {med * 1e3:.2f} ms ({nparams / med / 1e6:.0f} Mparam/s), "
                f"{ratio:.2f}x the rate of {ours.name}'s whole step (median of per-round ratios)"
            )
            result[c.name]["kernel_median_s"] = med  # type: ignore[index]
            result[c.name]["kernel_rate_over_ours"] = ratio  # type: ignore[index]
    base = next(c for c in contenders if c.name == baseline)
    speedup = statistics.median([a / b for a, b in zip(base.times, ours.times)])
    print(f"   => {ours.name} is {speedup:.2f}x {baseline} (median of per-round ratios)")
    result["speedup"] = speedup
    result["baseline"] = baseline
    for name in also:
        c = next(c for c in contenders if c.name == name)
        rel = statistics.median([a / b for a, b in zip(base.times, c.times)])
        print(f"   => {name} is {rel:.2f}x {baseline} (median of per-round ratios)")
        result[name]["speedup_over_baseline"] = rel  # type: ignore[index]
    return result


def _write_json(path: str | None, results: Any) -> None:
    """``--json PATH``: the results as JSON (what JSON cannot hold, as its text)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload_adam bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases", default="big,gpt2,many,bf16,threads,offload,lowbit,lowbit-gpt2,bf16-compact",
        help="comma-separated: big,gpt2,many,bf16,threads,offload,lowbit,lowbit-gpt2 (fp8 and uint8 moments against fp32 "
        "moments), bf16-compact, and peers (8-bit and fp8 peers: torchao compiled, which needs a C++ compiler, and "
        "bitsandbytes, where installed)",
    )
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--scale", type=float, default=1.0, help="shrink every case (e.g. 0.1 for a quick look)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--nvme", metavar="DIR", help="instead: the NVMe tier with its state under DIR (see nvme_bench)")
    ap.add_argument("--nvme-params", type=float, default=100e6, help="parameters of the --nvme model (default 100M)")
    ap.add_argument("--raw-gb", type=float, default=2.0, help="GiB of the --nvme raw-bandwidth file (default 2)")
    ap.add_argument("--fsdp2", action="store_true", help="instead: the step on FSDP2 local shards (see fsdp_bench)")
    ap.add_argument("--world", type=int, default=2, help="--fsdp2: processes (default 2)")
    ap.add_argument("--weights", metavar="DIR", help="instead: weights offloaded, their NVMe read path under DIR (see weights_bench)")
    ap.add_argument(
        "--train-weights", action="store_true",
        help="instead: training with streamed weights against the model resident and FSDP2 (see train_weights_bench)",
    )  # fmt: skip
    ap.add_argument(
        "--activations", action="store_true",
        help="instead: activations offloaded, against save_on_cpu and torchtune on a GPU (see activations_bench)",
    )  # fmt: skip
    ap.add_argument(
        "--linear", action="store_true",
        help="instead: the CPU matmul of decode (bf16, int8, fp8 weights) against torch and torchao (see linear_bench)",
    )  # fmt: skip
    ap.add_argument(
        "--linear-model", action="store_true",
        help="--linear: also decode the 4-layer 8B-class model, against llama.cpp where it installs",
    )  # fmt: skip
    ap.add_argument(
        "--experts", action="store_true",
        help="instead: a Qwen3-MoE-like layer's routed experts at decode in one native call against the per-expert loop and transformers' (see experts_bench)",
    )  # fmt: skip
    ap.add_argument(
        "--placement", metavar="DIR",
        help="instead: a model 4x its RAM budget run on the CPU from the SSD under DIR, against it resident and accelerate's disk offload (see placement_bench)",
    )  # fmt: skip
    ap.add_argument("--placement-params", type=float, default=1e9, help="--placement: the model's parameters (default 1B)")
    ap.add_argument(
        "--quantize", choices=["int8", "fp8"], default=None,
        help="--placement: also the model quantized as it loads (weight-only), beside bf16, and the CPU decode against llama.cpp",
    )  # fmt: skip
    ap.add_argument(
        "--gpu-placement", action="store_true",
        help="instead: placements stream, cpu and auto on a GPU, a 1B Llama with a quarter of it resident, bf16 and int8 (see gpu_placement_bench)",
    )  # fmt: skip
    ap.add_argument(
        "--simulate", action="store_true",
        help="--weights, --gpu-placement: their GPU part at tiny sizes on the simulated device (a dry run of the bench: the figures mean nothing)",
    )  # fmt: skip
    ap.add_argument("--weights-gb", type=float, default=2.0, help="--weights: GB of bf16 weights (default 2)")
    ap.add_argument("--prefetch", type=int, default=2, help="--weights: blocks read ahead (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"offload_adam bench: torch {torch.__version__}, {args.threads} threads, SIMD path {_native.simd_path()}, "
        f"I/O backend {_native.io_backend()}, python {sys.version.split()[0]}"
    )
    if args.fsdp2:
        from . import fsdp_bench

        per_rank = max(1, args.threads // args.world)
        res = fsdp_bench.run(world=args.world, rounds=args.rounds, threads=per_rank, scale=args.scale)
        _write_json(args.json, res)
        return 0
    if args.activations:
        from . import activations_bench

        ares = activations_bench.run(rounds=args.rounds)
        _write_json(args.json, ares)
        return 0
    if args.linear:
        from . import linear_bench

        lres = linear_bench.run(rounds=args.rounds, threads=args.threads, model=args.linear_model)
        _write_json(args.json, lres)
        return 0
    if args.experts:
        from . import experts_bench

        eres = experts_bench.run(rounds=args.rounds)
        _write_json(args.json, eres)
        return 0
    if args.train_weights:
        from . import train_weights_bench

        tres = train_weights_bench.run(rounds=args.rounds, prefetch=args.prefetch)
        _write_json(args.json, tres)
        return 0
    if args.placement:
        from . import placement_bench

        os.makedirs(args.placement, exist_ok=True)
        pres = placement_bench.run(
            args.placement, params=args.placement_params, prefetch=args.prefetch, rounds=max(1, min(args.rounds, 3)), quantize=args.quantize
        )  # fmt: skip
        if args.quantize is not None:
            from . import linear_bench

            pres["linear"] = linear_bench.run(rounds=args.rounds, threads=args.threads, model=True)
        _write_json(args.json, pres)
        return 0
    if args.gpu_placement:
        from . import gpu_placement_bench

        gres = gpu_placement_bench.run(simulate=args.simulate, progress=lambda r: _write_json(args.json, r))
        _write_json(args.json, gres)
        return 0
    if args.weights:
        from . import weights_bench

        os.makedirs(args.weights, exist_ok=True)
        wres = weights_bench.run(args.weights, gb=args.weights_gb, prefetch=args.prefetch, rounds=args.rounds, simulate=args.simulate)
        _write_json(args.json, wres)
        return 0
    if args.nvme:
        from . import nvme_bench

        out = nvme_bench.run(args.nvme, params=args.nvme_params, rounds=args.rounds, threads=args.threads, raw_gb=args.raw_gb)
        _write_json(args.json, out)
        return 0
    s = args.scale
    gpt2 = gpt2_small_shapes()
    if s != 1.0:
        gpt2 = [tuple(max(1, int(d * s)) if i == 0 else d for i, d in enumerate(sh)) for sh in gpt2]
    big: Shapes = [(int(100_000_000 * s),)]
    many: Shapes = [(10_000,)] * max(1, int(4000 * s))
    n = lambda shapes: sum(torch.Size(sh).numel() for sh in shapes)  # noqa: E731
    results = []
    for case in args.cases.split(","):
        gc.collect()
        if case == "big":
            shapes, title = big, "1 tensor x 100M fp32"
        elif case == "gpt2":
            shapes, title = gpt2, "GPT-2 small shapes, 148 tensors fp32"
        elif case == "many":
            shapes, title = many, "4000 tensors x 10k fp32"
        elif case == "bf16":
            cs = [
                Contender("offload_adam (bf16, fp32 masters)", _ours(gpt2, torch.bfloat16, args.threads)),
                Contender("torch copy+fused fp32+copy", _torch_bf16_sequence(gpt2)),
            ]
            results.append(
                run_case("bf16 params+grads, GPT-2 small shapes", cs, n(gpt2), args.rounds, "torch copy+fused fp32+copy")
            )
            continue
        elif case in ("lowbit", "lowbit-gpt2"):
            one: Shapes = [(int(64_000_000 * s),)]
            shapes, title = (one, "1 tensor x 64M fp32") if case == "lowbit" else (gpt2, "GPT-2 small shapes fp32")
            cs = [
                Contender("offload_adam fp8 moments", _ours(shapes, torch.float32, args.threads, state_dtype=torch.float8_e4m3fn)),
                Contender("offload_adam uint8 moments", _ours(shapes, torch.float32, args.threads, state_dtype=torch.uint8)),
                Contender("offload_adam fp32 moments", _ours(shapes, torch.float32, args.threads)),
            ]
            results.append(
                run_case(f"fp8 and 8-bit moments, {title}", cs, n(shapes), args.rounds, "offload_adam fp32 moments", also=("offload_adam uint8 moments",))
            )
            continue
        elif case == "bf16-compact":
            cs = [
                Contender(
                    "offload_adam bf16 Kahan, fp8 moments",
                    _ours(gpt2, torch.bfloat16, args.threads, state_dtype=torch.float8_e4m3fn, master_dtype=torch.bfloat16),
                ),
                Contender(
                    "offload_adam bf16 Kahan, uint8 moments",
                    _ours(gpt2, torch.bfloat16, args.threads, state_dtype=torch.uint8, master_dtype=torch.bfloat16),
                ),
                Contender("offload_adam bf16 Kahan, fp32 moments", _ours(gpt2, torch.bfloat16, args.threads, master_dtype=torch.bfloat16)),
                Contender("offload_adam bf16, fp32 masters", _ours(gpt2, torch.bfloat16, args.threads)),
                # torch's own step of a bf16 model: no master, bf16 moments
                Contender("torch AdamW(fused=True) bf16", _torch_opt(gpt2, fused=True, dtype=torch.bfloat16)),
            ]
            results.append(
                run_case(
                    "bf16 params, compact state, GPT-2 small shapes", cs, n(gpt2), args.rounds, "offload_adam bf16, fp32 masters",
                    also=("offload_adam bf16 Kahan, uint8 moments", "offload_adam bf16 Kahan, fp32 moments", "torch AdamW(fused=True) bf16"),
                )
            )
            continue
        elif case == "peers":
            # The same tensors for every contender: ours in three states, torch fused, and the
            # 8-bit and fp8 peers that run here.
            shapes = [(int(16_000_000 * s),)]  # type: ignore[list-item]
            cs = [
                Contender("offload_adam fp8 moments", _ours(shapes, torch.float32, args.threads, state_dtype=torch.float8_e4m3fn)),
                Contender("offload_adam uint8 moments", _ours(shapes, torch.float32, args.threads, state_dtype=torch.uint8)),
                Contender("offload_adam fp32 moments", _ours(shapes, torch.float32, args.threads)),
                Contender("torch AdamW(fused=True)", _torch_opt(shapes, fused=True)),
            ]
            for name, make in (
                ("torchao AdamWFp8 (compiled)", lambda: _torchao(shapes, "AdamWFp8")),
                ("torchao AdamW8bit (compiled)", lambda: _torchao(shapes, "AdamW8bit")),
                ("bitsandbytes AdamW8bit (CPU)", lambda: _bnb_8bit(shapes)),
            ):
                c = _peer(name, make)
                if c is not None:
                    cs.append(c)
            names = {c.name for c in cs}
            base = "torchao AdamWFp8 (compiled)" if "torchao AdamWFp8 (compiled)" in names else "offload_adam fp32 moments"
            also = ("offload_adam uint8 moments",) + (("torchao AdamW8bit (compiled)",) if "torchao AdamW8bit (compiled)" in names else ())
            results.append(run_case("fp8 and 8-bit peers, 1 tensor x 16M fp32", cs, n(shapes), args.rounds, base, also=also))
            continue
        elif case == "offload":
            cs = [
                Contender("offload_adam direct", _ours(gpt2, torch.float32, args.threads)),
                _ours_offloaded(gpt2, args.threads),
            ]
            results.append(
                run_case("offloaded vs direct path, GPT-2 small shapes fp32", cs, n(gpt2), args.rounds, "offload_adam direct")
            )
            continue
        elif case == "threads":
            cs = [
                Contender(f"offload_adam ({args.threads} threads)", _ours(gpt2, torch.float32, args.threads)),
                Contender("offload_adam 1 thread", _ours(gpt2, torch.float32, 1)),
            ]
            results.append(run_case("thread scaling, GPT-2 small shapes", cs, n(gpt2), args.rounds, "offload_adam 1 thread"))
            continue
        else:
            ap.error(f"unknown case {case!r}")
        cs = [
            Contender("offload_adam", _ours(shapes, torch.float32, args.threads)),
            Contender("torch AdamW(fused=True)", _torch_opt(shapes, fused=True)),
            Contender("torch AdamW(foreach=True)", _torch_opt(shapes, foreach=True)),
        ]
        if case == "many":  # the same elements as one flat tensor: the memory-bound rate
            cs.append(Contender("offload_adam, one flat tensor", _ours([(n(shapes),)], torch.float32, args.threads)))
        res = run_case(title, cs, n(shapes), args.rounds, "torch AdamW(fused=True)")
        if case == "many":
            flat = next(c for c in cs if c.name == "offload_adam, one flat tensor")
            rate = statistics.median([b / a for a, b in zip(cs[0].times, flat.times)])
            print(f"   => {len(shapes)} tensors run at {rate:.2f}x the Gparam/s of one flat tensor (median of per-round ratios)")
            res["many_over_flat_rate"] = rate
        results.append(res)
        del cs
    _write_json(args.json, results)
    return 0
