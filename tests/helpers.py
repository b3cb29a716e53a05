"""Shared helpers of the test suite: twin models stepped by our optimizer and torch's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

SHAPES = [(7, 13), (1,), (129,), (3, 5, 7), (0,), (64, 33)]


def make_params(shapes: list[tuple[int, ...]] = SHAPES, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """Parameters on the simulated device inside ``simulated_device()`` (as a user's on "cuda"),
    on the CPU outside."""
    return [torch.nn.Parameter(to_device(torch.randn(s).to(dtype))) for s in shapes]


def clone_params(ps: list[torch.nn.Parameter], dtype: torch.dtype | None = None) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in ps]


def groups_like(groups: list[dict[str, Any]], params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """The same group structure over another set of parameters (in the same order)."""
    it = iter(params)
    out = []
    for g in groups:
        g2 = {k: v for k, v in g.items() if k != "params"}
        g2["params"] = [next(it) for _ in g["params"]]
        out.append(g2)
    return out


def run_twins(
    ours: torch.optim.Optimizer,
    ref: torch.optim.Optimizer,
    ps: list[torch.nn.Parameter],
    qs: list[torch.nn.Parameter],
    steps: int,
    grad_scale: float = 1.0,
    after_step: Callable[[int], None] | None = None,
    skip: Callable[[int, int], bool] | None = None,
) -> None:
    """Feeds both optimizers the same random gradients for ``steps`` steps."""
    for t in range(steps):
        for i, (p, q) in enumerate(zip(ps, qs)):
            if skip is not None and skip(t, i):
                p.grad = None
                q.grad = None
                continue
            g = (torch.randn(p.shape) * grad_scale).to(p.dtype)  # both see the same (rounded) values
            p.grad = g.to(p.device)
            q.grad = g.to(q.device, q.dtype)
        ours.step()
        ref.step()
        if after_step is not None:
            after_step(t)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()


def assert_state_close(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, ps: list, qs: list, rtol: float = 1e-4) -> None:
    for p, q in zip(ps, qs):
        if q not in ref.state:
            assert p not in ours.state or not ours.state[p]
            continue
        sp, sq = ours.state[p], ref.state[q]
        assert float(sp["step"]) == float(sq["step"])
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in sq:
                # rtol as the issue states; the atol (1e-6 of the moments' typical size) only
                # covers elements that cross zero, where an ulp of the terms is all there is.
                atol = 1e-7 if k == "exp_avg" else 1e-10
                torch.testing.assert_close(sp[k].cpu().double(), sq[k].cpu().double(), rtol=rtol, atol=atol)


def deep(sd: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(sd)


def to_device(x: Any) -> Any:
    """What a user does with ``.to("cuda")``: a module, or tensors (in lists, tuples, dicts), to
    the simulated device of the innermost ``simulated_device()``; unchanged outside one."""
    from offload_adam import testing

    dev = testing.active_device()
    if dev is None:
        return x
    if isinstance(x, torch.nn.Module):
        return x.to(dev.torch_device)
    return torch.utils._pytree.tree_map(lambda t: t.to(dev.torch_device) if isinstance(t, torch.Tensor) else t, x)


def to_host(x: Any) -> Any:
    """Tensors (in lists, tuples, dicts) back on the CPU, to compare with a reference."""
    return torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, x)
