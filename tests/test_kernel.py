"""The native kernel and its DLPack bindings, through ``offload_adam._native``."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch.utils.dlpack import to_dlpack

import offload_adam
from offload_adam import _native

PATHS = offload_adam.simd_paths()
FAST = [p for p in PATHS if p != "scalar"]
LENGTHS = [0, 1, 15, 16, 17, 31, 33, 1000, _native.CHUNK + 3]


def buffers(n: int, gdtype: torch.dtype = torch.float32, sdtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 0.1).to(gdtype)
    m = (torch.randn(n, generator=g) * 0.01).to(sdtype)
    v = (torch.rand(n, generator=g) * 1e-4).to(sdtype)
    x = (v.float() + torch.rand(n, generator=g) * 1e-4).to(sdtype)
    return p, grad, m, v, x


def torch_reference(p, grad, m, v, x, step, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, amsgrad=True):
    """torch's single-tensor AdamW, on copies."""
    p, m, v, x = p.clone(), m.clone().float(), v.clone().float(), x.clone().float()
    g = grad.float()
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    if amsgrad:
        torch.maximum(x, v, out=x)
        denom = (x.sqrt() / bc2**0.5).add_(eps)
    else:
        denom = (v.sqrt() / bc2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
    return p, m, v, x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", LENGTHS)
def test_every_path_matches_torch_for_any_length(path: str, n: int) -> None:
    p, g, m, v, x = buffers(n, seed=n)
    rp, rm, rv, rx = torch_reference(p, g, m, v, x, step=3)
    _native.adam_update(p, g, m, v, x, step=3, weight_decay=0.01, amsgrad=True, simd=path)
    torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(x, rx, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("path", FAST)
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_fast_paths_match_the_scalar_reference(path: str, gdtype, sdtype, out_dtype) -> None:
    """Every dtype combination of every fast path against the scalar reference path."""
    n = 1000 + 7
    results = []
    for s in ("scalar", path):
        p, g, m, v, x = buffers(n, gdtype, sdtype, seed=1)
        out = None if out_dtype is None else p.to(out_dtype)
        for step in (1, 2, 3):
            _native.adam_update(p, g, m, v, x, out, step=step, weight_decay=0.1, amsgrad=True, simd=s)
        results.append((p, m.float(), v.float(), x.float(), None if out is None else out.float()))
    (p0, m0, v0, x0, o0), (p1, m1, v1, x1, o1) = results
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-6)
    # Values rounded to bf16 may land one bf16 unit apart (2^-8 relative).
    low = sdtype == torch.bfloat16
    torch.testing.assert_close(m1, m0, rtol=8e-3 if low else 1e-5, atol=1e-9)
    torch.testing.assert_close(v1, v0, rtol=8e-3 if low else 1e-5, atol=1e-12)
    torch.testing.assert_close(x1, x0, rtol=8e-3 if low else 1e-5, atol=1e-12)
    if o0 is not None:
        torch.testing.assert_close(o1, o0, rtol=8e-3, atol=1e-6)
        # the copy is the master rounded to the copy's dtype
        torch.testing.assert_close(o1, p1.to(out_dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_nan_and_inf_propagate_like_torch(path: str) -> None:
    p, g, m, v, x = buffers(50)
    g[3], g[20], g[49] = float("nan"), float("inf"), float("-inf")
    x[7] = float("nan")
    rp, rm, rv, rx = torch_reference(p, g, m, v, x, step=1)
    _native.adam_update(p, g, m, v, x, step=1, weight_decay=0.01, amsgrad=True, simd=path)
    for got, want in ((p, rp), (m, rm), (v, rv), (x, rx)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.isinf(), want.isinf())
        ok = ~(want.isnan() | want.isinf())
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-7)


def test_bitwise_identical_for_any_thread_count() -> None:
    n = 3 * _native.CHUNK + 5
    outs = []
    for threads in (1, 2, 3, 4):
        p, g, m, v, x = buffers(n, seed=9)
        _native.adam_update(p, g, m, v, x, step=5, amsgrad=True, num_threads=threads)
        outs.append((p, m, v, x))
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            assert torch.equal(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_norm_and_nonfinite_passes(path: str) -> None:
    ts = [torch.randn(_native.CHUNK * 2 + 9), torch.randn(17).bfloat16(), torch.randn(0), torch.randn(33).half()]
    want = sum(float(t.double().pow(2).sum()) for t in ts)
    got = _native.grad_sq_norm(ts, simd=path)
    assert abs(got - want) <= 1e-12 * want
    assert _native.grad_sq_norm(ts, simd=path, num_threads=2) == got == _native.grad_sq_norm(ts, simd=path, num_threads=3)
    assert not _native.grads_nonfinite(ts, simd=path)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for k in (0, 1, 3):
            ts2 = [t.clone() for t in ts]
            ts2[k][-1] = bad
            assert _native.grads_nonfinite(ts2, simd=path, num_threads=2)
            assert not np.isfinite(_native.grad_sq_norm(ts2, simd=path))


def test_legacy_and_versioned_capsules_are_imported_in_place() -> None:
    p, g, m, v, _ = buffers(100)
    before = p.clone()
    # legacy "dltensor" capsules (torch.utils.dlpack.to_dlpack) for the state buffers
    _native.adam_update(p, g, to_dlpack(m), to_dlpack(v), step=1)
    assert not torch.equal(p, before)
    assert m.abs().sum() > 0  # written in place through the legacy capsule
    cap = to_dlpack(m)
    _native.grad_sq_norm([cap])
    with pytest.raises(ValueError, match="already consumed"):
        _native.grad_sq_norm([cap])


def test_other_dlpack_producers_and_read_only_buffers() -> None:
    a = np.ones(16, dtype=np.float32)
    assert _native.grad_sq_norm([a]) == 16.0
    p, g, m, v, _ = buffers(16)
    ro = np.zeros(16, dtype=np.float32)
    ro.flags.writeable = False
    try:
        ro.__dlpack__(max_version=(1, 0))
    except (TypeError, BufferError):
        pytest.skip("this numpy cannot export read-only arrays through DLPack 1.0")
    with pytest.raises(ValueError, match="exp_avg: is read-only"):
        _native.adam_update(p, g, ro, v, step=1)


def test_bad_buffers_are_named_and_refused() -> None:
    p, g, m, v, _ = buffers(64)
    with pytest.raises(TypeError, match="param: dtype must be float32, got bfloat16"):
        _native.adam_update(p.bfloat16(), g, m, v, step=1)
    with pytest.raises(TypeError, match="grad: dtype must be float32, bfloat16 or float16, got float64"):
        _native.adam_update(p, g.double(), m, v, step=1)
    with pytest.raises(ValueError, match="exp_avg: must be dense"):
        _native.adam_update(p, g, torch.zeros(128)[::2], v, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq: has 63 elements"):
        _native.adam_update(p, g, m, v[:63], step=1)
    with pytest.raises(ValueError, match="share memory"):
        _native.adam_update(p, g, p, v, step=1)
    with pytest.raises(ValueError, match="grad: shares memory"):
        _native.adam_update(p, v, m, v, step=1)
    with pytest.raises(ValueError, match="max_exp_avg_sq: required"):
        _native.adam_update(p, g, m, v, step=1, amsgrad=True)
    with pytest.raises(ValueError, match="beta parameter at index 0"):
        _native.adam_update(p, g, m, v, step=1, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="simd"):
        _native.adam_update(p, g, m, v, step=1, simd="sse9")
    with pytest.raises(ValueError, match="num_threads"):
        _native.adam_update(p, g, m, v, step=1, num_threads=0)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        _native.grad_sq_norm([[1.0, 2.0]])
    before = [t.clone() for t in (p, m, v)]
    with pytest.raises(ValueError):
        _native.adam_update(p, g, m, v[:10], step=1)
    for a, b in zip(before, (p, m, v)):
        assert torch.equal(a, b)


HYPER = (0.1, 0.9, 0.999, 1e-8, 0.0, True, False, False)


def test_state_set_keeps_its_buffers_alive() -> None:
    p = torch.nn.Parameter(torch.randn(100))
    m, v, steps = torch.zeros(112), torch.zeros(112), torch.zeros(1)
    addr = m.data_ptr()
    s = _native.StateSet([100], [0], ["p"], m, v, steps, params=[p])
    # Drop every Python reference to the flat buffers: the set's DLPack imports hold them.
    del m, v, steps
    gc.collect()
    junk = [torch.full((112,), 7.0) for _ in range(50)]  # would reuse freed memory
    p.grad = torch.ones(100)
    assert _native.adam_step([s], [HYPER], [None], num_threads=1) == [[0]]
    assert all(float(j.sum()) == 784.0 for j in junk)
    assert addr != 0 and p.detach().abs().max() < 10


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_accumulate_rounds_like_torch(dst_dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    n = 2 * _native.CHUNK + 7
    dst = torch.randn(n).to(dst_dtype)
    src = torch.randn(n).to(src_dtype)
    want = (dst.float() + src.float()).to(dst_dtype)  # torch: computed in fp32, rounded once
    _native.grad_accumulate(dst, src, num_threads=2)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="src: has 3 elements"):
        _native.grad_accumulate(dst, src[:3])
    with pytest.raises(ValueError, match="share memory"):
        _native.grad_accumulate(dst, dst)


def test_state_set_checks_its_buffers_and_selections() -> None:
    n = 32
    master, m, v, steps, g = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(1), torch.zeros(n)
    landing = dict(landing=[g, None, None], landing_slots=[(0, 0)])
    s = _native.StateSet([n], [0], ["p"], m, v, steps, master, **landing)
    assert not s.in_place and s.grads_landed and len(s) == 1
    with pytest.raises(ValueError, match="share memory"):
        s.set_max_exp_avg_sq(v)
    with pytest.raises(ValueError, match="past the end"):
        _native.StateSet([n + 1], [0], ["p"], m, v, steps, master, **landing)
    with pytest.raises(ValueError, match="share memory"):
        _native.StateSet([n], [0], ["p"], m, m, steps, master, **landing)
    with pytest.raises(ValueError, match="master buffer"):
        _native.StateSet([n], [0], ["p"], m, v, steps, **landing)
    with pytest.raises(ValueError, match="overlapping state slots"):
        _native.StateSet([16, 16], [0, 8], ["a", "b"], m, v, torch.zeros(2), master, landing=[g, None, None], landing_slots=[(0, 0), (0, 16)])
    with pytest.raises(ValueError, match="no landing buffer"):
        _native.StateSet([n], [0], ["p"], m, v, steps, master, landing=[g, None, None], landing_slots=[(1, 0)])
    with pytest.raises(ValueError, match="repeated"):
        _native.adam_step([s], [HYPER], [[0, 0]], num_threads=1)
    with pytest.raises(ValueError, match="selections: required"):
        _native.adam_step([s], [HYPER], [None], num_threads=1)
    with pytest.raises(ValueError, match="param group 0: Invalid learning rate"):
        _native.adam_step([s], [(float("nan"), *HYPER[1:])], [[0]], num_threads=1)
    # Two sets of one step must not share memory.
    p = torch.nn.Parameter(torch.randn(n))
    a = _native.StateSet([n], [0], ["a"], torch.zeros(n), torch.zeros(n), torch.zeros(1), params=[p])
    b = _native.StateSet([n], [0], ["b"], torch.zeros(n), torch.zeros(n), torch.zeros(1), params=[p])
    p.grad = torch.ones(n)
    with pytest.raises(ValueError, match="share memory"):
        _native.adam_step([a, b], [HYPER, HYPER], [None, None], num_threads=1)
    with pytest.raises(ValueError, match="share memory"):
        a.check_disjoint([b])


def test_a_set_reads_its_gradients_from_landing_buffers_and_writes_masters() -> None:
    """Copy mode: a bfloat16 slot reads its gradient from the landing slot, then overwrites it
    with the rounded new weights; a float32 slot's weights are its master."""
    n = 20
    master = torch.randn(64)
    m, v = torch.zeros(64), torch.zeros(64)
    g32, g16 = torch.randn(32), torch.randn(32).bfloat16()
    refs = []
    for off, g in ((0, g32[:n]), (32, g16[:n].float())):
        ref = (master[off : off + n].clone(), g.clone(), torch.zeros(n), torch.zeros(n))
        _native.adam_update(*ref, step=1, lr=0.1)
        refs.append(ref[0])
    s = _native.StateSet([n, n], [0, 32], ["f", "b"], m, v, torch.zeros(2), master,
                         landing=[g32, g16, None], landing_slots=[(0, 0), (1, 0)])  # fmt: skip
    assert _native.adam_step([s], [HYPER], [[0, 1]], num_threads=1) == [[0, 1]]
    assert torch.equal(master[:n], refs[0])
    assert torch.equal(master[32 : 32 + n], refs[1])
    assert torch.equal(g16[:n], refs[1].bfloat16())
