"""The pager: named host buffers paged between RAM and files on an SSD, and the run directories
that hold those files. It knows nothing of what the buffers hold.

A :class:`RunDir` is one run's directory under a user's ``nvme_dir``
(``offload-adam-run-<host>-<pid>-<random>``), locked while it lives, removed by ``close()``, at
garbage collection and at interpreter exit; a directory left by a killed run is reported and
never reused (:func:`stale_runs`, :func:`remove_stale_runs`). Its files are read and written by
the Rust I/O engine (io_uring or threads, ``O_DIRECT``).

A :class:`Pager` pages *families* of buffers: buffers that share one element layout (several
buffers, each with its own dtype and its own file, with the same element offsets). A *page* is
an element range of a family: the range of every buffer of the family, and the same range in
each buffer's file. The buffers are host memory the size of the whole family, allocated
untouched (:func:`aligned_empty`, never pinned), and only resident pages hold memory: when a
page is read in, the pager's window (a ``MemoryWindow``) moves memory under its ranges
(``mremap``: page-table entries, not bytes), and when it has been written back, takes that memory
back for the next page (the page's ranges stay mapped, empty). The same RAM serves page after
page, never faulted in and zeroed again (giving it to the OS and faulting it back cost more than
the read itself on a fast disk). RAM held by the paged part is therefore bounded by the window:

* ``read_ahead`` pages being read before they are asked for (the next pages in order; after the
  last page, the first ones);
* the pages in use (between ``make_resident`` and ``release``);
* ``write_behind`` pages being written back.

Pages that fit in ``host_budget_bytes`` (the first ones added) stay in RAM and are never
written. Each page of each buffer carries a CRC-32C, verified on every read. The CRCs are
computed off the caller's thread, by a pool of two threads (the Rust CRC releases the GIL): a
write is queued at once and its CRC computed beside it (the page's memory does not change until
its write has completed); a read is waited for and checked there too, so that a page read ahead
is verified while the caller works on the previous one. A read error leaves
the page not resident (raised from ``make_resident``), a write error keeps the page in RAM
(dirty) and is raised at the next ``make_resident`` or ``end_step``, the write retried at the
next release.
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
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _native

log = logging.getLogger("offload_adam")

ALIGN = 4096  # bytes: O_DIRECT alignment of buffers, lengths and file offsets
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
    up): nobody holds their lock.

    Args:
        nvme_dir: the directory given to ``AdamW(offload="nvme", nvme_dir=...)``,
            ``offload_weights(storage="nvme", nvme_dir=...)`` or ``offload_activations``.
    """
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
    """Removes the run directories left under ``nvme_dir`` by killed runs (see ``stale_runs``);
    live runs are never touched. Returns the paths removed.

    Args:
        nvme_dir: the directory the runs were made under.
    """
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


def _cleanup(path: str, lock: Any, io: Any) -> None:
    del io  # its files are closed when the last reference goes
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(Exception):
        lock.close()


class RunDir:
    """One run's directory under ``nvme_dir`` and the I/O engine of its files (see the module
    documentation). ``what`` names the argument in errors (``nvme_dir``)."""

    def __init__(self, nvme_dir: Any, *, io: str | None = None, what: str = "nvme_dir") -> None:
        if not isinstance(nvme_dir, (str, os.PathLike)):
            raise TypeError(f"{what} must be a path, got {type(nvme_dir).__name__}")
        nvme_dir = os.fspath(nvme_dir)
        if not os.path.isdir(nvme_dir):
            raise ValueError(f"{what}: {nvme_dir!r} is not a directory")
        self.nvme_dir = nvme_dir
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
        self._finalizer = weakref.finalize(self, _cleanup, self.path, lock, self.io)

    def check_space(self, need: int, what: str) -> None:
        """Raises ENOSPC unless ``need`` more bytes fit on the run's filesystem."""
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise OSError(errno.ENOSPC, f"offload_adam: {what} needs {need} bytes under {self.nvme_dir}, which has {free} free")

    def open(self, name: str, size: int) -> tuple[int, str]:
        """Creates file ``name`` of ``size`` bytes (allocated); its number and path."""
        path = os.path.join(self.path, name)
        return self.io.open(path, size), path

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Removes the directory and its files (the caller has waited for its transfers)."""
        self._finalizer()


# -- the pager ----------------------------------------------------------------------------------


@dataclass
class Family:
    """Buffers sharing one element layout, each with its own file (see the module
    documentation). A buffer added later (``Pager.add_buffer``) reads zeros until written, where
    its page is not resident."""

    name: str
    total: int  # elements of each buffer
    buffers: dict[str, Tensor] = field(default_factory=dict)
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> (file, path)


@dataclass
class Page:
    family: Family
    start: int  # first element in each buffer
    end: int
    label: str  # what it holds, for errors ("the state of bucket 3 (...)")
    pinned: bool  # inside the host budget: stays in RAM, never written
    written: dict[str, int] = field(default_factory=dict)  # key -> CRC-32C of what is on disk
    refs: int = 0
    dirty: bool = False
    reading: Any = None  # Future of the read's wait and check (see Pager._verify)
    writing: Any = None  # IoTicket
    crcs: dict[str, Future[int]] = field(default_factory=dict)  # CRCs of the write in flight
    copies_done: Callable[[], None] | None = None
    resident: bool = False  # its memory holds its contents
    leases: dict[str, int] = field(default_factory=dict)  # key -> lease of window memory under its range

    def nbytes(self) -> int:
        return sum((self.end - self.start) * b.element_size() for b in self.family.buffers.values())


def _nothing() -> None:
    pass


def _verify(ticket: Any, checks: list[tuple[str, Tensor, int]]) -> list[str]:
    """On the CRC pool: waits a read, returns the keys whose CRC does not match what was
    written (an I/O error raises from here, to the caller's ``result()``)."""
    ticket.wait()
    return [key for key, view, crc in checks if _native.crc32c(view) != crc]


class Pager:
    """Families of host buffers paged through a window of RAM (see the module documentation).
    ``corrupt_hint`` ends the message of a checksum mismatch (what the client should do)."""

    def __init__(
        self,
        run: RunDir,
        *,
        host_budget_bytes: int = 0,
        read_ahead: int = 2,
        write_behind: int = 2,
        corrupt_hint: str = "",
    ) -> None:
        if read_ahead < 0 or write_behind < 1:
            raise ValueError(f"read_ahead must be >= 0 and write_behind >= 1, got {read_ahead}, {write_behind}")
        self.run = run
        self.io = run.io
        self.budget = int(host_budget_bytes)
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        self.corrupt_hint = corrupt_hint
        self.families: list[Family] = []
        self.pages: list[Page] = []  # in order: the order a pass visits them
        self.used_budget = 0
        self.writes: deque[Page] = deque()
        self.error: BaseException | None = None
        self.stats = {"read_bytes": 0.0, "write_bytes": 0.0, "io_wait_s": 0.0}
        self._crc = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload_adam-crc")
        self.window = _native.MemoryWindow()

    # -- set-up ---------------------------------------------------------------------------------

    def family(self, name: str, total: int) -> Family:
        fam = Family(name, total)
        self.families.append(fam)
        return fam

    def add_buffer(self, fam: Family, key: str, buf: Tensor) -> None:
        """A buffer of ``fam`` (``fam.total`` elements, ``ALIGN``-aligned host memory, untouched
        where paged: :func:`aligned_empty`); its file is created now, its blocks allocated. Pages
        resident now, and those the host budget keeps in RAM, keep what the caller wrote in them
        (a maximum copied from ``exp_avg_sq``); the others read zeros until written."""
        fam.buffers[key] = buf
        self._file(fam, key)
        for p in self.pages:
            if p.family is fam and not p.pinned and p.resident:
                # What the caller wrote is in the range's own memory: taken as it is.
                p.leases[key] = self.window.adopt([buf[p.start : p.end]])
        self._limit_window()

    def add_pages(self, fam: Family, ranges: Sequence[tuple[int, int, str]], what: str) -> list[int]:
        """Pages of ``fam`` over ``(start, end, label)`` element ranges, in the order they are
        visited; the first that fit in the host budget stay in RAM. Checks that the others fit
        on the disk (``what`` names their contents in the error). Returns their indices."""
        per_elem = sum(b.element_size() for b in fam.buffers.values())
        pages = []
        for start, end, label in ranges:
            nbytes = (end - start) * per_elem
            pinned = self.used_budget + nbytes <= self.budget
            if pinned:
                self.used_budget += nbytes
            pages.append(Page(fam, start, end, label, pinned))
        self.run.check_space(sum(p.nbytes() for p in pages if not p.pinned), what)
        first = len(self.pages)
        self.pages += pages
        for p in pages:
            if p.pinned:  # zeros, once; they stay in RAM
                for buf in fam.buffers.values():
                    buf[p.start : p.end].zero_()
                p.resident = True
        self._limit_window()
        return list(range(first, first + len(pages)))

    def _limit_window(self) -> None:
        """The window parks no more than the paging's window holds (``window_bytes``): what a
        checkpoint made resident beyond it goes back to the OS afterwards."""
        self.window.set_limit(self._window_bytes())

    def _window_bytes(self) -> int:
        """The most RAM the paging holds: its largest paged page, times the pages in flight at
        once (read ahead, stepped, written behind)."""
        largest = max((p.nbytes() for p in self.pages if not p.pinned), default=0)
        return largest * (self.read_ahead + 1 + self.write_behind)

    def _file(self, fam: Family, key: str) -> tuple[int, str]:
        f = fam.files.get(key)
        if f is None:
            buf = fam.buffers[key]
            f = fam.files[key] = self.run.open(f"{fam.name}-{key}.bin", fam.total * buf.element_size())
        return f

    # -- paging ---------------------------------------------------------------------------------

    def _lease(self, p: Page) -> None:
        """Window memory under every buffer's range of ``p`` that has none yet."""
        for key, buf in p.family.buffers.items():
            if key not in p.leases:
                p.leases[key] = self.window.map([buf[p.start : p.end]])

    def _submit_read(self, k: int) -> None:
        p = self.pages[k]
        if p.resident or p.reading is not None or p.pinned:
            return
        if p.writing is not None:  # its memory still holds the contents: keep it
            self._finish_write(p, keep=True)
            return
        self._lease(p)
        reqs, checks = [], []
        for key, buf in p.family.buffers.items():
            if key in p.written:
                fid, _ = self._file(p.family, key)
                view = buf[p.start : p.end]
                reqs.append((False, fid, view, p.start * buf.element_size()))
                checks.append((key, view, p.written[key]))
        if reqs:
            p.reading = self._crc.submit(_verify, self.io.submit(reqs), checks)
            self.stats["read_bytes"] += sum(r[2].numel() * r[2].element_size() for r in reqs)

    def _finish_read(self, p: Page) -> None:
        t0 = time.perf_counter()
        try:
            self._lease(p)  # a buffer added while the read was in flight (amsgrad switched on): memory for its zeros
            bad: list[str] = []
            if p.reading is not None:
                f, p.reading = p.reading, None
                try:
                    bad = f.result()
                except OSError as e:
                    raise OSError(e.errno, f"offload_adam: reading {p.label}: {e.strerror}") from None
            for key, buf in p.family.buffers.items():
                if key not in p.written:
                    buf[p.start : p.end].zero_()  # never written: fresh contents (or a buffer added later) are zeros
                elif key in bad:
                    path = self._file(p.family, key)[1]
                    raise OSError(
                        errno.EIO, f"offload_adam: {path}: {p.label} is corrupted (checksum mismatch){self.corrupt_hint}"
                    )
        finally:
            self.stats["io_wait_s"] += time.perf_counter() - t0
        p.resident = True

    def _finish_write(self, p: Page, keep: bool = False) -> None:
        """Waits for a page's write; on success its memory goes back to the OS (unless
        ``keep``: it is wanted again)."""
        t, p.writing = p.writing, None
        if t is None:
            return
        t0 = time.perf_counter()
        try:
            t.wait()
            p.written = {k: f.result() for k, f in p.crcs.items()}
        except OSError as e:
            p.dirty = True  # still in RAM: written again at the end of the step or the next release
            p.written = {}
            if self.error is None:
                self.error = OSError(e.errno, f"offload_adam: writing {p.label}: {e.strerror}")
            return
        finally:
            p.crcs = {}
            self.stats["io_wait_s"] += time.perf_counter() - t0
            with contextlib.suppress(ValueError):
                self.writes.remove(p)
        if p.refs == 0 and not p.dirty and not keep:
            self._evict(p)

    def _evict(self, p: Page) -> None:
        """Gives a page's memory back to the window, once the copies reading it are done."""
        if p.copies_done is not None:
            p.copies_done()
            p.copies_done = None
        leases, p.leases = p.leases, {}
        for lease in leases.values():
            self.window.unmap(lease)
        p.resident = False

    def _write(self, p: Page) -> None:
        """Queues a page's write, and its CRCs beside it (known once the write has completed:
        until then the page's memory is not written, and not given back)."""
        reqs = []
        for key, buf in p.family.buffers.items():
            view = buf[p.start : p.end]
            reqs.append((True, self._file(p.family, key)[0], view, p.start * buf.element_size()))
        p.writing = self.io.submit(reqs)
        p.crcs = {key: self._crc.submit(_native.crc32c, view) for (_, _, view, _), key in zip(reqs, p.family.buffers)}
        p.written = {}
        p.dirty = False
        self.stats["write_bytes"] += sum(r[2].numel() * r[2].element_size() for r in reqs)
        self.writes.append(p)
        while len(self.writes) > self.write_behind:
            self._finish_write(self.writes[0])

    def make_resident(self, pages: Sequence[int]) -> None:
        """Pages ``pages`` (sorted indices) hold their contents until released; a deferred
        write error is raised first."""
        if self.error is not None:
            e, self.error = self.error, None
            raise e
        for k in pages:
            self._submit_read(k)
        for k in pages:
            p = self.pages[k]
            if not p.resident:
                self._finish_read(p)
            p.refs += 1
        # Read ahead: the pages the next calls will ask for (after the last, the first ones:
        # the next pass's, read while the caller does something else).
        if pages:
            for j in range(1, min(self.read_ahead, len(self.pages) - 1) + 1):
                k = (pages[-1] + j) % len(self.pages)
                if k not in pages:
                    self._submit_read(k)

    def release(self, pages: Sequence[int], copies_done: Callable[[], None] = _nothing, wrote: bool = True) -> None:
        """Ends a use of ``pages``; ``copies_done()`` (a host wait) is called before their memory
        is reused or given back (copies to a device may still read it); ``wrote`` False: the
        contents were only read, and need not be written back."""
        for k in pages:
            p = self.pages[k]
            p.refs -= 1
            p.dirty = p.dirty or wrote
            if p.refs == 0 and not p.pinned:
                p.copies_done = copies_done
                if p.dirty:
                    self._write(p)
                elif p.writing is None:  # only read: the disk has it already
                    self._evict(p)

    def end_step(self) -> None:
        """After a pass: waits for the writes, retries failed ones, raises a write error."""
        for p in self.pages:
            if p.dirty and p.refs == 0 and not p.pinned and p.writing is None:
                self._write(p)
        while self.writes:
            self._finish_write(self.writes[0])
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    # -- reports --------------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """``nvme_bytes`` (paged), ``host_state_bytes`` (kept in RAM by the budget),
        ``window_bytes`` (the most RAM the paging holds) and ``window_held_bytes`` (the RAM its
        window holds now: leased to resident pages or kept for the next ones)."""
        return {
            "nvme_bytes": sum(p.nbytes() for p in self.pages if not p.pinned),
            "host_state_bytes": sum(p.nbytes() for p in self.pages if p.pinned),
            "window_bytes": self._window_bytes(),
            "window_held_bytes": self.window.nbytes,
        }

    def close(self) -> None:
        """Waits for the transfers in flight; the run directory is the owner's to close."""
        for p in self.pages:
            with contextlib.suppress(Exception):
                if p.reading is not None:
                    p.reading.result()
            with contextlib.suppress(Exception):
                if p.writing is not None:
                    p.writing.wait()
        self._crc.shutdown(wait=True)
