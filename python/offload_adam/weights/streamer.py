"""The streamer: streamed blocks copied into a static ring of device slots just before they run,
in the forward and, for training, again in the backward. It keeps the schedule (vLLM's
``PrefetchOffloader``): it subscribes to the module schedule and orchestrates acquire, release
and prefetch over four pieces that own their verbs, each in a file of its own: the ring of
device slots and what they hold (``ring.py``), the recorded cycle and its prefetch cursor
(``cycle.py``, a pure order), the per-block loader (``loader.py``) and the training side
(``saved.py``: the saved tensors, the backward's activations, autocast's cache, frozen linears);
where a call runs is the placer's (``placement.py``).

It subscribes to the module schedule (``runtime/schedule.py``). When a block's module starts its
forward (an *activation*), the block's parameters become views of its slot and the compute
stream waits for the block's copy event with a stream wait (never a host wait); when it ends,
they point to a placeholder that holds no device memory (a NaN scalar expanded to their shape,
so a read outside the block's forward gives NaN, never stale weights), and an event recorded on
the compute stream marks the slot's last use: the next copy into it waits for that event.

Training (``saved.py``): a block's forward under grad mode saves tokens of its slot instead of
its weights; the backward activates the block again when it unpacks one.

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
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device, Meter, refuse_capture
from ..runtime.hosted import Home
from ..runtime.schedule import SCHEDULE
from .blocks import Block
from .cycle import Cycle
from .loader import Loader
from .placement import Placer
from .plan import WeightPlan
from .ring import Loaded, Ring, Slot
from .saved import Lookups, SavedWeights, in_backward, weak
from .storage import Sources

log = logging.getLogger("offload_adam")


class Streamer:
    """Streams the plan's streamed blocks of ``blocks`` through a ring on ``device`` (see the
    module documentation)."""

    def __init__(
        self,
        device: Device,
        blocks: list[Block],
        plan: WeightPlan,
        sources: Sources,
        meter: Meter,
        guess: list[int],
        placeholders: dict[int, list[list[Tensor]]],
        homes: dict[int, list[Home]],
        placer: Placer,
    ) -> None:
        self.device = device
        self.placer = placer
        self.blocks = blocks
        self.sources = sources
        self.prefetch = plan.ahead
        streamed = plan.streamed
        self.ring = Ring(device, meter, blocks, plan.ring)
        self.loader = Loader(device, blocks, sources, placeholders, homes)
        on = set(streamed)
        self.cycle = Cycle([b for b in guess if b in on], {b for b in streamed if plan.blocks[b].own_slot})
        self.trigger: dict[int, int] = {id(m): b for b in streamed for m in blocks[b].modules}
        # Every module inside a streamed block: a recompute that runs a block's forward without
        # its module's hooks (transformers checkpoints `forward`, not `__call__`) is seen there.
        self.member: dict[int, int] = {id(c): b for b in streamed for m in blocks[b].modules for c in m.modules()}
        self.param_block: dict[int, int] = {id(e.param): b for b in streamed for e in blocks[b].entries}
        self.readers: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self.reading: dict[int, list[int]] = {}  # id(module) -> blocks activated for its reads, this pass
        self.in_cycle = False  # activations since the last cycle ended
        self.hosted: set[int] = set()  # blocks running on the CPU from their host bytes now
        self.rows: Any = None  # embeddings looked up by their rows, no page read (rows.RowLookups)
        self.active: dict[int, int] = {}
        self.act_pos: dict[int, int] = {}
        self.started: dict[int, int] = {}  # recording: id(module) -> where its forward started in `seen`
        self.recording = False
        look = Lookups(self.active, self.loader.versions, self.ring.slot_of, self.ring.of_storage, self.loader.views)
        self.saved = SavedWeights(blocks, streamed, look, weak(self._acquire), weak(self.deactivate), weak(self._end_cycle))
        self.sub = SCHEDULE.subscribe(self)
        for m in self._trigger_modules():  # a call is sized by its hidden states, positional or keyword
            SCHEDULE.see_kwargs(m)
        self._record()

    def _trigger_modules(self) -> list[torch.nn.Module]:
        return [m for b in set(self.trigger.values()) for m in self.blocks[b].modules]

    def _record(self) -> None:
        """The next pass records reads (a module reading another block's parameters)."""
        self.sub.record_next()
        self.recording = True

    # -- loads ----------------------------------------------------------------------------------

    def _load(self, b: int, g: int, last: int, slot: Slot | None = None, now: bool = False) -> Loaded:
        """Queues the copy of block ``b`` into a slot (see ``loader.py``). ``now``: needed at once
        (not a prefetch): on the device's stream of copies needed now, never behind a prefetch's wait."""
        if slot is None:
            slot = self.ring.take(b, self.active)
        try:
            event = self.loader.copy(b, slot, now)
        except BaseException:
            self._fault()
            raise
        return self.ring.hold(b, Loaded(g, slot, event, last, self.loader.versions(b)))

    def _prefetch(self, g: int, after_backward: bool = False) -> None:
        """Queues the instances after ``g`` up to ``g + prefetch``, in order, while slots are free
        (and the host copies final); starts reading the ones after (an NVMe source reads them
        into staging slots). ``after_backward``: from the end of a backward, the next cycle's
        blocks whose host copies an optimizer writes are left for later (loaded at their
        activation, once written)."""
        cy = self.cycle
        while (due := cy.due(g, self.prefetch)) is not None:
            b, p, first, last = due
            if self.placer.predict(b) == "cpu":
                # It will run from its host bytes: read ahead into the RAM ring, not copied. The
                # cursor stays on it while no page is free (it moved past once, and the read-ahead
                # below starts after the cursor: every third block was read on demand, its read
                # not overlapped with the blocks before it, at prefetch 2).
                blk = self.blocks[b]
                if not self._by_rows(b) and not self.sources.of(blk).start(blk):
                    break
                cy.skip()
                continue
            homes = self.loader.homes.get(b, ())
            if homes and not all(h.ready.is_set() for h in homes):
                break  # its step has not written it yet: loaded when it is needed
            if homes and (after_backward or (p > cy.ncycle and self.saved.trained)) and any(h.written for h in homes):
                break  # the next cycle's, after a backward: a step is to come, a copy now would be stale
            ld = self.ring.loaded.get(b)
            if ld is not None:
                if b in self.active or ld.last >= first:
                    cy.skip()  # still there when that instance comes (a nested activation)
                    continue
                break  # released before it is needed again: loaded after
            slot = self.ring.free(b)
            if slot is None:
                break
            self._load(b, cy.next_load, last, slot)
            cy.skip()
        for b in cy.read_ahead(self.prefetch + 1):
            blk = self.blocks[b]
            if b not in self.ring.loaded and not self._by_rows(b) and not self.sources.of(blk).start(blk):
                break

    def _by_rows(self, b: int) -> bool:
        """Whether ``b`` is looked up by its rows now (no page of it read: ``rows.py``)."""
        return self.rows is not None and bool(self.rows.takes(b))

    def _fault(self) -> None:
        """A load failed: nothing read ahead is trusted; the next cycle loads again, in the
        order recorded before (not this cycle's, which stops at the fault)."""
        self.ring.cancel(self.active)
        for src in self.sources:
            src.reset()
        self.cycle.fault()

    # -- activations ----------------------------------------------------------------------------

    def _host(self, b: int, pos: int, planned: bool) -> None:
        """Block ``b`` runs on the CPU: its parameters := views of its host bytes (the pinned
        copy, or the staging slot its page is read into), once its host copies are not being
        written."""
        blk = self.blocks[b]
        for h in self.loader.homes.get(b, ()):
            h.ready.wait()
        if b not in self.active:
            if not self._by_rows(b):  # (rows looked up: the module's own hook reads them)
                try:
                    host = self.sources.of(blk).host(blk)
                except BaseException:
                    self._fault()
                    raise
                self.loader.point_host(b, host)
            self.hosted.add(b)
        self.active[b] = self.active.get(b, 0) + 1
        self.act_pos[b] = self.cycle.abs(pos)
        if planned:
            self._prefetch(self.cycle.instance(pos)[0])

    def _acquire(self, b: int, at: int | None = None, where: str | None = None) -> Loaded | None:
        """Block ``b`` is needed now (a new position of the cycle): loaded if it is not (or if
        what is loaded is stale), the compute stream waiting for its copy, its parameters views
        of its slot; the instances ahead queued. ``at``: the position of the cycle it belongs to,
        if not the next one (a read found mid-way belongs where its module started). ``where``:
        ``"cpu"``, it runs from its host bytes instead (see ``placement.py``)."""
        self.in_cycle = True
        pos, planned, diverged = self.cycle.advance(b, at)
        if diverged:
            self.ring.cancel(self.active)
        if (where or self.placer.otherwise()) == "cpu" and b not in self.active or b in self.hosted:
            self._host(b, pos, planned)
            return None
        loaded = self.ring.loaded
        ld = loaded.get(b)
        if ld is not None and b not in self.active and ld.versions != self.loader.versions(b):
            self.ring.drop(b)  # copied before its host copies were written
            ld = None
        g = -1
        if planned:
            g, last = self.cycle.instance(pos)
            if ld is None or ld.g != g:
                if ld is not None and b not in self.active:
                    self.ring.drop(b)
                if b not in loaded:  # not prefetched (prefetch 0, or no slot was free)
                    ld = self._load(b, g, last, now=True)
                ld = loaded[b]
        elif ld is None:
            self.loader.count("on_demand")
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
            blk = self.blocks[b]
            self.sources.of(blk).done(blk, None)  # the host is done with its bytes (a staging slot reusable)
            return
        ld = self.ring.loaded.get(b)
        if ld is not None:
            self.ring.release(b, keep=not self.cycle.mismatch and ld.last > self.act_pos.get(b, 0))

    def activate(self, b: int, at: int | None = None, where: str | None = None) -> None:
        """A forward activation (from a module's pre-hook), ended by :meth:`deactivate`."""
        if self.saved.backward and not in_backward():
            self.saved.end_backward()  # a forward after a backward whose end was not seen
        if torch.is_grad_enabled():
            self.saved.building_graph()
        self._acquire(b, at, where)

    def deactivate(self, b: int) -> None:
        n = self.active.get(b, 0)
        if n == 0 or b in self.saved.open:  # its activation failed; or it runs on in the backward
            return
        if n > 1:
            self.active[b] = n - 1
            return
        self._release(b)

    def _end_cycle(self) -> None:
        """The cycle is over: recorded if it differs; the next cycle's first blocks queued."""
        for b in list(self.active):  # a cycle that ended without its post-hooks (an interrupt)
            self.saved.open.discard(b)
            self.active[b] = 1
            self._release(b)
        self.reading.clear()
        self.started.clear()
        self.recording = False
        changed, recorded = self.cycle.end()
        if changed:
            self.ring.cancel(self.active)
        if recorded:
            self._record()
        self.in_cycle = False
        trained = self.saved.cycle_ended()
        self.loader.count("passes")
        self.loader.fold()
        first = self.cycle.ncycle * len(self.cycle.inst)
        self._prefetch(first - 1, after_backward=trained)  # the next cycle's first blocks, meanwhile

    # -- the schedule's subscriber interface ----------------------------------------------------

    def pre_forward(self, module: torch.nn.Module) -> None:
        if self.recording:
            self.started[id(module)] = len(self.cycle.seen)
        b = self.trigger.get(id(module))
        if b is not None:
            refuse_capture(self.device, "offload_weights")
            self.saved.enter(module)
            if in_backward():
                self.placer.settle(module, self.placer.otherwise())
                self.saved.backward_activate(b)  # a checkpointed block, recomputed
            else:
                held = b in self.active and b not in self.hosted
                call = (SCHEDULE.call_args(), SCHEDULE.call_kwargs())
                self.activate(b, where=self.placer.place(b, module, call, torch.is_grad_enabled(), held))
            if torch.is_grad_enabled():
                self.saved.building(module, b)
        elif self.saved.backward or in_backward():
            c = self.member.get(id(module))
            if c is not None and c not in self.active:
                # Recomputed inside the backward without the block's own hooks: loaded for it
                # (and held by the recomputed tensors until the next block's backward).
                self.saved.backward_activate(c)
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
            self.saved.leave(module)
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
        if not self.in_cycle or self.saved.backward or in_backward():
            return  # none of our blocks ran; or a recompute inside the backward
        self.reading.clear()
        if not self.saved.graph:
            self._end_cycle()  # no backward will need these weights: the cycle was this forward

    def close(self) -> None:
        self.sub.cancel()
        for m in self._trigger_modules():
            SCHEDULE.see_kwargs(m, see=False)
        self.device.drain()
        self.active.clear()
        self.saved.open.clear()
        self.ring.clear()  # the ring's memory goes with its last reference
        self.loader.placeholders = {}
