"""Where streamed blocks' bytes live on the host: the streamer's sources.

:class:`HostWeights`: one allocation of the pinned arena (registered once, exactly the bytes of
the streamed blocks), each block at its offset; a block is copied to the device straight from it.

:class:`NvmeWeights`: one file of the runtime's page store (``runtime/pages.py``: a run
directory of its own with its lock, a free-space check, removed on close, at garbage collection
and at exit; a CRC-32C per page, computed and checked on the store's pool, off the caller's
thread), each block a page starting on a 4096-byte boundary (``O_DIRECT``). Pages are read by
the Rust I/O engine into a staging ring of ``prefetch + 2`` pinned slots, ahead of need; a slot
is reused once the copy to the device that reads it has completed (without a device, once the
block that ran from it has).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device
from ..runtime.pages import ALIGN, IoStats, PageStore, StagingRing
from ..runtime.pinned import PinnedArena, align_up
from .blocks import TENSOR_ALIGN, Block


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

    def io_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class NvmeWeights:
    """Streamed blocks in a file of the runtime's page store, read ahead into a staging ring (see
    the module documentation). ``device``: whose copies consume a staging slot (None: the host
    runs the block from the slot itself, ``device="cpu"``)."""

    FILE = "weights.bin"

    def __init__(
        self, device: Device | None, arena: PinnedArena | None, nvme_dir: Any, blocks: list[Block], slots: int,
        io: str | None = None,
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
        page = max((align_up(b.nbytes, ALIGN) for b in blocks), default=ALIGN)
        self.ring = StagingRing(device, arena, slots, page)

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

    def io_stats(self) -> dict[str, float]:
        return self.store.stats.as_dict()

    def close(self) -> None:
        self.ring.reset()
        self.store.close()


class SplitWeights:
    """Streamed blocks partly in RAM (``ram``: those ``host_budget_gb`` keeps there) and partly on
    NVMe (``nvme``: the rest); each call goes to the block's own."""

    def __init__(self, ram: HostWeights, nvme: NvmeWeights, in_ram: set[int]) -> None:
        self.ram = ram
        self.nvme = nvme
        self.in_ram = in_ram

    def _of(self, b: Block) -> HostWeights | NvmeWeights:
        return self.ram if b.index in self.in_ram else self.nvme

    def view(self, b: Block) -> Tensor | None:
        return self.ram.view(b) if b.index in self.in_ram else None

    def staging(self, b: Block) -> Tensor:
        return self._of(b).staging(b)

    def store_block(self, b: Block) -> None:
        self._of(b).store_block(b)

    def pin(self) -> None:
        self.ram.pin()

    def read(self, b: Block) -> Tensor:
        return self._of(b).read(b)

    def start(self, b: Block) -> bool:
        return self._of(b).start(b)

    def host(self, b: Block) -> Tensor:
        return self._of(b).host(b)

    def done(self, b: Block, event: Any) -> None:
        self._of(b).done(b, event)

    def reset(self) -> None:
        self.nvme.reset()

    @property
    def stats(self) -> IoStats:
        return self.nvme.stats

    @property
    def nvme_bytes(self) -> int:
        return self.nvme.nvme_bytes

    def io_stats(self) -> dict[str, float]:
        return self.nvme.io_stats()

    def close(self) -> None:
        self.nvme.close()
