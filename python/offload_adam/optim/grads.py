"""Where a step's gradients come from.

CPU parameters: their own ``.grad``, read by the native step itself (no Python per tensor).

Offloaded parameters: :class:`StreamedGrads` copies gradients to their host landing slots during
backward. A post-accumulate-grad hook per parameter marks it ready; when a bucket's parameters
are ready (those that got a gradient last step), the bucket is copied device-to-host on the
device's side stream, in the gradient's own dtype, and an event marks its arrival. Gradients
that change after their copy (``clip_grad_norm_`` on the model, a manual edit) are found by
their version counter and copied again at the step. With ``free_gradients`` each device
gradient is freed once its copy is queued; later micro-batches then add on the host, in the
gradient's dtype with torch's rounding.

A DTensor parameter (FSDP2 with shards on the device) is streamed by its local shard: the hook
is on the DTensor, the gradient copied is its gradient's local shard. Under DDP with
:func:`offload_adam.register_ddp_hook`, the hooks copy nothing: DDP's communication hook hands
over each bucket of averaged gradients (:meth:`StreamedGrads.land_averaged`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _native
from ..runtime.device import Device
from ..runtime.hosted import home_of
from .state import GroupState, same_sharding


def check_shard_grad(k: Tensor, grad: Tensor, name: str) -> None:
    """A DTensor parameter's gradient must be a DTensor of its mesh and placements: its local
    shard is what the kernel reads in place of the parameter's gradient."""
    if not same_sharding(grad, k):
        raise TypeError(
            f"{name}: the gradient of a DTensor parameter must be a DTensor with its mesh and placements, "
            f"got {type(grad).__name__}" + (f" with placements {grad.placements}" if hasattr(grad, "placements") else "")
        )


@dataclass
class Rec:
    """One offloaded parameter."""

    param: Tensor
    group: GroupState
    gi: int  # its param group
    index: int  # its slot in the group
    bucket: int
    dtype: torch.dtype  # its dtype when the group was built
    shape: torch.Size
    data_ptr: int  # the address of its storage when last bound
    slot: Tensor  # its gradient's host landing slot, shaped like it
    copy_src: Tensor | None  # the host view its updated weights are copied back from (None: its home)
    nbytes: int  # its gradient's bytes
    hook: Any = None
    has_grad: bool = False  # the landing slot holds this step's gradient
    pending: Tensor | None = None  # a device gradient waiting for its bucket's copy
    accumulate: bool = False  # the pending copy adds to the slot instead of replacing it
    grad_ref: Any = None  # weak reference to the device gradient last copied (kept gradients)
    grad_version: int = -1
    param_version: int = -1  # the parameter's version after our last copy-back
    key: Tensor | None = None  # a DTensor (FSDP2) whose local shard `param` is
    home: Any = None  # runtime.hosted.Home: its weights live in a host copy the step writes
    stage: bool = False  # its master is paged: copied into its landing slot (copy_src) after the step

    @property
    def name(self) -> str:
        return self.group.names[self.index]

    @property
    def owner(self) -> Tensor:
        """The tensor autograd (or FSDP2) gives the gradient to: the DTensor, or the parameter."""
        return self.key if self.key is not None else self.param

    def grad(self) -> Tensor | None:
        """The gradient to copy: ``.grad``, or the local shard of a DTensor's."""
        g = self.owner.grad
        if self.key is None or g is None:
            return g
        try:
            check_shard_grad(self.key, g, self.name)
        except TypeError:
            return None  # not a shard of ours: check_params refuses it at the step
        return g._local_tensor  # type: ignore[attr-defined, no-any-return]


@dataclass
class Bucket:
    """Consecutive parameters of one group, up to ``bucket_bytes`` of gradient."""

    group: GroupState
    gi: int
    recs: list[Rec]
    nbytes: int = 0  # gradient bytes of all its parameters
    ready_count: int = 0
    # Gradients to wait for before copying: those that arrived last step (a parameter that
    # never gets one, an unused layer, must not hold its bucket back until step()).
    expected: int = 0
    d2h_event: Any = None  # arrival of the bucket's last gradient copy
    h2d_event: Any = None  # completion of its last copy-back (its landing slots are the source)
    stale: list[Rec] = field(default_factory=list)  # masters to take from the model's weights
    staged: list[tuple[Rec, Tensor]] = field(default_factory=list)  # host adds still to do
    staged_event: Any = None
    done: threading.Event = field(default_factory=threading.Event)


class StreamedGrads:
    """The gradient streaming of one optimizer's offloaded groups."""

    def __init__(self, device: Device, *, free_gradients: bool, num_threads: int) -> None:
        self.device = device
        self.free_gradients = free_gradients
        self.num_threads = num_threads
        self.recs: list[Rec] = []
        self.by_param: dict[int, Rec] = {}
        self.buckets: list[Bucket] = []
        # Bumped by zero_grad: a failed step gives its gradients back only if none came since.
        self.generation = 0
        self.d2h_bytes = 0  # gradient bytes queued for the host since the last step took them
        # DDP: gradients come averaged from DDP's communication hook (`land_averaged`), not from
        # the post-accumulate hooks, which see the local ones (see offload_adam.optim.ddp).
        self.ddp = False
        self._landed: list[Rec] = []
        me = weakref.ref(self)

        def hook(p: Tensor) -> None:
            s = me()
            if s is not None:
                s._on_grad(p)

        self._hook: Callable[[Tensor], None] = hook

    def add_group(self, gi: int, group: GroupState) -> None:
        for rng in group.buckets:
            recs = []
            for i in rng:
                p = group.params[i]
                r = Rec(p, group, gi, i, len(self.buckets), p.dtype, p.shape, p.data_ptr(), group.grad_slot(i), group.copy_src(i), p.numel() * p.element_size())
                r.key = group.keys[i] if group.dtensor[i] else None
                r.home = home_of(p) if group.homes[i] is not None else None
                r.stage = group.stages_copyback(i)
                r.hook = r.owner.register_post_accumulate_grad_hook(self._hook)
                self.recs.append(r)
                self.by_param[id(p)] = r
                self.by_param[id(r.owner)] = r  # modules hold the DTensor
                recs.append(r)
            b = Bucket(group, gi, recs, sum(r.nbytes for r in recs))
            b.done.set()
            self.buckets.append(b)

    def close(self) -> None:
        for r in self.recs:
            r.hook.remove()

    # -- backward -------------------------------------------------------------------------------

    def _on_grad(self, p: Tensor) -> None:
        if self.ddp:
            return  # the averaged gradient comes from the communication hook
        r = self.by_param[id(p)]
        g = r.grad()
        if g is None or g.dtype != r.dtype or g.shape != r.shape:
            return  # a moved or re-typed parameter: the step reports it
        r.pending = g
        r.accumulate = r.has_grad and self.free_gradients
        b = self.buckets[r.bucket]
        b.ready_count += 1
        if b.ready_count >= (b.expected or len(b.recs)):
            self.flush(b)

    def flush(self, b: Bucket) -> None:
        """Queues the copies of a bucket's pending gradients to the host."""
        pend = [r for r in b.recs if r.pending is not None]
        b.ready_count = 0
        if not pend:
            return
        dev = self.device
        # An async step still working on this bucket reads its landing slots: new gradients wait
        # for it (only gradients made without a forward, which waits for it first, get here).
        b.done.wait()
        # The copies follow the gradients' producers (backward, on the current stream), and the
        # last copy-back of this bucket, which reads the landing slots they overwrite.
        dev.stream_waits(dev.d2h, dev.record_current())
        dev.stream_waits(dev.d2h, b.h2d_event)
        self.finish_staged(b)
        pairs: list[tuple[Tensor, Tensor]] = []
        staged: list[tuple[Rec, Tensor]] = []
        for r in pend:
            g = r.pending
            assert g is not None
            if r.accumulate:
                st = dev.staging(g)
                staged.append((r, st))
                pairs.append((st, g))
            else:
                pairs.append((r.slot, g))
        with torch.profiler.record_function("offload_adam.d2h"):
            dev.copy(pairs, dev.d2h)
        self.d2h_bytes += sum(g.numel() * g.element_size() for _, g in pairs)
        for r in pend:
            g = r.pending
            assert g is not None
            # The device gradient stays allocated until its copy has run, even if it is dropped
            # now (free_gradients) or by zero_grad() right after the step.
            dev.keep_until_done(g, dev.d2h)
            if self.free_gradients:
                r.owner.grad = None
            else:
                r.grad_ref = weakref.ref(g)
                r.grad_version = g._version
            r.pending = None
            r.has_grad = True
            r.accumulate = False
        b.d2h_event = dev.record(dev.d2h)
        if staged:
            b.staged, b.staged_event = staged, b.d2h_event

    def land_averaged(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """DDP's communication hook: a bucket of averaged gradients (views of DDP's bucket) is
        copied into the landing slots, once, as soon as its all-reduce is done."""
        touched: dict[int, Bucket] = {}
        for p, g in zip(params, grads):
            r = self.by_param.get(id(p))
            if r is None or g.dtype != r.dtype or g.numel() != r.slot.numel():
                continue
            r.pending, r.accumulate = g.view(r.shape), False
            self._landed.append(r)
            touched[r.bucket] = self.buckets[r.bucket]
        for b in touched.values():
            self.flush(b)

    def after_backward(self) -> None:
        """End of a backward under DDP (after DDP wrote the averaged gradients into ``.grad``):
        what ``.grad`` now holds is what was landed; a later edit (clipping on the model) is
        seen by its version counter and copied again at the step, as without DDP."""
        for r in self._landed:
            g = r.grad()
            if g is not None:
                r.grad_ref = weakref.ref(g)
                r.grad_version = g._version
        self._landed = []

    def finish_staged(self, b: Bucket) -> None:
        """Adds gradients staged by an earlier micro-batch into the landing slots, once their
        copies have arrived (normally long since: they were queued a backward ago)."""
        if not b.staged:
            return
        self.device.host_wait(b.staged_event)
        for r, st in b.staged:
            _native.grad_accumulate(r.slot, st, num_threads=self.num_threads)
        b.staged, b.staged_event = [], None

    # -- before a step --------------------------------------------------------------------------

    def check_params(self) -> None:
        """Raises if a parameter was moved or re-typed after the optimizer was built, or (with
        ``free_gradients``) its gradient rewritten after its copy. Parameters
        whose storage was replaced with the same shape, dtype and device (``p.data = t``,
        ``to_empty()`` with swapped parameters) are re-bound: their masters are taken from the
        new storage at the step, the old storage is never written again."""
        rebound = []
        for r in self.recs:
            if r.key is not None and r.key._local_tensor is not r.param:  # type: ignore[attr-defined]
                # FSDP2 replaced the DTensor's local tensor object: follow it (checked below)
                r.param = r.group.params[r.index] = r.key._local_tensor  # type: ignore[attr-defined]
            if r.key is not None and r.key.grad is not None:
                check_shard_grad(r.key, r.key.grad, r.name)
            p = r.param
            if self.free_gradients and r.has_grad and r.pending is None and r.grad() is not None:
                # Written after the backward copied and freed it, without a backward (no hook):
                # DistributedDataParallel writes its averaged gradients so. Adding it to the
                # host copy would be wrong under DDP, and replacing it wrong for an edit.
                raise RuntimeError(
                    f"{r.name}: its gradient was written again after the backward had copied it to the "
                    "host and freed it (DistributedDataParallel writes the averaged gradients this way); "
                    "free_gradients=True cannot tell whether to add or replace it: use free_gradients=False"
                )
            if r.home is not None or p.data_ptr() == r.data_ptr:
                continue  # (a hosted parameter's data moves with its streaming: its home is its identity)
            if p.dtype != r.dtype or p.shape != r.shape or p.device != self.device.torch_device:
                raise RuntimeError(
                    f"{r.name}: moved or changed after the optimizer was built (now {p.dtype} on {p.device}, "
                    f"shape {tuple(p.shape)}); build the optimizer after model.to()/.half()/..."
                )
            rebound.append(r)
        for r in rebound:
            r.data_ptr = r.param.data_ptr()
            r.param_version = -1  # its master is taken from the new storage
            r.hook.remove()  # swap_tensors moves hooks with the old contents: register again
            r.hook = r.owner.register_post_accumulate_grad_hook(self._hook)

    def collect(self, scaler_ready: bool, regather: bool = False) -> None:
        """Before a step: copy gradients the hooks did not see, or that changed after their copy
        (``clip_grad_norm_`` on the model, a manual edit; every one with ``regather``: changed in
        a way their version counter does not show); drop the host copy of a gradient set to None
        since (torch then skips the parameter); flush partial buckets."""
        for r in self.recs:
            g = r.grad()
            if g is None:
                if not self.free_gradients:
                    r.has_grad, r.pending, r.grad_ref = False, None, None
                continue
            if r.pending is not None:
                continue
            if self.free_gradients:
                r.pending, r.accumulate = g, False  # set by hand (check_params refused a rewrite)
                continue
            # GradScaler's inf check multiplies every gradient by 1.0 in place just before a step
            # it drives: that one version bump changes no value.
            expected = r.grad_version + (1 if scaler_ready else 0)
            same = r.grad_ref is not None and r.grad_ref() is g
            if regather or not (r.has_grad and same and g._version in (r.grad_version, expected)):
                r.pending, r.accumulate = g, False
        for b in self.buckets:
            if any(r.pending is not None for r in b.recs):
                self.flush(b)

    def discard(self) -> None:
        """``zero_grad``: the host slots no longer hold a gradient."""
        self.generation += 1
        for r in self.recs:
            r.has_grad = False
            r.pending = None
            r.grad_ref = None
        for b in self.buckets:
            b.ready_count = 0
            b.staged, b.staged_event = [], None

    def take(self) -> list[tuple[Bucket, list[Rec]]]:
        """The buckets with gradients, and their parameters that have one; from here the hooks
        (a next backward, while an async step runs) may mark new ones."""
        work = []
        for b in self.buckets:
            recs = [r for r in b.recs if r.has_grad]
            if recs:
                work.append((b, recs))
        for b, recs in work:
            b.expected = len(recs)
            for r in recs:
                r.has_grad = False
        return work

    def give_back(self, work: list[tuple[Bucket, list[Rec]]], generation: int) -> None:
        """A failed step's buckets keep their gradients for the next step, unless ``zero_grad``
        (or a new gradient) came since."""
        if generation != self.generation:
            return
        for _, recs in work:
            for r in recs:
                if r.pending is None:
                    r.has_grad = True

    def wait_all(self) -> None:
        for b in self.buckets:
            self.device.host_wait(b.d2h_event)
            self.finish_staged(b)

    def grad_views(self) -> tuple[list[Tensor], list[Rec]]:
        """Host copies of this step's gradients (after :meth:`wait_all`): those of plain
        parameters, and the records of DTensor shards (whose squares are summed over a mesh)."""
        plain = [r.slot.view(-1) for r in self.recs if r.has_grad and r.key is None]
        return plain, [r for r in self.recs if r.has_grad and r.key is not None]
