"""Where streamed blocks' bytes live on the host: the streamer's sources.

:class:`HostWeights`: one allocation of the pinned arena (registered once, exactly the bytes of
the streamed blocks), each block at its offset; a block is copied to the device straight from it.

:class:`NvmeWeights`: one file in a run directory of the pager (``runtime/pager.py``: its own
directory and lock, a free-space check, removed on close, at garbage collection and at exit),
each block a page starting on a 4096-byte boundary (``O_DIRECT``) with a CRC-32C. Pages are read
by the Rust I/O engine into a ring of ``prefetch + 2`` pinned staging slots, ahead of need; a
slot is reused once the copy to the device that reads it has completed.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _native
from ..runtime.device import Device
from ..runtime.pager import ALIGN, RunDir
from ..runtime.pinned import PinnedArena
from .blocks import TENSOR_ALIGN, Block


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class HostWeights:
    """Streamed blocks in pinned host memory (see the module documentation)."""

    def __init__(self, arena: PinnedArena, blocks: list[Block]) -> None:
        self.offset: dict[int, int] = {}
        total = 0
        for b in blocks:
            self.offset[b.index] = total
            total = _align(total + b.nbytes, TENSOR_ALIGN)
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

    def store(self, b: Block) -> None:
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


@dataclass(eq=False)
class _Staging:
    buf: Tensor  # pinned, ALIGN-aligned
    block: int | None = None
    ticket: Any = None  # the read in flight
    ready: bool = False  # read and checked
    event: Any = None  # the device copy that reads it


class NvmeWeights:
    """Streamed blocks in a file on an SSD, read ahead into pinned staging slots (see the
    module documentation)."""

    FILE = "weights.bin"

    def __init__(
        self, device: Device, arena: PinnedArena, nvme_dir: Any, blocks: list[Block], slots: int, io: str | None = None
    ) -> None:
        self.device = device
        self.blocks = {b.index: b for b in blocks}
        self.offset: dict[int, int] = {}
        total = 0
        for b in blocks:
            self.offset[b.index] = total
            total += _align(b.nbytes, ALIGN)
        self.run = RunDir(nvme_dir, io=io)
        try:
            self.run.check_space(total, "offload_weights(storage='nvme')")
            self.file, self.path = self.run.open(self.FILE, total)
        except BaseException:
            self.run.close()
            raise
        self.io = self.run.io
        self.total = total
        self.crc: dict[int, int] = {}
        page = max((_align(b.nbytes, ALIGN) for b in blocks), default=ALIGN)
        self.slots = [_Staging(arena.alloc(page, torch.uint8, align=ALIGN)) for _ in range(slots)]
        self.stats = {"read_bytes": 0.0, "write_bytes": 0.0, "io_wait_s": 0.0}

    def _what(self, b: Block) -> str:
        return f"the weights of block {b.index} ({b.name})"

    # -- filling (at offload time) --------------------------------------------------------------

    def staging(self, b: Block) -> Tensor:
        """A staging slot to fill with ``b``'s bytes, then :meth:`store`."""
        s = self._take()
        s.block, s.ready = b.index, False
        return s.buf[: b.nbytes]

    def store(self, b: Block) -> None:
        """Writes ``b``'s staged bytes to its page (waits), with its CRC."""
        s = next(s for s in self.slots if s.block == b.index)
        n = _align(b.nbytes, ALIGN)
        s.buf[b.nbytes : n].zero_()
        page = s.buf[:n]
        self.crc[b.index] = _native.crc32c(page)
        t0 = time.perf_counter()
        try:
            self.io.submit([(True, self.file, page, self.offset[b.index])]).wait()
        except OSError as e:
            raise OSError(e.errno, f"offload_adam: writing {self._what(b)} to {self.path}: {e.strerror}") from None
        finally:
            self.stats["io_wait_s"] += time.perf_counter() - t0
            s.block = None
        self.stats["write_bytes"] += n

    def pin(self) -> None:
        pass  # the staging slots are pinned already

    def read(self, b: Block) -> Tensor:
        """``b``'s bytes, read now (``close``: back to ordinary tensors)."""
        out = self.host(b).clone()
        for s in self.slots:
            if s.block == b.index:
                s.block, s.ready = None, False
        return out

    # -- the source interface -------------------------------------------------------------------

    def _take(self) -> _Staging:
        """A staging slot to read into: a free one, else the one whose device copy was queued
        first (waited for), else the one read for the block needed last."""
        dev = self.device
        for s in self.slots:
            if s.block is None or (s.event is not None and dev.query(s.event)):
                break
        else:
            queued = [s for s in self.slots if s.event is not None]
            s = queued[0] if queued else self.slots[-1]
            if s.event is not None:
                dev.host_wait(s.event)
            elif s.ticket is not None:
                s.ticket.wait()
        s.block, s.ticket, s.ready, s.event = None, None, False, None
        return s

    def _submit(self, s: _Staging, b: Block) -> None:
        n = _align(b.nbytes, ALIGN)
        s.block, s.ready, s.event = b.index, False, None
        s.ticket = self.io.submit([(False, self.file, s.buf[:n], self.offset[b.index])])
        self.stats["read_bytes"] += n
        # Queued slots move to the back: _take reuses the oldest queued copy first.
        self.slots.remove(s)
        self.slots.append(s)

    def start(self, b: Block) -> bool:
        if any(s.block == b.index and s.event is None for s in self.slots):
            return True  # being read, or read and not yet copied
        dev = self.device
        for s in self.slots:
            if s.block is None or (s.event is not None and dev.query(s.event)):
                self._submit(s, b)
                return True
        return False

    def host(self, b: Block) -> Tensor:
        s = next((s for s in self.slots if s.block == b.index and s.event is None), None)
        if s is None:
            s = self._take()
            self._submit(s, b)
        if not s.ready:
            t0 = time.perf_counter()
            try:
                ticket, s.ticket = s.ticket, None
                try:
                    ticket.wait()
                except OSError as e:
                    raise OSError(e.errno, f"offload_adam: reading {self._what(b)} from {self.path}: {e.strerror}") from None
                n = _align(b.nbytes, ALIGN)
                if _native.crc32c(s.buf[:n]) != self.crc[b.index]:
                    raise OSError(
                        errno.EIO, f"offload_adam: {self.path}: {self._what(b)} are corrupted (checksum mismatch)"
                    )
            except BaseException:
                s.block = None
                raise
            finally:
                self.stats["io_wait_s"] += time.perf_counter() - t0
            s.ready = True
        return s.buf[: b.nbytes]

    def done(self, b: Block, event: Any) -> None:
        for s in self.slots:
            if s.block == b.index and s.event is None:
                s.event = event

    def reset(self) -> None:
        for s in self.slots:
            if s.ticket is not None:
                try:
                    s.ticket.wait()
                except OSError:
                    pass
            if s.event is not None:
                self.device.host_wait(s.event)
            s.block, s.ticket, s.ready, s.event = None, None, False, None

    @property
    def nvme_bytes(self) -> int:
        return self.total

    def io_stats(self) -> dict[str, float]:
        return dict(self.stats)

    def close(self) -> None:
        self.reset()
        self.run.close()
