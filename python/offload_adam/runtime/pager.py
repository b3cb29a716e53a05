"""The pager: named host buffers paged between RAM and files of the runtime's page store
(``pages.py``). It knows nothing of what the buffers hold.

A :class:`Pager` pages *families* of buffers: buffers that share one element layout (several
buffers, each with its own dtype and its own file, with the same element offsets). A *page* is
an element range of a family: the range of every buffer of the family, and the same range in
each buffer's file. The buffers are host memory the size of the whole family, allocated
untouched (:func:`~offload_adam.runtime.pages.aligned_empty`, never pinned), and only resident
pages hold memory: when a page is read in, the pager's window (a ``MemoryWindow``) moves memory
under its ranges (``mremap``: page-table entries, not bytes), and when it has been written back,
takes that memory back for the next page (the page's ranges stay mapped, empty). The same RAM
serves page after page, never faulted in and zeroed again (giving it to the OS and faulting it
back cost more than the read itself on a fast disk). RAM held by the paged part is therefore
bounded by the window:

* ``read_ahead`` pages being read before they are asked for (the next pages in order; after the
  last page, the first ones);
* the pages in use (between ``make_resident`` and ``release``);
* ``write_behind`` pages being written back.

Pages that fit in ``host_budget_bytes`` (the first ones added) stay in RAM and are never
written. Each range written carries the page store's CRC-32C, computed beside the write and
checked on every read, off the caller's thread (a page read ahead is verified while the caller
works on the previous one). A read error leaves the page not resident (raised from
``make_resident``), a write error keeps the page in RAM (dirty) and is raised at the next
``make_resident`` or ``end_step``, the write retried at the next release.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from .. import _native
from .pages import PageFile, PageStore, Transfer


@dataclass
class Family:
    """Buffers sharing one element layout, each with its own file (see the module
    documentation). A buffer added later (``Pager.add_buffer``) reads zeros until written, where
    its page is not resident."""

    name: str
    total: int  # elements of each buffer
    buffers: dict[str, Tensor] = field(default_factory=dict)
    files: dict[str, PageFile] = field(default_factory=dict)  # key -> its file in the page store


@dataclass
class Page:
    family: Family
    start: int  # first element in each buffer
    end: int
    label: str  # what it holds, for errors ("the state of bucket 3 (...)")
    pinned: bool  # inside the host budget: stays in RAM, never written
    refs: int = 0
    dirty: bool = False
    reading: list[Transfer] | None = None  # its reads in flight (each checked against its CRC)
    writing: list[Transfer] | None = None  # its writes in flight
    copies_done: Callable[[], None] | None = None
    resident: bool = False  # its memory holds its contents
    leases: dict[str, int] = field(default_factory=dict)  # key -> lease of window memory under its range

    def nbytes(self) -> int:
        return sum((self.end - self.start) * b.element_size() for b in self.family.buffers.values())


def _nothing() -> None:
    pass


class Pager:
    """Families of host buffers paged through a window of RAM (see the module documentation).
    ``corrupt_hint`` ends the message of a checksum mismatch (what the client should do)."""

    def __init__(
        self,
        store: PageStore,
        *,
        host_budget_bytes: int = 0,
        read_ahead: int = 2,
        write_behind: int = 2,
        corrupt_hint: str = "",
    ) -> None:
        if read_ahead < 0 or write_behind < 1:
            raise ValueError(f"read_ahead must be >= 0 and write_behind >= 1, got {read_ahead}, {write_behind}")
        self.store = store
        self.io = store.io
        self.budget = int(host_budget_bytes)
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        self.corrupt_hint = corrupt_hint
        self.families: list[Family] = []
        self.pages: list[Page] = []  # in order: the order a pass visits them
        self.used_budget = 0
        self.writes: deque[Page] = deque()
        self.error: BaseException | None = None
        self.window = _native.MemoryWindow()

    @property
    def stats(self) -> dict[str, float]:
        """``read_bytes``, ``write_bytes``, ``io_wait_s`` of the page store."""
        return self.store.stats.as_dict()

    # -- set-up ---------------------------------------------------------------------------------

    def family(self, name: str, total: int) -> Family:
        fam = Family(name, total)
        self.families.append(fam)
        return fam

    def add_buffer(self, fam: Family, key: str, buf: Tensor) -> None:
        """A buffer of ``fam`` (``fam.total`` elements, ``ALIGN``-aligned host memory, untouched
        where paged: :func:`~offload_adam.runtime.pages.aligned_empty`); its file is created now, its blocks allocated. Pages
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
        self.store.check_space(sum(p.nbytes() for p in pages if not p.pinned), what)
        first = len(self.pages)
        self.pages += pages
        for p in pages:
            if p.pinned:  # zeros, once; they stay in RAM
                for buf in fam.buffers.values():
                    buf[p.start : p.end].zero_()
                p.resident = True
        self._limit_window()
        return list(range(first, first + len(pages)))

    def mark(self) -> tuple[int, int, int, int]:
        """Where the set-up stands (families, pages, host budget used, files): what
        :meth:`rollback` goes back to."""
        return len(self.families), len(self.pages), self.used_budget, len(self.store.files)

    def rollback(self, mark: tuple[int, int, int, int]) -> None:
        """Forgets the families and pages added since ``mark`` (a set-up that failed; none of
        them was paged yet) and closes and removes their files."""
        families, pages, used, files = mark
        del self.families[families:]
        del self.pages[pages:]
        self.used_budget = used
        for f in self.store.files[files:]:
            self.store.remove(f)
        self._limit_window()

    def _limit_window(self) -> None:
        """The window parks no more than the paging's window holds (``window_bytes``): what a
        checkpoint made resident beyond it goes back to the OS afterwards."""
        self.window.set_limit(self._window_bytes())

    def _window_bytes(self) -> int:
        """The most RAM the paging holds: its largest paged page, times the pages in flight at
        once (read ahead, stepped, written behind)."""
        largest = max((p.nbytes() for p in self.pages if not p.pinned), default=0)
        return largest * (self.read_ahead + 1 + self.write_behind)

    def _file(self, fam: Family, key: str) -> PageFile:
        f = fam.files.get(key)
        if f is None:
            buf = fam.buffers[key]
            # (add_pages checks the space the pages need: the pages in the host budget need none)
            f = fam.files[key] = self.store.open(
                f"{fam.name}-{key}.bin", fam.total * buf.element_size(), "", check=False, corrupt_hint=self.corrupt_hint
            )
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
        reads = []
        for key, buf in p.family.buffers.items():
            f = self._file(p.family, key)
            off = p.start * buf.element_size()
            if f.written(off):
                reads.append(f.read(off, buf[p.start : p.end], p.label))
        if reads:
            p.reading = reads

    def _finish_read(self, p: Page) -> None:
        self._lease(p)  # a buffer added while the read was in flight (amsgrad switched on): memory for its zeros
        reads, p.reading = p.reading or [], None
        try:
            for r in reads:
                r.wait()  # an I/O error or a checksum mismatch raises, naming the file and the page
        finally:
            for r in reads:
                with contextlib.suppress(OSError):
                    r.wait()
        for key, buf in p.family.buffers.items():
            if not self._file(p.family, key).written(p.start * buf.element_size()):
                buf[p.start : p.end].zero_()  # never written: fresh contents (or a buffer added later) are zeros
        p.resident = True

    def _finish_write(self, p: Page, keep: bool = False) -> None:
        """Waits for a page's writes; on success its memory goes back to the window (unless
        ``keep``: it is wanted again)."""
        writes, p.writing = p.writing, None
        if writes is None:
            return
        try:
            for w in writes:
                w.wait()
        except OSError as e:
            for w in writes:
                with contextlib.suppress(OSError):
                    w.wait()
            p.dirty = True  # still in RAM: written again at the end of the step or the next release
            for key, buf in p.family.buffers.items():
                self._file(p.family, key).forget(p.start * buf.element_size())
            if self.error is None:
                self.error = e
            return
        finally:
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
        """Queues a page's writes (their CRCs computed beside them; until they complete, the
        page's memory is not written, and not given back)."""
        p.writing = [
            self._file(p.family, key).write(p.start * buf.element_size(), buf[p.start : p.end], p.label)
            for key, buf in p.family.buffers.items()
        ]
        p.dirty = False
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
            for t in (p.reading or []) + (p.writing or []):
                with contextlib.suppress(Exception):
                    t.wait()
