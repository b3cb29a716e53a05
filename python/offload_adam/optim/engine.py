"""The step engine: one loop over buckets for every param group, whatever its device.

CPU groups go to the kernel in one native call per step (one parallel region over every
parameter). Offloaded groups are stepped bucket by bucket, in parameter order (the order the
next forward needs them), buckets whose gradients have arrived batched into one native call:

    wait for the gradients ─► tier.make_resident ─► native step ─► queue the copy-back ─► tier.release

synchronously in ``step()``, or (``async_step``) on a worker thread while the next forward
runs: the forward waits (``waits.py``) make each module wait only for the buckets it reads.
The gradients and the fences of each bucket are ``grads.py``'s; the engine asks them to wait
and tells them where the step is (:class:`~offload_adam.optim.grads.Bucket`).

Everything device-specific goes through a :class:`~offload_adam.runtime.device.Device`; the engine
holds no reference to the optimizer.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _native
from ..runtime.device import Device, device_for
from ..runtime.hosted import Home, claim, claimed, home_of, unclaim
from ..runtime.pinned import PinnedArena
from .grads import Bucket, Rec, StreamedGrads, end_step, grad_sq_norm
from .hyper import Hyper
from .shards import check_local, grad_shard, local, local_shards
from .state import GroupState
from .tier import HostTier, Tier
from .waits import ForwardWaits


@dataclass(frozen=True)
class EngineHooks:
    """Seams of the engine for tests (``offload_adam.testing.engine_hooks`` sets them for the
    optimizers built inside); the product sets none."""

    before_bucket: Callable[[int], None] | None = None  # called with the bucket's index in the step
    start_worker: Callable[[threading.Thread], None] | None = None  # starts the worker thread


HOOKS: ContextVar[EngineHooks] = ContextVar("offload_adam_engine_hooks", default=EngineHooks())


@dataclass
class _Failure:
    error: BaseException
    work: list[tuple[Bucket, list[Rec]]]  # buckets not updated
    generation: int


def _device_for(dev: torch.device, gi: int, current: Device | None) -> Device | None:
    """The device group ``gi``'s parameters stream through (None: host memory, stepped in
    place); one per optimizer (``current``: the other groups')."""
    try:
        device = device_for(dev)
    except ValueError:
        raise ValueError(f"param group {gi}: parameters on {dev} are not supported (CPU or CUDA)") from None
    if device is None or current is None or current is device:
        return device
    if dev.type == "cuda":
        raise ValueError(
            f"param group {gi}: is on {dev}, the optimizer's other offloaded parameters on "
            f"{current.torch_device}; use one optimizer per GPU"
        )
    raise ValueError(f"param group {gi}: streamed through another device than the optimizer's other groups")


def _hosted_device(homes: list[Home | None], names: list[str], gi: int, current: Device | None) -> Device:
    """The device of a group with parameters whose weights live in a host copy (streamed by
    offload_weights): theirs, whatever the context; the group's other parameters must be on
    it too (blocks kept resident)."""
    device = next(h.device for h in homes if h is not None)
    for h, name in zip(homes, names):
        if h is not None and h.host is None:
            raise ValueError(
                f"{name}: its weights are streamed from NVMe (offload_weights(storage='nvme')), which keeps no "
                "host copy for the step to write; train with offload_weights(storage='cpu')"
            )
        if h is not None and h.device is not device:
            raise ValueError(f"param group {gi}: its weights are streamed to two devices")
    if current is not None and current is not device:
        raise ValueError(f"param group {gi}: streamed through another device than the optimizer's other groups")
    return device


class Engine:
    """Steps the param groups of one optimizer (see the module documentation)."""

    def __init__(
        self,
        *,
        num_threads: int,
        bias_correction: bool,
        async_step: bool,
        free_gradients: bool,
        bucket_bytes: int,
        tier: Tier | None = None,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_threads = num_threads
        self.master_dtype = master_dtype
        self.bias_correction = bias_correction
        self.async_step = async_step
        self.free_gradients = free_gradients
        self.bucket_bytes = bucket_bytes
        self.hooks = HOOKS.get()
        self.tier: Tier = tier or HostTier()
        self.groups: list[GroupState | None] = []  # None: parameters still on the meta device
        self._deferred: dict[int, tuple[list[Tensor], list[str], torch.dtype, bool]] = {}
        self.device: Device | None = None
        self.arena: PinnedArena | None = None  # the pinned host buffers of offloaded groups
        self.streamed: StreamedGrads | None = None
        self.worker: threading.Thread | None = None
        self.in_flight = False
        self._failure: _Failure | None = None
        self._tentative: list[tuple[int, int]] = []  # state views installed before their step ran
        self._direct_left: set[tuple[int, int]] | None = None  # CPU chunks a failed step did not do
        self.stats: dict[str, float] = {}
        self._cur: dict[str, float] = {}
        self._backward_done: Any = None
        self._io_before: dict[str, float] = {}
        self.waits: ForwardWaits | None = None  # async mode, offloaded groups: the forward waits

    # -- groups ---------------------------------------------------------------------------------

    def add_group(self, gi: int, params: list[Tensor], names: list[str], state_dtype: torch.dtype, amsgrad: bool) -> None:
        """Builds group ``gi``'s state; on error nothing changes."""
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"param group {gi} mixes devices {sorted(map(str, devices))}: put CPU and CUDA parameters in separate groups"
            )
        dev = next(iter(devices), torch.device("cpu"))
        shards, keys = local_shards(params, names)
        if dev.type == "meta":
            # Built at the first step, once the parameters have storage (`to_empty()`).
            self.groups.append(None)
            self._deferred[gi] = (params, names, state_dtype, amsgrad)
            return
        homes = [home_of(p) for p in params]
        device = _hosted_device(homes, names, gi, self.device) if any(homes) else _device_for(dev, gi, self.device)
        if device is not None and self.arena is None:
            self.arena = PinnedArena(device)
        group = GroupState(
            shards, names, state_dtype=state_dtype, amsgrad=amsgrad, device=device,
            arena=self.arena if device is not None else None, bucket_bytes=self.bucket_bytes,
            page_align=self.tier.page_align, state_alloc=self.tier.state_alloc, keys=keys, master_dtype=self.master_dtype,
            homes=[h.host if h is not None else None for h in homes] if any(homes) else None,
        )  # fmt: skip
        me = weakref.ref(self)
        before = [(claimed(p), h.writer if h is not None else None) for p, h in zip(params, homes)]
        for p, h in zip(params, homes):
            claim(p, "an offload_adam optimizer", self)
            if h is not None:
                h.writer = me
        try:
            if device is None:
                group.native.check_disjoint([g.native for g in self.groups if g is not None and not g.streamed])
            self.tier.attach(group)
        except BaseException:
            for p, h, (who, writer) in zip(params, homes, before):
                if who is None:
                    unclaim(p)
                else:
                    claim(p, who)
                if h is not None:
                    h.writer = writer
            raise
        if gi < len(self.groups):
            self.groups[gi] = group
        else:
            self.groups.append(group)
        if device is not None:
            if self.streamed is None:
                self.device = device
                self.streamed = StreamedGrads(device, free_gradients=self.free_gradients, num_threads=self.num_threads)
                if self.async_step:
                    self.waits = ForwardWaits(self.streamed, device)
            self.streamed.add_group(gi, group)

    def materialize(self) -> None:
        """Builds the groups whose parameters were on the meta device, now materialized."""
        for gi, (params, names, state_dtype, amsgrad) in list(self._deferred.items()):
            if any(p.device.type == "meta" for p in params):
                raise RuntimeError(
                    f"param group {gi}: its parameters are still on the meta device; materialize them "
                    "(module.to_empty(...) with torch.__future__.set_swap_module_params_on_conversion(True)) before the step"
                )
            del self._deferred[gi]
            self.add_group(gi, params, names, state_dtype, amsgrad)

    def live_groups(self) -> list[tuple[int, GroupState]]:
        return [(gi, g) for gi, g in enumerate(self.groups) if g is not None]

    def close(self) -> None:
        self.synchronize(raise_error=False)
        if self.streamed is not None:
            self.streamed.close()
            for r in self.streamed.recs:
                if r.home is not None:
                    r.home.writer = None
        for _, g in self.live_groups():
            for s in g.slots:
                unclaim(s.key)
        if self.waits is not None:
            self.waits.close()
        self.tier.close()

    # -- the step -------------------------------------------------------------------------------

    def step(
        self, hypers: Sequence[Hyper], *, scale: float, grad_scale: Tensor | None, found_inf: Tensor | None,
        regather: bool = False,
    ) -> list[tuple[int, int]]:
        """One step of every group: ``hypers[gi]`` for group ``gi``, gradients multiplied by
        ``scale`` (the clipping coefficient) and by ``1/grad_scale`` (GradScaler), skipped if
        ``found_inf`` is non-zero. ``regather``: the device gradients were rewritten in place
        in a way their version does not show (GradScaler's unscale): copy them all again. Returns the (group, slot) pairs whose state is new: in async
        mode the state views are handed out before the step has run (see :meth:`unstepped`).
        Everything is checked before anything changes."""
        self.synchronize()
        self.materialize()
        if self.streamed is not None:
            for r in self.streamed.recs:
                if r.home is not None and r.home.released:
                    raise RuntimeError(
                        f"{r.name}: its weights were handed back by their offload's close() (ordinary host tensors now); "
                        "this optimizer wrote their streamed host copies and cannot step them: build a new optimizer "
                        "over the model's parameters (load this one's state_dict() into it)"
                    )
            # Checked before the CPU groups move, so that a refused step changes nothing; a
            # re-bound parameter's master is taken from its new storage below.
            self.streamed.check_params()
        live = self.live_groups()
        direct = [(gi, g) for gi, g in live if not g.streamed]
        first: list[tuple[int, int]] = []
        if direct or self.streamed is None:
            # CPU tensors: reading GradScaler's values here costs no device sync.
            if found_inf is not None and float(found_inf) != 0.0:
                if self.streamed is not None:
                    self.streamed.discard()
                return []
            if grad_scale is not None:
                scale /= float(grad_scale)
            grad_scale = found_inf = None
        if direct:
            bound = self._bind_shards()
            stand = [(g, g.bind_stand_ins()) for _, g in direct]
            try:
                first += self._step_direct(direct, hypers, scale)
            finally:
                for t in bound:
                    t.grad = None
                for g, slots in stand:
                    g.unbind_stand_ins(slots)
        if self.streamed is not None:
            first += self._step_streamed(hypers, scale, grad_scale, found_inf, regather)
        return first

    def _step_direct(self, direct: list[tuple[int, GroupState]], hypers: Sequence[Hyper], scale: float) -> list[tuple[int, int]]:
        """CPU groups: one native call for all of them, or (a tier that pages) one per chunk, in
        order. A chunk that fails is untouched, those before it fully updated; the next step
        does the chunks this one did not (unless ``zero_grad`` came between), as the streamed
        path gives back the buckets a failed step did not do."""
        chunks = [(gi, g, self.tier.chunks(g)) for gi, g in direct]
        whole = [(gi, g) for gi, g, ch in chunks if ch is None]
        calls: list[tuple[list[tuple[int, GroupState]], list[list[int]] | None, tuple[int, int]]] = []
        if whole:
            calls.append((whole, None, (-1, 0)))
        for gi, g, ch in chunks:
            for rng in ch or []:
                calls.append(([(gi, g)], [list(rng)], (gi, rng.start)))
        if self._direct_left is not None:
            calls = [c for c in calls if c[2] in self._direct_left]
            self._direct_left = None
        before = self._io_stats()
        first: list[tuple[int, int]] = []
        t_kernel = 0.0
        for n, (groups, selection, _) in enumerate(calls):
            try:
                for gi, g in groups:
                    self.tier.make_resident(g, selection[0] if selection else range(len(g)))
                t0 = time.perf_counter()
                try:
                    firsts = _native.adam_step(
                        [g.native for _, g in groups], [hypers[gi] for gi, _ in groups],
                        selection or [None] * len(groups), num_threads=self.num_threads, grad_scale=scale,
                        bias_correction=self.bias_correction,
                    )  # fmt: skip
                finally:
                    t_kernel += time.perf_counter() - t0
                    for gi, g in groups:
                        self.tier.release(g, selection[0] if selection else range(len(g)))
            except BaseException:
                self._direct_left = {c[2] for c in calls[n:]}
                raise
            first += [(gi, i) for (gi, _), idx in zip(groups, firsts) for i in idx]
        if self.streamed is None:
            try:
                self.tier.end_step()
            except BaseException:
                self._direct_left = set()  # every chunk is done: the next step() only writes back
                raise
            self.stats = {"cpu_step_s": t_kernel, **self._io_stats(before)}
        return first

    def _bind_shards(self) -> list[Tensor]:
        """DTensor (FSDP2) parameters: the kernel steps their local shards, reading the local
        shard of their DTensor gradient. Follows a local tensor object FSDP2 replaced. Returns
        the local tensors whose ``.grad`` was set (cleared by the caller after the step)."""
        bound: list[Tensor] = []
        try:
            for _, g in self.live_groups():
                if g.streamed or not g.has_dtensor:
                    continue  # streamed shards: their gradients come through StreamedGrads
                for i, s in enumerate(g.slots):
                    if not s.dtensor:
                        continue
                    k = s.key
                    loc = local(k)
                    if loc is not s.param:
                        check_local(loc, s.name)
                        s.param = loc
                        g.native.replace_param(i, loc)
                    grad = k.grad
                    loc.grad = None if grad is None else grad_shard(k, grad, s.name)
                    bound.append(loc)
        except BaseException:
            for t in bound:
                t.grad = None
            raise
        return bound

    def _io_stats(self, before: dict[str, float] | None = None) -> dict[str, float]:
        """The tier's I/O counters (bytes read and written, seconds waited for I/O), or their
        change since ``before``."""
        now = dict(self.tier.stats)
        return now if before is None else {k: v - before.get(k, 0.0) for k, v in now.items()}

    def _step_streamed(
        self, hypers: Sequence[Hyper], scale: float, grad_scale: Tensor | None, found_inf: Tensor | None, regather: bool
    ) -> list[tuple[int, int]]:
        st, dev = self.streamed, self.device
        assert st is not None and dev is not None
        st.collect(scaler_ready=grad_scale is not None, regather=regather)
        work = st.take()
        counts = {id(g): g.steps.tolist() for _, g in self.live_groups() if g.streamed}
        first = [(b.gi, r.index) for b, recs in work for r in recs if counts[id(b.group)][r.index] == 0.0]
        self._tentative = list(first)
        for b, _ in work:
            b.begin_step()
        self._cur = {"cpu_step_s": 0.0, "d2h_wait_s": 0.0, "h2d_issue_s": 0.0, "forward_wait_s": 0.0}
        self._cur.update(d2h_bytes=st.d2h_bytes, h2d_bytes=0)
        st.d2h_bytes = 0
        self._io_before = self._io_stats()
        # Weights may be overwritten once the work queued so far (the backward that read them)
        # is done; the copy-back waits for this point only, not for a next forward.
        self._backward_done = dev.record_current()
        # (The masters to take from the model's weights, noted by `take`, are copied once their
        # state is resident: see _step_batch.)
        # Host copies (streamed weights) this step rewrites: the streamer copies none of them to
        # the device until its bucket's kernel has run (end_write, in _step_batch).
        for _, recs in work:
            for r in recs:
                if r.home is not None:
                    r.home.begin_write()
        # GradScaler's values are device tensors: read them in the step's thread after a copy,
        # not with a sync here (async mode returns before the backward has finished).
        scalars = None
        if grad_scale is not None or found_inf is not None:
            vals = [t.reshape(1).float() for t in (found_inf, grad_scale) if t is not None]
            host = dev.staging(torch.empty(len(vals), dtype=torch.float32))
            dev.stream_waits(dev.d2h, self._backward_done)
            dev.copy([(host[k : k + 1], v) for k, v in enumerate(vals)], dev.d2h)
            for v in vals:  # GradScaler drops these tensors when step() returns
                dev.keep_until_done(v, dev.d2h)
            scalars = (host, dev.record(dev.d2h), found_inf is not None)
        # Later device work (zero_grad(set_to_none=False), the next batch reusing a freed
        # gradient's block) waits for every gradient copy queued so far.
        dev.current_waits(dev.record(dev.d2h))
        args = (work, list(hypers), scale, scalars, st.generation)
        if self.async_step:
            self.in_flight = True
            self.worker = threading.Thread(target=self._run, args=args, name="offload-adam-step", daemon=True)
            if self.waits is not None:
                self.waits.arm(self._cur)
            try:
                (self.hooks.start_worker or threading.Thread.start)(self.worker)
            except BaseException:
                self.worker, self.in_flight = None, False
                if self.waits is not None:
                    self.waits.disarm()
                end_step(work)
                st.give_back(work, st.generation)
                raise
        else:
            self._run(*args)
            self.synchronize()
        return first

    def _run(
        self,
        work: list[tuple[Bucket, list[Rec]]],
        hypers: list[Hyper],
        scale: float,
        scalars: tuple[Tensor, Any, bool] | None,
        generation: int,
    ) -> None:
        dev = self.device
        assert dev is not None
        try:
            with dev.thread_context(), torch.no_grad():  # grad mode is per thread, and on in a new one
                if scalars is not None:
                    host, event, has_inf = scalars
                    dev.host_wait(event)
                    vals = host.tolist()
                    if has_inf and vals[0] != 0.0:
                        return  # skipped: nothing advances, the host gradients are dropped
                    if len(vals) > int(has_inf):
                        scale /= vals[-1]
                k = 0
                while k < len(work):
                    batch, interrupted = self._batch(work, k)
                    self._step_batch(batch, hypers[batch[0][0].gi], scale)
                    if interrupted is not None:
                        raise interrupted
                    k += len(batch)
                self.tier.end_step()
        except BaseException as e:  # raised to the caller by the next step()/synchronize()
            # A bucket is stepped once its weights are on their way back.
            self._failure = _Failure(e, [(b, recs) for b, recs in work if not b.is_stepped()], generation)
        finally:
            end_step(work)  # (a skipped or failed bucket's host copies are as they were)
            self.in_flight = False
            self._cur.update(self._io_stats(self._io_before))
            self.stats = self._cur  # the last finished step's (a forward still waiting adds to it)

    def _batch(
        self, work: list[tuple[Bucket, list[Rec]]], k: int
    ) -> tuple[list[tuple[Bucket, list[Rec]]], BaseException | None]:
        """Bucket ``k``, and the buckets after it of the same group whose gradients (and
        everything else the kernel waits for) have already arrived, up to the tier's
        ``batch_bytes`` of gradient: one native call (one parallel region) for them all (fewer,
        larger regions run at the rate of one big tensor; see the bench's `offload` case). After
        a finished backward that is most of the step; in async mode a forward then waits a little longer for its
        first weights, never for more than one batch. An error of the ``before_bucket`` hook
        for a later bucket ends the batch before it, and is returned to raise after it."""
        dev = self.device
        assert dev is not None
        before = self.hooks.before_bucket
        if before is not None:
            before(k)
        batch = [work[k]]
        size = work[k][0].nbytes
        for j in range(k + 1, len(work)):
            b, recs = work[j]
            if b.gi != work[k][0].gi or size + b.nbytes > self.tier.batch_bytes or not b.arrived(dev):
                break
            if before is not None:
                try:
                    before(j)
                except BaseException as e:
                    return batch, e
            batch.append((b, recs))
            size += b.nbytes
        return batch, None

    def _step_batch(self, batch: list[tuple[Bucket, list[Rec]]], hyper: Hyper, scale: float) -> None:
        """Steps consecutive buckets of one group in one native call, then queues their copies
        back."""
        dev, st = self.device, self.streamed
        assert dev is not None and st is not None
        g = batch[0][0].group
        t0 = time.perf_counter()
        for b, _ in batch:
            st.wait_arrived(b)
        recs = [r for _, rs in batch for r in rs]
        slots = [r.index for r in recs]
        self.tier.make_resident(g, slots)
        stale = [r for b, _ in batch for r in b.take_stale()]
        if stale:
            # The model's weights into the masters, on the side stream after the backward (not on
            # the legacy default stream of this thread).
            dev.stream_waits(dev.d2h, self._backward_done)
            dev.copy_blocking([(r.group.master_view(r.index), r.param.detach()) for r in stale], dev.d2h)
        t1 = time.perf_counter()
        stepped = False
        try:
            with torch.profiler.record_function("offload_adam.cpu_step"):
                _native.adam_step(
                    [g.native], [hyper], [slots], num_threads=self.num_threads, grad_scale=scale,
                    bias_correction=self.bias_correction,
                )  # fmt: skip
            stepped = True
        finally:
            # The buckets' host state is updated: from here their weights must reach the model
            # even if an interrupt arrives, so that each bucket is either untouched or fully
            # updated.
            t2 = time.perf_counter()
            if stepped:
                for r in recs:
                    if r.stage:
                        # The master is a page of the tier's (pageable): the copy back reads this
                        # pinned copy of it (a cudaMemcpyAsync from pageable memory is staged by
                        # the driver and blocks this thread).
                        assert r.copy_src is not None
                        r.copy_src.copy_(r.group.master_view(r.index))
                dev.stream_waits(dev.h2d, self._backward_done)
                with torch.profiler.record_function("offload_adam.h2d"):
                    for b, rs in batch:
                        back = [(r.param.detach(), r.copy_src) for r in rs if r.copy_src is not None]
                        if back:
                            dev.copy(back, dev.h2d)
                            self._cur["h2d_bytes"] += sum(s.numel() * s.element_size() for _, s in back)
                            b.copied_back(dev.record(dev.h2d))
                for r in recs:
                    r.written()
            self.tier.release(g, slots, batch[-1][0].copied_back_waiter(dev))
            t3 = time.perf_counter()
            self._cur["d2h_wait_s"] += t1 - t0
            self._cur["cpu_step_s"] += t2 - t1
            self._cur["h2d_issue_s"] += t3 - t2
            if stepped:
                for b, _ in batch:
                    b.stepped()

    def wait_writes(self) -> None:
        """Waits for an async step's worker to have queued every write of the parameters (the
        state, its failure and the streams' waits are left to :meth:`synchronize`)."""
        w = self.worker
        if w is not None and w is not threading.current_thread():
            w.join()

    def synchronize(self, raise_error: bool = True) -> None:
        """Waits for an async step to finish and makes the current stream wait for its copies;
        raises an error the step met (its buckets not updated keep their gradients)."""
        w = self.worker
        if w is not None:
            w.join()
            self.worker = None
        if self.streamed is not None:
            if self.waits is not None:
                self.waits.disarm()
            self.streamed.current_waits_copy_backs()
        f, self._failure = self._failure, None
        if f is not None and self.streamed is not None:
            self.streamed.give_back(f.work, f.generation)
        if f is not None and raise_error:
            if isinstance(f.error, KeyboardInterrupt):
                raise f.error
            raise RuntimeError(f"offload_adam: the optimizer step failed: {f.error}") from f.error

    def unstepped(self) -> list[tuple[int, int]]:
        """After :meth:`synchronize`: slots whose state views were handed out for a step that
        did not run (skipped by GradScaler, or failed); their state is still empty."""
        out = [(gi, i) for gi, i in self._tentative if (g := self.groups[gi]) is not None and float(g.steps[i]) == 0.0]
        self._tentative = []
        return out

    def quiesce(self) -> None:
        """Before the host writes a buffer a copy-back reads (a checkpoint load): the step has
        finished and every copy-back has read its source."""
        self.synchronize()
        self._wait_copy_backs()

    def _wait_copy_backs(self) -> None:
        if self.streamed is not None:
            self.streamed.wait_copy_backs()

    @contextlib.contextmanager
    def resident(self, only: tuple[GroupState, Sequence[int]] | None = None, write: bool = True) -> Iterator[None]:
        """Every group's whole state resident (checkpoints, state written by other code), or
        only these slots of one group (a streaming checkpoint, bucket by bucket). ``write``
        False: the caller only reads it (a paging tier then writes nothing back)."""
        parts = [(g, range(len(g))) for _, g in self.live_groups()] if only is None else [only]
        for g, slots in parts:
            self.tier.make_resident(g, slots)
        try:
            yield
        finally:
            for g, slots in parts:
                self.tier.release(g, slots, self._wait_copy_backs, wrote=write)
            if only is None:
                self.tier.end_step()

    def discard_grads(self) -> None:
        self._direct_left = None
        if self.streamed is not None:
            self.streamed.discard()

    # -- gradients ------------------------------------------------------------------------------

    def grad_sq_norm(self) -> float:
        """Squared 2-norm of this step's gradients (see :func:`~offload_adam.optim.grads.grad_sq_norm`)."""
        return grad_sq_norm([g for _, g in self.live_groups()], self.streamed, self.num_threads, self.synchronize)

    # -- reports --------------------------------------------------------------------------------

    def memory(self) -> tuple[int, int]:
        tier = self.tier.memory()
        held = tight = tier.get("host_state_bytes", 0) + tier.get("window_bytes", 0)
        for _, g in self.live_groups():
            h, t = g.memory(paged=bool(tier))
            held += h
            tight += t
        return held, tight
