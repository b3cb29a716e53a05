"""torch.distributed on 2 processes over gloo (CPU): DDP and ZeroRedundancyOptimizer with our
optimizer, against torch's on the same data."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import spawn

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

STEPS = 20
STREAM = {"OFFLOAD_ADAM_FORCE_STREAMING": "1"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100)
    return [(torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 4, generator=g)) for _ in range(steps)]


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


def test_ddp_with_free_gradients_is_refused_clearly() -> None:
    """DDP writes the averaged gradients after our hook copied (and freed) the local ones: that
    step was silently wrong (the ranks drifted apart); it is refused before anything changes."""
    with pytest.raises(AssertionError, match="written again after the backward.*free_gradients=False"):
        spawn(_ddp_worker, {"free_gradients": True}, env=STREAM)


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
            ctx = ddp.no_sync() if j == 0 else _nullcontext()
            with ctx:
                (((ddp(x[rank::world]) - y[rank::world]) ** 2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return [p.detach().clone() for p in m.parameters()]


def _nullcontext() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _accumulated_reference(world: int) -> list[torch.Tensor]:
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    data = _batches(world, STEPS)
    for t in range(0, len(data), 2):
        for x, y in data[t : t + 2]:
            (sum(((m(x[r::world]) - y[r::world]) ** 2).mean() for r in range(world)) / world / 2).backward()
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
    from torch.distributed.tensor import DTensor, Replicate

    from offload_adam import AdamW, _native

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Replicate()]))
    out = []
    try:
        AdamW([p])
        out.append("accepted")
    except TypeError as e:
        out.append(str(e))
    # The kernel's own entry points refuse a DTensor as well (its export has no host pointer).
    for call in (lambda: _native.grad_sq_norm([p.detach()]), lambda: _native.grads_nonfinite([p.detach()])):
        try:
            call()
            out.append("accepted")
        except (TypeError, ValueError, RuntimeError) as e:
            out.append(type(e).__name__)
    return out


def test_dtensors_never_reach_the_kernel() -> None:
    msgs = spawn(_dtensor_worker)[0]
    assert "DTensor is not supported" in msgs[0] and "local shards" in msgs[0]
    assert "accepted" not in msgs
