"""This machine's measured figures, each with when, on which CPU and under what load it was
measured, cached per user.

The file is ``calibration-<uid>.json`` in :func:`cache_dir` (``$OFFLOAD_ADAM_CACHE_DIR``, else
``$XDG_CACHE_HOME/offload_adam``, else ``~/.cache/offload_adam``; made ``0700``): one file per
user, so that another user sharing ``$HOME`` never writes yours. It holds ``"format": 2`` and a
list of ``"measurements"``, each a :class:`Measurement`: ``time`` (ISO 8601, UTC), ``cpu`` (the
CPU's model string), ``cores``, ``load_avg`` (the 1-minute load average when it began),
``spread`` (the largest spread between the repeats of one of its figures, see
:data:`MAX_SPREAD`), ``repeats``, ``by`` (the command or call that measured), ``offload_adam``
(the version) and ``figures``, any of:

* ``host_read_gbs``: the host memory's read bandwidth, GB/s;
* ``disk_read_gbs``: the SSD's ``O_DIRECT`` read rate, GB/s;
* ``pcie_h2d_gbs``: pinned host-to-device bandwidth, GB/s;
* ``cpu_matmul_gflops``: the CPU's matmul rate by dtype name, at 1 and at 64 rows
  (``{"bfloat16": {"1": 40.0, "64": 900.0}}``), GFLOP/s.

A measurement taken under load is never stored (:func:`unsettled`: a load average above the
cores, or a spread above 20%): its figures would be this moment's contention, not the machine's.
A store is atomic (a temporary file in the same folder, then ``os.replace``) and keeps, of the
earlier measurements, the figures the new one did not measure. :func:`read` gives the figures of
measurements taken on this CPU, each with its measurement (the later wins); ``plan`` reads them
only with ``--this-machine``, ``placement="auto"`` always (``weights/costs.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import math
import os
import platform
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 2
RATES = ("host_read_gbs", "disk_read_gbs", "pcie_h2d_gbs")
MATMUL = "cpu_matmul_gflops"
# The largest spread between a figure's repeats that is stored: the best repeat against their
# median, (best - median) / best. One slow repeat (a page fault, a timer tick) does not count;
# half of them slow is contention.
MAX_SPREAD = 0.20


def cache_dir() -> Path:
    """Where the per-machine cache lives (see the module documentation)."""
    own = os.environ.get("OFFLOAD_ADAM_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "offload_adam"


def path() -> Path:
    """This user's calibration file (it may not exist)."""
    return cache_dir() / f"calibration-{os.getuid()}.json"


def cpu_model() -> str:
    """The CPU's model string (``/proc/cpuinfo``'s ``model name``), else the platform's word."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def spread(repeats: list[float]) -> float:
    """The spread of a figure's repeated rates: (best - median) / best (see :data:`MAX_SPREAD`)."""
    if len(repeats) < 2:
        return 0.0
    best = max(repeats)
    ordered = sorted(repeats)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return (best - median) / best if best > 0 else 0.0


@dataclass(frozen=True)
class Measurement:
    """One measurement of some figures and how it went (see the module documentation)."""

    figures: dict[str, Any]
    time: str
    cpu: str
    cores: int
    load_avg: float
    spread: float
    repeats: int
    by: str
    version: str = ""

    def when(self) -> str:
        """The time it was measured, to the minute: ``2026-12-05 10:11 UTC``."""
        return self.time.replace("T", " ")[:16] + " UTC" if "T" in self.time else self.time

    def describe(self) -> str:
        """When, where and under what load, in words."""
        return (
            f"measured {self.when()} on {self.cpu} ({self.cores} cores) by {self.by}, load average {self.load_avg:.2f}, "
            f"spread between repeats {self.spread:.0%}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time, "cpu": self.cpu, "cores": self.cores, "load_avg": self.load_avg, "spread": self.spread,
            "repeats": self.repeats, "by": self.by, "offload_adam": self.version, "figures": self.figures,
        }  # fmt: skip


def now() -> str:
    """The time of a measurement: ISO 8601, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def unsettled(m: Measurement) -> str | None:
    """Why ``m`` was taken under load, in words (None: it was not): a load average above the
    cores, or a spread between repeats above :data:`MAX_SPREAD`."""
    why = []
    if m.load_avg > m.cores:
        why.append(f"the load average, {m.load_avg:.2f}, was above the {m.cores} cores")
    if m.spread > MAX_SPREAD:
        why.append(f"its repeats spread by {m.spread:.0%}, above {MAX_SPREAD:.0%}")
    return " and ".join(why) or None


def _rate(v: Any, what: str, where: Path) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: {what} must be a positive number, got {v!r} (remove the file, or measure again)")
    return float(v)


def _figures(data: Any, where: Path) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a measurement's figures must be a JSON object, got {type(data).__name__}")
    out = dict(data)
    for k in RATES:
        if k in data:
            out[k] = _rate(data[k], k, where)
    if MATMUL in data:
        rates = data[MATMUL]
        if not isinstance(rates, dict):
            raise ValueError(f"{where}: {MATMUL} must map a dtype name to {{rows: GFLOP/s}}")
        for dt, by_rows in rates.items():
            if not isinstance(by_rows, dict):
                raise ValueError(f"{where}: {MATMUL}[{dt!r}] must map rows (\"1\", \"64\") to GFLOP/s")
        out[MATMUL] = {
            str(dt): {str(rows): _rate(r, f"{MATMUL}[{dt!r}][{rows!r}]", where) for rows, r in by_rows.items()}
            for dt, by_rows in rates.items()
        }
    return out


def _measurement(data: Any, where: Path) -> Measurement:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a measurement must be a JSON object, got {type(data).__name__}")
    missing = [k for k in ("time", "cpu", "cores", "load_avg", "spread", "figures") if k not in data]
    if missing:
        raise ValueError(f"{where}: a measurement lacks {', '.join(missing)}; remove the file, or measure again")
    try:
        return Measurement(
            figures=_figures(data["figures"], where), time=str(data["time"]), cpu=str(data["cpu"]), cores=int(data["cores"]),
            load_avg=float(data["load_avg"]), spread=float(data["spread"]), repeats=int(data.get("repeats", 0)),
            by=str(data.get("by", "?")), version=str(data.get("offload_adam", "")),
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        if str(where) in str(e):
            raise
        raise ValueError(f"{where}: a measurement's fields are not what they should be ({e}); remove the file, or measure again") from None


def measurements(where: Path | None = None) -> list[Measurement]:
    """The file's measurements, oldest first, checked: ``[]`` when there is no file. A file that
    is not valid JSON, not of format 2, or holds a figure that is not a positive number, is a
    ``ValueError`` naming the file."""
    where = path() if where is None else where
    try:
        text = where.read_text()
    except FileNotFoundError:
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); remove the file, or measure again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ValueError(
            f"{where}: not a calibration of format {FORMAT} (got format {data.get('format')!r}: no record of when and under "
            "what load it was measured); remove the file, or measure again"
        )
    items = data.get("measurements")
    if not isinstance(items, list):
        raise ValueError(f"{where}: \"measurements\" must be a list")
    return [_measurement(m, where) for m in items]


@dataclass
class Calibration:
    """This CPU's measured figures, each with the measurement it came from (later measurements
    win); ``other`` holds the file's measurements of another CPU (not used)."""

    where: Path
    figures: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Measurement] = field(default_factory=dict)  # "host_read_gbs", "cpu_matmul_gflops[bfloat16]"
    other: list[Measurement] = field(default_factory=list)

    def rate(self, key: str) -> tuple[float, Measurement] | None:
        """A bandwidth of :data:`RATES` and its measurement (None: not measured)."""
        return (self.figures[key], self.source[key]) if key in self.figures else None

    def matmul(self, dtype: str) -> tuple[dict[str, float], Measurement] | None:
        """The matmul rates of ``dtype`` by rows and their measurement (None: not measured)."""
        got = self.figures.get(MATMUL, {}).get(dtype)
        return (got, self.source[f"{MATMUL}[{dtype}]"]) if got is not None else None


def read(where: Path | None = None) -> Calibration:
    """The figures of the file's measurements taken on this CPU (:func:`cpu_model`), each with
    its measurement; see :func:`measurements` for the errors."""
    where = path() if where is None else where
    out = Calibration(where)
    cpu = cpu_model()
    for m in measurements(where):
        if m.cpu != cpu:
            out.other.append(m)
            continue
        for k, v in m.figures.items():
            if k == MATMUL:
                for dt, by_rows in v.items():
                    out.figures.setdefault(MATMUL, {})[dt] = by_rows
                    out.source[f"{MATMUL}[{dt}]"] = m
            else:
                out.figures[k] = v
                out.source[k] = m
    return out


def load() -> dict[str, Any]:
    """This CPU's figures, checked (``{}`` when there is no file): :func:`read`'s, without
    where each came from."""
    return read().figures


def _keys(figures: dict[str, Any]) -> set[str]:
    return {k for k in figures if k != MATMUL} | {f"{MATMUL}[{dt}]" for dt in figures.get(MATMUL, {})}


def _without(figures: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    out = {k: v for k, v in figures.items() if k != MATMUL and k not in keys}
    rates = {dt: r for dt, r in figures.get(MATMUL, {}).items() if f"{MATMUL}[{dt}]" not in keys}
    if rates:
        out[MATMUL] = rates
    return out


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder locked against another store of this user (``flock`` on the folder itself)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Unsettled(ValueError):
    """A measurement taken under load, which :func:`store` refuses (see :func:`unsettled`)."""


def store(m: Measurement, where: Path | None = None) -> Path:
    """Adds ``m`` to the file and returns its path: the earlier measurements keep the figures
    ``m`` did not measure (those of another CPU go); the file is replaced atomically. A
    measurement under load is refused (:class:`Unsettled`, nothing written); an unreadable file is
    replaced."""
    why = unsettled(m)
    where = path() if where is None else where
    if why is not None:
        raise Unsettled(f"not stored in {where}: {why}; measure again when the machine is idle")
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(where.parent):
        try:
            old = measurements(where)
        except ValueError:
            old = []  # unreadable: the new measurement replaces it
        keys = _keys(m.figures)
        kept = [
            Measurement(**{**vars(o), "figures": _without(o.figures, keys)}) for o in old if o.cpu == m.cpu
        ]  # fmt: skip
        kept = [o for o in kept if o.figures] + [m]
        text = json.dumps({"format": FORMAT, "measurements": [o.to_json() for o in kept]}, indent=2, sort_keys=True) + "\n"
        fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=f".{where.name}.", suffix=".tmp")  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, where)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return where
