"""The page store: bytes kept on an SSD for every client of the runtime (the optimizer's state,
the weights, the activations), through one set of rules.

A :class:`PageStore` is one run directory (:class:`RunDir`, ``offload-adam-run-<host>-<pid>-<random>``
under a user's ``nvme_dir``, 0700: locked while it lives through its ``LOCK`` (0600, beginning with
``MARKER``: what makes a directory one of ours), the free-space check; at ``close()``, garbage
collection and interpreter exit its I/O engine is closed (every descriptor) and the directory
removed, and a failed set-up removes what it made; a directory left by a killed run is reported
and never reused: :func:`stale_runs`, :func:`remove_stale_runs`, which follow no symlink inside
``nvme_dir``, create nothing, and skip with a debug line what they cannot open, read or lock) and
the I/O engine of its files (io_uring or a thread pool, ``O_DIRECT``), with one :class:`IoStats`.
Its files (:class:`PageFile`) are written and read in ranges whose offsets, lengths and buffers
sit on 4 KiB (``ALIGN``). Each range written gets a CRC-32C, computed on the store's pool of two
threads beside the write (the memory does not change until the write has completed); each range
read is waited for and checked on that pool too, so that a range read ahead is verified while
the caller works on the one before. A mismatch, or an I/O error, is an ``OSError`` naming the
file and what the range holds, raised from :meth:`Transfer.wait`.

A :class:`StagingRing` reads ranges ahead into a ring of pinned host slots, each slot reused once
the device copy (or the host work) that consumed it has completed: the read-ahead of the weights
streamed from NVMe (to the GPU's ring, or run on the CPU from the slot itself). Write-behind is
each client's own policy over :meth:`PageFile.write` (how many writes it keeps in flight).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from .. import _native
from .device import Device
from .pinned import PinnedArena, align_up

log = logging.getLogger("offload_adam")

ALIGN = 4096  # bytes: O_DIRECT alignment of buffers, lengths and file offsets
RUN_PREFIX = "offload-adam-run-"
LOCK = "LOCK"
MARKER = b"offload_adam run directory\n"  # how a run's LOCK begins: what makes a directory one of ours


def aligned_empty(n: int, dtype: torch.dtype) -> Tensor:
    """``n`` elements of untouched host memory starting on an ``ALIGN`` boundary."""
    es = torch.empty((), dtype=dtype).element_size()
    extra = ALIGN // es
    raw = torch.empty(n + extra, dtype=dtype)
    skip = (-raw.data_ptr() % ALIGN) // es
    return raw[skip : skip + n]


# -- run directories ------------------------------------------------------------------------------


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _skip(path: str, why: str) -> None:
    log.debug("offload_adam: %s skipped by the scan for killed runs: %s", path, why)


def _lock_run(path: str) -> tuple[int, tuple[int, int]] | None:
    """Locks the run directory ``path``: its LOCK's descriptor (the lock kept while it is open)
    and the directory's ``(st_dev, st_ino)``. None if another process holds the lock (a live
    run), or if ``path`` is not a run directory of this user that the scan can lock (skipped
    with a debug line): a symlink, not a directory, another user's, unreadable, its LOCK
    missing, a symlink, not a regular file, without the package's marker, or not lockable.
    Nothing is followed and nothing is created."""
    try:
        dfd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        _skip(path, f"cannot be opened as a directory without following a symlink ({e.strerror})")
        return None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            _skip(path, f"owned by another user (uid {st.st_uid})")
            return None
        try:
            fd = os.open(LOCK, _LOCK_FLAGS, dir_fd=dfd)
        except OSError as e:
            _skip(path, f"its {LOCK} cannot be opened without following a symlink ({e.strerror})")
            return None
    finally:
        os.close(dfd)
    why = None
    try:
        lst = os.fstat(fd)
        if not stat.S_ISREG(lst.st_mode):
            why = f"its {LOCK} is not a regular file"
        elif lst.st_uid != os.geteuid():
            why = f"its {LOCK} belongs to another user (uid {lst.st_uid})"
        elif os.pread(fd, len(MARKER), 0) != MARKER:
            why = f"not a run directory of offload_adam (no marker in its {LOCK})"
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd, (st.st_dev, st.st_ino)
            except BlockingIOError:
                pass  # a live run
            except OSError as e:
                why = f"its {LOCK} cannot be locked ({e.strerror})"
    except OSError as e:
        why = f"its {LOCK} cannot be read ({e.strerror})"
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        _skip(path, why)
    os.close(fd)
    return None


def stale_runs(nvme_dir: str) -> list[str]:
    """Run directories under ``nvme_dir`` whose process is gone (killed before it could clean
    up): nobody holds their lock. Only directories this user's runs made count (their ``LOCK``
    begins with the package's marker); the scan follows no symlink, creates nothing, and skips
    with a debug line whatever it cannot open, read or lock (another user's run, a ``LOCK``
    that is not a regular file, anything else named ``offload-adam-run-*``).

    Args:
        nvme_dir: the directory given to ``AdamW(storage="nvme", nvme_dir=...)``,
            ``offload_weights(storage="nvme", nvme_dir=...)`` or ``offload_activations``.
    """
    out = []
    try:
        names = sorted(os.listdir(nvme_dir))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.startswith(RUN_PREFIX):
            continue
        path = os.path.join(nvme_dir, name)
        held = _lock_run(path)
        if held is not None:
            os.close(held[0])
            out.append(path)
    return out


def remove_stale_runs(nvme_dir: str) -> list[str]:
    """Removes the run directories left under ``nvme_dir`` by killed runs (see ``stale_runs``);
    live runs, other users' and anything the package did not make are never touched. Returns
    the paths removed (a directory that could not be removed entirely is not among them: a
    warning says what was left).

    Args:
        nvme_dir: the directory the runs were made under.
    """
    removed = []
    for path in stale_runs(nvme_dir):
        held = _lock_run(path)
        if held is None:  # taken since
            continue
        fd, ident = held
        try:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != ident or not stat.S_ISDIR(st.st_mode):
                _skip(path, "replaced since it was locked")
                continue
            shutil.rmtree(path, ignore_errors=True)  # (never follows a symlink inside it)
            if os.path.lexists(path):
                log.warning("offload_adam: %s could not be removed entirely", path)
            else:
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def _cleanup(path: str, lock: int, io: Any) -> None:
    if io is not None:
        io.close()  # its files' descriptors (and its threads): their space is given back as they go
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(Exception):
        os.close(lock)


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
        lock = -1
        try:
            # 0600 whatever the umask, never through a symlink (O_EXCL refuses one too).
            lock = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.write(lock, MARKER + f"{socket.gethostname()} {os.getpid()}\n".encode())
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh directory: nobody else holds it
            self.io = _native.IoEngine(io)
        except BaseException:
            _cleanup(self.path, lock, None)  # a failed set-up leaves nothing behind
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self.path, lock, self.io)

    def check_space(self, need: int, what: str) -> None:
        """Raises ENOSPC unless ``need`` more bytes fit on the run's filesystem."""
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise OSError(errno.ENOSPC, f"offload_adam: {what} needs {need} bytes under {self.nvme_dir}, which has {free} free")

    def open(self, name: str, size: int) -> tuple[int, str]:
        """Creates file ``name`` of ``size`` bytes (allocated); its number and path. If it cannot
        be allocated (a full disk), the file is removed and the error raised."""
        path = os.path.join(self.path, name)
        try:
            return self.io.open(path, size), path
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Closes the I/O engine (every descriptor of the run's files: their space is given back
        now, not when the engine is garbage-collected) and removes the directory and its files
        (the caller has waited for its transfers). Using the engine afterwards is an error."""
        self._finalizer()



# -- pages ------------------------------------------------------------------------------------------




@dataclass
class IoStats:
    """Bytes read and written, and host time waiting for the disk (a CRC check included)."""

    read_bytes: int = 0
    write_bytes: int = 0
    io_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The counts (bytes as ints: ``read_bytes`` was a float, 2567696384.0, in reports
        whose other byte counts are ints) and the time."""
        return {f.name: int(getattr(self, f.name)) if f.name.endswith("_bytes") else float(getattr(self, f.name)) for f in fields(self)}

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0 if f.name.endswith("_bytes") else 0.0)


def _check_read(ticket: Any, view: Tensor, crc: int | None) -> bool:
    """On the CRC pool: waits a read; whether its bytes have the CRC written (an I/O error raises
    from here, to the caller's ``wait``)."""
    ticket.wait()
    return crc is None or _native.crc32c(view) == crc


def _write_crc(ticket: Any, view: Tensor) -> int:
    """On the CRC pool: the CRC of what a write is writing (computed beside it), once it has
    completed (an I/O error raises from here)."""
    crc = _native.crc32c(view)
    ticket.wait()
    return crc


class Transfer:
    """A read or a write of one range in flight (see the module documentation)."""

    def __init__(self, file: PageFile, kind: str, offset: int, nbytes: int, label: str, future: Future[Any]) -> None:
        self.file = file
        self.kind = kind
        self.offset = offset
        self.nbytes = nbytes
        self.label = label
        self._future = future
        self._finished = False
        self._error: OSError | None = None

    def done(self) -> bool:
        """Completed (checked, for a read); never waits."""
        return self._finished or self._future.done()

    def wait(self) -> None:
        """Blocks until the transfer has completed; raises naming the file and the range's
        contents on an I/O error or (a read) a checksum mismatch, and raises the same error again
        at every later call (a failed transfer never reads as done)."""
        if self._finished:
            if self._error is not None:
                raise OSError(self._error.errno, self._error.strerror)
            return
        f = self.file
        t0 = time.perf_counter()
        try:
            result = self._future.result()
        except OSError as e:
            verb = "reading" if self.kind == "read" else "writing"
            prep = "from" if self.kind == "read" else "to"
            self._error = OSError(e.errno, f"offload_adam: {verb} {self.label} {prep} {f.path}: {e.strerror}")
            raise OSError(e.errno, self._error.strerror) from None
        finally:
            f.store.stats.io_wait_s += time.perf_counter() - t0
            self._finished = True
        if self.kind == "write":
            f.crc[self.offset] = (self.nbytes, int(result))
        elif not result:
            self._error = OSError(errno.EIO, f"offload_adam: {f.path}: {self.label} is corrupted (checksum mismatch){f.corrupt_hint}")
            raise OSError(errno.EIO, self._error.strerror)


class PageFile:
    """One file of a :class:`PageStore`, written and read by ranges (see the module
    documentation). ``corrupt_hint`` ends the message of a checksum mismatch (what to do)."""

    def __init__(self, store: PageStore, fid: int, path: str, size: int, corrupt_hint: str) -> None:
        self.store = store
        self.fid = fid
        self.path = path
        self.size = size
        self.corrupt_hint = corrupt_hint
        self.crc: dict[int, tuple[int, int]] = {}  # offset -> (bytes, CRC-32C) of what was written there

    def written(self, offset: int) -> bool:
        """Whether a range starting at ``offset`` was written (its CRC known)."""
        return offset in self.crc

    def forget(self, offset: int) -> None:
        """The range at ``offset`` holds nothing any more (its space reused)."""
        self.crc.pop(offset, None)

    def write(self, offset: int, data: Tensor, label: str) -> Transfer:
        """Queues the write of ``data`` (aligned host memory, unchanged until the write has
        completed) at ``offset``; its CRC is computed beside it and known once it completes."""
        n = data.numel() * data.element_size()
        self.crc.pop(offset, None)
        ticket = self.store.io.submit([(True, self.fid, data, offset)])
        self.store.stats.write_bytes += n
        return Transfer(self, "write", offset, n, label, self.store._pool.submit(_write_crc, ticket, data))

    def read(self, offset: int, into: Tensor, label: str) -> Transfer:
        """Queues the read of the range at ``offset`` into ``into`` (aligned host memory), checked
        against the CRC of what was written there (a range never written is read unchecked)."""
        n = into.numel() * into.element_size()
        known = self.crc.get(offset)
        crc = known[1] if known is not None and known[0] == n else None
        ticket = self.store.io.submit([(False, self.fid, into, offset)])
        self.store.stats.read_bytes += n
        return Transfer(self, "read", offset, n, label, self.store._pool.submit(_check_read, ticket, into, crc))


def page_cache_bytes(path: str) -> int:
    """Bytes of the file at ``path`` that sit in the OS page cache now (``mincore`` over a
    mapping of it; the mapping itself reads nothing)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            page = mmap.PAGESIZE
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return sum(1 for v in bytes(vec) if v & 1) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


class PageStore:
    """A run directory under ``nvme_dir`` and its files (see the module documentation)."""

    def __init__(self, nvme_dir: Any, *, io: str | None = None, what: str = "nvme_dir", stats: IoStats | None = None) -> None:
        self.run = RunDir(nvme_dir, io=io, what=what)
        self.io = self.run.io
        self.stats = stats if stats is not None else IoStats()  # (a client's own, to outlive the store)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload_adam-crc")
        self.files: list[PageFile] = []

    @property
    def path(self) -> str:
        return self.run.path

    @property
    def alive(self) -> bool:
        return self.run.alive

    def open(self, name: str, size: int, what: str, *, check: bool = True, corrupt_hint: str = "") -> PageFile:
        """A new file of ``size`` bytes (allocated now), after checking that the disk has room for
        it (``what`` names its contents in the error; ``check=False``: the caller checks what it
        will write)."""
        if check:
            self.run.check_space(size, what)
        fid, path = self.run.open(name, align_up(size, ALIGN))
        f = PageFile(self, fid, path, size, corrupt_hint)
        self.files.append(f)
        return f

    def check_space(self, need: int, what: str) -> None:
        self.run.check_space(need, what)

    def remove(self, f: PageFile) -> None:
        """Closes and removes file ``f`` (its transfers waited for): a set-up that failed after
        opening it."""
        self.io.close_file(f.fid)
        with contextlib.suppress(OSError):
            os.unlink(f.path)
        self.files.remove(f)

    def page_cache_bytes(self) -> int:
        """Bytes of this store's files in the OS page cache (``O_DIRECT`` keeps it near 0)."""
        return sum(page_cache_bytes(f.path) for f in self.files if os.path.exists(f.path))

    def close(self) -> None:
        """Waits for the transfers in flight, then closes the files and removes the directory."""
        self._pool.shutdown(wait=True)
        self.run.close()


_DONE = object()  # a slot's consumer was the host, and is done


@dataclass(eq=False)
class _Staged:
    buf: Tensor  # pinned (or plain, without a device), ALIGN-aligned
    key: int | None = None
    transfer: Transfer | None = None  # its read in flight
    ready: bool = False  # read and checked
    event: Any = None  # the device copy (or None: the host's own use) that consumed it
    held: bool = False  # handed out by get() and not yet given back by done(): never reused
    own: int | None = None  # the key this page is reserved for (a page of its own), if any


class StagingRing:
    """``slots`` buffers of ``slot_bytes`` that ranges are read ahead into (see the module
    documentation). ``device``: whose events say when a slot's consumer is done (None: the host
    consumes a slot itself, and gives it back with ``done(key, None)``). Keys are the caller's
    (a block's index).

    ``own``: keys with a page of their own, of the bytes given (a range larger than the general
    slots: a head), made at its first use and never used for another key; the bytes read into
    it stay valid after their consumer is done, so the next ``get`` of its key reads nothing.
    ``transient``: keys of ``own`` whose page is freed when dropped (a range read whole only to
    fill or hand it back: an embedding looked up by its rows)."""

    def __init__(
        self, device: Device | None, arena: PinnedArena | None, slots: int, slot_bytes: int,
        own: dict[int, int] | None = None, transient: frozenset[int] | set[int] = frozenset(),
    ) -> None:  # fmt: skip
        self.device = device
        self.arena = arena
        self.size = align_up(max(slot_bytes, 1), ALIGN)
        self.own = {k: align_up(max(n, 1), ALIGN) for k, n in (own or {}).items()}
        self.transient = frozenset(transient)
        self.slots = [_Staged(self._buffer()) for _ in range(slots)]
        self.misses = 0  # ranges read when asked for, not ahead (get() without a start())

    def _buffer(self, size: int | None = None) -> Tensor:
        n = self.size if size is None else size
        if self.arena is not None:
            return self.arena.alloc(n, torch.uint8, align=ALIGN)
        return aligned_empty(n, torch.uint8)

    def _own_page(self, key: int) -> _Staged:
        """``key``'s page of its own, made now if it has none; if the host still runs from it
        (a block calling itself), a second one, with a warning."""
        s = next((s for s in self.slots if s.own == key and not s.held), None)
        if s is None:
            if any(s.own == key for s in self.slots):
                log.warning("offload_adam: the page of its own of range %d is in use; the RAM ring grows by %d bytes", key, self.own[key])
            s = _Staged(self._buffer(self.own[key]), own=key)
            self.slots.append(s)
        return s

    def _intact(self, key: int) -> _Staged | None:
        """``key``'s page of its own if it still holds ``key``'s bytes, read and checked (its
        consumer done): handed out again as read ahead, without reading."""
        for s in self.slots:
            if s.own == key and s.key == key and s.ready and not s.held and s.transfer is None:
                if s.event is not None:
                    self._wait_consumed(s)
                s.event = None
                return s
        return None

    @property
    def nbytes(self) -> int:
        return sum(s.buf.numel() for s in self.slots)

    def _consumed(self, s: _Staged) -> bool:
        if s.event is None:
            return False
        return s.event is _DONE or self.device is None or self.device.query(s.event)

    def _wait_consumed(self, s: _Staged) -> None:
        if s.event is not None and s.event is not _DONE and self.device is not None:
            self.device.host_wait(s.event)

    def take(self, key: int | None = None) -> _Staged:
        """A slot to read (or stage) ``key`` into: its page of its own if it has one; else a free
        general slot, else the one whose consumer was queued first (waited for), else the one
        read ahead for the range needed last; never one the host still holds (a block running on
        the CPU from it): when the host holds every slot (blocks that call blocks), the ring
        grows by one, with a warning."""
        if key is not None and key in self.own:
            s = self._own_page(key)
            if s.transfer is not None:
                try:
                    s.transfer.wait()
                except OSError:
                    pass  # (its reader's error, if any)
            self._wait_consumed(s)
            s.key, s.transfer, s.ready, s.event, s.held = None, None, False, None, False
            return s
        general = [s for s in self.slots if s.own is None]
        for s in general:
            if not s.held and (s.key is None or self._consumed(s)):
                break
        else:
            queued = [s for s in general if s.event is not None]
            ahead = [s for s in general if s.event is None and not s.held]
            if queued:
                s = queued[0]
                self._wait_consumed(s)
            elif ahead:
                s = ahead[-1]
                if s.transfer is not None:
                    try:
                        s.transfer.wait()
                    except OSError:
                        pass  # read for a range now dropped: its error is its reader's, if any
            else:
                log.warning(
                    "offload_adam: every staging slot is held by a block running from it; the RAM ring grows by %d bytes",
                    self.size,
                )
                s = _Staged(self._buffer())
                self.slots.append(s)
        s.key, s.transfer, s.ready, s.event, s.held = None, None, False, None, False
        return s

    def _submit(self, s: _Staged, key: int, file: PageFile, offset: int, nbytes: int, label: str) -> None:
        n = align_up(nbytes, ALIGN)
        s.key, s.ready, s.event = key, False, None
        s.transfer = file.read(offset, s.buf[:n], label)
        # Slots read move to the back: take() reuses the oldest consumed one first.
        self.slots.remove(s)
        self.slots.append(s)

    def start(self, key: int, file: PageFile, offset: int, nbytes: int, label: str) -> bool:
        """Starts reading ``key``'s range unless it is read or being read; False: no slot free."""
        if any(s.key == key and s.event is None for s in self.slots):
            return True
        if key in self.own:
            if self._intact(key) is None:
                s = next((s for s in self.slots if s.own == key), None)
                if s is not None and (s.held or not (s.key is None or self._consumed(s))):
                    return False
                self._submit(self.take(key), key, file, offset, nbytes, label)
            return True
        for s in self.slots:
            if s.own is None and (s.key is None or self._consumed(s)):
                self._submit(s, key, file, offset, nbytes, label)
                return True
        return False

    def get(self, key: int, file: PageFile, offset: int, nbytes: int, label: str) -> Tensor:
        """``key``'s bytes in a slot (read now if not ahead; waits for the read and its check)."""
        s = next((s for s in self.slots if s.key == key and s.event is None), None)
        if s is None and key in self.own:
            s = self._intact(key)
        if s is None:
            s = self.take(key)
            self._submit(s, key, file, offset, nbytes, label)
            self.misses += 1
        if not s.ready:
            tr, s.transfer = s.transfer, None
            try:
                assert tr is not None
                tr.wait()
            except BaseException:
                s.key = None
                raise
            s.ready = True
        s.held = True
        return s.buf[:nbytes]

    def done(self, key: int, event: Any) -> None:
        """The consumer of ``key``'s slot completes at ``event`` (None, without a device: now)."""
        for s in self.slots:
            if s.key == key and s.event is None:
                s.event = event if event is not None else _DONE
                s.held = False

    def stage(self, key: int) -> Tensor:
        """A slot to fill by hand (then written by the caller); given back by :meth:`drop`."""
        s = self.take(key)
        s.key, s.ready = key, False
        return s.buf

    def drop(self, key: int) -> None:
        """Forgets ``key``'s slot (its bytes are not wanted any more); a transient page of its
        own is freed."""
        for s in self.slots:
            if s.key == key:
                s.key, s.ready, s.event, s.held = None, False, None, False
        if key in self.transient:
            self.slots = [s for s in self.slots if s.own != key or s.transfer is not None]

    def reset(self) -> None:
        """After a fault: waits what is in flight and forgets every slot."""
        for s in self.slots:
            if s.transfer is not None:
                try:
                    s.transfer.wait()
                except OSError:
                    pass
            self._wait_consumed(s)
            s.key, s.transfer, s.ready, s.event, s.held = None, None, False, None, False
