"""DistributedDataParallel with offloaded parameters: each gradient crosses to the host once,
averaged.

Without this, our post-accumulate-grad hooks copy each local gradient to the host during
backward, DDP then averages the gradients and writes them into ``.grad``, and the step copies
them again. ``register_ddp_hook(ddp_model, optimizer)`` installs a DDP communication hook that
does DDP's own all-reduce (divide by the world size, then sum, as DDP's default hook) and, as
soon as a bucket is reduced, queues the copy of its averaged gradients into our host landing
slots; the post-accumulate hooks then copy nothing.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist


def _hook(opt: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    engine = opt._engine
    group = engine.ddp_group
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()  # type: ignore[union-attr]
    params, grads = bucket.parameters(), bucket.gradients()
    engine.queue_after_backward()

    def land(f: torch.futures.Future[Any]) -> torch.Tensor:
        out = f.value()[0]
        engine.streamed.land_averaged(params, grads)
        return out

    return fut.then(land)


def register_ddp_hook(model: Any, optimizer: Any, process_group: Any = None) -> None:
    """Makes ``model`` (a ``DistributedDataParallel``) hand its averaged gradients to
    ``optimizer`` (an ``offload_adam`` optimizer over the model's offloaded parameters): each
    gradient is copied to the host once, bucket by bucket as DDP reduces them. DDP's own
    process group by default."""
    engine = optimizer._engine
    if engine.streamed is None:
        raise ValueError("register_ddp_hook: the optimizer has no offloaded (CUDA) parameters; DDP needs no hook for CPU ones")
    if engine.free_gradients:
        raise ValueError("register_ddp_hook: free_gradients=True is not supported under DDP (use free_gradients=False)")
    engine.ddp_group = process_group if process_group is not None else getattr(model, "process_group", None)
    engine.streamed.ddp = True
    model.register_comm_hook(optimizer, _hook)
