"""``python -m offload_adam bench-charts BENCH.json [--out DIR]``: the charts of a benchmark run,
drawn from the JSON ``python -m offload_adam bench --json BENCH.json`` wrote (issue 37, point 2).

Two PNGs: ``bench-speedup.png``, each case's median per-round ratio of offload_adam over its
baseline (the figure the tables of ``docs/benchmarks.md`` print in bold), with 1x marked; and
``bench-times.png``, each case's median step time per contender, on one logarithmic axis. The
figures are the JSON's, as the bench measured them; nothing is computed but the drawing. Needs
matplotlib (a dev dependency, not the package's)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def cases(results: Any) -> list[dict[str, Any]]:
    """The cases of a main bench's JSON (a list of ``{"case", "speedup", "baseline", contender:
    {"median_s", ...}}``); anything else is refused naming what it lacks."""
    if not isinstance(results, list) or not results:
        raise ValueError("not the JSON of python -m offload_adam bench --json (a list of cases)")
    out = []
    for r in results:
        if not isinstance(r, dict) or "case" not in r or "speedup" not in r or "baseline" not in r:
            raise ValueError(f"a case without 'case', 'speedup' and 'baseline': {str(r)[:120]}")
        out.append(r)
    return out


def contenders(case: dict[str, Any]) -> dict[str, float]:
    """Each contender's median step time (s) in ``case``."""
    return {k: float(v["median_s"]) for k, v in case.items() if isinstance(v, dict) and "median_s" in v}


def draw(results: Any, out_dir: str) -> list[str]:
    """The two charts of ``results`` under ``out_dir``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = cases(results)
    os.makedirs(out_dir, exist_ok=True)
    labels = [f"{c['case']}\n(vs {c['baseline']})" for c in cs]
    speed = [float(c["speedup"]) for c in cs]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(cs) + 1.5))
    ys = range(len(cs))
    ax.barh(ys, speed, color=["tab:blue" if s >= 1 else "tab:orange" for s in speed])
    ax.axvline(1.0, color="black", lw=1)
    for y, s in zip(ys, speed):
        ax.text(s, y, f" {s:.2f}x", va="center", fontsize=8)
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("offload_adam's speed over the baseline (median of per-round ratios; right of 1x: faster)")
    ax.set_title("python -m offload_adam bench: each case against its baseline, same process, same run", fontsize=9)
    fig.tight_layout()
    speedup_png = os.path.join(out_dir, "bench-speedup.png")
    fig.savefig(speedup_png, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 0.55 * len(cs) + 1.5))
    names = sorted({n for c in cs for n in contenders(c)}, key=lambda n: (not n.startswith("offload_adam"), n))
    height = 0.8 / max(1, len(names))
    cmap = plt.get_cmap("tab10")
    for i, n in enumerate(names):
        pts = [(y, contenders(c)[n] * 1e3) for y, c in enumerate(cs) if n in contenders(c)]
        ax.barh([y + i * height for y, _ in pts], [t for _, t in pts], height=height, color=cmap(i % 10), label=n)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(cs))], [c["case"] for c in cs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median step time (ms, log scale; shorter is faster)")
    ax.legend(fontsize=6, loc="lower right")
    ax.set_title("python -m offload_adam bench: each contender's median step", fontsize=9)
    fig.tight_layout()
    times_png = os.path.join(out_dir, "bench-times.png")
    fig.savefig(times_png, dpi=100)
    plt.close(fig)
    return [speedup_png, times_png]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_adam bench-charts",
        description="Draws the charts of a benchmark run from the JSON that python -m offload_adam bench --json wrote.",
    )
    ap.add_argument("json", help="the bench's JSON (python -m offload_adam bench --json FILE)")
    ap.add_argument("--out", default="docs/img", help="the folder the PNGs go to")
    args = ap.parse_args(argv)
    try:
        with open(args.json) as f:
            results = json.load(f)
        paths = draw(results, args.out)
    except (OSError, ValueError) as e:
        print(f"offload_adam bench-charts: {args.json}: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(f"wrote {p}")
    return 0
