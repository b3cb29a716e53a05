"""``python -m offload_adam calibrate``: measures this machine's figures for the cost model of
``placement="auto"`` and for ``plan``, and stores them in the calibration file
(:mod:`offload_adam.runtime.calibration`).

It measures the host memory's read bandwidth, the CPU's matmul rate (bf16 and fp32, at 1 and 64
rows), with ``--nvme-dir`` the disk's ``O_DIRECT`` read rate (a 1 GiB file written there and
removed), and on a GPU the pinned host-to-device bandwidth. ``--dry-run`` prints without storing.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..runtime import calibration, costs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_adam calibrate",
        description="Measures host read bandwidth, CPU matmul rates, the disk's O_DIRECT read rate (--nvme-dir) and "
        f"PCIe (on a GPU), and stores them in {calibration.path()} for placement='auto' and plan.",
    )
    ap.add_argument("--nvme-dir", help="a directory on the SSD to measure (a 1 GiB file is written there and removed)")
    ap.add_argument("--quick", action="store_true", help="smaller buffers: a second or two, less exact")
    ap.add_argument("--dry-run", action="store_true", help="print the figures without storing them")
    args = ap.parse_args(argv)
    figures = costs.measure(nvme_dir=args.nvme_dir, dtypes=(torch.bfloat16, torch.float32), quick=args.quick)
    print(json.dumps(figures, indent=2, sort_keys=True))
    model = costs.CostModel.from_calibration(figures)
    if "pcie_h2d_gbs" not in figures:
        print(f"(no GPU: streaming is costed at the default {costs.DEFAULT_PCIE_GBS:g} GB/s of PCIe)")
    for rows in (1, 8, 64, 512):
        # one 8B-class decoder layer (about 218M parameters in bf16) as the example call
        params = 218_000_000
        where = model.choose(2 * params, params, rows, torch.bfloat16)
        print(f"a bf16 8B-class layer over {rows:>3} rows: {where} (cpu {model.cpu_seconds(2 * params, params, rows, torch.bfloat16) * 1e3:.1f} ms, "
              f"streamed {model.stream_seconds(2 * params, params, rows, torch.bfloat16) * 1e3:.1f} ms)")
    if not args.dry_run:
        print(f"stored in {costs.store(figures)}")
    return 0
