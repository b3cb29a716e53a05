"""torch.distributed on 2 processes over gloo (CPU): DDP and ZeroRedundancyOptimizer with our
optimizer, against torch's on the same data."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import SIMULATE, spawn
from helpers import to_device

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

STEPS = 20
STREAM = {SIMULATE: "1"}


def _model() -> torch.nn.Module:
    """On the simulated device inside one (as to "cuda"), else on the CPU."""
    torch.manual_seed(0)
    return to_device(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))


def _batches(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100)
    return [to_device((torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 4, generator=g))) for _ in range(steps)]


def _single_process_reference(world: int, steps: int = STEPS) -> list[torch.Tensor]:
    """torch.optim.AdamW on the full batch: the mean over ranks of each rank's mean loss."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in _batches(world, steps):
        loss = sum(((m(x[r::world]) - y[r::world]) ** 2).mean() for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


def _ddp_worker(rank: int, world: int, kw: dict[str, Any]) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_adam import AdamW

    m = _model()
    ddp = DDP(m)
    opt = AdamW(ddp.parameters(), lr=1e-2, **kw)
    for x, y in _batches(world, STEPS):
        loss = ((ddp(x[rank::world]) - y[rank::world]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return [p.detach().clone() for p in m.parameters()]


def _assert_same_on_ranks_and_close(out: list[list[torch.Tensor]], ref: list[torch.Tensor]) -> None:
    a, b = out
    for x, y, r in zip(a, b, ref):
        assert torch.equal(x, y), "the ranks' weights differ"
        torch.testing.assert_close(x, r, rtol=0, atol=1e-5)


@pytest.mark.parametrize("env", [{}, STREAM], ids=["cpu", "streamed"])
@pytest.mark.parametrize("kw", [{}, {"async_step": True}], ids=["sync", "async"])
def test_ddp_matches_single_process_adamw(env: dict[str, str], kw: dict[str, Any]) -> None:
    if kw and not env:
        pytest.skip("async_step applies to offloaded parameters")
    _assert_same_on_ranks_and_close(spawn(_ddp_worker, kw, env=env), _single_process_reference(2))


def _ddp_hook_worker(rank: int, world: int, hook: bool, kw: dict[str, Any], ddp_kw: dict[str, Any]) -> Any:
    """DDP over offloaded parameters (simulated device), with or without our communication
    hook; two micro-batches per step (the first under no_sync), clipping on the model. Returns
    the weights and the bytes copied to the host per step (after the first)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_adam import AdamW, register_ddp_hook

    m = _model()
    ddp = DDP(m, **ddp_kw)
    opt = AdamW(ddp.parameters(), lr=1e-2, **kw)
    if hook:
        register_ddp_hook(ddp, opt)
    dev = opt._engine.device
    per_step = []
    data = _batches(world, STEPS)
    for t in range(0, len(data), 2):
        before = dev.copied_bytes.get("d2h", 0)
        for j, (x, y) in enumerate(data[t : t + 2]):
            with ddp.no_sync() if j == 0 else contextlib.nullcontext():
                (((ddp(x[rank::world]) - y[rank::world]) ** 2).mean() / 2).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        per_step.append(dev.copied_bytes.get("d2h", 0) - before)
    grad_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    return [p.detach().clone() for p in m.parameters()], per_step[1:], grad_bytes


@pytest.mark.parametrize(
    "kw, ddp_kw", [({}, {}), ({"async_step": True}, {}), ({}, {"gradient_as_bucket_view": True})],
    ids=["sync", "async", "bucket-view"],
)  # fmt: skip
def test_ddp_hook_copies_each_averaged_gradient_once(kw: dict[str, Any], ddp_kw: dict[str, Any]) -> None:
    ref = _accumulated_reference(2, clip=0.5)
    out = spawn(_ddp_hook_worker, True, kw, ddp_kw, env=STREAM)
    _assert_same_on_ranks_and_close([w for w, _, _ in out], ref)
    for _, per_step, grad_bytes in out:
        # once: no local copy at the hooks, none again at the step (clipping on the model
        # edits the gradients after the backward: those are copied again, as they must be)
        assert all(b <= 2 * grad_bytes for b in per_step), (per_step, grad_bytes)
    plain = spawn(_ddp_hook_worker, False, kw, ddp_kw, env=STREAM)
    _assert_same_on_ranks_and_close([w for w, _, _ in plain], ref)


def _ddp_hook_noclip_worker(rank: int, world: int) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_adam import AdamW, register_ddp_hook

    out = {}
    for hook in (True, False):
        m = _model()
        ddp = DDP(m)
        opt = AdamW(ddp.parameters(), lr=1e-2)
        if hook:
            register_ddp_hook(ddp, opt)
        dev = opt._engine.device
        counts = []
        for x, y in _batches(world, 6):
            before = dev.copied_bytes.get("d2h", 0)
            ((ddp(x[rank::world]) - y[rank::world]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            counts.append(dev.copied_bytes.get("d2h", 0) - before)
        out[hook] = (counts[1:], [p.detach().clone() for p in m.parameters()])
        opt.close()
    grad_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    return out, grad_bytes


def test_ddp_hook_bytes_per_step_are_the_gradients_once() -> None:
    (out, grad_bytes), _ = spawn(_ddp_hook_noclip_worker, env=STREAM)
    assert out[True][0] == [grad_bytes] * len(out[True][0])  # each gradient once
    assert all(b == 2 * grad_bytes for b in out[False][0])  # without the hook: twice
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))


def test_ddp_with_free_gradients_is_refused_clearly() -> None:
    """DDP writes the averaged gradients after our hook copied (and freed) the local ones: that
    step was silently wrong (the ranks drifted apart); it is refused before anything changes."""
    with pytest.raises(AssertionError, match="written again after the backward.*free_gradients=False"):
        spawn(_ddp_worker, {"free_gradients": True}, env=STREAM)


def _ddp_streamed_weights_worker(rank: int, world: int, stream: bool, kw: dict[str, Any]) -> Any:
    """DDP with our hook over a model whose weights each rank streams (offload_weights first,
    then DDP without its initial broadcast: the parameters hold placeholders outside a forward,
    the ranks start from the same seed), two micro-batches a step, clipping on the model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import offload_adam
    from offload_adam.runtime.hosted import home_of

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])
    h = offload_adam.offload_weights(m, prefetch=1) if stream else None
    if h is None:
        m = to_device(m)  # resident: on the device, as on "cuda"
    ddp = DDP(m, init_sync=False, broadcast_buffers=False)
    opt = offload_adam.AdamW(ddp.parameters(), lr=1e-2, **kw)
    opt.register_ddp_hook(ddp)
    data = _batches(world, STEPS)
    for t in range(0, len(data), 2):
        for j, (x, y) in enumerate(data[t : t + 2]):
            with ddp.no_sync() if j == 0 else contextlib.nullcontext():
                (((ddp(x[rank::world])[:, :4] - y[rank::world]) ** 2).mean() / 2).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = [(home_of(p).host if home_of(p) is not None else p.detach()).clone() for p in m.parameters()]
    state = [opt.state[p]["exp_avg_sq"].clone() for p in m.parameters()]
    report = h.report() if h is not None else None
    opt.close()
    if h is not None:
        h.close()
    return out, state, report


@pytest.mark.parametrize("kw", [{}, {"async_step": True}], ids=["sync", "async"])
def test_ddp_with_streamed_weights_is_bitwise_ddp_with_them_resident(kw: dict[str, Any]) -> None:
    """Each rank streams its own weights; the averaged gradients reach the kernel through our
    hook, which writes the host copies the next forward streams: the same as DDP over offloaded
    resident weights, to the bit, on both ranks."""
    streamed = spawn(_ddp_streamed_weights_worker, True, kw, env=STREAM)
    resident = spawn(_ddp_streamed_weights_worker, False, kw, env=STREAM)
    (w0, s0, r0), (w1, s1, _) = streamed
    assert r0["h2d_bytes"] > 0 and r0["gpu_peak_bytes"] < r0["weights_bytes"]
    for a, b, c, d in zip(w0, w1, s0, s1):
        assert torch.equal(a, b) and torch.equal(c, d), "the ranks differ"
    for (w, s, _), (rw, rs, _) in zip(streamed, resident):
        assert all(torch.equal(a, b) for a, b in zip(w, rw))
        assert all(torch.equal(a, b) for a, b in zip(s, rs))


def _ddp_accumulate_worker(rank: int, world: int, kw: dict[str, Any], ddp_kw: dict[str, Any]) -> list[torch.Tensor]:
    """Two micro-batches per step, the first under no_sync()."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_adam import AdamW

    m = _model()
    ddp = DDP(m, **ddp_kw)
    opt = AdamW(ddp.parameters(), lr=1e-2, **kw)
    data = _batches(world, 2 * STEPS // 2)
    for t in range(0, len(data), 2):
        for j, (x, y) in enumerate(data[t : t + 2]):
            ctx = ddp.no_sync() if j == 0 else contextlib.nullcontext()
            with ctx:
                (((ddp(x[rank::world]) - y[rank::world]) ** 2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return [p.detach().clone() for p in m.parameters()]


def _accumulated_reference(world: int, clip: float | None = None) -> list[torch.Tensor]:
    """torch.optim.AdamW in one process, two micro-batches per step (optionally clipped)."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    data = _batches(world, STEPS)
    for t in range(0, len(data), 2):
        for x, y in data[t : t + 2]:
            (sum(((m(x[r::world]) - y[r::world]) ** 2).mean() for r in range(world)) / world / 2).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("env", [{}, STREAM], ids=["cpu", "streamed"])
@pytest.mark.parametrize("ddp_kw", [{}, {"gradient_as_bucket_view": True}], ids=["default", "bucket-view"])
def test_ddp_no_sync_accumulation_and_bucket_views(env: dict[str, str], ddp_kw: dict[str, Any]) -> None:
    _assert_same_on_ranks_and_close(spawn(_ddp_accumulate_worker, {}, ddp_kw, env=env), _accumulated_reference(2))


def _zero_worker(rank: int, world: int, resume: bool, ours: bool, kw: dict[str, Any]) -> list[torch.Tensor]:
    """ZeroRedundancyOptimizer over DDP: 5 steps, optionally a consolidated checkpoint loaded
    into a new ZeroRedundancyOptimizer, 5 more steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import offload_adam

    cls = offload_adam.AdamW if ours else torch.optim.AdamW
    m = _model()
    ddp = DDP(m)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, lr=1e-2, **kw)
    data = _batches(world, 10)

    def train(opt: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            ((ddp(x[rank::world]) - y[rank::world]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

    train(opt, data[:5])
    if resume:
        opt.consolidate_state_dict(to=0)
        obj = [opt.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, lr=0.5, **kw)
        opt.load_state_dict(obj[0])
    train(opt, data[5:])
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("kw", [{}, {"parameters_as_bucket_view": True}], ids=["default", "bucket-view"])
def test_zero_redundancy_optimizer_trains_and_resumes_exactly(kw: dict[str, Any]) -> None:
    ref = spawn(_zero_worker, False, False, kw)[0]  # torch's AdamW under ZeRO, uninterrupted
    for resume in (False, True):
        a, b = spawn(_zero_worker, resume, True, kw)
        for x, y, r in zip(a, b, ref):
            assert torch.equal(x, y)
            torch.testing.assert_close(x, r, rtol=0, atol=1e-5)


def _dtensor_worker(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from offload_adam import AdamW, _native

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Shard(0)]))
    opt = AdamW([p])
    out = []
    # The cases that crashed the process: a DTensor parameter with a plain-tensor gradient in
    # step(), and clip_grad_norm_ over such gradients. Both are refused, nothing changed.
    p.grad = torch.ones(4 * world)  # the global shape: torch allows it
    for call in (opt.step, lambda: opt.clip_grad_norm_(1.0)):
        try:
            call()
            out.append("accepted")
        except TypeError as e:
            out.append(str(e))
    # The kernel's own entry points refuse a DTensor (its export has no host pointer).
    for call in (lambda: _native.grad_sq_norm([p.detach()]), lambda: _native.grads_nonfinite([p.detach()])):
        try:
            call()
            out.append("accepted")
        except (TypeError, ValueError, RuntimeError) as e:
            out.append(type(e).__name__)
    out.append("stepped" if opt.state else "untouched")
    return out


def test_dtensors_never_reach_the_kernel_unchecked() -> None:
    msgs = spawn(_dtensor_worker)[0]
    assert "accepted" not in msgs
    assert all("must be a DTensor with its mesh and placements" in m for m in msgs[:2])
    assert msgs[-1] == "untouched"


# -- FSDP2 ----------------------------------------------------------------------------------------


def _fsdp_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """On the simulated device inside one (as to "cuda"), else on the CPU."""
    torch.manual_seed(0)
    # Linear(16, 3): shards of 2 and 1 rows; Linear(3, 1): shards of 1 and 0 rows (an empty one).
    return to_device(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).to(dtype)
    )


def _shard(m: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    return m


def _fsdp_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [to_device(torch.randn(4, 8, generator=g)) for _ in range(steps)]


def _fsdp_train(m: torch.nn.Module, opt: Any, batches: list[torch.Tensor], rank: int, world: int, clip: str, sched: Any = None) -> list[float]:
    norms = []
    dt = next(m.parameters()).dtype
    for x in batches:
        x = x.to(dt)
        xs = x[rank::world] if world > 1 else x
        if world > 1:
            loss = m(xs).float().square().mean()
        else:  # one rank doing what two did: the mean of their mean losses
            loss = sum(m(x[r::2]).float().square().mean() for r in range(2)) / 2
        loss.backward()
        if clip == "ours":
            norms.append(float(opt.clip_grad_norm_(0.5)))
        elif clip == "torch":
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return norms


def _fsdp_worker(rank: int, world: int, ours: bool, kw: dict[str, Any], clip: str, dtype: torch.dtype) -> Any:
    import tempfile

    import offload_adam

    m = _shard(_fsdp_model(dtype))
    cls = offload_adam.AdamW if ours else torch.optim.AdamW
    kw = dict(kw)
    nvme = tempfile.TemporaryDirectory() if kw.pop("nvme", False) else None
    if nvme is not None:  # each rank its own run directory, here even its own nvme_dir
        kw.update(offload="nvme", nvme_dir=nvme.name, bucket_mb=0.0005)
    opt = cls(m.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5)
    norms = _fsdp_train(m, opt, _fsdp_batches(12), rank, world, clip, sched)
    sd = opt.state_dict()
    kinds = sorted({f"{k}:{type(v).__name__}" for e in sd["state"].values() for k, v in e.items()})
    full = {k: v.full_tensor() for k, v in sd["state"][2].items() if k != "step"}  # Linear(16, 3).weight
    if nvme is not None:
        opt.close()
        nvme.cleanup()
    return [p.full_tensor().float() for p in m.parameters()], norms, kinds, full


@pytest.mark.parametrize(
    "kw, clip, dtype",
    [({}, "ours", torch.float32), ({"amsgrad": True}, "torch", torch.float32), ({}, "none", torch.bfloat16)],
    ids=["clip-ours", "amsgrad-clip-torch", "bf16-params"],
)
def test_fsdp2_matches_torch_adamw_on_the_same_shards(kw: dict[str, Any], clip: str, dtype: torch.dtype) -> None:
    ref = spawn(_fsdp_worker, False, kw, "torch" if clip != "none" else "none", dtype)
    out = spawn(_fsdp_worker, True, kw, clip, dtype)
    (wa, na, kinds, full), (wb, nb, _, _) = out
    assert all(torch.equal(x, y) for x, y in zip(wa, wb)), "the ranks' weights differ"
    assert "exp_avg:DTensor" in kinds and "step:Tensor" in kinds  # as torch's AdamW keeps them
    if dtype == torch.bfloat16:
        assert "master_param:DTensor" in kinds  # fp32 masters of the bf16 shards
        tol = 1e-2  # torch steps bf16 weights directly; ours keeps fp32 masters
    else:
        tol = 1e-5
        for k, v in ref[0][3].items():
            torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-6)
    for x, r in zip(wa, ref[0][0]):
        torch.testing.assert_close(x, r, rtol=0, atol=tol)
    if clip != "none":
        assert na == nb
        for x, r in zip(na, ref[0][1]):
            assert abs(x - r) <= 1e-5 * max(1.0, r)


def _fsdp_q8_worker(rank: int, world: int, state_dtype: str = "uint8") -> Any:
    """8-bit (or fp8) moments on FSDP2 shards (world 2) or on the whole model (world 1):
    Linear(256, 64)'s weight quantizes (rows of 256, shards of 32 rows); the others are too small."""
    import offload_adam

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48))
    if world > 1:
        _shard(m)
    opt = offload_adam.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, state_dtype=getattr(torch, state_dtype))
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(4, 256, generator=g) for _ in range(8)]
    _fsdp_train(m, opt, batches, rank, world, "none")
    sd = opt.state_dict()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    kinds = sorted({f"{k}:{type(v).__name__}" for e in sd["state"].values() for k, v in e.items()})

    def bits(t: Any) -> Any:  # fp8 codes gathered as their bytes (gloo has no float8)
        if t.dtype != torch.float8_e4m3fn:
            return full(t)
        if not hasattr(t, "full_tensor"):
            return t.view(torch.uint8)
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()

    return [full(p.detach()) for p in m.parameters()], {k: bits(v) for k, v in sd["state"][0].items()}, kinds, set(sd["state"][2])


@pytest.mark.parametrize("state_dtype, scale", [("uint8", "absmax"), ("float8_e4m3fn", "scale")])
def test_fsdp2_shards_with_quantized_moments_step_as_the_whole_model(state_dtype: str, scale: str) -> None:
    """Blocks along whole rows never straddle a shard: FSDP2's two ranks quantize as one process
    quantizes the whole tensor, bitwise (codes, and absmax or scale shaped (rows, row // 256), as
    DTensors)."""
    out = spawn(_fsdp_q8_worker, state_dtype)
    (wa, sa, kinds, keys2), (wb, _, _, _) = out
    assert all(torch.equal(x, y) for x, y in zip(wa, wb)), "the ranks' weights differ"
    assert "exp_avg_codes:DTensor" in kinds and f"exp_avg_{scale}:DTensor" in kinds
    assert "exp_avg" in keys2 and "exp_avg_codes" not in keys2  # Linear(64, 48).weight: too small
    wr, sr, _, _ = _fsdp_q8_worker(0, 1, state_dtype)
    assert sa[f"exp_avg_{scale}"].shape == (64, 1) and sr[f"exp_avg_{scale}"].shape == (64,)
    for x, r in zip(wa, wr):
        assert torch.equal(x, r)
    assert torch.equal(sa["exp_avg_codes"], sr["exp_avg_codes"])
    assert torch.equal(sa[f"exp_avg_{scale}"].reshape(-1), sr[f"exp_avg_{scale}"])


@pytest.mark.parametrize("kw", [{}, {"async_step": True}, {"free_gradients": True}], ids=["sync", "async", "free-gradients"])
def test_fsdp2_streamed_shards_match_torch_adamw(kw: dict[str, Any]) -> None:
    """FSDP2 with its shards on the device (no CPUOffloadPolicy): our optimizer streams each
    rank's reduce-scattered gradient shard to the host and its updated shard back, here on the
    simulated device (the mesh of simgpu, gloo on host copies for its collectives). The state
    read after the steps is the steps' (torch's within rounding): it was a copy on the device
    made when the entry was first read, which no step updated."""
    ref = spawn(_fsdp_worker, False, {}, "torch", torch.float32)
    out = spawn(_fsdp_worker, True, kw, "ours", torch.float32, env=STREAM)
    (wa, na, kinds, full), (wb, nb, _, _) = out
    assert all(torch.equal(x, y) for x, y in zip(wa, wb)), "the ranks' weights differ"
    assert "exp_avg:DTensor" in kinds and "master_param:DTensor" in kinds
    for k, v in ref[0][3].items():
        torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-6)
    for x, r in zip(wa, ref[0][0]):
        torch.testing.assert_close(x, r, rtol=0, atol=1e-5)
    for x, r in zip(na, ref[0][1]):
        assert abs(x - r) <= 1e-5 * max(1.0, r)


@pytest.mark.parametrize("env", [{}, STREAM], ids=["cpu-shards", "streamed-shards"])
def test_fsdp2_on_the_nvme_tier_is_bitwise_the_ram_tier(env: dict[str, str]) -> None:
    ram = spawn(_fsdp_worker, True, {}, "ours", torch.float32, env=env)
    nvme = spawn(_fsdp_worker, True, {"nvme": True}, "ours", torch.float32, env=env)
    for (wa, na, _, fa), (wb, nb, _, fb) in zip(ram, nvme):
        assert all(torch.equal(x, y) for x, y in zip(wa, wb))
        assert na == nb
        assert all(torch.equal(fa[k], fb[k]) for k in fa)


def _scaler_worker(rank: int, world: int, ours: bool) -> Any:
    """GradScaler over FSDP2: an inf in rank 1's shard at step 2 only."""
    import offload_adam

    m = _shard(_fsdp_model())
    opt = offload_adam.AdamW(m.parameters(), lr=1e-2) if ours else torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler(next(m.parameters()).device.type, init_scale=1024.0)  # (the simulated device's when streamed)
    out = []
    for t, x in enumerate(_fsdp_batches(5)):
        scaler.scale(m(x[rank::world]).square().mean()).backward()
        if t == 2 and rank == 1:
            next(m.parameters()).grad._local_tensor[0, 0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        opt_state = opt.state[next(m.parameters())]
        out.append((scaler.get_scale(), float(opt_state["step"])))
    opt.synchronize() if ours else None
    return out, [p.full_tensor() for p in m.parameters()]


@pytest.mark.parametrize("env", [{}, STREAM], ids=["cpu-shards", "streamed-shards"])
def test_fsdp2_grad_scaler_skips_on_every_rank_together(env: dict[str, str]) -> None:
    (ra, wa), (rb, wb) = spawn(_scaler_worker, True, env=env)
    assert ra == rb  # the same scale and step counts on both ranks: the inf step skipped by both
    assert [s for _, s in ra] == [1.0, 2.0, 2.0, 3.0, 4.0] and ra[2][0] == ra[1][0] / 2
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    (ref, wr), _ = spawn(_scaler_worker, False)
    assert ra == ref
    for x, r in zip(wa, wr):
        torch.testing.assert_close(x, r, rtol=0, atol=1e-5)


def _dcp_worker(rank: int, world: int, phase: str, ckpt: str, how: dict[str, Any]) -> Any:
    """phase "save": 6 steps, a DCP checkpoint of model and optimizer, 6 more steps; "load": a
    fresh model and optimizer loaded from it, 6 steps. Returns the final full weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import offload_adam

    m = _shard(_fsdp_model())
    opt = offload_adam.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    batches = _fsdp_batches(12)
    full = bool(how.get("full"))
    if phase == "save":
        _fsdp_train(m, opt, batches[:6], rank, world, "none")
        if full:
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            osd = get_optimizer_state_dict(m, opt, options=opts)
            msd = get_model_state_dict(m, options=opts)
            if rank == 0:
                torch.save({"model": msd, "optim": osd}, ckpt + ".pt")
        else:
            dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=ckpt)
        _fsdp_train(m, opt, batches[6:], rank, world, "none")
    else:
        if full:
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            sd = torch.load(ckpt + ".pt", weights_only=False) if rank == 0 else {"model": {}, "optim": {}}
            set_model_state_dict(m, sd["model"], options=opts)
            set_optimizer_state_dict(m, opt, sd["optim"], options=opts)
        else:
            sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
            dcp.load(sd, checkpoint_id=ckpt)
            set_model_state_dict(m, sd["model"])
            set_optimizer_state_dict(m, opt, sd["optim"])
        _fsdp_train(m, opt, batches[6:], rank, world, "none")
    return [p.full_tensor() for p in m.parameters()]


@pytest.mark.parametrize("how", [{}, {"full": True}], ids=["sharded", "full-cpu_offload-broadcast"])
def test_fsdp2_distributed_checkpoint_resumes_exactly(tmp_path: Any, how: dict[str, Any]) -> None:
    ckpt = str(tmp_path / "ckpt")
    straight = spawn(_dcp_worker, "save", ckpt, how)[0]
    resumed = spawn(_dcp_worker, "load", ckpt, how)[0]
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def _ddp_dcp_worker(rank: int, world: int, phase: str, ckpt: str) -> list[torch.Tensor]:
    """DDP: 10 steps with a DCP checkpoint of the optimizer after 5 ("save"), or a fresh
    optimizer loaded from it, then 5 steps ("load")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_adam import AdamW

    m = _model()
    ddp = DDP(m)
    opt = AdamW(ddp.parameters(), lr=1e-2)
    data = _batches(world, 10)

    def train(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            ((ddp(x[rank::world]) - y[rank::world]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

    if phase == "save":
        train(data[:5])
        dcp.save({"optim": get_optimizer_state_dict(ddp, opt), "model": m.state_dict()}, checkpoint_id=ckpt)
        train(data[5:])
    else:
        sd = {"optim": get_optimizer_state_dict(ddp, opt), "model": m.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt)
        m.load_state_dict(sd["model"])
        set_optimizer_state_dict(ddp, opt, sd["optim"])
        train(data[5:])
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("env", [{}, STREAM], ids=["cpu", "streamed"])
def test_ddp_distributed_checkpoint_resumes_exactly(tmp_path: Any, env: dict[str, str]) -> None:
    ckpt = str(tmp_path / "ckpt")
    straight = spawn(_ddp_dcp_worker, "save", ckpt, env=env)
    resumed = spawn(_ddp_dcp_worker, "load", ckpt, env=env)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fsdp2_checkpoint_of_2_ranks_loads_into_1_and_back(tmp_path: Any) -> None:
    """DCP reshards: saved by 2 ranks, loaded by 1 (and a 1-rank checkpoint by 2), training
    continues on the same trajectory."""
    two = str(tmp_path / "two")
    straight = spawn(_dcp_worker, "save", two, {})[0]
    one = spawn(_dcp_worker, "load", two, {}, world=1)[0]
    for a, b in zip(straight, one):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    single = str(tmp_path / "one")
    spawn(_dcp_worker, "save", single, {}, world=1)
    back = spawn(_dcp_worker, "load", single, {})[0]
    for a, b in zip(straight, back):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# -- NCCL (GPU machines with 2 GPUs or more) -------------------------------------------------------

needs_2_gpus = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
    reason="NCCL runs need 2 GPUs",
)


def _nccl_worker(rank: int, world: int, mode: str) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import offload_adam

    dev = torch.device("cuda", rank)
    if mode == "ddp":
        m = _model().to(dev)
        model: Any = DDP(m, device_ids=[rank])
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2)
        offload_adam.register_ddp_hook(model, opt)
        params = m.parameters
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        m = _fsdp_model().to(dev)
        kw = {"offload_policy": CPUOffloadPolicy()} if mode == "fsdp2-cpu-offload" else {}
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(m, **kw)
        model, params = m, m.parameters
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches(world, STEPS):
        x = x.to(dev)
        if mode == "ddp":
            loss = ((model(x[rank::world]) - y.to(dev)[rank::world]) ** 2).mean()
        else:
            loss = model(x[:, :8][rank::world]).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for p in params()]


@needs_2_gpus
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "fsdp2-cpu-offload"])
def test_nccl_runs_agree_across_ranks(mode: str) -> None:
    a, b = spawn(_nccl_worker, mode, backend="nccl")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
