"""An embedding on the SSD looked up by its rows (``device="cpu"``, ``storage="nvme"``).

A decode step looks up one row of the token embedding: 4 KiB of a table of 32000 rows, which
reading whole would cost 125 MiB a token (7% of a 1B Llama's bytes from the SSD, for nothing).
An embedding block whose rows can be read alone (:func:`readable`: a plain ``nn.Embedding``,
unquantized, no ``max_norm``) has no page in the RAM ring (``plan.host_ring_plan``); at each
call of its module under inference, :class:`RowLookups` reads the 4 KiB units (``O_DIRECT``,
aligned) that the call's rows span, checks each unit against its CRC-32C, and runs the module's
own forward over those rows only: its weight is, for the call, the rows looked up, and the ids
their places among them (``torch.unique``'s inverse). A lookup copies rows: the output is the
resident model's, bitwise.

The CRC of each unit is computed once, at set-up, over the block's page read back whole and
checked against the page's own CRC (what the fill wrote). A call that builds a graph (training)
reads the whole page into a page of its own instead (the streamer's ordinary path), as does a
call with ids out of range, which then fails in torch's lookup as it would resident.
"""

from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import _native
from ..runtime.pages import ALIGN, aligned_empty
from .blocks import Block

if TYPE_CHECKING:
    from .storage import NvmeWeights


def readable(b: Block) -> bool:
    """Whether block ``b``'s rows can be read alone: one plain 2-D parameter, run only by
    ``nn.Embedding`` modules with the class's own forward (a subclass's may read the table
    otherwise) and no ``max_norm`` (which rewrites the rows it looks up)."""
    if len(b.entries) != 1 or b.entries[0].wrapped or len(b.entries[0].parts[0].shape) != 2:
        return False
    if b.entries[0].parts[0].stride is not None or not b.modules:
        return False
    return all(
        isinstance(m, torch.nn.Embedding) and type(m).forward is torch.nn.Embedding.forward and m.max_norm is None
        for m in b.modules
    )


class RowTable:
    """Block ``b``'s page on ``nvme`` as rows: the CRC of each of its 4 KiB units, and the read of
    the units some rows span."""

    def __init__(self, nvme: NvmeWeights, b: Block) -> None:
        self.nvme = nvme
        self.block = b
        part = b.entries[0].parts[0]
        self.num, self.width = part.shape
        self.dtype = part.dtype
        self.row_bytes = part.nbytes // self.num
        self.start = part.offset  # of row 0, from the page's start
        self.page = nvme.offset[b.index]  # of the page, in the file
        page = nvme.host(b)  # read whole once, checked against the page's CRC
        try:
            n = (page.numel() + ALIGN - 1) // ALIGN
            full = aligned_empty(n * ALIGN, torch.uint8)
            full[: page.numel()].copy_(page)
            full[page.numel() :].zero_()  # (the page's tail, as the fill wrote it)
            self.crc = [_native.crc32c(full[i * ALIGN : (i + 1) * ALIGN]) for i in range(n)]
        finally:
            nvme.ring.drop(b.index)  # (its page freed: the rows are read from now on)

    def read(self, rows: Tensor) -> Tensor:
        """The rows ``rows`` (sorted, unique, in range) of the table, a ``(len(rows), width)``
        tensor of their own: only the units they span are read (one request per run of units),
        each checked against its CRC. Raises OSError naming the file and the block on an I/O
        error or a mismatch."""
        rb, a = self.row_bytes, ALIGN
        lo = (self.start + rows * rb) // a
        hi = (self.start + (rows + 1) * rb - 1) // a
        span = int((hi - lo).max()) + 1
        units = torch.unique(torch.cat([torch.minimum(lo + k, hi) for k in range(span)]))  # sorted
        buf = aligned_empty(units.numel() * a, torch.uint8)
        breaks = (torch.nonzero(units[1:] - units[:-1] != 1).flatten() + 1).tolist()
        cuts = [0, *breaks, units.numel()]
        first = units.tolist()
        f = self.nvme.file
        reqs = [(False, f.fid, buf[i * a : j * a], self.page + first[i] * a) for i, j in zip(cuts, cuts[1:])]
        stats = f.store.stats
        t0 = time.perf_counter()
        try:
            f.store.io.submit(reqs).wait()
        except OSError as e:
            raise OSError(e.errno, f"offload_adam: reading rows of {self._what()} from {f.path}: {e.strerror}") from None
        finally:
            stats.io_wait_s += time.perf_counter() - t0
        stats.read_bytes += buf.numel()
        for k, u in enumerate(first):
            if _native.crc32c(buf[k * a : (k + 1) * a]) != self.crc[u]:
                raise OSError(errno.EIO, f"offload_adam: {f.path}: rows of {self._what()} are corrupted (checksum mismatch){f.corrupt_hint}")
        at = torch.searchsorted(units, lo) * a + (self.start + rows * rb - lo * a)  # each row's first byte in buf
        idx = at.unsqueeze(1) + torch.arange(rb).unsqueeze(0)
        return buf[idx].view(self.dtype).view(rows.numel(), self.width)

    def _what(self) -> str:
        return f"block {self.block.index} ({self.block.name})"


class RowLookups:
    """The embeddings of ``blocks`` on ``nvme`` looked up by their rows (see the module
    documentation): :meth:`takes` tells the streamer which activations read no page; the
    modules' hooks read the rows and run the lookup over them."""

    def __init__(self, nvme: NvmeWeights, blocks: list[Block]) -> None:
        self.tables = {b.index: RowTable(nvme, b) for b in blocks}
        self.blocks = {b.index: b for b in blocks}
        self.of_module = {id(m): b.index for b in blocks for m in b.modules}
        self.handles: list[Any] = []
        self.padding: list[tuple[torch.nn.Module, Any]] = []  # modules whose padding_idx a call set aside
        for b in blocks:
            for m in b.modules:
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def takes(self, b: int) -> bool:
        """Whether block ``b``'s activation now reads its rows, not its page: an embedding of
        this lookup's, and no graph wanted of its weight."""
        blk = self.blocks.get(b)
        return blk is not None and not (torch.is_grad_enabled() and blk.entries[0].param.requires_grad)

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        b = self.of_module.get(id(module))
        if b is None or not self.takes(b):
            return None
        ids = args[0] if args else kwargs.get("input")
        t = self.tables[b]
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.device.type != "cpu":
            return None
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        if rows.numel() == 0 or int(rows[0]) < 0 or int(rows[-1]) >= t.num:
            return None  # (out of range: torch's lookup over the placeholder raises as it would resident)
        self.blocks[b].entries[0].bind([t.read(rows)])
        # padding_idx only shapes the gradient; the lookup checks it against the table's rows
        self.padding.append((module, module.padding_idx))
        setattr(module, "padding_idx", None)  # (nn.Embedding's own attribute; mypy sees Module's)
        inverse = inverse.view(ids.shape)
        if args:
            return (inverse, *args[1:]), kwargs
        return args, {**kwargs, "input": inverse}

    def _post(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if self.padding and self.padding[-1][0] is module:
            module.padding_idx = self.padding.pop()[1]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
