"""``python -m offload_adam calibrate``: measures this machine's figures for the cost model of
``placement="auto"`` (and for ``plan --this-machine``), and stores them in this user's
calibration file (:mod:`offload_adam.runtime.calibration`) with when, on which CPU and under what
load they were measured.

It measures the host memory's read bandwidth, the CPU's matmul rate (bf16 and fp32, at 1 and 64
rows), with ``--nvme-dir`` the disk's ``O_DIRECT`` read rate (a 1 GiB file written there and
removed), and on a GPU the pinned host-to-device bandwidth; each the best of 5 repeats. A
measurement taken under load (the load average above the cores, or the repeats spread by more
than 20%) is printed, not stored, and the command exits with 1. ``--dry-run`` prints without
storing.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..runtime import calibration, costs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_adam calibrate",
        description="Measures host read bandwidth, CPU matmul rates, the disk's O_DIRECT read rate (--nvme-dir) and "
        f"PCIe (on a GPU), and stores them in {calibration.path()} for placement='auto' and plan --this-machine, "
        "with when, on which CPU and under what load they were measured. A measurement under load (the load "
        f"average above the cores, or repeats spread by more than {calibration.MAX_SPREAD:.0%}) is not stored.",
    )
    ap.add_argument("--nvme-dir", help="a directory on the SSD to measure (a 1 GiB file is written there and removed)")
    ap.add_argument("--quick", action="store_true", help="smaller buffers: a second or two, less exact")
    ap.add_argument("--dry-run", action="store_true", help="print the figures without storing them")
    args = ap.parse_args(argv)
    m = costs.measure(
        nvme_dir=args.nvme_dir, dtypes=(torch.bfloat16, torch.float32), quick=args.quick,
        say=lambda line: print(line, file=sys.stderr, flush=True),  # (as it goes; the figures on stdout at the end)
    )  # fmt: skip
    print(json.dumps(m.figures, indent=2, sort_keys=True))
    print(m.describe())
    model = costs.CostModel.from_calibration(m.figures)
    if "pcie_h2d_gbs" not in m.figures:
        print(f"(no GPU: streaming is costed at the default {costs.DEFAULT_PCIE_GBS:g} GB/s of PCIe)")
    for rows in (1, 8, 64, 512):
        # one 8B-class decoder layer (about 218M parameters in bf16) as the example call
        params = 218_000_000
        where = model.choose(2 * params, params, rows, torch.bfloat16)
        print(f"a bf16 8B-class layer over {rows:>3} rows: {where} (cpu {model.cpu_seconds(2 * params, params, rows, torch.bfloat16) * 1e3:.1f} ms, "
              f"streamed {model.stream_seconds(2 * params, params, rows, torch.bfloat16) * 1e3:.1f} ms)")
    if args.dry_run:
        print("not stored (--dry-run)")
        return 0
    try:
        print(f"stored in {calibration.store(m)}")
    except calibration.Unsettled as e:
        print(f"offload_adam calibrate: {e}", file=sys.stderr)
        return 1
    return 0
