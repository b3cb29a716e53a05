"""The ring: the device slots streamed blocks are copied into, allocated once (vLLM's
``StaticBufferPool``).

``min(prefetch + 1, general blocks)`` general slots, each the size of the largest layer it
serves, and one slot of its own for each block that stays needed while other blocks run (run by
several modules, as a tied embedding and head; or holding parameters of a module that calls other
blocks), or that is larger than a layer and no layer (a head: its slot is made at its first copy,
so that an embedding looked up on the host never takes one). A slot remembers the event after its last use on the compute stream (``free_event``)
and its last copy (``copy_event``): the next copy into it waits for both. Nothing is allocated
afterwards, unless a forward holds more blocks at once than the ring has slots (it grows, with a
warning).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device, Meter
from .blocks import Block

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


def plan(
    blocks: list[Block], streamed: list[int], own: set[int], prefetch: int, general: bool = True,
    host_only: set[int] | None = None,
) -> tuple[int, int, set[int], set[int]]:  # fmt: skip
    """The ring for ``streamed`` blocks: (bytes of a general slot, general slots, blocks with a
    slot made at once, blocks with a slot made at their first copy). General slots are sized by
    the largest layer they serve; a block that is not a layer and is larger (a head, a large
    embedding) gets a slot of its own, made when it is first copied: an embedding looked up on the
    host (``host_only``) takes one only if training copies it, and otherwise shares the general
    slots, which it then never takes for inference. ``general``: False when no call is expected to stream
    (placement ``"cpu"``): every slot is made on demand."""
    skip = host_only or set()
    own = {b for b in own if b in streamed}
    later = {b for b in own if b in skip}  # looked up on the host: a slot only if training copies it
    own -= later
    rest = [b for b in streamed if b not in own and b not in later]
    layers = [blocks[b].nbytes for b in rest if blocks[b].layer]
    size = max(layers) if layers else max((blocks[b].nbytes for b in rest), default=0)
    later |= {b for b in rest if blocks[b].nbytes > size}
    if not general:
        return size, 0, set(), later | own
    return size, min(prefetch + 1, len(rest) - len(later & set(rest))), own, later


class Ring:
    """The slots of ``blocks`` streamed on ``device`` (see the module documentation)."""

    def __init__(
        self, device: Device, meter: Meter, blocks: list[Block], streamed: list[int], own: set[int], prefetch: int,
        general: bool = True, host_only: set[int] | None = None,
    ) -> None:  # fmt: skip
        self.device = device
        self.meter = meter
        self.blocks = blocks
        self.slot_bytes, n, made, self.later = plan(blocks, streamed, own, prefetch, general, host_only)
        self.own = made | self.later
        self.on_demand = not general  # no slot planned: each is made when first needed, without a warning
        self.slots = [self._slot(self.slot_bytes) for _ in range(n)]
        self.slots += [self._slot(blocks[b].nbytes, own=b) for b in sorted(made)]
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

    def of_storage(self, ptr: int) -> Slot | None:
        """The slot whose memory starts at ``ptr`` (a tensor's storage), if any."""
        return self.by_ptr.get(ptr)

    @property
    def nbytes(self) -> int:
        return sum(s.buf.numel() for s in self.slots)

    def clear(self) -> None:
        """Drops the slots (their memory goes with the last reference)."""
        self.slots.clear()
        self.by_ptr.clear()
