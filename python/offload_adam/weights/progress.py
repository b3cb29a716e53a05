"""A progress bar over the blocks an offload fills (issue 37, point 6): a checkpoint of GBs read
onto an SSD takes minutes, and the call said nothing meanwhile. The bar (tqdm) appears only where a
person watches (stderr a terminal, tqdm installed: it is the examples' dependency, not the package's) and only once the fill has taken :data:`DELAY_S` seconds: a small
model's offload, and every test (their stderr is captured), print nothing."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

DELAY_S = 3.0  # the bar appears once the fill has run this long


def blocks(items: Iterable[T], total: int, what: str) -> Iterator[T]:
    """``items``, with a bar of ``total`` steps titled ``what`` on a terminal's stderr after
    :data:`DELAY_S` seconds."""
    stream: Any = sys.stderr
    if stream is None or not getattr(stream, "isatty", lambda: False)():
        yield from items
        return
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # (not a dependency of the package: no bar without it)
        yield from items
        return
    with tqdm(total=total, desc=what, unit="block", delay=DELAY_S, file=stream, leave=False) as bar:
        for item in items:
            yield item
            bar.update(1)
