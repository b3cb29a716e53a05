"""Files in the safetensors format, written and read one tensor at a time.

A :class:`Writer` is given the layout first (names, dtypes, shapes) and then the tensors in that
order, one at a time, so that a file larger than RAM can be written from state paged through a
window; it writes under a temporary name (``<file>.tmp-<pid>``, locked while it is written)
renamed when complete, and removes the temporary files of writers that were killed (their lock
free). A :class:`Reader` parses the
header (every safetensors dtype torch has), validated by safetensors' own rules as the file
opens, and reads a tensor, or gives each tensor's byte range in the file for a reader of its own
(the weights' checkpoint loader reads them with the I/O engine).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import math
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("offload_adam")

DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0",
}  # fmt: skip
_BY_NAME = {v: k for k, v in DTYPES.items()}


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


def _stored(t: Tensor) -> Tensor:
    """``t`` as stored: real, row-major contiguous, flat."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.detach().contiguous().reshape(-1)


_TMP_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def remove_leftovers(path: str) -> list[str]:
    """Removes the temporary files ``<path>.tmp-<pid>`` that writers of ``path`` killed mid-write
    left: only regular files of this user whose lock nobody holds (a live writer keeps its own
    locked until it is renamed), never through a symlink. Returns the paths removed."""
    d, base = os.path.split(os.path.abspath(path))
    prefix = base + ".tmp-"
    removed = []
    for name in sorted(os.listdir(d)):
        if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
            continue
        tmp = os.path.join(d, name)
        try:
            fd = os.open(tmp, _TMP_FLAGS)
        except OSError:  # gone, a symlink, not ours to write
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a writer at work
                continue
            now = os.lstat(tmp)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(tmp)
                removed.append(tmp)
                log.info("offload_adam: removed %s, left by a checkpoint writer that was killed", tmp)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class Writer:
    """Writes one safetensors file: the layout first (names, dtypes, shapes), then the tensors
    in that order, one at a time (see the module documentation)."""

    def __init__(self, path: str, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": metadata}
        off = 0
        self.entries = []
        for name, dtype, shape in layout:
            n = 1
            for d in shape:
                n *= d
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self.entries.append(Entry(name, dtype, shape, off, off + nbytes))
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self.tmp = f"{path}.tmp-{os.getpid()}"
        self.path = path
        remove_leftovers(path)
        # (O_EXCL: one of ours left by a killed process of the same pid is gone by now; a writer
        # of this process still at work on the same file is an error, not a file truncated)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            # Held until the file is renamed or removed: remove_leftovers leaves it alone.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        self.f: io.BufferedWriter = os.fdopen(fd, "wb")
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)
        self.next = 0

    def write(self, name: str, t: Tensor) -> None:
        e = self.entries[self.next]
        if e.name != name:
            raise RuntimeError(f"checkpoint writer: expected {e.name}, got {name}")
        flat = _stored(t)
        if flat.dtype != e.dtype or flat.numel() * flat.element_size() != e.end - e.begin:
            raise RuntimeError(f"checkpoint writer: {name} changed while being written")
        self.f.write(flat.view(torch.uint8).numpy().data)
        self.next += 1

    def commit(self) -> None:
        if self.next != len(self.entries):
            raise RuntimeError(f"checkpoint writer: {len(self.entries) - self.next} tensors not written")
        self.f.flush()
        os.fsync(self.f.fileno())
        os.posix_fadvise(self.f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # not kept in the page cache
        os.replace(self.tmp, self.path)  # (renamed while locked and open)
        self.f.close()
        d = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(d)
        finally:
            os.close(d)

    def abort(self) -> None:
        if os.path.exists(self.tmp):
            os.remove(self.tmp)  # (while locked)
        self.f.close()


class Reader:
    """Reads the tensors of one safetensors file, one at a time.

    The header is validated as the file opens (see :func:`_parse`), before any tensor is read:
    a file that safetensors would refuse is a ``ValueError`` naming the file and the tensor.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.f: io.BufferedReader = open(path, "rb")
        try:
            self.metadata, self.base, self.entries = _parse(path, self.f)
        except BaseException:
            self.f.close()
            raise

    def read(self, name: str) -> Tensor:
        e = self.entries[name]
        n = 1
        for d in e.shape:
            n *= d
        out = torch.empty(n, dtype=e.dtype)
        self.f.seek(self.base + e.begin)
        got = self.f.readinto(out.view(torch.uint8).numpy().data)
        if got != e.end - e.begin:
            raise ValueError(f"{self.path}: {name} is truncated")
        return out.view(e.shape)

    def close(self) -> None:
        self.f.close()


MAX_HEADER = 100_000_000  # bytes: safetensors' own limit on a header
_DEPTH = 127  # JSON nesting serde_json (safetensors' parser) reads: its recursion limit is 128
_U64 = 1 << 64  # safetensors' sizes and offsets are u64: anything larger is not a number it reads
_I64 = 1 << 63  # torch's sizes are int64
_SUB_BYTE = ("F4", "F6_E2M3", "F6_E3M2")  # safetensors' dtypes of under a byte an element: no torch dtype


def json_kind(x: Any) -> str:
    """``x``'s JSON type, for messages."""
    if isinstance(x, dict):
        return "an object"
    if isinstance(x, list):
        return "an array"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, bool):
        return "a boolean"
    if x is None:
        return "null"
    return "a number"


def _is_u64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _U64


def _json_int(s: str) -> Any:
    if s == "-0":
        return -0.0  # serde_json reads -0 as a float: not an integer where one is wanted
    v = int(s)
    if abs(v) >= _U64 and math.isinf(float(s)):
        raise ValueError(f"number {s[:20]}... out of range")  # serde_json's "number out of range"
    return v


def _json_float(s: str) -> float:
    v = float(s)
    if math.isinf(v):
        raise ValueError(f"number {s[:40]} out of range")  # serde_json refuses it, Python reads inf
    return v


def _json_constant(s: str) -> Any:
    raise ValueError(f"{s} is not JSON")  # Python's json reads NaN and Infinity, JSON has neither


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} is given twice")
        out[k] = v
    return out


def _check_json(x: Any, depth: int) -> None:
    """What serde_json refuses and Python's ``json`` reads: nesting deeper than serde's limit,
    lone surrogates (a ``\\ud800`` escape) in strings."""
    if isinstance(x, str):
        x.encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
        return
    if isinstance(x, (dict, list)) and depth > _DEPTH:
        raise ValueError(f"arrays and objects nested deeper than {_DEPTH} levels")
    if isinstance(x, dict):
        for k, v in x.items():
            k.encode("utf-8")
            _check_json(v, depth + 1)
    elif isinstance(x, list):
        for v in x:
            _check_json(v, depth + 1)


def _parse(path: str, f: io.BufferedReader) -> tuple[dict[str, str], int, dict[str, Entry]]:
    """The header of the safetensors file ``f`` (at ``path``), validated by safetensors' own rules
    (its Rust crate's ``read_metadata`` and ``Metadata::validate``): a header of at most 100 MB
    inside the file, UTF-8 JSON, an object; ``__metadata__`` absent, null or a str->str object;
    every other entry a tensor: an object with a ``dtype`` (one safetensors and torch have),
    a ``shape`` (non-negative integers) and ``data_offsets`` (two non-negative integers
    ``begin <= end``) whose range holds exactly the shape's bytes; the ranges, in order, tile the
    data section: from its start to the end of the file, without gap or overlap (safetensors'
    rule, which every writer follows: a gap or a trailing byte means a file written otherwise, or
    damaged). Returns the metadata, where the data section starts and the entries; any other
    file is a ``ValueError`` naming the file and the tensor.

    Stricter than safetensors on purpose: an entry must be an object and its dtype a string
    (serde also reads them from an array and from a one-key object), a key is given once (of a
    tensor given twice safetensors keeps the last), and what torch cannot hold is refused: the
    dtypes of under a byte an element (F4, F6_E2M3, F6_E3M2) and dimensions of 2**63 or more (in
    a tensor of no element: safetensors reads the header, and then fails to make the tensor)."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{path}: not a safetensors file (too short: {size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes, over safetensors' limit of {MAX_HEADER})")
    if n > size - 8:
        raise ValueError(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
    try:
        text = f.read(n).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a safetensors file (its header is not UTF-8: {err})") from None
    try:
        header = json.loads(
            text, object_pairs_hook=_json_object, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant
        )
        _check_json(header, 1)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {err})") from None
    except UnicodeEncodeError:
        raise ValueError(f"{path}: not a safetensors file (its header has a lone surrogate escape in a string)") from None
    except RecursionError:
        raise ValueError(f"{path}: not a safetensors file (its header is nested too deeply)") from None
    except ValueError as err:
        raise ValueError(f"{path}: not a safetensors file (its header: {err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is {json_kind(header)}, not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise ValueError(f"{path}: '__metadata__' is {json_kind(metadata)}, not an object of strings")
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise ValueError(f"{path}: '__metadata__' entry {k!r} is {json_kind(v)}, not a string")
    data = size - 8 - n  # the data section's bytes
    entries: dict[str, Entry] = {}
    for name, h in header.items():
        entries[name] = _entry(f"{path}: tensor {name!r}", name, h, data)
    _check_tiling(path, entries, data)
    return metadata, 8 + n, entries

def _entry(where: str, name: str, h: Any, data: int) -> Entry:
    """The header's entry ``h`` of tensor ``name`` (``where`` names it in errors), checked by
    safetensors' rules (see :func:`_parse`) in a data section of ``data`` bytes."""
    if not isinstance(h, dict):
        raise ValueError(f"{where}: its entry is {json_kind(h)}, not an object with dtype, shape and data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in h:
            raise ValueError(f"{where}: its entry has no {key!r}")
    code = h["dtype"]
    if not isinstance(code, str):
        raise ValueError(f"{where}: dtype {code!r} is {json_kind(code)}, not a string")
    dtype = _BY_NAME.get(code)
    if dtype is None:
        if code in _SUB_BYTE:
            raise ValueError(f"{where}: dtype {code} (under a byte an element) has no torch dtype")
        raise ValueError(f"{where}: dtype {code!r} is not one of safetensors' ({', '.join(sorted(_BY_NAME))})")
    shape = h["shape"]
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not an array of non-negative integers")
    if any(d >= _I64 for d in shape):
        raise ValueError(f"{where}: shape {shape} has a dimension of 2**63 or more, past torch's sizes (int64)")
    offsets = h["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise ValueError(f"{where}: data_offsets {offsets!r} are not two non-negative integers [begin, end]")
    begin, end = offsets
    if end < begin:
        raise ValueError(f"{where}: data_offsets [{begin}, {end}] are reversed (end before begin)")
    numel = 1
    for d in shape:
        numel *= d
        if numel >= _U64:
            raise ValueError(f"{where}: shape {shape} has more elements than 64 bits count")
    item = dtype.itemsize
    if numel * item * 8 >= _U64:
        raise ValueError(f"{where}: shape {shape} of {code} has more bits than 64 bits count")
    if end - begin != numel * item:
        raise ValueError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, its shape {shape} of {code} {numel * item}"
        )
    if end > data:
        raise ValueError(
            f"{where}: ends after the end of the file (truncated): data_offsets [{begin}, {end}], "
            f"the data section has {data} bytes"
        )
    return Entry(name, dtype, tuple(shape), begin, end)


def _check_tiling(path: str, entries: dict[str, Entry], data: int) -> None:
    """The tensors' ranges, in order, tile the data section of ``data`` bytes (see :func:`_parse`)."""
    at, last = 0, None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end, e.name)):
        if e.begin < at:
            assert last is not None
            raise ValueError(
                f"{path}: tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] overlap [{last.begin}, {last.end}] of tensor {last.name!r}"
            )
        if e.begin > at:
            raise ValueError(
                f"{path}: tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] leave bytes [{at}, {e.begin}) of the data "
                "unused (as safetensors requires, the tensors tile the data section, without gaps)"
            )
        at, last = e.end, e
    if at != data:
        raise ValueError(
            f"{path}: {data - at} bytes after the last tensor's data (the data section has {data} bytes, the tensors "
            f"{at}): as safetensors requires, the tensors cover the data section to the end of the file"
        )

