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
from .shards import check_shard_grad, grad_shard, local
from .state import GroupState, Slot


@dataclass(eq=False)
class Rec:
    """One offloaded parameter: its slot in the group's state, and its gradient's trip. Its
    per-step fields are written here only (the engine calls the methods)."""

    slot: Slot  # its place in the group's state (param, key, name, home's host copy, ...)
    group: GroupState
    gi: int  # its param group
    index: int  # its slot in the group
    bucket: int
    dtype: torch.dtype  # its dtype when the group was built
    shape: torch.Size
    data_ptr: int  # the address of its storage when last bound
    landing: Tensor  # its gradient's host landing slot, shaped like it
    copy_src: Tensor | None  # the host view its updated weights are copied back from (None: its home)
    nbytes: int  # its gradient's bytes
    hook: Any = None
    has_grad: bool = False  # the landing slot holds this step's gradient
    pending: Tensor | None = None  # a device gradient waiting for its bucket's copy
    accumulate: bool = False  # the pending copy adds to the slot instead of replacing it
    grad_ref: Any = None  # weak reference to the device gradient last copied (kept gradients)
    grad_version: int = -1
    param_version: int = -1  # the parameter's version after our last copy-back
    home: Any = None  # runtime.hosted.Home: its weights live in a host copy the step writes
    stage: bool = False  # its master is paged: copied into its landing slot (copy_src) after the step

    @property
    def param(self) -> Tensor:
        """What is streamed: the parameter, or a DTensor's local shard."""
        return self.slot.param

    @property
    def key(self) -> Tensor | None:
        """A DTensor (FSDP2) whose local shard :attr:`param` is."""
        return self.slot.key if self.slot.dtensor else None

    @property
    def name(self) -> str:
        return self.slot.name

    @property
    def owner(self) -> Tensor:
        """The tensor autograd (or FSDP2) gives the gradient to: the DTensor, or the parameter."""
        return self.slot.key

    def grad(self) -> Tensor | None:
        """The gradient to copy: ``.grad``, or the local shard of a DTensor's."""
        g = self.owner.grad
        if self.key is None or g is None:
            return g
        try:
            return grad_shard(self.key, g, self.name)
        except TypeError:
            return None  # not a shard of ours: check_params refuses it at the step

    def written(self) -> None:
        """The step wrote this parameter's weights: their copy back is queued (the parameter's
        version as of now holds our weights), or its home's host copy is written (its fence
        goes up: the streamer may copy it)."""
        if self.home is None:
            self.param_version = self.param._version
        else:
            self.home.end_write()


@dataclass(eq=False)
class Bucket:
    """Consecutive parameters of one group, up to ``bucket_bytes`` of gradient, and the fences
    between their gradients' copies, their step and their weights' copies back. Only this file
    writes them: the engine calls :meth:`begin_step`, :meth:`copied_back` and :meth:`stepped`;
    the gradient copies wait with :meth:`wait_landing_free`, forwards with
    :meth:`wait_stepped`."""

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
    done: threading.Event = field(default_factory=threading.Event)  # clear while a step works on it

    # -- the step's side ------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A step takes this bucket: forwards and new gradient copies wait for it."""
        self.done.clear()

    def copied_back(self, event: Any) -> None:
        """Its updated weights are queued back to the device; ``event`` marks their copy."""
        self.h2d_event = event

    def stepped(self) -> None:
        """Its step is over (updated, or given up): forwards and gradient copies go on."""
        self.done.set()

    def is_stepped(self) -> bool:
        """Whether no step works on it (its weights, if a step took it, are on their way back)."""
        return self.done.is_set()

    def take_stale(self) -> list[Rec]:
        """The parameters whose master the step takes from the model's weights (once)."""
        stale, self.stale = self.stale, []
        return stale

    def arrived(self, dev: Device) -> bool:
        """Whether everything its step waits for has happened (no wait needed)."""
        return all(dev.query(e) for e in (self.d2h_event, self.h2d_event, self.staged_event))

    def wait_copied_back(self, dev: Device) -> None:
        """The host waits its last copy-back, which reads the masters and landing slots."""
        dev.host_wait(self.h2d_event)

    def copied_back_waiter(self, dev: Device) -> Callable[[], None]:
        """A wait for its copy-back as of now (later ones not included), for the tier to call
        before it rewrites the pages that copy reads."""
        event = self.h2d_event
        return lambda: dev.host_wait(event)

    # -- the readers' side ----------------------------------------------------------------------

    def wait_landing_free(self, dev: Device) -> None:
        """Before new gradients are copied into its landing slots: a step working on them has
        ended (the host waits), and the copies wait its last copy-back (the d2h stream)."""
        self.done.wait()
        dev.stream_waits(dev.d2h, self.h2d_event)

    def wait_stepped(self, dev: Device) -> bool:
        """Before a forward reads its weights: the host waits its step, the current stream its
        copy-back. Returns whether the host had to wait."""
        waited = not self.done.is_set()
        if waited:
            with torch.profiler.record_function("offload_adam.forward_wait"):
                self.done.wait()
        dev.current_waits(self.h2d_event)
        return waited


def end_step(work: list[tuple[Bucket, list[Rec]]]) -> None:
    """Every bucket of a step finished (or abandoned): forwards and host-copy readers go on."""
    for b, recs in work:
        b.stepped()
        for r in recs:
            if r.home is not None:
                r.home.end_write()


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
                s = group.slots[i]
                p = s.param
                r = Rec(s, group, gi, i, len(self.buckets), p.dtype, p.shape, p.data_ptr(), group.grad_slot(i), group.copy_src(i), p.numel() * p.element_size())
                r.home = home_of(p) if s.home is not None else None
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
        # The copies follow the gradients' producers (backward, on the current stream); an async
        # step still working on this bucket reads its landing slots: new gradients wait for it
        # (only gradients made without a forward, which waits for it first, get here), and for
        # its last copy-back, which reads the landing slots they overwrite.
        dev.stream_waits(dev.d2h, dev.record_current())
        b.wait_landing_free(dev)
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
                pairs.append((r.landing, g))
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
            if r is None or g.dtype != r.dtype or g.numel() != r.landing.numel():
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
            _native.grad_accumulate(r.landing, st, num_threads=self.num_threads)
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
            if r.key is not None and local(r.key) is not r.param:
                # FSDP2 replaced the DTensor's local tensor object: follow it (checked below)
                r.slot.param = local(r.key)
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
        (a next backward, while an async step runs) may mark new ones. Notes the masters the
        step takes from the model's weights: first step, a re-bound storage, or weights written
        since our copy-back (a checkpoint loaded into the model)."""
        work = []
        for b in self.buckets:
            recs = [r for r in b.recs if r.has_grad]
            if recs:
                work.append((b, recs))
        for b, recs in work:
            b.expected = len(recs)
            for r in recs:
                r.has_grad = False
            b.stale = [r for r in recs if r.home is None and r.param._version != r.param_version]
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

    def wait_arrived(self, b: Bucket) -> None:
        """Before bucket ``b``'s step: the host waits its last copy-back (it read the masters and
        landing slots the step rewrites) and its gradients' arrival, then adds staged ones."""
        b.wait_copied_back(self.device)
        self.device.host_wait(b.d2h_event)
        self.finish_staged(b)

    def wait_all(self) -> None:
        for b in self.buckets:
            self.device.host_wait(b.d2h_event)
            self.finish_staged(b)

    def grad_views(self) -> tuple[list[Tensor], list[Rec]]:
        """Host copies of this step's gradients (after :meth:`wait_all`): those of plain
        parameters, and the records of DTensor shards (whose squares are summed over a mesh)."""
        plain = [r.landing.view(-1) for r in self.recs if r.has_grad and r.key is None]
        return plain, [r for r in self.recs if r.has_grad and r.key is not None]

    # -- the weights' side ----------------------------------------------------------------------

    def master_loaded(self, param: Tensor, *, from_checkpoint: bool) -> None:
        """A checkpoint load wrote ``param``'s state: with a master from the checkpoint, that
        master is the truth and the model's weights are taken over only if they are written
        after this point; without, the next step takes the model's weights."""
        r = self.by_param[id(param)]
        r.param_version = r.param._version if from_checkpoint else -1

    def current_waits_copy_backs(self) -> None:
        """The current stream waits every bucket's last copy-back (later work reads the weights)."""
        for b in self.buckets:
            self.device.current_waits(b.h2d_event)

    def wait_copy_backs(self) -> None:
        """The host waits every bucket's last copy-back (before it rewrites what they read)."""
        for b in self.buckets:
            b.wait_copied_back(self.device)


# -- the gradients' norm --------------------------------------------------------------------------


def grad_sq_norm(groups: list[GroupState], streamed: StreamedGrads | None, num_threads: int, settle: Callable[[], None]) -> float:
    """Squared 2-norm of this step's gradients: CPU groups' ``.grad``, offloaded groups' host
    copies (read after ``settle()``, which ends a running step); DTensor (FSDP2) gradients by
    their local shards, summed over the mesh."""
    views: list[Tensor] = []
    sharded: list[Tensor] = []
    mesh: Any = None

    def add_shard(k: Tensor, shard: Tensor, name: str) -> None:
        nonlocal mesh
        if any(pl.is_shard() for pl in k.placements):  # type: ignore[attr-defined]
            if k.device_mesh.ndim != 1 or (mesh is not None and k.device_mesh != mesh):  # type: ignore[attr-defined]
                raise NotImplementedError(f"{name}: clip_grad_norm_ over DTensors supports one 1-D mesh")
            mesh = k.device_mesh  # type: ignore[attr-defined]
            sharded.append(shard)
        else:  # replicated: every rank holds it whole, counted once
            views.append(shard)

    for g in groups:
        if g.streamed:
            continue
        views += [s.param.grad for s in g.slots if not s.dtensor and s.param.grad is not None]
        for s in g.slots:
            if s.dtensor and s.key.grad is not None:
                add_shard(s.key, grad_shard(s.key, s.key.grad, s.name), s.name)
    if streamed is not None:
        settle()
        streamed.check_params()
        streamed.collect(False)
        streamed.wait_all()
        plain, shards = streamed.grad_views()
        views += plain
        for r in shards:
            assert r.key is not None
            add_shard(r.key, r.landing.view(-1), r.name)
    flat = [v.view(torch.float32) if v.is_complex() else v for v in views]
    total = _native.grad_sq_norm(flat, num_threads=num_threads)
    if mesh is not None:
        import torch.distributed as dist

        part = torch.tensor([_native.grad_sq_norm(sharded, num_threads=num_threads)], dtype=torch.float64)
        dist.all_reduce(part, group=mesh.get_group())
        total += float(part)
    return total
