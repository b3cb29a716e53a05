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
