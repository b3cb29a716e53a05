"""fp8 moments (``state_dtype=torch.float8_e4m3fn``) against torchao's ``AdamWFp8``/``AdamFp8``,
run eagerly on the CPU (``TORCHDYNAMO_DISABLE=1``, set before torchao imports torch's compile
path), and the state schema's fp8 codec through state dicts, checkpoints, the tiers.

The codes and scales are torchao's bitwise. The weights are not (our update is torch AdamW's
arithmetic, as for uint8 moments: see test_lowbit.py's docstring), so Adam with weight decay
(whose moments read the weights) is held bitwise with torchao's weights set to ours before each
step, and within the issue's tolerances when each runs on its own.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import copy
from typing import Any

import pytest
import torch

from offload_adam import Adam, AdamW, _native, dequantized, testing

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.subclass_fp8 import quantize_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = [(64, 256), (12544,), (48, 96), (100,), (4196,), (33, 7)]  # the last three keep float32 moments
QUANTIZED = [0, 1, 2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, comparable with torch.equal (which has no fp8 kernel)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32) if t.dtype == torch.float32 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float8_e4m3fn codes bitwise, but for the sign of NaN (0x7f and 0xff alike): a NaN's sign
    is not specified by IEEE 754 (an invalid operation gives x86's default NaN, negative; ARM's is
    positive), torch's cast keeps it, and the kernel's scalar path and its SIMD paths reach NaN
    through other operations (a block poisoned by inf - inf: 0xff on the scalar path, 0x7f as
    torchao on the SIMD paths)."""
    ca, cb = (_bits(t.contiguous()).clone() for t in (a, b))
    for c in (ca, cb):
        c[(c & 0x7F) == 0x7F] = 0x7F
    return a.dtype == b.dtype and torch.equal(ca, cb)


def _params(shapes: list[tuple[int, ...]] = SHAPES, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _groups(ps: list[torch.Tensor], wd: float) -> list[dict[str, Any]]:
    return [{"params": ps[:3], "weight_decay": wd}, {"params": ps[3:], "weight_decay": wd / 2, "lr": 2e-3}]


def _run(adamw: bool, wd: float, *, sync: bool = False, steps: int = 100, poison: bool = False) -> dict[str, Any]:
    """Ours (fp8), torchao's fp8 and torch's fp32 optimizer on the same gradients, two groups and
    a schedule (the lr halves after 50 steps; torchao's lr is a tensor, filled by hand). ``sync``:
    torchao's weights set to ours before each step. ``poison``: a NaN and an inf gradient element
    (in two blocks of the first tensor) at step 3."""
    init = _params()
    runs = {}
    cls_ours, cls_ao, cls_torch = (AdamW, torchao_optim.AdamWFp8, torch.optim.AdamW) if adamw else (Adam, torchao_optim.AdamFp8, torch.optim.Adam)
    for name, cls, kw in (("ours", cls_ours, {"state_dtype": FP8}), ("ao", cls_ao, {}), ("torch", cls_torch, {})):
        ps = [p.clone().requires_grad_() for p in init]
        runs[name] = (ps, cls(_groups(ps, wd), lr=1e-3, **kw))
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        grads = [torch.randn(p.shape, generator=g) * (0.1 if i % 2 else 1.0) for i, p in enumerate(init)]
        if poison and t == 3:
            grads[0].view(-1)[300] = float("nan")
            grads[0].view(-1)[1000] = float("inf")
        if sync:
            with torch.no_grad():
                for p, q in zip(runs["ao"][0], runs["ours"][0]):
                    p.copy_(q)
        for ps, opt in runs.values():
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            opt.step()
        if t == 49:
            for _, opt in runs.values():
                for group in opt.param_groups:
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"].fill_(group["lr"].item() / 2)
                    else:
                        group["lr"] = group["lr"] / 2
    return runs


def _state_is_torchaos(runs: dict[str, Any], keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> None:
    (po, ours), (pa, ao) = runs["ours"], runs["ao"]
    for i in QUANTIZED:
        for key in keys:
            so, sa = ours.state[po[i]], ao.state[pa[i]][key]
            assert same_codes(so[key + "_codes"], sa.codes), (i, key)
            torch.testing.assert_close(so[key + "_scale"], sa.scale, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("adamw,wd", [(True, 0.01), (True, 0.0), (False, 0.01), (False, 0.0)], ids=["adamw", "adamw-nowd", "adam", "adam-nowd"])
def test_fp8_moments_are_torchaos_bitwise_over_100_steps(adamw: bool, wd: float) -> None:
    runs = _run(adamw, wd)
    (ours, _), (ao, _), (ref, _) = runs["ours"], runs["ao"], runs["torch"]
    for i in QUANTIZED:
        ours_ao = (ours[i] - ao[i]).abs().max().item()
        ao_fp32 = (ao[i] - ref[i]).abs().max().item()
        assert ours_ao <= 1e-4, (i, ours_ao)
        assert ours_ao * 10 <= ao_fp32, (i, ours_ao, ao_fp32)
    for i in set(range(len(SHAPES))) - set(QUANTIZED):
        # torchao keeps these unquantized in the parameter's dtype (float32 here), as we do
        torch.testing.assert_close(ours[i], ref[i], rtol=0, atol=1e-6)
        assert runs["ours"][1].state[ours[i]]["exp_avg"].dtype == torch.float32
    if adamw or wd == 0.0:  # the moments never read the weights: bitwise on their own
        _state_is_torchaos(runs)
    else:  # Adam's L2 term reads the weights: bitwise from the same weights
        _state_is_torchaos(_run(adamw, wd, sync=True))


def test_nan_and_inf_blocks_follow_torchao() -> None:
    """A NaN gradient element makes its block's scale and codes NaN (and the block's weights NaN
    from the next step on); an inf one makes its block's scale inf, its code NaN and the block's
    other codes 0: as torchao's, bitwise, and the other blocks untouched."""
    runs = _run(True, 0.01, steps=6, poison=True)
    _state_is_torchaos(runs)
    (po, ours), (pa, _) = runs["ours"], runs["ao"]
    s = ours.state[po[0]]
    assert s["exp_avg_scale"][1].isnan() and s["exp_avg_scale"][3].isnan()  # inf - inf later: NaN
    assert s["exp_avg_scale"][[0, 2, 4]].isfinite().all()
    w = po[0].detach().view(-1)
    assert w[256:512].isnan().all() and w[:256].isfinite().all()
    torch.testing.assert_close(po[0], pa[0], rtol=0, atol=1e-4, equal_nan=True)


def test_quantize_and_dequantize_are_torchaos_bitwise() -> None:
    g = torch.Generator().manual_seed(3)
    n = 64 * 256
    x = torch.randn(n, generator=g) * torch.logspace(-12, 2, n)[torch.randperm(n, generator=g)]
    x[:256] = 0.0
    x[256] = float("nan")
    x[600] = float("inf")
    x[1000] = -float("inf")
    x[2000:2256] = torch.logspace(-40, -30, 256)  # subnormal and tiny floats
    want, scale = quantize_fp8(x.clone(), 256)
    codes, got = torch.empty(n, dtype=torch.uint8), torch.empty(n // 256)
    _native.quantize(x, codes, got, signed=True, fp8=True)
    assert same(codes.view(FP8), want)
    torch.testing.assert_close(got, scale, equal_nan=True, rtol=0, atol=0)
    out = torch.empty(n)
    _native.dequantize(codes, got, out, signed=False, fp8=True)
    torch.testing.assert_close(out, (want.float().view(-1, 256) * scale.view(-1, 1)).view(-1), equal_nan=True, rtol=0, atol=0)


def _stepped(state_dtype: torch.dtype = FP8, seed: int = 0, steps: int = 3, **kw: Any) -> tuple[list[torch.Tensor], AdamW]:
    ps = [p.requires_grad_() for p in _params(seed=seed)]
    opt = AdamW(_groups(ps, 0.01), lr=1e-3, state_dtype=state_dtype, **kw)
    g = torch.Generator().manual_seed(seed + 11)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, opt


def test_state_dict_layout_round_trip_and_checkpoint(tmp_path: Any) -> None:
    ps, opt = _stepped()
    sd = opt.state_dict()
    e = sd["state"][0]
    assert set(e) == {"step", "exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale"}
    assert e["exp_avg_codes"].dtype == FP8 and e["exp_avg_codes"].shape == ps[0].shape
    assert e["exp_avg_scale"].dtype == torch.float32 and e["exp_avg_scale"].shape == (ps[0].numel() // 256,)
    assert set(sd["state"][3]) == {"step", "exp_avg", "exp_avg_sq"}
    qs = [p.detach().clone().requires_grad_() for p in ps]
    other = AdamW(_groups(qs, 0.01), lr=1e-3, state_dtype=FP8)
    other.load_state_dict(copy.deepcopy(sd))
    opt.save_state(tmp_path)
    rs = [p.detach().clone().requires_grad_() for p in ps]
    third = AdamW(_groups(rs, 0.01), lr=1e-3, state_dtype=FP8)
    third.load_state(tmp_path)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q, r in zip(ps, qs, rs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad, r.grad = p.grad.clone(), p.grad.clone()
        for o in (opt, other, third):
            o.step()
    for p, q, r in zip(ps, qs, rs):
        assert same(p, q) and same(p, r)
        for k, v in opt.state[p].items():
            assert same(v, other.state[q][k]) and same(v, third.state[r][k]), k


def test_fp8_entries_convert_to_every_other_codec() -> None:
    """An fp8 state dict into uint8, float32 and torch's AdamW (through ``dequantized``), and a
    uint8 or fp32 one into fp8: each moment dequantized, then quantized in the slot's codec."""
    ps, opt = _stepped()
    sd = opt.state_dict()
    plain = dequantized(sd)
    assert set(plain["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    for i in QUANTIZED:
        e = sd["state"][i]
        want = (e["exp_avg_codes"].float().view(-1, 256) * e["exp_avg_scale"].view(-1, 1)).view(ps[i].shape)
        assert same(plain["state"][i]["exp_avg"], want)
    t = torch.optim.AdamW(_groups([p.detach().clone().requires_grad_() for p in ps], 0.01), lr=1e-3)
    t.load_state_dict(plain)
    for sd_dtype in (torch.float32, torch.uint8):
        o = AdamW(_groups([p.detach().clone().requires_grad_() for p in ps], 0.01), lr=1e-3, state_dtype=sd_dtype)
        o.load_state_dict(copy.deepcopy(sd))
        back = AdamW(_groups([p.detach().clone().requires_grad_() for p in ps], 0.01), lr=1e-3, state_dtype=FP8)
        back.load_state_dict(o.state_dict())
        for i in QUANTIZED:
            a = dequantized({"state": {0: dict(o.state[o.param_groups[0]["params"][i]])}})["state"][0]["exp_avg"]
            if sd_dtype == torch.float32:
                assert same(a, plain["state"][i]["exp_avg"])
                # fp8 values re-quantize to themselves
                b = back.state[back.param_groups[0]["params"][i]]
                assert same(b["exp_avg_codes"], sd["state"][i]["exp_avg_codes"])
            else:
                err = (a - plain["state"][i]["exp_avg"]).abs().max() / plain["state"][i]["exp_avg"].abs().max()
                assert 0 < err < 0.02
    # an fp32 moment into fp8: torchao's quantization of it
    ref = torch.optim.AdamW(_groups([p.detach().clone().requires_grad_() for p in ps], 0.01), lr=1e-3)
    ref.load_state_dict(plain)
    f8 = AdamW(_groups([p.detach().clone().requires_grad_() for p in ps], 0.01), lr=1e-3, state_dtype=FP8)
    f8.load_state_dict(ref.state_dict())
    for i in QUANTIZED:
        m = ref.state[ref.param_groups[0]["params"][i]]["exp_avg_sq"]
        codes, scale = quantize_fp8(m.reshape(-1).clone(), 256)
        s = f8.state[f8.param_groups[0]["params"][i]]
        assert same(s["exp_avg_sq_codes"].reshape(-1), codes)
        torch.testing.assert_close(s["exp_avg_sq_scale"], scale, rtol=0, atol=0)


def test_bad_fp8_entries_are_refused_before_anything_changes() -> None:
    ps, opt = _stepped(steps=1)
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_scale"] = sd["state"][0]["exp_avg_scale"][:-1]
    with pytest.raises(ValueError, match="exp_avg_scale must be 64 float32 values"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["exp_avg_codes"] = sd["state"][1]["exp_avg_codes"].view(torch.uint8)  # uint8 codes with a scale
    with pytest.raises(ValueError, match="exp_avg_codes must be float8_e4m3fn"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["exp_avg_sq_scale"]
    with pytest.raises(ValueError, match="exp_avg_sq_codes and exp_avg_sq_scale go together"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["exp_avg_absmax"] = sd["state"][2]["exp_avg_scale"]
    with pytest.raises(ValueError, match="both 'exp_avg_absmax' and 'exp_avg_scale'"):
        opt.load_state_dict(sd)
    for k, v in before.items():
        assert same(opt.state[ps[0]][k], v)


def test_offloaded_and_nvme_fp8_moments_step_as_cpu_ones(tmp_path: Any) -> None:
    init = _params(SHAPES[:4])
    cpu = [p.clone().requires_grad_() for p in init]
    ref = AdamW(cpu, lr=1e-3, state_dtype=FP8, amsgrad=True)
    nv = [p.clone().requires_grad_() for p in init]
    nvme = AdamW(nv, lr=1e-3, state_dtype=FP8, amsgrad=True, offload="nvme", nvme_dir=tmp_path, bucket_mb=0.02)
    with testing.simulated_device(seed=1, max_delay_s=0.001) as dev:
        off = [p.detach().to(dev.torch_device).requires_grad_() for p in init]  # on the simulated device
        opt = AdamW(off, lr=1e-3, state_dtype=FP8, amsgrad=True, bucket_mb=0.01)
        g = torch.Generator().manual_seed(9)
        for _ in range(6):
            grads = [torch.randn(p.shape, generator=g) for p in init]
            for ps in (cpu, off, nv):
                for p, gr in zip(ps, grads):
                    p.grad = gr.to(p.device, copy=True)
            ref.step()
            opt.step()
            nvme.step()
        opt.synchronize()
        paged = nvme.state_dict()["state"]  # the NVMe tier's state, read back from its pages
        for i, (p, q, r) in enumerate(zip(cpu, off, nv)):
            assert same(p, q.cpu()) and same(p, r)
            for k, v in ref.state[p].items():
                if k != "master_param":
                    assert same(v, opt.state[q][k]) and same(v, paged[i][k]), k
        assert "max_exp_avg_sq_codes" in ref.state[cpu[0]]
        assert dev.violations == []
    assert nvme.last_step_stats["read_bytes"] > 0
    nvme.close()


def test_memory_report_counts_one_byte_per_moment_element() -> None:
    ps = [torch.zeros(1 << 20, requires_grad=True)]
    opt = AdamW(ps, state_dtype=FP8)
    ps[0].grad = torch.zeros_like(ps[0])
    opt.step()
    assert abs(opt.memory_report()["host_bytes"] - 2 * ((1 << 20) + 4 * 4096)) <= 4096


def test_bf16_kahan_weights_with_fp8_moments_track_fp32_moments() -> None:
    init = _params(SHAPES[:3])
    runs = []
    for sd, md in ((FP8, torch.bfloat16), (torch.float32, torch.float32)):
        ps = [p.to(torch.bfloat16).requires_grad_() for p in init]
        opt = AdamW(ps, lr=1e-3, state_dtype=sd, master_dtype=md)
        g = torch.Generator().manual_seed(5)
        for _ in range(30):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
        st = opt.state
        runs.append([st[p]["master_param"] if "master_param" in st[p] else p.detach().float() + st[p]["kahan_comp"].float() for p in ps])
    for a, b, p0 in zip(*runs, init):
        assert (a - b).abs().max() < 0.1 * (b - p0.to(torch.bfloat16).float()).abs().max()
