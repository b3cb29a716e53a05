"""The NVMe tier: a group's optimizer state (moments, amsgrad maximum, fp32 masters) on a local
SSD, paged bucket by bucket through a small window of host memory.

Each bucket of a group (see :class:`~offload_adam.state.GroupState`) is a *page*: for every
state buffer, an aligned range of elements with the same range in that buffer's file. The
buffers are host memory the size of the whole state, but only resident pages are ever touched:
a page written back is given to the OS (``madvise``), and its memory counts again only when it
is read in. RAM held by the NVMe part of the state is therefore bounded by the window:

* ``read_ahead`` pages being read before the engine asks for them (the next buckets in order);
* the pages the kernel is stepping;
* ``write_behind`` pages being written back.

Pages that fit in ``host_budget_bytes`` (the first ones: what the next forward needs first) stay
in RAM and are never written. Files are read and written by the Rust I/O engine (io_uring or
threads, ``O_DIRECT``); each page of each buffer carries a CRC-32C verified on every read.

The engine brackets every access with ``make_resident``/``release``; a read error leaves the
bucket untouched (raised before its step), a write error keeps the page in RAM (dirty) and is
raised at the end of the step, the write retried at the next release.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _native
from .state import GroupState

log = logging.getLogger("offload_adam")

ALIGN = 4096  # bytes: O_DIRECT alignment of buffers, lengths and file offsets
PAGE_ALIGN = 2048  # elements: 4096 bytes of a 2-byte state, 8192 of a 4-byte one
RUN_PREFIX = "offload-adam-run-"
LOCK = "LOCK"


def aligned_empty(n: int, dtype: torch.dtype) -> Tensor:
    """``n`` elements of untouched host memory starting on an ``ALIGN`` boundary."""
    es = torch.empty((), dtype=dtype).element_size()
    extra = ALIGN // es
    raw = torch.empty(n + extra, dtype=dtype)
    skip = (-raw.data_ptr() % ALIGN) // es
    return raw[skip : skip + n]


# -- run directories ----------------------------------------------------------------------------


def _lock(path: str) -> Any:
    """An exclusive lock on ``path`` (kept while the returned file is open), or None if another
    process holds it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def stale_runs(nvme_dir: str) -> list[str]:
    """Run directories under ``nvme_dir`` whose process is gone (killed before it could clean
    up): nobody holds their lock."""
    out = []
    try:
        names = sorted(os.listdir(nvme_dir))
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(nvme_dir, name)
        if not name.startswith(RUN_PREFIX) or not os.path.isdir(path):
            continue
        f = _lock(os.path.join(path, LOCK))
        if f is not None:
            f.close()
            out.append(path)
    return out


def remove_stale_runs(nvme_dir: str) -> list[str]:
    """Removes the run directories left under ``nvme_dir`` by killed runs (see
    :func:`stale_runs`); live runs are never touched. Returns what was removed."""
    removed = []
    for path in stale_runs(nvme_dir):
        f = _lock(os.path.join(path, LOCK))
        if f is None:  # taken since
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            f.close()
    return removed


def _cleanup(path: str, lock: Any, engine: Any) -> None:
    del engine  # its files are closed when the last reference goes
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(Exception):
        lock.close()


# -- pages --------------------------------------------------------------------------------------


@dataclass
class _Page:
    group: GroupState
    gi: int  # the group's index in the tier (its files)
    index: int  # its bucket in the group
    start: int  # first element in each buffer
    end: int
    pinned: bool  # inside the host budget: stays in RAM, never written
    written: dict[str, int] = field(default_factory=dict)  # key -> CRC-32C of what is on disk
    refs: int = 0
    dirty: bool = False
    reading: Any = None  # IoTicket
    writing: Any = None  # IoTicket
    copies_done: Callable[[], None] | None = None
    resident: bool = False  # its memory holds its state

    def names(self) -> str:
        g = self.group
        b = g.buckets[self.index]
        first, last = g.names[b.start], g.names[b.stop - 1]
        return f"bucket {self.index} ({first}" + (f" .. {last})" if last != first else ")")


class NvmeTier:
    """State on NVMe, paged through a window of host memory (see the module documentation)."""

    stable_views = False
    page_align = PAGE_ALIGN
    batch_bytes = 0  # one bucket per native call: the window holds a few buckets, not a batch

    def __init__(
        self,
        nvme_dir: str,
        *,
        host_budget_bytes: int = 0,
        read_ahead: int = 2,
        write_behind: int = 2,
        io: str | None = None,
    ) -> None:
        if not isinstance(nvme_dir, (str, os.PathLike)):
            raise TypeError(f"nvme_dir must be a path, got {type(nvme_dir).__name__}")
        nvme_dir = os.fspath(nvme_dir)
        if not os.path.isdir(nvme_dir):
            raise ValueError(f"nvme_dir: {nvme_dir!r} is not a directory")
        if read_ahead < 0 or write_behind < 1:
            raise ValueError(f"read_ahead must be >= 0 and write_behind >= 1, got {read_ahead}, {write_behind}")
        self.nvme_dir = nvme_dir
        self.budget = int(host_budget_bytes)
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        stale = stale_runs(nvme_dir)
        if stale:
            log.warning(
                "offload_adam: %d run director%s under %s left by killed runs (%s); they are not reused. "
                "Remove them with offload_adam.remove_stale_runs(%r)",
                len(stale), "y" if len(stale) == 1 else "ies", nvme_dir, ", ".join(map(os.path.basename, stale)), nvme_dir,
            )  # fmt: skip
        name = f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = os.path.join(nvme_dir, name)
        os.mkdir(self.path, 0o700)
        lock = _lock(os.path.join(self.path, LOCK))
        if lock is None:  # pragma: no cover - a fresh unique directory
            raise RuntimeError(f"{self.path}: locked by another process")
        self.io = _native.IoEngine(io)
        self.state_alloc: Callable[[int, torch.dtype], Tensor] | None = aligned_empty
        self._finalizer = weakref.finalize(self, _cleanup, self.path, lock, self.io)
        self.groups: list[GroupState] = []
        self.files: dict[tuple[int, str], tuple[int, str]] = {}  # (group, key) -> (file, path)
        self.pages: list[_Page] = []  # in order: the order a step visits them
        self.page_of: dict[int, list[int]] = {}  # id(group) -> page (global index) of each slot
        self.used_budget = 0
        self.writes: deque[_Page] = deque()
        self.error: BaseException | None = None
        self.stats = {"read_bytes": 0.0, "write_bytes": 0.0, "io_wait_s": 0.0}

    # -- set-up ---------------------------------------------------------------------------------

    def attach(self, group: GroupState) -> None:
        gi = len(self.groups)
        first = len(self.pages)
        per_elem = sum(b.element_size() for b in self._buffers(group).values())
        pages = []
        slot_page = [0] * len(group)
        for k, rng in enumerate(group.buckets):
            start = group.offsets[rng.start]
            end = group.offsets[group.buckets[k + 1].start] if k + 1 < len(group.buckets) else group.total
            nbytes = (end - start) * per_elem
            pinned = self.used_budget + nbytes <= self.budget
            if pinned:
                self.used_budget += nbytes
            pages.append(_Page(group, gi, k, start, end, pinned))
            for i in rng:
                slot_page[i] = first + k
        need = sum((p.end - p.start) * per_elem for p in pages if not p.pinned)
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise OSError(
                errno.ENOSPC,
                f"offload_adam: the optimizer state needs {need} bytes under {self.nvme_dir}, which has {free} free",
            )
        self.groups.append(group)
        self.pages += pages
        self.page_of[id(group)] = slot_page
        for key, buf in self._buffers(group).items():
            self._open(gi, group, key, buf)
        for p in pages:
            if p.pinned:  # zeros, once; they stay in RAM
                for buf in self._buffers(group).values():
                    buf[p.start : p.end].zero_()
                p.resident = True

    def _open(self, gi: int, group: GroupState, key: str, buf: Tensor) -> None:
        if (gi, key) in self.files:
            return
        path = os.path.join(self.path, f"group{gi}-{key}.bin")
        size = group.total * buf.element_size()
        self.files[(gi, key)] = (self.io.open(path, size), path)

    @staticmethod
    def _buffers(group: GroupState) -> dict[str, Tensor]:
        bufs = {"exp_avg": group.exp_avg, "exp_avg_sq": group.exp_avg_sq, "max_exp_avg_sq": group.max_exp_avg_sq, "master": group.master}
        return {k: b for k, b in bufs.items() if b is not None}

    # -- paging ---------------------------------------------------------------------------------

    def _pages(self, group: GroupState, slots: Sequence[int]) -> list[int]:
        of = self.page_of[id(group)]
        return sorted({of[i] for i in slots})

    def _submit_read(self, k: int) -> None:
        p = self.pages[k]
        if p.resident or p.reading is not None or p.pinned:
            return
        if p.writing is not None:  # its memory still holds the state: keep it
            self._finish_write(p, keep=True)
            return
        gi = p.gi
        reqs = []
        for key, buf in self._buffers(p.group).items():
            view = buf[p.start : p.end]
            if key in p.written:
                self._open(gi, p.group, key, buf)
                fid, _ = self.files[(gi, key)]
                reqs.append((False, fid, view, p.start * buf.element_size()))
        if reqs:
            p.reading = self.io.submit(reqs)
            self.stats["read_bytes"] += sum(r[2].numel() * r[2].element_size() for r in reqs)

    def _finish_read(self, p: _Page) -> None:
        t0 = time.perf_counter()
        gi = p.gi
        try:
            if p.reading is not None:
                t, p.reading = p.reading, None
                try:
                    t.wait()
                except OSError as e:
                    raise OSError(e.errno, f"offload_adam: reading the state of {p.names()}: {e.strerror}") from None
            for key, buf in self._buffers(p.group).items():
                view = buf[p.start : p.end]
                crc = p.written.get(key)
                if crc is None:
                    view.zero_()  # never written: a fresh state (or a later amsgrad buffer) is zeros
                elif _native.crc32c(view) != crc:
                    path = self.files[(gi, key)][1]
                    raise OSError(
                        errno.EIO,
                        f"offload_adam: {path}: the state of {p.names()} is corrupted (checksum mismatch); "
                        "restore the optimizer from a checkpoint",
                    )
        finally:
            self.stats["io_wait_s"] += time.perf_counter() - t0
        p.resident = True

    def _finish_write(self, p: _Page, keep: bool = False) -> None:
        """Waits for a page's write; on success its memory goes back to the OS (unless
        ``keep``: it is wanted again)."""
        t, p.writing = p.writing, None
        if t is None:
            return
        t0 = time.perf_counter()
        try:
            t.wait()
        except OSError as e:
            p.dirty = True  # still in RAM: written again at the end of the step or the next release
            p.written = {}
            if self.error is None:
                self.error = OSError(e.errno, f"offload_adam: writing the state of {p.names()}: {e.strerror}")
            return
        finally:
            self.stats["io_wait_s"] += time.perf_counter() - t0
            with contextlib.suppress(ValueError):
                self.writes.remove(p)
        if p.refs == 0 and not p.dirty and not keep:
            self._evict(p)

    def _evict(self, p: _Page) -> None:
        """Gives a page's memory back to the OS, once the copy-backs reading it are done."""
        if p.copies_done is not None:
            p.copies_done()
            p.copies_done = None
        for buf in self._buffers(p.group).values():
            _native.discard_memory(buf[p.start : p.end])
        p.resident = False

    def _write(self, p: _Page) -> None:
        gi = p.gi
        reqs = []
        crcs = {}
        for key, buf in self._buffers(p.group).items():
            view = buf[p.start : p.end]
            self._open(gi, p.group, key, buf)
            crcs[key] = _native.crc32c(view)
            reqs.append((True, self.files[(gi, key)][0], view, p.start * buf.element_size()))
        p.writing = self.io.submit(reqs)
        p.written = crcs
        p.dirty = False
        self.stats["write_bytes"] += sum(r[2].numel() * r[2].element_size() for r in reqs)
        self.writes.append(p)
        while len(self.writes) > self.write_behind:
            self._finish_write(self.writes[0])

    def make_resident(self, group: GroupState, slots: Sequence[int]) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e
        pages = self._pages(group, slots)
        for k in pages:
            self._submit_read(k)
        for k in pages:
            p = self.pages[k]
            if not p.resident:
                self._finish_read(p)
            p.refs += 1
        # Read ahead: the pages the next calls will ask for (after the last, the first ones:
        # the next step's, read while the forward and backward run).
        if pages:
            for j in range(1, min(self.read_ahead, len(self.pages) - 1) + 1):
                k = (pages[-1] + j) % len(self.pages)
                if k not in pages:
                    self._submit_read(k)

    def release(
        self, group: GroupState, slots: Sequence[int], copies_done: Callable[[], None] = lambda: None, wrote: bool = True
    ) -> None:
        for k in self._pages(group, slots):
            p = self.pages[k]
            p.refs -= 1
            p.dirty = p.dirty or wrote
            if p.refs == 0 and not p.pinned:
                p.copies_done = copies_done
                if p.dirty:
                    self._write(p)
                elif p.writing is None:  # only read (a checkpoint): the disk has it already
                    self._evict(p)

    def end_step(self) -> None:
        """After a step: waits for the writes, retries failed ones, raises a write error."""
        for p in self.pages:
            if p.dirty and p.refs == 0 and not p.pinned and p.writing is None:
                self._write(p)
        while self.writes:
            self._finish_write(self.writes[0])
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def chunks(self, group: GroupState) -> list[range] | None:
        return list(group.buckets)

    # -- reports --------------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        nvme = host = window = 0
        for p in self.pages:
            per = sum((p.end - p.start) * b.element_size() for b in self._buffers(p.group).values())
            if p.pinned:
                host += per
            else:
                nvme += per
                window = max(window, per)
        return {
            "nvme_bytes": nvme,
            "host_state_bytes": host,
            "window_bytes": window * (self.read_ahead + 1 + self.write_behind),
        }

    def bytes_per_step(self) -> int:
        """Bytes read and written per step: each paged page once in, once out."""
        return 2 * self.memory()["nvme_bytes"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for p in self.pages:
                if p.reading is not None:
                    p.reading.wait()
                if p.writing is not None:
                    p.writing.wait()
        self._finalizer()
