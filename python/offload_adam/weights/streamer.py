"""The streamer: streamed blocks copied into a static ring of device slots just before they run,
in the forward and, for training, again in the backward.

The ring is allocated once: ``min(prefetch + 1, streamed blocks)`` general slots, each the size
of the largest streamed block run by one module, and one slot of its own for each streamed block
that stays needed while other blocks run (run by several modules, as a tied embedding and head;
or holding parameters of a module that calls other blocks). No allocation happens afterwards.

It subscribes to the module schedule (``runtime/schedule.py``). When a block's module starts its
forward (an *activation*), the block's parameters become views of its slot and the compute
stream waits for the block's copy event with a stream wait (never a host wait); when it ends,
they point to a placeholder that holds no device memory (a NaN scalar expanded to their shape,
so a read outside the block's forward gives NaN, never stale weights), and an event recorded on
the compute stream marks the slot free: the next copy into it waits for that event on the
host-to-device stream.

Training. While grad mode is on, a block's forward runs under saved-tensor hooks: a tensor
autograd saves that lies in a slot (a weight, or a view of one) is saved as a token (block,
offset, shape), anything else goes to the hooks outside (a ``torch.utils.checkpoint`` region's,
an activation offload's) or is kept. In the backward, unpacking a token activates the block again
(loaded if needed, prefetched in backward order) and gives a view of its slot; a block stays
active in the backward until another block is activated (or the backward ends), then its slot is
freed as in the forward. A checkpointed block's recompute runs its forward inside the backward:
that activation and the backward's own are one, so the block crosses once for both.

Prefetch follows the *cycle* recorded: the activations from the start of a forward to the end of
its backward (or of the forward, in inference). Each activation is an *instance* of its block (a
block with a slot of its own has one per cycle, from its first activation to its last; an
activation of the block active just before is the same instance), loaded in order; at the
activation of instance g, the instances up to g + ``prefetch`` are queued into free slots,
cyclically (the next cycle's first blocks during the last ones). A cycle whose activations differ
from the recorded one (or the first, whose order is a guess from the model's module order) loads
what it needs on demand, is exact all the same, and is recorded as the new one. Reads of a block's
parameters by other modules (a parent reading a child's weight) are found on recorded passes.

Blocks whose weights an optimizer rewrites (``runtime/hosted.py``): a block is copied only once
its host copies are not being written (a host wait on the step's fence, for that block only), a
copy made before a step is copied again, and the next cycle's blocks are not read ahead from a
backward (a step is to come: the copies would be stale).

Where a block's bytes come from is its *source* (``storage.py``): pinned host memory, or NVMe
pages read ahead into pinned staging slots (an NVMe read is the one wait done on the host).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ..runtime.device import Device, Meter, refuse_capture
from ..runtime.hosted import Home
from ..runtime.schedule import SCHEDULE
from .blocks import Block

log = logging.getLogger("offload_adam")


class Source(Protocol):
    """Where streamed blocks' bytes live on the host."""

    def start(self, b: Block) -> bool:
        """Starts bringing ``b``'s bytes into host memory (read ahead); False: no room now."""
        ...

    def host(self, b: Block) -> Tensor:
        """``b``'s bytes in pinned host memory (waits for a read), a uint8 tensor."""
        ...

    def done(self, b: Block, event: Any) -> None:
        """The copy reading :meth:`host` of ``b`` completes at ``event``."""
        ...

    def reset(self) -> None:
        """After a fault: forgets what was read ahead."""
        ...


@dataclass(eq=False)
class _Slot:
    buf: Tensor  # uint8 device memory
    own: int | None = None  # the block this slot is reserved for, if any
    block: int | None = None  # the block loaded (or being loaded) into it
    free_event: Any = None  # compute-stream event after the last use of its previous block
    copy_event: Any = None  # the last copy into it (demand loads and prefetches use two streams)
    views: dict[int, list[Tensor]] = field(default_factory=dict)  # block -> its parameters in this slot
    typed: dict[torch.dtype, Tensor] = field(default_factory=dict)  # the slot seen as each dtype

    def as_dtype(self, dtype: torch.dtype) -> Tensor:
        t = self.typed.get(dtype)
        if t is None:
            es = torch.empty((), dtype=dtype).element_size()
            t = self.typed[dtype] = self.buf[: self.buf.numel() // es * es].view(dtype)
        return t


@dataclass
class _Loaded:
    g: int  # the instance (cycle * instances per cycle + index); -1: loaded on demand
    slot: _Slot
    event: Any  # its copy's completion
    last: int  # absolute position of its last planned activation (-1: release after this one)
    versions: tuple[int, ...]  # its host copies' versions when copied


@dataclass(frozen=True)
class _Token:
    """A saved tensor that lies in a slot: where it is in its block."""

    block: int
    offset: int  # elements of `dtype` from the block's start
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    versions: tuple[int, ...]


@dataclass(frozen=True)
class _Cast:
    """A saved tensor that is (a view of) a cast of a streamed parameter (autocast's: F.linear
    under torch.autocast saves the bf16 copy of an fp32 weight): cast again from the slot when
    unpacked, instead of holding the copy on the device until the backward."""

    block: int
    entry: int  # the parameter's place in its block
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the cast's start
    versions: tuple[int, ...]


@dataclass(frozen=True)
class _Outer:
    """A saved tensor handed to the saved-tensor hooks that were active outside ours."""

    packed: Any
    unpack: Callable[[Any], Tensor]


def placeholders(device: Device, blocks: Sequence[Block], meter: Meter) -> dict[int, list[Tensor]]:
    """What each parameter of ``blocks`` points to outside its block's forward: one NaN of its
    dtype on the device, expanded to its shape (no memory of its own)."""
    nan: dict[torch.dtype, Tensor] = {}
    out: dict[int, list[Tensor]] = {}
    for b in blocks:
        ph = []
        for e in b.entries:
            if e.param.dtype not in nan:
                nan[e.param.dtype] = device.empty(1, e.param.dtype, meter).fill_(float("nan")).view(())
            ph.append(nan[e.param.dtype].expand(e.param.shape))
        out[b.index] = ph
    return out


def plan(order: Sequence[int], own: set[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The instances of one cycle of ``order`` (block, first position, last position), in the
    order they are loaded, and the instance of each position. A block with a slot of its own
    has one instance per cycle; any other block one per run of consecutive activations."""
    span: dict[int, list[int]] = {}
    for pos, b in enumerate(order):
        if b in own:
            span.setdefault(b, [pos, pos])[1] = pos
    inst: list[tuple[int, int, int]] = []
    of_pos: list[int] = []
    first: dict[int, int] = {}
    for pos, b in enumerate(order):
        if b in own:
            if b not in first:
                first[b] = len(inst)
                inst.append((b, span[b][0], span[b][1]))
            of_pos.append(first[b])
        elif pos and order[pos - 1] == b:
            j = of_pos[-1]
            inst[j] = (b, inst[j][1], pos)
            of_pos.append(j)
        else:
            of_pos.append(len(inst))
            inst.append((b, pos, pos))
    return inst, of_pos


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class Streamer:
    """Streams ``streamed`` blocks of ``blocks`` through a ring on ``device`` (see the module
    documentation)."""

    def __init__(
        self,
        device: Device,
        blocks: list[Block],
        streamed: list[int],
        own: set[int],
        source: Source,
        prefetch: int,
        meter: Meter,
        guess: list[int],
        placeholders: dict[int, list[Tensor]],
        homes: dict[int, list[Home]] | None = None,
    ) -> None:
        self.device = device
        self.blocks = blocks
        self.source = source
        self.prefetch = prefetch
        self.meter = meter
        self.streamed = set(streamed)
        self.own = own & self.streamed
        self.homes = homes or {}
        general = [b for b in streamed if b not in self.own]
        self.slot_bytes = max((blocks[b].nbytes for b in general), default=0)
        self.slots = [_Slot(device.empty(self.slot_bytes, torch.uint8, meter)) for _ in range(min(prefetch + 1, len(general)))]
        self.slots += [_Slot(device.empty(blocks[b].nbytes, torch.uint8, meter), own=b) for b in sorted(self.own)]
        self._index_slots()
        self.placeholders = placeholders
        self.trigger: dict[int, int] = {id(m): b for b in streamed for m in blocks[b].modules}
        # Every module inside a streamed block: a recompute that runs a block's forward without
        # its module's hooks (transformers checkpoints `forward`, not `__call__`) is seen there.
        self.member: dict[int, int] = {id(c): b for b in streamed for m in blocks[b].modules for c in m.modules()}
        self.param_block: dict[int, int] = {id(e.param): b for b in streamed for e in blocks[b].entries}
        self.param_entry: dict[int, tuple[int, int]] = {
            id(e.param): (b, k) for b in streamed for k, e in enumerate(blocks[b].entries)
        }
        self.cache_state: dict[int, list[bool]] = {}  # id(module) -> autocast cache flags to restore
        self.readers: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self.reading: dict[int, list[int]] = {}  # id(module) -> blocks activated for its reads, this pass
        self.pushed: dict[int, int] = {}  # id(module) -> saved-tensor hooks it pushed (to pop after it)
        # The cycle recorded, and where this one is in it.
        self.order: list[int] = [b for b in guess if b in self.streamed]
        self.inst, self.of_pos = plan(self.order, self.own)
        self.ncycle = 0
        self.pos = 0
        self.seen: list[int] = []
        self.mismatch = False
        self.faulted = False
        self.in_cycle = False  # activations since the last cycle ended
        self.graph = False  # this cycle's forward built a graph: a backward may follow
        self.backward = False  # this cycle's backward has started
        self.trained = False  # this cycle had a backward (a step may follow)
        self.next_load = 0
        self.loaded: dict[int, _Loaded] = {}
        self.active: dict[int, int] = {}
        self.open: set[int] = set()  # active in the backward until another block is
        self.act_pos: dict[int, int] = {}
        self.reset_stats()
        self.started: dict[int, int] = {}  # recording: id(module) -> where its forward started in `seen`
        self.recording = False
        self.sub = SCHEDULE.subscribe(self)
        self._record()

    def _record(self) -> None:
        """The next pass records reads (a module reading another block's parameters)."""
        self.sub.record_next()
        self.recording = True

    def _index_slots(self) -> None:
        self.slot_of_ptr = {s.buf.untyped_storage().data_ptr(): s for s in self.slots}

    # -- the ring -------------------------------------------------------------------------------

    def _views(self, slot: _Slot, b: int) -> list[Tensor]:
        v = slot.views.get(b)
        if v is None:
            v = slot.views[b] = [e.view(slot.buf) for e in self.blocks[b].entries]
        return v

    def _point(self, b: int, slot: _Slot | None) -> None:
        views = self.placeholders[b] if slot is None else self._views(slot, b)
        for e, v in zip(self.blocks[b].entries, views):
            e.param.data = v

    def _versions(self, b: int) -> tuple[int, ...]:
        return tuple(h.version for h in self.homes.get(b, ()))

    def _free_slot(self, b: int) -> _Slot | None:
        for s in self.slots:
            if s.block is None and (s.own == b if b in self.own else s.own is None):
                return s
        return None

    def _evict_for(self, b: int) -> _Slot:
        """A slot for ``b`` when none is free: one holding a block not running (the one needed
        last), else a new one (the ring grows: a forward holds more blocks at once than it has)."""
        cands = [(ld.g, c) for c, ld in self.loaded.items() if c not in self.active and (ld.slot.own == b if b in self.own else ld.slot.own is None)]
        if cands:
            _, c = max(cands)
            slot = self.loaded.pop(c).slot
            slot.block = None
            return slot
        size = self.blocks[b].nbytes
        log.warning(
            "offload_adam: offload_weights: block %s needed while every slot of the ring is in use; the ring grows by %d bytes",
            self.blocks[b].name, size,
        )  # fmt: skip
        slot = _Slot(self.device.empty(size, torch.uint8, self.meter), own=b if b in self.own else None)
        if b not in self.own:
            self.slot_bytes = max(self.slot_bytes, size)
        self.slots.append(slot)
        self._index_slots()
        return slot

    def _load(self, b: int, g: int, last: int, slot: _Slot | None = None, now: bool = False) -> _Loaded:
        """Queues the copy of block ``b`` into a slot (after that slot's last use, and its last
        copy), once its host copies are not being written (an optimizer's step). ``now``: needed
        at once (not a prefetch): on the device's priority stream, never behind a prefetch."""
        dev = self.device
        stream = dev.h2d_now if now else dev.h2d
        if slot is None:
            slot = self._free_slot(b) or self._evict_for(b)
        blk = self.blocks[b]
        for h in self.homes.get(b, ()):
            h.ready.wait()
        try:
            host = self.source.host(blk)
        except BaseException:
            self._fault()
            raise
        dev.stream_waits(stream, slot.free_event)
        dev.stream_waits(stream, slot.copy_event)  # (a copy of a block dropped, maybe on the other stream)
        e0 = dev.record(stream, timing=True)
        with torch.profiler.record_function("offload_adam.weights_h2d"):
            dev.copy([(slot.buf[: blk.nbytes], host[: blk.nbytes])], stream)
        e1 = dev.record(stream, timing=True)
        slot.copy_event = e1
        self.source.done(blk, e1)
        self._copies.append((e0, e1))
        self.stats["h2d_bytes"] += blk.nbytes
        self.stats["loads"] += 1
        slot.block = b
        ld = self.loaded[b] = _Loaded(g, slot, e1, last, self._versions(b))
        return ld

    def _abs(self, pos: int) -> int:
        return self.ncycle * len(self.order) + pos

    def _prefetch(self, g: int, after_backward: bool = False) -> None:
        """Queues the instances after ``g`` up to ``g + prefetch``, in order, while slots are free
        (and the host copies final); starts reading the ones after (an NVMe source reads them
        into staging slots). ``after_backward``: from the end of a backward, the next cycle's
        blocks whose host copies an optimizer writes are left for later (loaded at their
        activation, once written)."""
        n = len(self.inst)
        if not n:
            return
        self.next_load = max(self.next_load, g + 1)
        while self.next_load <= g + self.prefetch:
            j, p = self.next_load % n, self.next_load // n
            b, first, last = self.inst[j]
            homes = self.homes.get(b, ())
            if homes and not all(h.ready.is_set() for h in homes):
                break  # its step has not written it yet: loaded when it is needed
            if homes and (after_backward or (p > self.ncycle and self.trained)) and any(h.written for h in homes):
                break  # the next cycle's, after a backward: a step is to come, a copy now would be stale
            ld = self.loaded.get(b)
            if ld is not None:
                if b in self.active or ld.last >= p * len(self.order) + first:
                    self.next_load += 1  # still there when that instance comes (a nested activation)
                    continue
                break  # released before it is needed again: loaded after
            slot = self._free_slot(b)
            if slot is None:
                break
            self._load(b, self.next_load, p * len(self.order) + last, slot)
            self.next_load += 1
        for k in range(self.next_load, self.next_load + self.prefetch + 1):
            b = self.inst[k % n][0]
            if b not in self.loaded and not self.source.start(self.blocks[b]):
                break

    def _cancel(self) -> None:
        """Drops the loaded blocks not running (prefetched for an order that no longer holds)."""
        for c in [c for c in self.loaded if c not in self.active]:
            self.loaded.pop(c).slot.block = None

    def _fault(self) -> None:
        """A load failed: nothing read ahead is trusted; the next cycle loads again, in the
        order recorded before (not this cycle's, which stops at the fault)."""
        self._cancel()
        self.source.reset()
        self.mismatch = True
        self.faulted = True

    # -- activations ----------------------------------------------------------------------------

    def _acquire(self, b: int, at: int | None = None) -> _Loaded:
        """Block ``b`` is needed now (a new position of the cycle): loaded if it is not (or if
        what is loaded is stale), the compute stream waiting for its copy, its parameters views
        of its slot; the instances ahead queued. ``at``: the position of the cycle it belongs to,
        if not the next one (a read found mid-way belongs where its module started)."""
        if not self.in_cycle:
            self.in_cycle = True
        pos = self.pos
        self.pos += 1
        if at is None:
            self.seen.append(b)
        else:
            self.seen.insert(at, b)
            self.mismatch = True  # the order of this cycle is being discovered
        planned = not self.mismatch and pos < len(self.order) and self.order[pos] == b
        if not planned and not self.mismatch:
            self.mismatch = True
            self._cancel()
        ld = self.loaded.get(b)
        if ld is not None and b not in self.active and ld.versions != self._versions(b):
            self.loaded.pop(b).slot.block = None  # copied before its host copies were written
            ld = None
        g = -1
        if planned:
            j = self.of_pos[pos]
            g = self.ncycle * len(self.inst) + j
            if ld is None or ld.g != g:
                if ld is not None and b not in self.active:
                    self.loaded.pop(b).slot.block = None
                if b not in self.loaded:  # not prefetched (prefetch 0, or no slot was free)
                    ld = self._load(b, g, self._abs(self.inst[j][2]), now=True)
                ld = self.loaded[b]
        elif ld is None:
            self.stats["on_demand"] += 1
            ld = self._load(b, -1, -1, now=True)
        if b not in self.active:
            dev = self.device
            e0 = dev.record_current(timing=True)
            dev.current_waits(ld.event)
            self._stalls.append((e0, dev.record_current(timing=True)))
            self._point(b, ld.slot)
        self.active[b] = self.active.get(b, 0) + 1
        self.act_pos[b] = self._abs(pos)
        if planned:
            self._prefetch(g)
        return ld

    def _release(self, b: int) -> None:
        """``b`` stops running: its parameters point to their placeholders; its slot is freed
        (after the work queued so far) at its instance's last activation."""
        del self.active[b]
        self._point(b, None)
        ld = self.loaded.get(b)
        if ld is None:
            return
        # The slot's last use so far, recorded at every release: a block kept loaded for a later
        # activation can still lose its slot without running again (a cancel, an eviction, a
        # stale copy dropped), and the next copy into it must follow this use.
        ld.slot.free_event = self.device.record_current()
        if self.mismatch or ld.last <= self.act_pos.get(b, 0):
            ld.slot.block = None
            del self.loaded[b]

    def activate(self, b: int, at: int | None = None) -> None:
        """A forward activation (from a module's pre-hook), ended by :meth:`deactivate`."""
        if self.backward and not _in_backward():
            self._end_backward()  # a forward after a backward whose end was not seen
        if torch.is_grad_enabled():
            self.graph = True
        self._acquire(b, at)

    def deactivate(self, b: int) -> None:
        n = self.active.get(b, 0)
        if n == 0 or b in self.open:  # its activation failed; or it runs on in the backward
            return
        if n > 1:
            self.active[b] = n - 1
            return
        self._release(b)

    def _bwd_activate(self, b: int) -> None:
        """A backward activation (a token unpacked, a checkpointed block recomputed): ``b`` stays
        active until another block is activated in the backward, or the backward ends."""
        if not self.backward:
            self.backward = self.trained = True
            me = weakref.ref(self)

            def done() -> None:
                s = me()
                if s is not None:
                    s._end_backward()

            torch.autograd.Variable._execution_engine.queue_callback(done)  # type: ignore[attr-defined]
        if b in self.open:
            return
        self._close_open()
        self._acquire(b)
        self.open.add(b)

    def _close_open(self) -> None:
        """The blocks a backward activated are done (it moved on, or ended)."""
        for c in list(self.open):
            self.open.discard(c)
            if self.active.get(c, 0) == 1:
                self._release(c)
            elif c in self.active:
                self.active[c] -= 1

    def _end_backward(self) -> None:
        if not self.backward:
            return
        self._close_open()
        self.backward = False
        self._end_cycle()

    def _end_cycle(self) -> None:
        """The cycle is over: recorded if it differs; the next cycle's first blocks queued."""
        for b in list(self.active):  # a cycle that ended without its post-hooks (an interrupt)
            self.open.discard(b)
            self.active[b] = 1
            self._release(b)
        self.reading.clear()
        self.started.clear()
        self.recording = False
        changed = self.mismatch or self.seen != self.order
        if changed:
            self._cancel()
            if not self.faulted and self.seen:
                self.order = self.seen
                self.inst, self.of_pos = plan(self.order, self.own)
                self._record()
        self.seen = []
        self.mismatch = self.faulted = False
        self.in_cycle = self.graph = False
        self.ncycle += 1
        self.pos = 0
        self.stats["passes"] += 1
        self._fold()
        first = self.ncycle * len(self.inst)
        if changed:
            self.next_load = first
        self._prefetch(first - 1, after_backward=self.trained)  # the next cycle's first blocks, meanwhile
        self.trained = False

    # -- saved tensors (training) ---------------------------------------------------------------

    def _push_hooks(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        me = weakref.ref(self)

        def pack(t: Tensor) -> Any:
            s = me()
            slot = s.slot_of_ptr.get(t.untyped_storage().data_ptr()) if s is not None else None
            if s is not None and slot is not None and slot.block is not None and t.device == slot.buf.device:
                b = slot.block
                es = t.element_size()
                off = t.data_ptr() - slot.buf.data_ptr()
                return _Token(b, off // es, t.dtype, tuple(t.shape), tuple(t.stride()), s._versions(b))
            cast = s._cast_of(t) if s is not None else None
            if cast is not None:
                return cast
            if outer is not None:
                return _Outer(outer[0](t), outer[1])
            return t

        def unpack(x: Any) -> Tensor:
            if isinstance(x, (_Token, _Cast)):
                s = me()
                if s is None:
                    raise RuntimeError("offload_adam: the weights' streamer is gone (offload closed?) before the backward")
                return s._unpack(x)
            if isinstance(x, _Outer):
                return x.unpack(x.packed)
            return x  # type: ignore[no-any-return]

        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)

    def _cast_of(self, t: Tensor) -> _Cast | None:
        """``t`` as a cast of a running block's parameter (a view of ``p.to(dtype)``), or None."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or fn.name() != "ToCopyBackward0" or not base.is_contiguous():
            return None
        nxt = fn.next_functions
        var = getattr(nxt[0][0], "variable", None) if nxt and nxt[0][0] is not None else None
        if var is None:
            return None
        where = self.param_entry.get(id(var))
        if where is None or where[0] not in self.active or base.shape != var.shape:
            return None
        b, k = where
        return _Cast(b, k, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), self._versions(b))

    def _unpack(self, tok: _Token | _Cast) -> Tensor:
        if tok.versions != self._versions(tok.block):
            raise RuntimeError(
                f"offload_adam: the weights of block {self.blocks[tok.block].name} were written (an optimizer step) "
                "between the forward that used them and its backward"
            )
        self._bwd_activate(tok.block)
        slot = self.loaded[tok.block].slot
        if isinstance(tok, _Cast):
            cast = self._views(slot, tok.block)[tok.entry].to(tok.dtype)
            return torch.as_strided(cast, tok.size, tok.stride, tok.offset)
        return torch.as_strided(slot.as_dtype(tok.dtype), tok.size, tok.stride, tok.offset)

    # -- the schedule's subscriber interface ----------------------------------------------------

    def pre_forward(self, module: torch.nn.Module) -> None:
        if self.recording:
            self.started[id(module)] = len(self.seen)
        b = self.trigger.get(id(module))
        if b is not None:
            refuse_capture(self.device, "offload_weights")
            # autocast's cast cache keeps a copy of each fp32 weight it casts (keyed by the
            # parameter, which stays the same object) until the outermost autocast exits: the
            # whole model on the device. Off while a streamed block runs; a cast saved for the
            # backward is cast again from the slot then (_Cast).
            self.cache_state.setdefault(id(module), []).append(torch.is_autocast_cache_enabled())
            torch.set_autocast_cache_enabled(False)
            if _in_backward():
                self._bwd_activate(b)  # a checkpointed block, recomputed
            else:
                self.activate(b)
            if torch.is_grad_enabled():
                self._push_hooks()
                self.pushed[id(module)] = self.pushed.get(id(module), 0) + 1
        elif self.backward or _in_backward():
            c = self.member.get(id(module))
            if c is not None and c not in self.active:
                # Recomputed inside the backward without the block's own hooks: loaded for it
                # (and held by the recomputed tensors until the next block's backward).
                self._bwd_activate(c)
        extra = self.readers.get(module) if self.readers else None
        if extra:
            acts = self.reading.setdefault(id(module), [])
            for c in sorted(extra):
                if c not in self.active:
                    self.activate(c)
                    acts.append(c)

    def post_forward(self, module: torch.nn.Module) -> None:
        if self.reading:
            for c in self.reading.pop(id(module), ()):
                self.deactivate(c)
        b = self.trigger.get(id(module))
        if b is not None:
            flags = self.cache_state.get(id(module))
            if flags:
                torch.set_autocast_cache_enabled(flags.pop())
                if not flags:
                    del self.cache_state[id(module)]
            n = self.pushed.get(id(module), 0)
            if n:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                if n == 1:
                    del self.pushed[id(module)]
                else:
                    self.pushed[id(module)] = n - 1
            self.deactivate(b)

    def read_key(self, t: Tensor) -> int | None:
        return self.param_block.get(id(t))

    def on_read(self, module: torch.nn.Module, key: Any) -> None:
        if key in self.active:
            return
        # Read by a module that is not the block's: loaded now (the call has not run yet), and
        # from the next pass on when that module starts.
        self.readers.setdefault(module, set()).add(key)
        self.activate(key, at=self.started.get(id(module), len(self.seen)))
        self.reading.setdefault(id(module), []).append(key)

    def pass_ended(self, recorded: bool) -> None:
        if not self.in_cycle or self.backward or _in_backward():
            return  # none of our blocks ran; or a recompute inside the backward
        self.reading.clear()
        if not self.graph:
            self._end_cycle()  # no backward will need these weights: the cycle was this forward

    # -- reports --------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = {"h2d_bytes": 0, "loads": 0, "on_demand": 0, "passes": 0}
        self._copies: list[tuple[Any, Any]] = []  # (start, end) of copies not yet counted
        self._stalls: list[tuple[Any, Any]] = []  # compute stream before and after a wait
        self._h2d_s = self._stall_s = 0.0

    def _fold(self) -> None:
        """Counts the timings that have completed (and drops their events)."""
        dev = self.device
        for pairs, attr in ((self._copies, "_h2d_s"), (self._stalls, "_stall_s")):
            keep = []
            total = getattr(self, attr)
            for a, b in pairs:
                t = dev.elapsed(a, b)
                if t is None:
                    keep.append((a, b))
                else:
                    total += t
            pairs[:] = keep
            setattr(self, attr, total)

    def timings(self) -> tuple[float, float]:
        """(seconds the copies took, seconds compute waited for them) since the last reset;
        waits for the copies in flight."""
        dev = self.device
        for _, e in self._copies:  # (on two streams: the last queued is not the last to run)
            dev.host_wait(e)
        t0 = time.perf_counter()
        self._fold()
        while (self._copies or self._stalls) and time.perf_counter() - t0 < 10:
            time.sleep(0.001)
            self._fold()
        return self._h2d_s, self._stall_s

    @property
    def ring_bytes(self) -> int:
        return sum(s.buf.numel() for s in self.slots)

    def close(self) -> None:
        self.sub.cancel()
        self.device.drain()
        self.loaded.clear()
        self.active.clear()
        self.open.clear()
        self.slots.clear()
        self.slot_of_ptr.clear()  # the ring's memory goes with its last reference
