"""The hyper-parameters: torch's checks of ``Adam.__init__`` and a param group's hyper-parameters
as the kernel takes them (the one place they enter it), shared by the optimizer's surface, its
state I/O (the groups of a loaded checkpoint) and the engine."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

# A param group's hyper-parameters as the kernel takes them:
# (lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize).
Hyper = tuple[float, float, float, float, float, bool, bool, bool]


def to_scalar(x: Any) -> Any:
    """torch's ``_to_scalar``: a 1-element tensor becomes 0-d; anything else is kept."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


def as_float(x: Any, what: str) -> float:
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        return float(x.item())
    return float(x)


def check_init(lr: Any, betas: Any, eps: float, weight_decay: float, foreach: bool | None, capturable: bool) -> None:
    """torch's checks of ``Adam.__init__``, in its order and with its messages (plus NaN and inf
    learning rates, which the kernel refuses)."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr or math.isinf(float(lr)):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (
        (isinstance(betas[0], float) and isinstance(betas[1], float))
        or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))
    ):
        raise ValueError("betas must be either both floats or both Tensors")
    for k in (0, 1):
        if isinstance(betas[k], Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{k}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[k].numel() != 1:
                raise ValueError(f"Tensor betas[{k}] must be 1-element")


def hyper(group: dict[str, Any]) -> Hyper:
    """A param group's hyper-parameters as the kernel takes them, checked: the one place they
    enter the kernel (any pair for betas: a tuple, a list from a config file, tensors)."""
    lr = as_float(group["lr"], "lr")
    if not 0.0 <= lr or math.isinf(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    try:
        b1, b2 = group["betas"]
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats, got {group['betas']!r}") from None
    b1, b2 = as_float(b1, "betas[0]"), as_float(b2, "betas[1]")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b1}")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b2}")
    eps, wd = float(group["eps"]), float(group["weight_decay"])
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= wd:
        raise ValueError(f"Invalid weight_decay value: {wd}")
    return (lr, b1, b2, eps, wd, bool(group["decoupled_weight_decay"]), bool(group["amsgrad"]), bool(group["maximize"]))
