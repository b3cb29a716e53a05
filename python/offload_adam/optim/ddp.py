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
        self.after_backward_queued = False


def _hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state.group))
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()  # type: ignore[union-attr]
    params, grads = bucket.parameters(), bucket.gradients()
    engine = state.engine()
    if engine is None:  # the optimizer is gone: DDP's own all-reduce, nothing to land
        return fut.then(lambda f: f.value()[0])
    _queue_after_backward(state)

    def land(f: torch.futures.Future[Any]) -> torch.Tensor:
        out = f.value()[0]
        e = state.engine()
        if e is not None and e.streamed is not None:
            e.streamed.land_averaged(params, grads)  # a bucket of averaged gradients, copied once
        return out

    return fut.then(land)


def _queue_after_backward(state: _HookState) -> None:
    """From the communication hook (inside a backward): at the end of this backward, after DDP's
    own end-of-backward work, note what ``.grad`` holds (``StreamedGrads.after_backward``)."""
    if state.after_backward_queued:
        return
    state.after_backward_queued = True

    def done() -> None:
        state.after_backward_queued = False
        e = state.engine()
        if e is not None and e.streamed is not None:
            e.streamed.after_backward()

    def then_done() -> None:
        # DDP queues its end-of-backward work when its last bucket is ready, after ours was
        # queued: queued from here, `done` runs after it (callbacks queued by a callback run
        # in the same backward, in order).
        torch.autograd.Variable._execution_engine.queue_callback(done)  # type: ignore[attr-defined]

    torch.autograd.Variable._execution_engine.queue_callback(then_done)  # type: ignore[attr-defined]


def install(model: Any, engine: Any, process_group: Any = None) -> None:
    """The communication hook on ``model`` (a ``DistributedDataParallel``), landing its averaged
    gradients in ``engine``'s host slots (its streamed gradients then come from the hook, not
    from the post-accumulate hooks); DDP's own process group by default."""
    if engine.streamed is None:
        raise ValueError("register_ddp_hook: the optimizer has no offloaded (CUDA) parameters; DDP needs no hook for CPU ones")
    if engine.free_gradients:
        raise ValueError("register_ddp_hook: free_gradients=True is not supported under DDP (use free_gradients=False)")
    engine.streamed.ddp = True
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
