"""DistributedDataParallel with offloaded parameters: each gradient crosses to the host once,
averaged.

Without this, our post-accumulate-grad hooks copy each local gradient to the host during
backward, DDP then averages the gradients and writes them into ``.grad``, and the step copies
them again. ``register_ddp_hook(ddp_model, optimizer)`` installs a DDP communication hook that
does DDP's own all-reduce (divide by the world size, then sum, as DDP's default hook) and, as
soon as a bucket is reduced, queues the copy of its averaged gradients into our host landing
slots; the post-accumulate hooks then copy nothing. The hook holds the optimizer's engine
weakly: DDP keeps no optimizer alive.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import weakref
from typing import Any

import torch
import torch.distributed as dist


class _HookState:
    """What the communication hook holds: the process group, and the engine weakly."""

    def __init__(self, engine: Any, group: Any) -> None:
        self.engine = weakref.ref(engine)
        self.group = group


def _hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state.group))
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()  # type: ignore[union-attr]
    params, grads = bucket.parameters(), bucket.gradients()
    engine = state.engine()
    if engine is None:  # the optimizer is gone: DDP's own all-reduce, nothing to land
        return fut.then(lambda f: f.value()[0])
    engine.queue_after_backward()

    def land(f: torch.futures.Future[Any]) -> torch.Tensor:
        out = f.value()[0]
        e = state.engine()
        if e is not None:
            e.land_averaged(params, grads)
        return out

    return fut.then(land)


def install(model: Any, engine: Any, process_group: Any = None) -> None:
    """The communication hook on ``model`` (a ``DistributedDataParallel``), landing its averaged
    gradients in ``engine``'s host slots; DDP's own process group by default."""
    engine.use_ddp_hook()
    group = process_group if process_group is not None else getattr(model, "process_group", None)
    model.register_comm_hook(_HookState(engine, group), _hook)


def register_ddp_hook(model: Any, optimizer: Any, process_group: Any = None) -> None:
    """Makes ``model`` (a ``DistributedDataParallel``) hand its averaged gradients to
    ``optimizer``: each gradient is copied to the host once, bucket by bucket as DDP reduces them
    (without the hook, offloaded gradients cross to the host twice). The same as
    ``optimizer.register_ddp_hook(model, process_group)``.

    Args:
        model: the ``torch.nn.parallel.DistributedDataParallel`` module.
        optimizer: an ``offload_adam.AdamW``/``Adam`` over the model's offloaded (CUDA) parameters.
        process_group: the group DDP's all-reduce runs on (default: None, DDP's own process group).
    """
    hook = getattr(optimizer, "register_ddp_hook", None)
    if hook is None:
        raise TypeError(f"register_ddp_hook: optimizer must be an offload_adam optimizer, got {type(optimizer).__name__}")
    hook(model, process_group)
