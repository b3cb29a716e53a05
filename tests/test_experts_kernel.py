"""The routed experts of a mixture-of-experts layer in one native call (``_native.experts``,
``rust/linear/experts.rs``): every path of this CPU (``simd=``) and every format (bfloat16, int8
and fp8 with scales of each dtype) against a float64 evaluation of transformers' eager loop
within the kernel's stated bound (``offload_adam.testing.experts.reference``); thread counts
change no bit; bad input raises naming the argument and writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from offload_adam import _native
from offload_adam.testing.experts import reference

PATHS = _native.simd_paths()
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expert_weights(
    kind: str, n: int, k: int, u: int, g: torch.Generator, scale_dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """``u`` stored ``[n, k]`` matrices of ``kind`` and their per-row scales (None for bf16);
    float32 scales shaped ``[n, 1]`` as torchao stores them, the others ``[n]``, every third one
    tensor-wide."""
    ws, ss = [], []
    for i in range(u):
        if kind == "bf16":
            ws.append((torch.randn(n, k, generator=g) * 0.2).to(torch.bfloat16))
            continue
        if kind == "int8":
            ws.append(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
        else:
            ws.append((torch.randn(n, k, generator=g) * 100).to(torch.float8_e4m3fn))
        s = torch.rand(n, 1, generator=g) * 0.004 + 1e-3
        if i % 3 == 2:
            s = s[:1, 0]
        elif scale_dtype != torch.float32:
            s = s[:, 0]
        ss.append(s.to(scale_dtype))
    return ws, (None if kind == "bf16" else ss)


def routing(rows: int, k: int, u: int, g: torch.Generator) -> torch.Tensor:
    """``[rows, k]`` expert numbers with duplicates, and about one slot in eight skipped (-1)."""
    idx = torch.randint(0, u, (rows, k), generator=g)
    skip = torch.rand(rows, k, generator=g) < 0.125
    return torch.where(skip, torch.full_like(idx, -1), idx)


def run(x: torch.Tensor, gu: list[torch.Tensor], dn: list[torch.Tensor], idx: torch.Tensor, w: torch.Tensor, **kw: object) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    _native.experts(x, gu, dn, idx, w, out=out, **kw)  # type: ignore[arg-type]
    return out


def check(out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = (out.double() - y).abs()
    assert bool((err <= b).all()), f"{what}: worst {float((err - b).max())} over the bound"


@pytest.mark.parametrize("kind", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("seed", range(4))
def test_every_path_is_within_the_bound_of_the_float64_eager_loop(kind: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 17 + len(kind))
    rows = int(torch.randint(1, 17, (1,), generator=g))
    k = int(torch.randint(1, 9, (1,), generator=g))
    u = int(torch.randint(1, 17, (1,), generator=g))
    hidden = int(torch.randint(1, 97, (1,), generator=g))
    inter = int(torch.randint(1, 49, (1,), generator=g))
    sd = SCALE_DTYPES[seed % 3]
    gu, gus = expert_weights(kind, 2 * inter, hidden, u, g, sd)
    dn, dns = expert_weights(kind, hidden, inter, u, g, sd)
    idx = routing(rows, k, u, g)
    x32 = torch.randn(rows, hidden, generator=g)
    w32 = torch.rand(rows, k, generator=g)
    for xdt in (torch.float32, torch.bfloat16):
        for wdt in (torch.float32, torch.bfloat16):
            x, w = x32.to(xdt), w32.to(wdt)
            for act in ("silu", "gelu_tanh"):
                y, b = reference(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, act=act)
                for simd in PATHS:
                    out = run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, act=act, simd=simd, num_threads=1 + seed % 2)
                    check(out, y, b, f"{simd} {kind} x {xdt} weights {wdt} {act} rows {rows} k {k} U {u} H {hidden} I {inter}")


def test_a_decode_row_of_a_wide_layer_on_every_path() -> None:
    """One row through experts of hidden 1024 and width 192 (the tiles' full steps and several
    tasks per expert), 8 of 16 routed, on 2 threads."""
    g = torch.Generator().manual_seed(5)
    for kind in ("bf16", "int8", "fp8"):
        gu, gus = expert_weights(kind, 384, 1024, 16, g)
        dn, dns = expert_weights(kind, 1024, 192, 16, g)
        idx = torch.randperm(16, generator=g)[:8][None]
        w = torch.softmax(torch.randn(1, 8, generator=g), -1)
        x = torch.randn(1, 1024, generator=g).bfloat16()
        y, b = reference(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns)
        for simd in PATHS:
            check(run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, simd=simd, num_threads=2), y, b, f"{simd} {kind}")


def test_the_reference_is_transformers_eager_loop() -> None:
    """The helper's float64 result is transformers' ``Qwen3MoeExperts`` eager forward run in
    float64 (the layout: gate rows, then up rows; the weights; the index), and the kernel on the
    module's own bfloat16 experts is within the bound of it."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3)
    torch.manual_seed(0)
    mod = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.2)
        mod.down_proj.normal_(0, 0.2)
    mod = mod.to(torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    idx = torch.tensor([[0, 3, 5], [1, 1, 2], [5, 4, 0], [2, 3, 1], [0, 0, 0]])
    w = torch.rand(5, 3)
    gu = list(mod.gate_up_proj.detach().unbind(0))
    dn = list(mod.down_proj.detach().unbind(0))
    y, b = reference(x, gu, dn, idx, w)
    with torch.no_grad():
        eager64 = mod.double()(x.double(), idx, w.double())
    torch.testing.assert_close(y, eager64, rtol=1e-12, atol=1e-12)
    for simd in PATHS:
        check(run(x, gu, dn, idx, w, simd=simd), y, b, simd)


def formats(seed: int) -> Iterator[tuple[Any, ...]]:
    """For each format: 7 experts (gate_up [160, 200], down [200, 80]) and their scales, 9 rows
    routed to 4 of them, the rows and their weights."""
    g = torch.Generator().manual_seed(seed)
    for kind in ("bf16", "int8", "fp8"):
        gu, gus = expert_weights(kind, 160, 200, 7, g)
        dn, dns = expert_weights(kind, 200, 80, 7, g)
        idx = routing(9, 4, 7, g)
        yield kind, gu, gus, dn, dns, idx, torch.randn(9, 200, generator=g).bfloat16(), torch.rand(9, 4, generator=g)


def test_thread_counts_and_the_batch_change_no_bit() -> None:
    for kind, gu, gus, dn, dns, idx, x, w in formats(3):
        for simd in PATHS:
            one = run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, simd=simd)
            for threads in (2, 3):
                assert torch.equal(one, run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, simd=simd, num_threads=threads))
            alone = run(x[4:5], gu, dn, idx[4:5], w[4:5], gate_up_scale=gus, down_scale=dns, simd=simd)
            assert torch.equal(alone, one[4:5]), f"{simd} {kind}: a row alone differs from the same row in the batch"


@pytest.mark.skipif(not _native.omp_available(), reason="no OpenMP runtime (libgomp) in this process")
def test_the_openmp_team_changes_no_bit() -> None:
    """``omp=True`` runs the call's tasks on torch's OpenMP team (as ``linear``'s): the same tasks,
    so the same bits as on the kernel's pool, every format, thread count and path."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for kind, gu, gus, dn, dns, idx, x, w in formats(5):
            for simd in PATHS:
                pool = run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, simd=simd, num_threads=2)
                team = run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns, simd=simd, num_threads=2, omp=True)
                assert torch.equal(pool, team), f"{simd} {kind}"
    finally:
        torch.set_num_threads(threads)


def test_skipped_slots_and_rows_without_experts() -> None:
    g = torch.Generator().manual_seed(1)
    gu, _ = expert_weights("bf16", 32, 16, 3, g)
    dn, _ = expert_weights("bf16", 16, 16, 3, g)
    x = torch.randn(3, 16, generator=g)
    idx = torch.tensor([[-1, -1], [2, -1], [-1, -1]])
    w = torch.rand(3, 2, generator=g)
    out = run(x, gu, dn, idx, w)
    assert torch.equal(out[0], torch.zeros(16)) and torch.equal(out[2], torch.zeros(16))
    y, b = reference(x, gu, dn, idx, w)
    check(out, y, b, "skips")
    # No experts given at all: every slot skipped, zeros.
    out = run(x, [], [], torch.full((3, 2), -1), w)
    assert torch.equal(out, torch.zeros(3, 16))


def test_only_the_experts_the_index_names_are_read() -> None:
    """A layer's lists hold every expert; a call reads those its index names: the other entries
    may be anything (None for an expert computed elsewhere, a wrong shape or format)."""
    g = torch.Generator().manual_seed(4)
    gu, gus = expert_weights("int8", 32, 24, 4, g)
    dn, dns = expert_weights("int8", 24, 16, 4, g)
    assert gus is not None and dns is not None
    x = torch.randn(2, 24, generator=g)
    idx = torch.tensor([[1, 3], [3, -1]])
    w = torch.rand(2, 2, generator=g)
    want = run(x, gu, dn, idx, w, gate_up_scale=gus, down_scale=dns)
    holes: list[object] = [None, gu[1], torch.zeros(3, dtype=torch.bfloat16), gu[3]]
    got = run(x, holes, [None, dn[1], None, dn[3]], idx, w, gate_up_scale=[None, gus[1], None, gus[3]], down_scale=[None, dns[1], None, dns[3]])  # type: ignore[arg-type]
    assert torch.equal(got, want)


def _case() -> dict[str, object]:
    g = torch.Generator().manual_seed(2)
    gu, gus = expert_weights("int8", 16, 12, 3, g)
    dn, dns = expert_weights("int8", 12, 8, 3, g)
    return {
        "x": torch.randn(2, 12, generator=g),
        "gate_up": gu,
        "down": dn,
        "index": torch.tensor([[0, 2], [1, -1]]),
        "weights": torch.rand(2, 2, generator=g),
        "gate_up_scale": gus,
        "down_scale": dns,
        "out": torch.full((2, 12), 7.0),
    }


def _bad(exc: type[Exception], match: str, **change: object) -> None:
    args = _case()
    args.update(change)
    out = args["out"]
    assert isinstance(out, torch.Tensor)
    before = out.clone()
    x, gu, dn, idx, w = (args.pop(n) for n in ("x", "gate_up", "down", "index", "weights"))
    with pytest.raises(exc, match=match):
        _native.experts(x, gu, dn, idx, w, **args)  # type: ignore[arg-type]
    assert torch.equal(out, before), "a refused call wrote its output"


def test_bad_arguments_are_refused_naming_them_and_write_nothing() -> None:
    c = _case()
    x, gu, dn, gus = c["x"], c["gate_up"], c["down"], c["gate_up_scale"]
    assert isinstance(x, torch.Tensor) and isinstance(gu, list) and isinstance(dn, list) and isinstance(gus, list)
    _bad(ValueError, r"^x: must be 2-D", x=x[0])
    _bad(TypeError, r"^x: dtype must be float32 or bfloat16", x=x.half(), out=torch.zeros(2, 12, dtype=torch.float16))
    _bad(TypeError, r"^gate_up: expected a list of tensors", gate_up=torch.stack(gu))
    _bad(ValueError, r"^down: has 2 experts, gate_up has 3", down=dn[:2])
    _bad(ValueError, r"^gate_up\[1\]: shape must be \(16, 12\)", gate_up=[gu[0], gu[1][:, :10].contiguous(), gu[2]])
    _bad(ValueError, r"^gate_up\[0\]: shape must be \(2 \* intermediate, hidden\)", gate_up=[g[:15] for g in gu])
    _bad(ValueError, r"^down\[2\]: shape must be \(12, 8\)", down=[dn[0], dn[1], dn[2][:, :7].contiguous()])
    _bad(TypeError, r"^gate_up\[2\]: dtype bfloat16 differs from gate_up\[0\]'s \(int8\)", gate_up=[gu[0], gu[1], gu[2].bfloat16()])
    _bad(TypeError, r"^down\[1\]: dtype float8_e4m3fn differs", down=[dn[0], dn[1].to(torch.float8_e4m3fn), dn[2]])
    _bad(TypeError, r"^gate_up\[0\]: dtype must be bfloat16, int8 or float8_e4m3fn", gate_up=[g.float() for g in gu])
    _bad(ValueError, r"^gate_up_scale\[0\]: required for quantized weights", gate_up_scale=None)
    _bad(ValueError, r"^gate_up_scale: has 2 scales, gate_up has 3 experts", gate_up_scale=gus[:2])
    _bad(ValueError, r"^gate_up_scale\[1\]: has 5 elements", gate_up_scale=[gus[0], gus[1][:5], gus[2]])
    _bad(TypeError, r"^down_scale\[0\]: dtype must be float32, bfloat16 or float16", down_scale=[torch.ones(12, dtype=torch.int8)] * 3)
    bf = [g.bfloat16() for g in gu]
    _bad(ValueError, r"^gate_up_scale\[0\]: bfloat16 weights take no scale", gate_up=bf)
    _bad(ValueError, r"^index: has 3 rows, x has 2", index=torch.zeros(3, 2, dtype=torch.int64))
    _bad(TypeError, r"^index: dtype must be int64", index=torch.tensor([[0, 2], [1, -1]], dtype=torch.int8))
    _bad(TypeError, r"^index: unsupported dtype", index=torch.tensor([[0, 2], [1, -1]], dtype=torch.int32))
    for v in (3, -2):
        _bad(ValueError, rf"^index: {v} at \(0, 1\) is outside \[0, 3\)", index=torch.tensor([[0, v], [1, -1]]))
    _bad(ValueError, r"^index: 7 at \(1, 1\)", index=torch.tensor([[0, 2], [1, 7]]))
    _bad(ValueError, r"^weights: shape must be index's \(2, 2\)", weights=torch.rand(2, 3))
    _bad(TypeError, r"^weights: dtype must be float32 or bfloat16", weights=torch.rand(2, 2).half())
    _bad(ValueError, r"^out: shape must be x's \(2, 12\)", out=torch.zeros(2, 11))
    _bad(TypeError, r"^out: dtype must be x's \(float32\)", out=torch.zeros(2, 12, dtype=torch.bfloat16))
    same = torch.randn(2, 12)
    _bad(ValueError, r"^out: shares memory with an input", x=same, out=same)
    buf = torch.zeros(40)
    _bad(ValueError, r"^out: shares memory with an input", out=buf[:24].view(2, 12), gate_up_scale=[buf[20:36], gus[1], gus[2]])
    _bad(ValueError, r"^x: must be contiguous", x=torch.randn(12, 2).T)
    _bad(ValueError, r"^act: must be \"silu\" or \"gelu_tanh\"", act="relu")
    _bad(ValueError, r"^num_threads", num_threads=0)
    _bad(ValueError, r"^simd", simd="sse9")


def test_the_bench_runs_at_a_tiny_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --experts``'s code at a tiny layer (the figures mean nothing): every contender
    runs and is reported with its bound."""
    from offload_adam.tools import experts_bench as eb

    for name, v in (("HIDDEN", 64), ("INTER", 32), ("EXPERTS", 8), ("TOP_K", 2), ("CALLS", 2)):
        monkeypatch.setattr(eb, name, v)
    monkeypatch.setattr(eb, "bandwidth", lambda: {"read_GBps": 10.0, "copy_GBps": 5.0})
    threads = torch.get_num_threads()
    try:
        res = eb.run(rounds=1, threads_list=(1,))
    finally:
        torch.set_num_threads(threads)
    got = res["threads"][1]
    assert {"ours int8 (one call)", "native linear loop fp8", "transformers eager bf16"} <= set(got)
    assert all(r["bound_s"] > 0 and r["per_call_s"] > 0 for r in got.values())
