"""Packaging: the abi3 extension, the typed stub, the bench command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import offload_adam
from offload_adam import _native


def test_extension_is_abi3_and_typed() -> None:
    assert _native.__file__ is not None
    assert Path(_native.__file__).name.endswith(".abi3.so"), _native.__file__
    pkg = Path(offload_adam.__file__).parent
    assert (pkg / "py.typed").exists()
    assert (pkg / "_native.pyi").exists()


def test_stub_matches_the_extension() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "offload_adam._native"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_bench_command_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "offload_adam", "bench", "--scale", "0.002", "--rounds", "2", "--json", str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr
    assert "torch AdamW(fused=True)" in out.stdout and "GB/s" in out.stdout
    results = json.loads((tmp_path / "b.json").read_text())
    assert [r["case"].split()[0] for r in results] == ["1", "GPT-2", "4000", "bf16", "thread"]
    assert all(r["speedup"] > 0 for r in results)
