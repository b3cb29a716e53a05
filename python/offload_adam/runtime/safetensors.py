"""Files in the safetensors format, written and read one tensor at a time.

A :class:`Writer` is given the layout first (names, dtypes, shapes) and then the tensors in that
order, one at a time, so that a file larger than RAM can be written from state paged through a
window; it writes under a temporary name renamed when complete. A :class:`Reader` parses the
header (every safetensors dtype) and reads a tensor, or gives each tensor's byte range in the
file for a reader of its own (the weights' checkpoint loader reads them with the I/O engine).
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
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


class Writer:
    """Writes one safetensors file: the layout first (names, dtypes, shapes), then the tensors
    in that order, one at a time."""

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
        self.f: io.BufferedWriter = open(self.tmp, "wb")
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
        self.f.close()
        os.replace(self.tmp, self.path)
        d = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(d)
        finally:
            os.close(d)

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


class Reader:
    """Reads the tensors of one safetensors file, one at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f: io.BufferedReader = open(path, "rb")
        size = os.fstat(self.f.fileno()).st_size
        head = self.f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
        try:
            header = json.loads(self.f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.base = 8 + n  # where the data section starts: an entry's bytes are at base + begin
        self.entries: dict[str, Entry] = {}
        for name, h in header.items():
            dtype = _BY_NAME.get(h["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: {name} has dtype {h['dtype']}, which torch does not have")
            begin, end = h["data_offsets"]
            if self.base + end > size:
                raise ValueError(f"{path}: {name} ends after the end of the file (truncated)")
            self.entries[name] = Entry(name, dtype, tuple(h["shape"]), begin, end)

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
