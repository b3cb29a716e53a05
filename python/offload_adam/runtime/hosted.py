"""Parameters whose truth lives on the host: a client streams them to the device, another may
write them.

A client that keeps a parameter's weights in host memory and streams them to a device (the
weight streamer) gives the parameter a :class:`Home`: its host copy (a view of pinned memory, the
parameter's shape and dtype; None where the host copy is not in memory, on NVMe), the device it
runs on, and a fence. A client that rewrites the host copy (the optimizer's step) raises the fence
while it writes (``begin_write``/``end_write``); the streamer copies a block to the device only
once its homes are not being written, and copies again a block whose homes were written since
(``version``); a host copy with a live ``writer`` is not read ahead across a backward (a step is
to come, and would make the copy stale). When the streaming client hands the parameter back
(``release``), the writer refuses to write it again.

A parameter held by an optimizer of this package is *claimed*: offloading the weights of a
claimed parameter is refused (the optimizer imported its storage). The claim names its writer
(weakly): a client that replaces a parameter's data (the weight offload's ``close()`` moving the
parameters ``resident=`` kept on the device back to the host) first waits for an asynchronous step
still writing it (``wait_for_writer``), whose copy-back would otherwise land in the freed tensor.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .device import Device


@dataclass(eq=False)
class Home:
    host: Tensor | None  # the host copy (None: not in memory)
    device: Device
    block: str  # what holds it, for errors
    version: int = 0
    writer: Any = None  # weak reference to the client that writes it
    ready: threading.Event = field(default_factory=threading.Event)
    released: bool = False  # the streaming client let it go (its parameter is an ordinary tensor again)

    def __post_init__(self) -> None:
        self.ready.set()

    def begin_write(self) -> None:
        self.version += 1
        self.ready.clear()

    def end_write(self) -> None:
        self.ready.set()

    def release(self) -> None:
        """The streaming client hands the parameter back: a writer must not step it again."""
        self.released = True

    @property
    def written(self) -> bool:
        """A live writer holds it."""
        return self.writer is not None and self.writer() is not None


# By identity (a tensor's == is elementwise), weakly.
_homes: WeakIdKeyDictionary = WeakIdKeyDictionary()
_claims: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_home(p: Tensor, home: Home | None) -> None:
    if home is None:
        _homes.pop(p, None)
    else:
        _homes[p] = home


def home_of(p: Tensor) -> Home | None:
    h = _homes.get(p)
    return h if isinstance(h, Home) else None


_writers: WeakIdKeyDictionary = WeakIdKeyDictionary()


def claim(p: Tensor, who: str, writer: Any = None) -> None:
    """``p`` is held by ``who`` (in words); ``writer``: the object whose ``wait_writes()`` waits
    for its writes of ``p`` in flight (held weakly)."""
    _claims[p] = who
    if writer is not None:
        _writers[p] = weakref.ref(writer)


def unclaim(p: Tensor) -> None:
    _claims.pop(p, None)
    _writers.pop(p, None)


def wait_for_writer(p: Tensor) -> None:
    """Waits for the writes of ``p`` its claiming writer has in flight (an asynchronous step)."""
    ref = _writers.get(p)
    w = ref() if ref is not None else None
    if w is not None:
        w.wait_writes()


def claimed(p: Tensor) -> str | None:
    who = _claims.get(p)
    return who if isinstance(who, str) else None


__all__ = ["Home", "claim", "claimed", "home_of", "set_home", "unclaim", "wait_for_writer"]
