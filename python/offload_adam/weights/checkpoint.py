"""Weights loaded from a checkpoint straight into their storage, block by block.

``checkpoint=`` is a ``.safetensors`` file, or a folder (as ``save_pretrained`` writes it) with
``model.safetensors`` or a sharded ``model.safetensors.index.json``. Each parameter is found
under one of its names (a tied parameter under any), checked (present, same shape and dtype)
before anything is read, and its bytes are read by the Rust I/O engine from the file straight
into the block's place: the pinned host copy, an NVMe staging slot, or a transfer buffer for a
resident block. Nothing is materialised whole: a model larger than RAM needs the window only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .. import _native
from ..runtime.safetensors import Entry as TensorEntry
from ..runtime.safetensors import Reader
from .blocks import Block

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Located:
    key: str  # its name in the checkpoint
    path: str
    entry: TensorEntry
    base: int  # where the file's data section starts


class Checkpoint:
    """The tensors of a checkpoint and where their bytes are (see the module documentation)."""

    def __init__(self, path: Any) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX)
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"checkpoint: {index} has no weight_map")
                files = sorted(set(weight_map.values()))
            elif os.path.isfile(os.path.join(path, SINGLE)):
                files = [SINGLE]
            else:
                raise ValueError(f"checkpoint: {path!r} has neither {INDEX} nor {SINGLE}")
            files = [os.path.join(path, f) for f in files]
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ValueError(f"checkpoint: {path!r} is neither a file nor a directory")
        self.path = path
        self.tensors: dict[str, Located] = {}
        for fp in files:
            if not os.path.isfile(fp):
                raise ValueError(f"checkpoint: shard {fp!r} of {path!r} is missing")
            r = Reader(fp)
            try:
                for name, e in r.entries.items():
                    self.tensors[name] = Located(name, fp, e, r.base)
            finally:
                r.close()
        self.io = _native.IoEngine()
        self._files: dict[str, int] = {}

    def locate(self, blocks: list[Block]) -> dict[int, Located]:
        """Each parameter's tensor (by ``id``), checked: present under one of its names, with
        its shape and dtype. Raises naming the first parameter that is not."""
        out: dict[int, Located] = {}
        for b in blocks:
            for e in b.entries:
                hit = next((self.tensors[n] for n in e.names if n in self.tensors), None)
                if hit is None:
                    raise ValueError(f"checkpoint {self.path!r} has no tensor for parameter {e.names[0]!r}")
                p = e.param
                if tuple(hit.entry.shape) != tuple(p.shape) or hit.entry.dtype != p.dtype:
                    raise ValueError(
                        f"checkpoint {self.path!r}: {hit.key!r} is {hit.entry.dtype} of shape {tuple(hit.entry.shape)}, "
                        f"the model's parameter {e.names[0]!r} is {p.dtype} of shape {tuple(p.shape)}"
                    )
                out[id(p)] = hit
        return out

    def _file(self, path: str) -> int:
        fid = self._files.get(path)
        if fid is None:
            fid, _ = self.io.open_read(path)
            self._files[path] = fid
        return fid

    def read_block(self, b: Block, where: dict[int, Located], dst: Tensor) -> None:
        """Reads block ``b``'s parameters into ``dst`` (its bytes, uint8), each at its offset."""
        reqs = []
        for e in b.entries:
            loc = where[id(e.param)]
            reqs.append((False, self._file(loc.path), dst[e.offset : e.offset + e.nbytes], loc.base + loc.entry.begin))
        try:
            self.io.submit(reqs).wait()
        except OSError as err:
            raise OSError(err.errno, f"offload_adam: reading the checkpoint for block {b.name}: {err.strerror}") from None

    def close(self) -> None:
        for fid in self._files.values():
            self.io.close_file(fid)
        self._files = {}
