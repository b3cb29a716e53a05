"""``python -m offload_adam bench --experts``: the routed experts of one mixture-of-experts layer
at decode in one native call (``_native.experts``, ``rust/linear/experts.rs``) against the
per-expert loop of ``_native.linear`` calls and against transformers' own loops, in the same run.

A Qwen3-MoE-like layer (hidden 2048, expert width 768, 64 experts, 8 routed), bfloat16 weights
and their int8 and fp8 weight-only codes with per-row scales; one bfloat16 decode row, a fresh
routing per call (``CALLS`` routings of 8 distinct experts, the same for every contender), round
after round, the contenders' order rotating:

- ours, one call per layer, bf16 / int8 / fp8;
- the per-expert loop of ``hostmatmul.linear`` (``_native.linear``) calls: gate/up, ``silu`` and
  the product in torch, down, the weighted ``index_add_`` (what the experts function would do
  without the one call), bf16 / int8 / fp8;
- transformers' ``Qwen3MoeExperts`` with ``"eager"`` (its per-expert loop of ``F.linear``) and its
  default (``grouped_mm``), bf16.

Printed per thread count: the median time per call, the routed experts' bytes over it, the
median per-round ratio to the bf16 call, and the bytes-read bound (routed bytes over this
machine's read rate, measured in the same run) as a fraction of the time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import _native
from ..weights import hostmatmul as hm
from .linear_bench import _quantized, bandwidth

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 64, 8
CALLS = 16


def _layer(g: torch.Generator) -> dict[str, Any]:
    """The bf16 experts (fused, as transformers stores them) and per-expert int8 / fp8 codes."""
    gate_up = torch.empty(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    down = torch.empty(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    out: dict[str, Any] = {"bf16": (list(gate_up.unbind(0)), list(down.unbind(0)), None, None), "fused": (gate_up, down)}
    for kind in ("int8", "fp8"):
        gq, gs, dq, ds = [], [], [], []
        for e in range(EXPERTS):
            q, s = _quantized(gate_up[e])[kind]
            gq.append(q)
            gs.append(s)
            q, s = _quantized(down[e])[kind]
            dq.append(q)
            ds.append(s)
        out[kind] = (gq, dq, gs, ds)
    return out


def _routings(g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    res = []
    for _ in range(CALLS):
        idx = torch.randperm(EXPERTS, generator=g)[:TOP_K][None]
        w = torch.softmax(torch.randn(1, TOP_K, generator=g), -1)
        res.append((idx, w))
    return res


def _eager_module(fused: tuple[torch.Tensor, torch.Tensor], impl: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    cfg._experts_implementation = impl
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        mod = Qwen3MoeExperts(cfg)
    finally:
        torch.set_default_dtype(prev)
    mod.gate_up_proj.data = fused[0]
    mod.down_proj.data = fused[1]
    return mod.eval()


def _loop(x: torch.Tensor, parts: tuple[Any, ...], idx: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """The per-expert loop of native ``linear`` calls, eager's operations around them."""
    gu, dn, gs, ds = parts
    out = torch.zeros_like(x)
    for j, e in enumerate(idx[0].tolist()):
        gate, up = hm.linear(x, gu[e], None if gs is None else gs[e], num_threads=threads).chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = hm.linear(h, dn[e], None if ds is None else ds[e], num_threads=threads)
        out.index_add_(0, torch.zeros(1, dtype=torch.long), (y * w[:, j, None]).to(out.dtype))
    return out


def _rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each round times every contender once, the order rotating: the times, round by round."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for f in fns.values():
        f()  # warm-up
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def _ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """The median over rounds of ``slow``'s time over ``fast``'s."""
    return statistics.median(a / b for a, b in zip(times[slow], times[fast]))


def run(rounds: int = 5, threads_list: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    print(
        f"experts of a Qwen3-MoE-like layer: hidden {HIDDEN}, width {INTER}, {EXPERTS} experts, {TOP_K} routed, "
        f"one bf16 decode row, {CALLS} routings per round, {rounds} rounds, SIMD path {_native.simd_path()}"
    )
    layer = _layer(g)
    routings = _routings(g)
    x = torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)
    per_expert = 3 * INTER * HIDDEN
    bytes_per_call = {"bf16": TOP_K * per_expert * 2, "int8": TOP_K * per_expert, "fp8": TOP_K * per_expert}
    eager = {impl: _eager_module(layer["fused"], impl) for impl in ("eager", "grouped_mm")}
    bw = bandwidth()
    print(f"   memory: read {bw['read_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s")
    results: dict[str, Any] = {"bandwidth": bw, "threads": {}}
    for threads in threads_list:
        torch.set_num_threads(threads)
        out = torch.empty_like(x)

        def ours(kind: str) -> Callable[[], object]:
            gu, dn, gs, ds = layer[kind]

            def f() -> None:
                for idx, w in routings:
                    _native.experts(x, gu, dn, idx, w, gate_up_scale=gs, down_scale=ds, out=out, num_threads=threads)

            return f

        def loop(kind: str) -> Callable[[], object]:
            return lambda: [_loop(x, layer[kind], idx, w, threads) for idx, w in routings]

        def tf(impl: str) -> Callable[[], object]:
            m = eager[impl]
            return lambda: [m(x, idx, w.to(torch.bfloat16)) for idx, w in routings]

        fns: dict[str, Callable[[], object]] = {}
        for kind in ("bf16", "int8", "fp8"):
            fns[f"ours {kind} (one call)"] = ours(kind)
        for kind in ("bf16", "int8", "fp8"):
            fns[f"native linear loop {kind}"] = loop(kind)
        fns["transformers eager bf16"] = tf("eager")
        fns["transformers grouped_mm bf16"] = tf("grouped_mm")
        with torch.no_grad():
            times = _rounds(fns, rounds)
        print(f"\n   {threads} thread(s), per call (one layer, one row), median of {rounds} rounds:")
        res: dict[str, Any] = {}
        for name, ts in times.items():
            kind = next(k for k in ("bf16", "int8", "fp8") if k in name)
            per_call = statistics.median(ts) / CALLS
            nbytes = bytes_per_call[kind]
            bound_s = nbytes / (bw["read_GBps"] * 1e9)
            ours_name = f"ours {kind} (one call)"
            vs = "" if name == ours_name else f"  ours {kind} is {_ratio(times, name, ours_name):5.2f}x faster"
            res[name] = {"per_call_s": per_call, "GBps": nbytes / per_call / 1e9, "bound_s": bound_s, "of_bound": bound_s / per_call, "times_s": ts}
            print(
                f"   {name:30s} {per_call * 1e3:7.2f} ms  {nbytes / per_call / 1e9:5.1f} GB/s  "
                f"bound {bound_s * 1e3:5.2f} ms ({bound_s / per_call:.2f} of it){vs}"
            )
        results["threads"][threads] = res
    return results
