"""The command line a newcomer meets first: ``python -m offload_adam --help``, ``env`` (what a
bug report needs) and the calibration file the commands read."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

import offload_adam
from offload_adam.__main__ import COMMANDS, main
from offload_adam.runtime import calibration


def test_help_lists_each_command_with_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0  # `python -m offload_adam` itself runs in test_packaging (bench)
    out = capsys.readouterr().out
    for name in ("plan", "env", "bench"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 30  # a description, not just the name
    assert "plan --params 13B" in out


def test_unknown_or_missing_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert main([]) == 2
    assert set(COMMANDS) <= set(capsys.readouterr().err.split())


def test_env_reports_what_a_bug_report_needs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    assert main(["env"]) == 0
    rows = dict(line.strip().split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["offload_adam"].startswith(offload_adam.__version__)
    assert rows["SIMD path"].startswith(offload_adam.simd_path())
    assert rows["I/O backend"].startswith(("io_uring", "threads"))
    assert rows["torch"].startswith(torch.__version__) and "CUDA available" in rows["torch"]
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert rows["memlock limit"].startswith("soft " + ("unlimited" if soft == resource.RLIM_INFINITY else ""))
    assert rows["pinned memory allowed"].startswith("at most ")
    assert rows["calibration"] == f"{tmp_path / 'calibration.json'}: none"
    # the I/O backend forced, as the tests do
    monkeypatch.setenv("OFFLOAD_ADAM_IO", "threads")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "I/O backend: threads" in out and "OFFLOAD_ADAM_IO=threads" in out


def test_calibration_file_location_and_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OFFLOAD_ADAM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.path() == tmp_path / "xdg" / "offload_adam" / "calibration.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert calibration.path() == Path.home() / ".cache" / "offload_adam" / "calibration.json"
    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    assert calibration.load() == {}  # absent
    f = tmp_path / "calibration.json"
    data = {"pcie_h2d_gbs": 24, "disk_read_gbs": 3.5, "cpu_matmul_gflops": {"bfloat16": {"1": 20, "64": 600}}, "later": "kept"}
    f.write_text(json.dumps(data))
    got = calibration.load()
    assert got["pcie_h2d_gbs"] == 24.0 and got["cpu_matmul_gflops"]["bfloat16"]["64"] == 600.0 and got["later"] == "kept"
    for bad, what in (("{", "not valid JSON"), ("[1]", "JSON object"), ('{"host_read_gbs": -1}', "host_read_gbs"),
                      ('{"cpu_matmul_gflops": {"bfloat16": 5}}', "cpu_matmul_gflops")):  # fmt: skip
        f.write_text(bad)
        with pytest.raises(ValueError, match=what) as e:
            calibration.load()
        assert str(f) in str(e.value)
