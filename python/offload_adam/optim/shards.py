"""DTensor (FSDP2) parameters, stepped through their local shards.

FSDP2 keeps each rank's shard of a parameter as the local tensor of a DTensor. The kernel steps
that local tensor in place (a CPU shard) or streams it (a shard on the device); the optimizer's
param groups and ``state`` hold the DTensor. This module is the one place the package reaches a
DTensor's local tensor (``_local_tensor``, which FSDP2 itself reads and replaces: ``to_local()``
would wrap it for autograd), and it checks that what is handed to us lines up with a parameter's
shard: its gradient, a loaded state entry, an 8-bit moment's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .schema import MIN_NUMEL, QBLOCK


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's parameters), without importing torch.distributed."""
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def local(t: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    return t._local_tensor if is_dtensor(t) else t


def same_sharding(t: Any, key: Tensor) -> bool:
    """Whether ``t`` is a DTensor of the DTensor parameter ``key``'s mesh and placements, so that
    its local shard lines up with ``key``'s."""
    return (
        is_dtensor(t) and is_dtensor(key) and t.placements == key.placements and t.device_mesh == key.device_mesh  # type: ignore[attr-defined]
    )


def check_local(loc: Any, name: str) -> None:
    """A DTensor parameter's local shard must be a plain tensor: it is what the kernel updates
    (or the plain memory of a device whose tensors are a Python subclass, its ``tensor_type``:
    the test suite's simulated GPU)."""
    if not isinstance(loc, Tensor) or (type(loc).__torch_dispatch__ is not Tensor.__torch_dispatch__ and not _device_memory(loc)):
        raise TypeError(f"{name}: the DTensor's local shard is a {type(loc).__name__}, not a plain tensor")


def _device_memory(t: Tensor) -> bool:
    from ..runtime.device import device_for, tensor_type

    try:
        dev = device_for(t.device)
    except ValueError:
        return False
    return dev is not None and type(t) is tensor_type(dev)


def local_shards(params: list[Tensor], names: list[str]) -> tuple[list[Tensor], list[Tensor] | None]:
    """The tensors the kernel steps: a DTensor parameter's local shard (FSDP2 keeps its shard of
    every parameter as one), others themselves; and the parameters as given (None if no
    DTensor is among them)."""
    if not any(is_dtensor(p) for p in params):
        return params, None
    out = []
    for p, name in zip(params, names):
        if is_dtensor(p):
            if any(pl.is_partial() for pl in p.placements):  # type: ignore[attr-defined]
                raise ValueError(f"{name}: a DTensor with a Partial placement has no values of its own to update")
            loc = local(p)
            check_local(loc, name)
            out.append(loc)
        else:
            out.append(p)
    return out, list(params)


def check_shard_grad(k: Tensor, grad: Tensor, name: str) -> None:
    """A DTensor parameter's gradient must be a DTensor of its mesh and placements: its local
    shard is what the kernel reads in place of the parameter's gradient."""
    if not same_sharding(grad, k):
        raise TypeError(
            f"{name}: the gradient of a DTensor parameter must be a DTensor with its mesh and placements, "
            f"got {type(grad).__name__}" + (f" with placements {grad.placements}" if hasattr(grad, "placements") else "")
        )


def grad_shard(k: Tensor, grad: Tensor, name: str) -> Tensor:
    """The local shard of DTensor parameter ``k``'s gradient ``grad``, checked."""
    check_shard_grad(k, grad, name)
    return local(grad)  # type: ignore[no-any-return]


def checked_local(t: Any, key: Tensor | None = None, what: str = "") -> Any:
    """A DTensor's local shard (checked against the parameter ``key``'s mesh and placements when
    given); anything else as it is."""
    if not is_dtensor(t):
        return t
    if key is not None and not same_sharding(t, key):
        raise ValueError(
            f"{what}: a DTensor with placements {t.placements} does not match its parameter's "  # type: ignore[attr-defined]
            f"{getattr(key, 'placements', 'plain tensor')}"
        )
    return local(t)


def localizer(key: Tensor, name: str) -> Callable[[Any, str], Any]:
    """A loaded entry's tensors as local shards, checked against the parameter ``key`` (the
    ``local`` argument of the schema's checks and writes)."""
    return lambda t, what: checked_local(t, key, f"loaded state of {name}: {what}")


def row_blocks(k: Tensor) -> bool:
    """Whether a DTensor parameter's shards all get 8-bit moments, with their blocks along whole
    rows: FSDP2's ``Shard(0)`` on one mesh dimension, rows of whole blocks of 256, and every
    rank's shard (``torch.chunk`` of the rows) at least ``MIN_NUMEL`` elements. Every rank then
    agrees on the codec (from the global shape alone), a block never straddles a shard, and the
    absmax shards as the parameter's rows do (``(rows, row // 256)``)."""
    from torch.distributed.tensor import Shard

    pl = k.placements  # type: ignore[attr-defined]
    if k.ndim < 2 or len(pl) != 1 or pl[0] != Shard(0):
        return False
    row = math.prod(k.shape[1:])
    if row % QBLOCK:
        return False
    world, rows = k.device_mesh.size(), k.shape[0]  # type: ignore[attr-defined]
    per = -(-rows // world)
    return all(max(0, min(rows, (r + 1) * per) - r * per) * row >= MIN_NUMEL for r in range(world))


def as_dtensor(name: str, t: Tensor, k: Tensor) -> Tensor:
    """State view ``t`` (named ``name`` in ``state[p]``) of DTensor parameter ``k``'s local shard,
    as a DTensor of ``k``'s mesh and placements (as torch's AdamW keeps it), whose local tensor
    is the view itself, in host memory on a GPU's mesh too (as FSDP2 keeps a CPUOffloadPolicy
    shard): ``DTensor.from_local`` would copy it to the mesh's device, a copy made once that the
    steps never update (the state read on a GPU was the one at the first step)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    assert isinstance(k, DTensor)
    shape, stride = k.shape, k.stride()
    if name.endswith(("_absmax", "_scale")):  # one per 256 elements of each row (see row_blocks)
        per = math.prod(k.shape[1:]) // QBLOCK
        shape, stride = torch.Size((k.shape[0], per)), (per, 1)
    spec = DTensorSpec(k.device_mesh, tuple(k.placements), tensor_meta=TensorMeta(shape, stride, t.dtype))
    return DTensor(t, spec, requires_grad=False)  # type: ignore[call-arg]
