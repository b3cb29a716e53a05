"""Streaming checkpoints of the optimizer state in the safetensors format.

``optimizer.save_state(dir)`` writes ``dir/optimizer.safetensors`` bucket by bucket, each
bucket's state made resident, written and released in turn, so the RAM it needs is the tier's
window (with ``offload="nvme"``) however large the state is. The file is written under a
temporary name and renamed when complete: a checkpoint killed mid-write leaves the previous one
intact. ``optimizer.load_state(dir)`` reads it back the same way, into any tier.

The file is plain safetensors (any safetensors reader opens it): tensors
``state.<id>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param``, and
``step`` as a float32 scalar), ``<id>`` being the parameter's id in ``state_dict()``; the param
groups (as in ``state_dict()``, JSON) are in the metadata under ``param_groups``. Complex
parameters' state is stored as its real view (a trailing dimension of 2), noted under
``complex``.
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

FILE = "optimizer.safetensors"
FORMAT = "offload_adam.optimizer_state/1"

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


def jsonable(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, list):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    raise TypeError(f"param group value {x!r} cannot be stored in a checkpoint")


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
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
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
        self.base = 8 + n
        self.entries: dict[str, Entry] = {}
        for name, h in header.items():
            dtype = _BY_NAME.get(h["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: {name} has dtype {h['dtype']}, not a floating type")
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
