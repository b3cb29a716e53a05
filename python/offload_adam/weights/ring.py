"""The ring: the device slots streamed blocks are copied into, allocated once (vLLM's
``StaticBufferPool``), as the plan sized it (``plan.py``: ``RingPlan``).

``min(prefetch + 1, general blocks)`` general slots, each the size of the largest layer it
serves, and one slot of its own for each block that stays needed while other blocks run (run by
several modules, as a tied embedding and head; or holding parameters of a module that calls other
blocks), or that is larger than a layer and no layer (a head: its slot is made at its first copy,
so that an embedding looked up on the host never takes one). A slot remembers the event after its last use on the compute stream (``free_event``)
and its last copy (``copy_event``): the next copy into it waits for both. Nothing is allocated
afterwards, unless a forward holds more blocks at once than the ring has slots (it grows, with a
warning).

The ring owns residency: the table of blocks loaded (each with its slot, its copy's event and the
instance it was loaded for), the choice of a slot to evict, a block's release (its slot's last
use recorded, the slot freed or kept for a later activation) and the cancel of what was loaded
for an order that no longer holds.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device, Meter
from .blocks import Block
from .plan import RingPlan

log = logging.getLogger("offload_adam")


@dataclass(eq=False)
class Slot:
    buf: Tensor  # uint8 device memory
    own: int | None = None  # the block this slot is reserved for, if any
    block: int | None = None  # the block loaded (or being loaded) into it
    free_event: Any = None  # compute-stream event after the last use of its previous block
    copy_event: Any = None  # the last copy into it (demand loads and prefetches use two streams)
    views: dict[int, list[list[Tensor]]] = field(default_factory=dict)  # block -> its parameters (their parts) in this slot
    typed: dict[torch.dtype, Tensor] = field(default_factory=dict)  # the slot seen as each dtype

    def as_dtype(self, dtype: torch.dtype) -> Tensor:
        t = self.typed.get(dtype)
        if t is None:
            es = torch.empty((), dtype=dtype).element_size()
            t = self.typed[dtype] = self.buf[: self.buf.numel() // es * es].view(dtype)
        return t


@dataclass
class Loaded:
    """A block in a slot (or being copied into it)."""

    g: int  # the instance (cycle * instances per cycle + index); -1: loaded on demand
    slot: Slot
    event: Any  # its copy's completion
    last: int  # absolute position of its last planned activation (-1: release after this one)
    versions: tuple[int, ...]  # its host copies' versions when copied


class Ring:
    """The slots of ``blocks`` streamed on ``device`` (see the module documentation)."""

    def __init__(self, device: Device, meter: Meter, blocks: list[Block], rp: RingPlan) -> None:
        self.device = device
        self.meter = meter
        self.blocks = blocks
        self.slot_bytes = rp.slot_bytes
        self.later = set(rp.later)
        self.own = set(rp.made) | self.later
        self.on_demand = rp.on_demand  # no slot planned: each is made when first needed, without a warning
        self.slots = [self._slot(self.slot_bytes) for _ in range(rp.general)]
        self.slots += [self._slot(blocks[b].nbytes, own=b) for b in sorted(rp.made)]
        self.loaded: dict[int, Loaded] = {}  # block -> where it is loaded
        self._index()

    def _slot(self, size: int, own: int | None = None) -> Slot:
        """A new slot: its memory was handed out on the compute stream, which may still read it
        (a caching allocator reuses freed blocks at once): its first copy waits for an event
        recorded after the allocation."""
        buf = self.device.empty(size, torch.uint8, self.meter)
        return Slot(buf, own=own, free_event=self.device.record_current())

    def _index(self) -> None:
        self.by_ptr = {s.buf.untyped_storage().data_ptr(): s for s in self.slots}

    def serves(self, slot: Slot, b: int) -> bool:
        """Whether ``slot`` may hold block ``b`` (its own slot, or a general one)."""
        return slot.own == b if b in self.own else slot.own is None

    def free(self, b: int) -> Slot | None:
        """A slot for ``b`` that holds nothing, if any."""
        for s in self.slots:
            if s.block is None and self.serves(s, b):
                return s
        return self.grow(b) if b in self.later else None

    def take(self, b: int, running: Container[int]) -> Slot:
        """A slot for ``b``: a free one, else one holding a block not ``running`` (the one
        needed last), else a new one (the ring grows: a forward holds more blocks at once than
        it has)."""
        slot = self.free(b)
        if slot is not None:
            return slot
        cands = [(ld.g, c) for c, ld in self.loaded.items() if c not in running and self.serves(ld.slot, b)]
        if cands:
            _, c = max(cands)
            slot = self.loaded.pop(c).slot
            slot.block = None
            return slot
        return self.grow(b)

    def hold(self, b: int, ld: Loaded) -> Loaded:
        """``b`` is loaded as ``ld`` says (its copy queued into ``ld.slot``)."""
        self.loaded[b] = ld
        return ld

    def drop(self, b: int) -> None:
        """``b``'s slot holds nothing now (a stale copy, a cancel): free for another block."""
        self.loaded.pop(b).slot.block = None

    def cancel(self, running: Container[int]) -> None:
        """Drops the loaded blocks not ``running`` (prefetched for an order that no longer holds)."""
        for c in [c for c in self.loaded if c not in running]:
            self.drop(c)

    def release(self, b: int, keep: bool) -> None:
        """``b`` stops running: its slot's last use is an event recorded on the compute stream
        now (after the work queued so far). Recorded at every release: a block kept loaded for a
        later activation (``keep``) can still lose its slot without running again (a cancel, an
        eviction, a stale copy dropped), and the next copy into it must follow this use."""
        ld = self.loaded.get(b)
        if ld is None:
            return
        ld.slot.free_event = self.device.record_current()
        if not keep:
            self.drop(b)

    def grow(self, b: int) -> Slot:
        """A new slot for ``b``: its own slot, made at its first copy; a general slot of a ring
        made on demand; or a forward holds more blocks at once than the ring has slots (with a
        warning)."""
        size = self.blocks[b].nbytes if b in self.own else max(self.blocks[b].nbytes, self.slot_bytes)
        if b in self.later:
            self.later.discard(b)  # (its own slot from now on)
        elif not self.on_demand:
            log.warning(
                "offload_adam: offload_weights: block %s needed while every slot of the ring is in use; the ring grows by %d bytes",
                self.blocks[b].name, size,
            )  # fmt: skip
        slot = self._slot(size, own=b if b in self.own else None)
        if b not in self.own:
            self.slot_bytes = max(self.slot_bytes, size)
        self.slots.append(slot)
        self._index()
        return slot

    def slot_of(self, b: int) -> Slot:
        """The slot ``b`` is loaded into."""
        return self.loaded[b].slot

    def of_storage(self, ptr: int) -> Slot | None:
        """The slot whose memory starts at ``ptr`` (a tensor's storage), if any."""
        return self.by_ptr.get(ptr)

    @property
    def nbytes(self) -> int:
        return sum(s.buf.numel() for s in self.slots)

    def clear(self) -> None:
        """Drops the slots (their memory goes with the last reference)."""
        self.loaded.clear()
        self.slots.clear()
        self.by_ptr.clear()
