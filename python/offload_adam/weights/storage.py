"""Where streamed blocks' bytes live on the host: the streamer's sources.

:class:`HostWeights`: one allocation of the pinned arena (registered once, exactly the bytes of
the streamed blocks), each block at its offset; a block is copied to the device straight from it.

:class:`NvmeWeights`: one file of the runtime's page store (``runtime/pages.py``: a run
directory of its own with its lock, a free-space check, removed on close, at garbage collection
and at exit; a CRC-32C per page, computed and checked on the store's pool, off the caller's
thread), each block a page starting on a 4096-byte boundary (``O_DIRECT``). Pages are read by
the Rust I/O engine into a staging ring of ``prefetch + 2`` pinned slots, ahead of need; a slot
is reused once the copy to the device that reads it has completed (without a device, once the
block that ran from it has). Without a device the ring is ``prefetch + 1`` pages of the largest
layer, a page of its own for each larger block (a head), and none for an embedding, whose rows
are read instead (``plan.host_ring_plan``, ``rows.py``).

Both are a :class:`Source`, the one interface the offload, the streamer and the loader call;
:class:`Sources` holds the offload's (RAM, NVMe, or both: the blocks ``host_budget_gb`` keeps in
RAM and the rest on NVMe) and says which one holds a block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from ..runtime.device import Device
from ..runtime.pages import ALIGN, IoStats, PageStore, StagingRing
from ..runtime.pinned import PinnedArena, align_up
from .blocks import TENSOR_ALIGN, Block


class Source(Protocol):
    """Where streamed blocks' bytes live on the host."""

    # -- filling (at offload time) and handing back (close) -------------------------------------

    def staging(self, b: Block) -> Tensor:
        """Where ``b``'s bytes are written when it is filled, then :meth:`store_block`."""
        ...

    def store_block(self, b: Block) -> None:
        """``b``'s staged bytes to their place (a page written, with its CRC; waits)."""
        ...

    def pin(self) -> None:
        """Every block filled: its memory pinned (copies from it are asynchronous)."""
        ...

    def view(self, b: Block) -> Tensor | None:
        """``b``'s bytes kept in host memory (the copy an optimizer's step writes), or None (NVMe)."""
        ...

    def read(self, b: Block) -> Tensor:
        """``b``'s bytes, read now, a tensor of their own or the kept copy (``close``)."""
        ...

    def close(self) -> None:
        ...

    # -- streaming ------------------------------------------------------------------------------

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

    # -- reports --------------------------------------------------------------------------------

    @property
    def nvme_bytes(self) -> int: ...

    @property
    def ring_bytes(self) -> int:
        """Bytes of its RAM ring of pages read ahead (0: none)."""
        ...

    def page_cache_bytes(self) -> int: ...

    def io_stats(self) -> dict[str, float]: ...

    def reset_stats(self) -> None: ...



class HostWeights:
    """Streamed blocks in pinned host memory (see the module documentation)."""

    def __init__(self, arena: PinnedArena, blocks: list[Block]) -> None:
        self.offset: dict[int, int] = {}
        total = 0
        for b in blocks:
            self.offset[b.index] = total
            total = align_up(total + b.nbytes, TENSOR_ALIGN)
        # Untouched until filled, pinned after (pin()): the fill frees the model's tensors block
        # by block, so the host never holds the model twice, nor zeroes what it is about to fill.
        self.arena = arena
        self.buf = arena.alloc(total, torch.uint8, pin=False)

    def pin(self) -> None:
        """Every block filled: the buffer is pinned (copies from it are asynchronous)."""
        self.arena.pin(self.buf)

    def view(self, b: Block) -> Tensor:
        o = self.offset[b.index]
        return self.buf[o : o + b.nbytes]

    def staging(self, b: Block) -> Tensor:
        """Where ``b``'s bytes are written when it is filled (its own place)."""
        return self.view(b)

    def store_block(self, b: Block) -> None:
        pass  # filled in place

    def read(self, b: Block) -> Tensor:
        return self.view(b)

    # Source interface.
    def start(self, b: Block) -> bool:
        return True

    def host(self, b: Block) -> Tensor:
        return self.view(b)

    def done(self, b: Block, event: Any) -> None:
        pass

    def reset(self) -> None:
        pass

    @property
    def nvme_bytes(self) -> int:
        return 0

    @property
    def ring_bytes(self) -> int:
        return 0

    def page_cache_bytes(self) -> int:
        return 0

    def io_stats(self) -> dict[str, float]:
        return {}

    def reset_stats(self) -> None:
        pass

    def close(self) -> None:
        pass


class NvmeWeights:
    """Streamed blocks in a file of the runtime's page store, read ahead into a staging ring (see
    the module documentation). ``device``: whose copies consume a staging slot (None: the host
    runs the block from the slot itself, ``device="cpu"``)."""

    FILE = "weights.bin"

    def __init__(
        self, device: Device | None, arena: PinnedArena | None, nvme_dir: Any, blocks: list[Block], slots: int,
        io: str | None = None, *, page: int | None = None, own: dict[int, int] | None = None,
        transient: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        self.device = device
        self.blocks = {b.index: b for b in blocks}
        self.offset: dict[int, int] = {}
        total = 0
        for b in blocks:
            self.offset[b.index] = total
            total += align_up(b.nbytes, ALIGN)
        self.store = PageStore(nvme_dir, io=io)
        try:
            self.file = self.store.open(self.FILE, total, "offload_weights(storage='nvme')")
        except BaseException:
            self.store.close()
            raise
        self.path = self.file.path
        self.total = total
        if page is None:
            page = max((align_up(b.nbytes, ALIGN) for b in blocks), default=ALIGN)
        # (own: pages of their own, by block; transient: those freed once dropped, see pages.py)
        self.ring = StagingRing(device, arena, slots, page, own, transient)

    @property
    def run(self) -> Any:
        return self.store.run

    @property
    def io(self) -> Any:
        return self.store.io

    @property
    def stats(self) -> IoStats:
        return self.store.stats

    def _what(self, b: Block) -> str:
        return f"the page of block {b.index} ({b.name})"

    # -- filling (at offload time) --------------------------------------------------------------

    def staging(self, b: Block) -> Tensor:
        """A staging slot to fill with ``b``'s bytes, then :meth:`store`."""
        return self.ring.stage(b.index)[: b.nbytes]

    def store_block(self, b: Block) -> None:
        """Writes ``b``'s staged bytes to its page (waits), with its CRC."""
        buf = next(s.buf for s in self.ring.slots if s.key == b.index)
        n = align_up(b.nbytes, ALIGN)
        buf[b.nbytes : n].zero_()
        try:
            self.file.write(self.offset[b.index], buf[:n], self._what(b)).wait()
        finally:
            self.ring.drop(b.index)

    def pin(self) -> None:
        pass  # the staging slots are pinned already

    def view(self, b: Block) -> Tensor | None:
        return None  # (no copy kept in memory)

    def read(self, b: Block) -> Tensor:
        """``b``'s bytes, read now (``close``: back to ordinary tensors)."""
        out = self.host(b).clone()
        self.ring.drop(b.index)
        return out

    # -- the source interface -------------------------------------------------------------------

    def start(self, b: Block) -> bool:
        return self.ring.start(b.index, self.file, self.offset[b.index], b.nbytes, self._what(b))

    def host(self, b: Block) -> Tensor:
        return self.ring.get(b.index, self.file, self.offset[b.index], b.nbytes, self._what(b))

    def done(self, b: Block, event: Any) -> None:
        self.ring.done(b.index, event)

    def reset(self) -> None:
        self.ring.reset()

    @property
    def nvme_bytes(self) -> int:
        return self.total

    @property
    def ring_bytes(self) -> int:
        return self.ring.nbytes

    def page_cache_bytes(self) -> int:
        return self.store.page_cache_bytes()

    def io_stats(self) -> dict[str, float]:
        return self.store.stats.as_dict()

    def reset_stats(self) -> None:
        self.store.stats.reset()

    def close(self) -> None:
        self.ring.reset()
        self.store.close()


class Sources:
    """The offload's sources (one or two: RAM and NVMe) and the one holding each block."""

    def __init__(self, ram: HostWeights | None = None, nvme: NvmeWeights | None = None, in_ram: set[int] | frozenset[int] = frozenset()) -> None:
        self.ram = ram
        self.nvme = nvme
        self.all: list[Source] = [s for s in (ram, nvme) if s is not None]
        self.default: Source = nvme if nvme is not None else ram  # type: ignore[assignment]
        self.by_block: dict[int, Source] = {i: ram for i in in_ram} if ram is not None else {}

    def of(self, b: Block) -> Source:
        """The source holding ``b``."""
        return self.by_block.get(b.index, self.default)

    def __iter__(self) -> Iterator[Source]:
        return iter(self.all)
