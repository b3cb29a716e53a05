"""This machine's measured figures, cached in the user's cache directory.

The file is ``calibration.json`` in :func:`cache_dir`: ``$OFFLOAD_ADAM_CACHE_DIR``, else
``$XDG_CACHE_HOME/offload_adam``, else ``~/.cache/offload_adam``. Every key is optional:

* ``host_read_gbs``: the host memory's read bandwidth, GB/s;
* ``disk_read_gbs``: the SSD's ``O_DIRECT`` read bandwidth, GB/s;
* ``pcie_h2d_gbs``: pinned host-to-device bandwidth, GB/s;
* ``cpu_matmul_gflops``: the CPU's matmul rate by dtype name, at 1 and at 64 rows
  (``{"bfloat16": {"1": 40.0, "64": 900.0}}``), GFLOP/s.

:func:`load` reads it (``python -m offload_adam plan`` takes its bandwidths from it); keys it does
not know are kept as they are, for the tools that wrote them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

FILE = "calibration.json"
RATES = ("host_read_gbs", "disk_read_gbs", "pcie_h2d_gbs")


def cache_dir() -> Path:
    """Where the per-machine cache lives (see the module documentation)."""
    own = os.environ.get("OFFLOAD_ADAM_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "offload_adam"


def path() -> Path:
    """The calibration file's path (it may not exist)."""
    return cache_dir() / FILE


def _rate(v: Any, what: str, where: Path) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: {what} must be a positive number, got {v!r} (remove the file, or measure again)")
    return float(v)


def load() -> dict[str, Any]:
    """The calibration's figures, checked: ``{}`` when there is no file. A file that is not
    valid JSON, or a figure that is not a positive number, is a ``ValueError`` naming the file."""
    where = path()
    try:
        text = where.read_text()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); remove the file, or measure again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    out = dict(data)
    for k in RATES:
        if k in data:
            out[k] = _rate(data[k], k, where)
    if "cpu_matmul_gflops" in data:
        rates = data["cpu_matmul_gflops"]
        if not isinstance(rates, dict):
            raise ValueError(f"{where}: cpu_matmul_gflops must map a dtype name to {{rows: GFLOP/s}}")
        for dt, by_rows in rates.items():
            if not isinstance(by_rows, dict):
                raise ValueError(f"{where}: cpu_matmul_gflops[{dt!r}] must map rows (\"1\", \"64\") to GFLOP/s")
        out["cpu_matmul_gflops"] = {
            str(dt): {str(rows): _rate(r, f"cpu_matmul_gflops[{dt!r}][{rows!r}]", where) for rows, r in by_rows.items()}
            for dt, by_rows in rates.items()
        }
    return out
