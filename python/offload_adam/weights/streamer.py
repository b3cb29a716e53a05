"""The streamer: streamed blocks copied into a static ring of device slots just before they run,
in the forward and, for training, again in the backward. It joins three pieces, each in a file of
its own: the ring of device slots (``ring.py``), the recorded cycle that says what runs next
(``cycle.py``, a pure order) and the per-block loader (``loader.py``); what it adds is the glue
to the module schedule, the backward and the optimizer's fences.

It subscribes to the module schedule (``runtime/schedule.py``). When a block's module starts its
forward (an *activation*), the block's parameters become views of its slot and the compute
stream waits for the block's copy event with a stream wait (never a host wait); when it ends,
they point to a placeholder that holds no device memory (a NaN scalar expanded to their shape,
so a read outside the block's forward gives NaN, never stale weights), and an event recorded on
the compute stream marks the slot's last use: the next copy into it waits for that event.

Training. While grad mode is on, a block's forward runs under saved-tensor hooks: a tensor
autograd saves that lies in a slot (a weight, or a view of one) is saved as a token (block,
offset, shape), a cast of a slot's parameter (autocast's) as a token that casts again, anything
else goes to the hooks outside (a ``torch.utils.checkpoint`` region's, an activation offload's)
or is kept. In the backward, unpacking a token activates the block again (loaded if needed,
prefetched in backward order) and gives a view of its slot; a block stays active in the backward
until another block is activated (or the backward ends), then its slot is freed as in the
forward. A checkpointed block's recompute runs its forward inside the backward: that activation
and the backward's own are one, so the block crosses once for both.

Prefetch follows the cycle recorded (``cycle.py``): at the activation of instance g, the
instances up to g + ``prefetch`` are queued into free slots, cyclically (the next cycle's first
blocks during the last ones). A cycle whose activations differ from the recorded one loads what
it needs on demand, is exact all the same, and is recorded as the new one. Reads of a block's
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
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device, Meter, data_address, refuse_capture, storage_address
from ..runtime.hosted import Home
from ..runtime.schedule import SCHEDULE
from .blocks import Block, wrapped
from .cycle import Cycle
from .frozen import FrozenLinearMode
from .hostmatmul import leave_mode
from .loader import Loader, Source
from .placement import Placer
from .ring import Ring, Slot

log = logging.getLogger("offload_adam")


@dataclass
class _Loaded:
    g: int  # the instance (cycle * instances per cycle + index); -1: loaded on demand
    slot: Slot
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
class _Param:
    """A saved streamed parameter that is a wrapper subclass (a frozen quantized weight a linear
    saves for its backward): the block is loaded again when it is unpacked."""

    block: int
    entry: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class _Outer:
    """A saved tensor handed to the saved-tensor hooks that were active outside ours."""

    packed: Any
    unpack: Callable[[Any], Tensor]


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
        placeholders: dict[int, list[list[Tensor]]],
        homes: dict[int, list[Home]] | None = None,
        placer: Placer | None = None,
    ) -> None:
        self.device = device
        self.placer = placer
        self.blocks = blocks
        self.source = source
        self.prefetch = prefetch
        self.streamed = set(streamed)
        self.own = own & self.streamed
        self.homes = homes or {}
        on_device = placer is None or placer.on_device
        self.ring = Ring(
            device, meter, blocks, streamed if on_device else [], self.own, prefetch,
            general=placer is None or placer.mode != "cpu", host_only=placer.host_only if placer is not None else None,
        )  # fmt: skip
        self.loader = Loader(device, blocks, source, placeholders, self.homes)
        self.cycle = Cycle([b for b in guess if b in self.streamed], self.own)
        self.trigger: dict[int, int] = {id(m): b for b in streamed for m in blocks[b].modules}
        # Every module inside a streamed block: a recompute that runs a block's forward without
        # its module's hooks (transformers checkpoints `forward`, not `__call__`) is seen there.
        self.member: dict[int, int] = {id(c): b for b in streamed for m in blocks[b].modules for c in m.modules()}
        self.param_block: dict[int, int] = {id(e.param): b for b in streamed for e in blocks[b].entries}
        self.param_entry: dict[int, tuple[int, int]] = {
            id(e.param): (b, k) for b in streamed for k, e in enumerate(blocks[b].entries)
        }
        # Frozen wrapped parameters (quantized bases) per block: their linears go through
        # FrozenLinear while the block's forward builds a graph.
        self.frozen: dict[int, set[int]] = {}
        for b in streamed:
            ids = {id(e.param) for e in blocks[b].entries if e.wrapped and not e.param.requires_grad}
            if ids:
                self.frozen[b] = ids
        self.modes: dict[int, list[FrozenLinearMode]] = {}  # id(module) -> the modes it entered
        self.cache_state: dict[int, list[bool]] = {}  # id(module) -> autocast cache flags to restore
        self.readers: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self.reading: dict[int, list[int]] = {}  # id(module) -> blocks activated for its reads, this pass
        self.pushed: dict[int, int] = {}  # id(module) -> saved-tensor hooks it pushed (to pop after it)
        self.in_cycle = False  # activations since the last cycle ended
        self.graph = False  # this cycle's forward built a graph: a backward may follow
        self.backward = False  # this cycle's backward has started
        self.trained = False  # this cycle had a backward (a step may follow)
        self.loaded: dict[int, _Loaded] = {}
        self.hosted: set[int] = set()  # blocks running on the CPU from their host bytes now
        self.decided: dict[int, str] = {}  # id(module) -> where its current call runs
        self.active: dict[int, int] = {}
        self.open: set[int] = set()  # active in the backward until another block is
        self.act_pos: dict[int, int] = {}
        self.started: dict[int, int] = {}  # recording: id(module) -> where its forward started in `seen`
        self.recording = False
        self.sub = SCHEDULE.subscribe(self)
        if placer is not None:  # a call is sized by its hidden states, positional or keyword
            for m in self._trigger_modules():
                SCHEDULE.see_kwargs(m)
        self._record()

    def _trigger_modules(self) -> list[torch.nn.Module]:
        return [m for b in self.streamed for m in self.blocks[b].modules]

    @property
    def order(self) -> list[int]:
        """The cycle recorded: the blocks' activations from a forward's start to its backward's end."""
        return self.cycle.order

    @property
    def stats(self) -> dict[str, int]:
        return self.loader.stats

    def _record(self) -> None:
        """The next pass records reads (a module reading another block's parameters)."""
        self.sub.record_next()
        self.recording = True

    # -- slots ----------------------------------------------------------------------------------

    def _evict_for(self, b: int) -> Slot:
        """A slot for ``b`` when none is free: one holding a block not running (the one needed
        last), else a new one (the ring grows: a forward holds more blocks at once than it has)."""
        cands = [(ld.g, c) for c, ld in self.loaded.items() if c not in self.active and self.ring.serves(ld.slot, b)]
        if cands:
            _, c = max(cands)
            slot = self.loaded.pop(c).slot
            slot.block = None
            return slot
        return self.ring.grow(b)

    def _load(self, b: int, g: int, last: int, slot: Slot | None = None, now: bool = False) -> _Loaded:
        """Queues the copy of block ``b`` into a slot (see ``loader.py``). ``now``: needed at once
        (not a prefetch): on the device's stream of copies needed now, never behind a prefetch's wait."""
        if slot is None:
            slot = self.ring.free(b) or self._evict_for(b)
        try:
            event = self.loader.copy(b, slot, now)
        except BaseException:
            self._fault()
            raise
        ld = self.loaded[b] = _Loaded(g, slot, event, last, self.loader.versions(b))
        return ld

    def _prefetch(self, g: int, after_backward: bool = False) -> None:
        """Queues the instances after ``g`` up to ``g + prefetch``, in order, while slots are free
        (and the host copies final); starts reading the ones after (an NVMe source reads them
        into staging slots). ``after_backward``: from the end of a backward, the next cycle's
        blocks whose host copies an optimizer writes are left for later (loaded at their
        activation, once written)."""
        cy = self.cycle
        n = len(cy.inst)
        if not n:
            return
        cy.next_load = max(cy.next_load, g + 1)
        while cy.next_load <= g + self.prefetch:
            b, p, first, last = cy.at(cy.next_load)
            if self.placer is not None and self.placer.predict(b) == "cpu":
                cy.next_load += 1  # it will run from its host bytes: read ahead below, not copied
                continue
            homes = self.homes.get(b, ())
            if homes and not all(h.ready.is_set() for h in homes):
                break  # its step has not written it yet: loaded when it is needed
            if homes and (after_backward or (p > cy.ncycle and self.trained)) and any(h.written for h in homes):
                break  # the next cycle's, after a backward: a step is to come, a copy now would be stale
            ld = self.loaded.get(b)
            if ld is not None:
                if b in self.active or ld.last >= first:
                    cy.next_load += 1  # still there when that instance comes (a nested activation)
                    continue
                break  # released before it is needed again: loaded after
            slot = self.ring.free(b)
            if slot is None:
                break
            self._load(b, cy.next_load, last, slot)
            cy.next_load += 1
        for k in range(cy.next_load, cy.next_load + self.prefetch + 1):
            b = cy.inst[k % n][0]
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
        self.cycle.mismatch = True
        self.cycle.faulted = True

    # -- activations ----------------------------------------------------------------------------

    def _where(self) -> str:
        """Where an activation not decided by the placer runs (a read by another module, a
        backward): on the device, unless there is none."""
        return "cpu" if self.placer is not None and not self.placer.on_device else "stream"

    def _host(self, b: int, pos: int, planned: bool) -> None:
        """Block ``b`` runs on the CPU: its parameters := views of its host bytes (the pinned
        copy, or the staging slot its page is read into), once its host copies are not being
        written."""
        blk = self.blocks[b]
        for h in self.homes.get(b, ()):
            h.ready.wait()
        if b not in self.active:
            try:
                host = self.source.host(blk)
            except BaseException:
                self._fault()
                raise
            self.loader.point_host(b, host)
            self.hosted.add(b)
        self.active[b] = self.active.get(b, 0) + 1
        self.act_pos[b] = self.cycle.abs(pos)
        if planned:
            self._prefetch(self.cycle.instance(pos)[0])

    def _acquire(self, b: int, at: int | None = None, where: str | None = None) -> _Loaded | None:
        """Block ``b`` is needed now (a new position of the cycle): loaded if it is not (or if
        what is loaded is stale), the compute stream waiting for its copy, its parameters views
        of its slot; the instances ahead queued. ``at``: the position of the cycle it belongs to,
        if not the next one (a read found mid-way belongs where its module started). ``where``:
        ``"cpu"``, it runs from its host bytes instead (see ``placement.py``)."""
        self.in_cycle = True
        pos, planned, diverged = self.cycle.advance(b, at)
        if diverged:
            self._cancel()
        if (where or self._where()) == "cpu" and b not in self.active or b in self.hosted:
            self._host(b, pos, planned)
            return None
        ld = self.loaded.get(b)
        if ld is not None and b not in self.active and ld.versions != self.loader.versions(b):
            self.loaded.pop(b).slot.block = None  # copied before its host copies were written
            ld = None
        g = -1
        if planned:
            g, last = self.cycle.instance(pos)
            if ld is None or ld.g != g:
                if ld is not None and b not in self.active:
                    self.loaded.pop(b).slot.block = None
                if b not in self.loaded:  # not prefetched (prefetch 0, or no slot was free)
                    ld = self._load(b, g, last, now=True)
                ld = self.loaded[b]
        elif ld is None:
            self.loader.stats["on_demand"] += 1
            ld = self._load(b, -1, -1, now=True)
        if b not in self.active:
            self.loader.wait(ld.event)
            self.loader.point(b, ld.slot)
        self.active[b] = self.active.get(b, 0) + 1
        self.act_pos[b] = self.cycle.abs(pos)
        if planned:
            self._prefetch(g)
        return ld

    def _release(self, b: int) -> None:
        """``b`` stops running: its parameters point to their placeholders; its slot is freed
        (after the work queued so far) at its instance's last activation."""
        del self.active[b]
        self.loader.point(b, None)
        if b in self.hosted:
            self.hosted.discard(b)
            self.source.done(self.blocks[b], None)  # the host is done with its bytes (a staging slot reusable)
            return
        ld = self.loaded.get(b)
        if ld is None:
            return
        # The slot's last use so far, recorded at every release: a block kept loaded for a later
        # activation can still lose its slot without running again (a cancel, an eviction, a
        # stale copy dropped), and the next copy into it must follow this use.
        ld.slot.free_event = self.device.record_current()
        if self.cycle.mismatch or ld.last <= self.act_pos.get(b, 0):
            ld.slot.block = None
            del self.loaded[b]

    def activate(self, b: int, at: int | None = None, where: str | None = None) -> None:
        """A forward activation (from a module's pre-hook), ended by :meth:`deactivate`."""
        if self.backward and not _in_backward():
            self._end_backward()  # a forward after a backward whose end was not seen
        if torch.is_grad_enabled():
            self.graph = True
        self._acquire(b, at, where)

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
        changed, recorded = self.cycle.end()
        if changed:
            self._cancel()
        if recorded:
            self._record()
        self.in_cycle = self.graph = False
        self.loader.stats["passes"] += 1
        self.loader.fold()
        first = self.cycle.ncycle * len(self.cycle.inst)
        self._prefetch(first - 1, after_backward=self.trained)  # the next cycle's first blocks, meanwhile
        self.trained = False

    # -- saved tensors (training) ---------------------------------------------------------------

    def _push_hooks(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        me = weakref.ref(self)

        def pack(t: Tensor) -> Any:
            s = me()
            if wrapped(t):  # (no storage of its own) a streamed parameter: streamed again for the backward
                where = s.param_entry.get(id(t)) if s is not None else None
                if s is not None and where is not None and where[0] in s.active:
                    return _Param(where[0], where[1], s.loader.versions(where[0]))
                return _Outer(outer[0](t), outer[1]) if outer is not None else t
            slot = s.ring.of_storage(storage_address(t)) if s is not None else None
            if s is not None and slot is not None and slot.block is not None and t.device == slot.buf.device:
                b = slot.block
                es = t.element_size()
                off = data_address(t) - data_address(slot.buf)
                return _Token(b, off // es, t.dtype, tuple(t.shape), tuple(t.stride()), s.loader.versions(b))
            cast = s._cast_of(t) if s is not None else None
            if cast is not None:
                return cast
            if outer is not None:
                return _Outer(outer[0](t), outer[1])
            return t

        def unpack(x: Any) -> Tensor:
            if isinstance(x, (_Token, _Cast, _Param)):
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
        return _Cast(b, k, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), self.loader.versions(b))

    def _unpack(self, tok: _Token | _Cast | _Param) -> Tensor:
        if tok.versions != self.loader.versions(tok.block):
            raise RuntimeError(
                f"offload_adam: the weights of block {self.blocks[tok.block].name} were written (an optimizer step) "
                "between the forward that used them and its backward"
            )
        self._bwd_activate(tok.block)
        if isinstance(tok, _Param):
            return self.blocks[tok.block].entries[tok.entry].param  # (its parts point at the slot now)
        slot = self.loaded[tok.block].slot
        if isinstance(tok, _Cast):
            cast = self.loader.views(slot, tok.block)[tok.entry][0].to(tok.dtype)
            return torch.as_strided(cast, tok.size, tok.stride, tok.offset)
        return torch.as_strided(slot.as_dtype(tok.dtype), tok.size, tok.stride, tok.offset)

    # -- the schedule's subscriber interface ----------------------------------------------------

    def pre_forward(self, module: torch.nn.Module) -> None:
        if self.recording:
            self.started[id(module)] = len(self.cycle.seen)
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
                self.decided[id(module)] = self._where()
                self._bwd_activate(b)  # a checkpointed block, recomputed
            else:
                where = self._where()
                if self.placer is not None:
                    args, kwargs = SCHEDULE.call_args(), SCHEDULE.call_kwargs()
                    where = self.placer.decide(b, module, args, torch.is_grad_enabled(), kwargs)
                    if where == "cpu" and b in self.active and b not in self.hosted:
                        # Its weights are on the device already (held there by a read outside its
                        # module): the call runs there, its inputs are not moved to the host.
                        where = self.placer.overrule(b, args, "stream", kwargs)
                self.decided[id(module)] = where
                self.activate(b, where=where)
            if torch.is_grad_enabled():
                self._push_hooks()
                self.pushed[id(module)] = self.pushed.get(id(module), 0) + 1
                if b in self.frozen:
                    mode = FrozenLinearMode(self.frozen[b])
                    mode.__enter__()
                    self.modes.setdefault(id(module), []).append(mode)
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
            modes = self.modes.get(id(module))
            if modes:
                # By identity: on device="cpu" the CPU-run call's NativeMatmul, entered after it
                # (global hooks run before a module's own), may still be above it on the stack
                # (CUDA review, second pass, 9: __exit__ popped that one, a mode leaked per call).
                leave_mode(modes.pop())
                if not modes:
                    del self.modes[id(module)]
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
        self.activate(key, at=self.started.get(id(module), len(self.cycle.seen)))
        self.reading.setdefault(id(module), []).append(key)

    def pass_ended(self, recorded: bool) -> None:
        if not self.in_cycle or self.backward or _in_backward():
            return  # none of our blocks ran; or a recompute inside the backward
        self.reading.clear()
        if not self.graph:
            self._end_cycle()  # no backward will need these weights: the cycle was this forward

    # -- reports --------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.loader.reset_stats()

    def timings(self) -> tuple[float, float]:
        """(seconds the copies took, seconds compute waited for them) since the last reset."""
        return self.loader.timings()

    @property
    def ring_bytes(self) -> int:
        return self.ring.nbytes

    def close(self) -> None:
        self.sub.cancel()
        for m in self._trigger_modules():
            SCHEDULE.see_kwargs(m, see=False)
        self.device.drain()
        self.loaded.clear()
        self.active.clear()
        self.open.clear()
        self.ring.clear()  # the ring's memory goes with its last reference
        self.loader.placeholders = {}
