"""Packaging: the abi3 extension, the typed stub, the bench command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import offload_adam
from offload_adam import _native


def test_extension_is_abi3_and_typed() -> None:
    assert _native.__file__ is not None
    assert Path(_native.__file__).name.endswith(".abi3.so"), _native.__file__
    pkg = Path(offload_adam.__file__).parent
    assert (pkg / "py.typed").exists()
    assert (pkg / "_native.pyi").exists()


def test_stub_matches_the_extension() -> None:
    pytest.importorskip("mypy")
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
    assert [r["case"].split()[0] for r in results] == ["1", "GPT-2", "4000", "bf16", "thread", "offloaded", "fp8", "fp8", "bf16"]
    assert results[6]["offload_adam uint8 moments"]["speedup_over_baseline"] > 0
    assert all(r["speedup"] > 0 for r in results)
    assert results[2]["many_over_flat_rate"] > 0
    assert results[5]["offload_adam offloaded (simulated device)"]["kernel_rate_over_ours"] > 0


def _run_example(args: list[str], env: dict[str, str] | None = None) -> str:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_main_job_runs_plots_and_reports_agreement(tmp_path: Path) -> None:
    small = ["--steps", "20", "--layers", "1", "--d-model", "32", "--batch", "8"]
    out = _run_example(["examples/train_gpt.py", *small, "--plot", str(tmp_path / "a.png")])
    assert "loss curves agree" in out and (tmp_path / "a.png").stat().st_size > 1000
    # the offload path, on CPU parameters through the streaming machinery
    out = _run_example(["examples/train_gpt.py", *small, "--async-step", "--simulate", "--plot", str(tmp_path / "b.png")])
    assert "offload breakdown per step" in out and "loss curves agree" in out


def test_gpu_benchmark_script_smoke_on_cpu(tmp_path: Path) -> None:
    tiny = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "50", "--ctx", "16"]
    out = _run_example(["examples/gpu_bench.py", *tiny, "--batch", "2", "--steps", "3", "--json", str(tmp_path / "g.json")])
    res = json.loads((tmp_path / "g.json").read_text())
    assert {"offload_adam", "offload_adam async_step"} <= set(res["results"])
    assert "cpu_step_s" in res["results"]["offload_adam"]
    assert "step" in out


def test_generate_example_runs_and_matches_the_resident_model(tmp_path: Path) -> None:
    small = ["--layers", "2", "--d-model", "128", "--vocab", "500", "--tokens", "6", "--prompt", "8"]
    out = _run_example(["examples/generate.py", *small])
    assert "simulated device" in out and "tokens identical" in out and "tokens/s" in out
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = _run_example(["examples/generate.py", *small, "--storage", "nvme", "--nvme-dir", str(nvme), "--prefetch", "1"])
    assert "tokens identical" in out and "disk read" in out
    assert list(nvme.iterdir()) == []


def test_weights_bench_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "offload_adam", "bench", "--weights", str(tmp_path), "--weights-gb", "0.1", "--rounds", "2",
         "--json", str(tmp_path / "w.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "w.json").read_text())["read_path"]
    assert res["ratio"] > 0 and res["raw_Bps"] > 0
    assert "owed" in out.stdout or "tokens/s" in out.stdout
