"""Sizes as a person reads them, for the clients' summaries (``weights/summary.py``,
``optim/summary.py``)."""

from __future__ import annotations

MiB = 1 << 20


def size(n: float) -> str:
    """Bytes as a person reads them: ``512 B``, ``4.0 KiB``, ``4.72 MiB``, ``1.50 GiB``."""
    if n < 1 << 10:
        return f"{int(n)} B"
    if n < MiB:
        return f"{n / (1 << 10):.1f} KiB"
    if n < 1 << 30:
        return f"{n / MiB:.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"
