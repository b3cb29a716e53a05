"""The command line a newcomer meets first: ``python -m offload_adam --help``, ``env`` (what a
bug report needs) and the calibration file the commands read."""

from __future__ import annotations

import json
import os
import resource
import stat
from pathlib import Path
from typing import Any

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
    assert rows["calibration"] == f"{tmp_path / f'calibration-{os.getuid()}.json'}: none"
    # the I/O backend forced, as the tests do
    monkeypatch.setenv("OFFLOAD_ADAM_IO", "threads")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "I/O backend: threads" in out and "OFFLOAD_ADAM_IO=threads" in out


def _measurement(**kw: Any) -> calibration.Measurement:
    """A measurement as costs.measure makes one, of given figures and conditions (a quiet
    machine by default)."""
    base: dict[str, Any] = dict(
        figures={"host_read_gbs": 20.0, "cpu_matmul_gflops": {"bfloat16": {"1": 40.0, "64": 600.0}}},
        time="2026-12-05T10:11:12+00:00", cpu=calibration.cpu_model(), cores=2, load_avg=0.5, spread=0.05, repeats=5,
        by="test", version="0",
    )  # fmt: skip
    return calibration.Measurement(**{**base, **kw})


def test_calibration_file_location_and_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One file per user (the uid in its name), under the cache directory; a file that is not a
    format-2 calibration is an error naming it."""
    name = f"calibration-{os.getuid()}.json"
    monkeypatch.delenv("OFFLOAD_ADAM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.path() == tmp_path / "xdg" / "offload_adam" / name
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert calibration.path() == Path.home() / ".cache" / "offload_adam" / name
    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    assert calibration.load() == {} and calibration.measurements() == []  # absent
    f = tmp_path / name
    m = _measurement(figures={"pcie_h2d_gbs": 24, "disk_read_gbs": 3.5, "cpu_matmul_gflops": {"bfloat16": {"1": 20, "64": 600}}, "later": "kept"})
    f.write_text(json.dumps({"format": 2, "measurements": [m.to_json()]}))
    got = calibration.load()
    assert got["pcie_h2d_gbs"] == 24.0 and got["cpu_matmul_gflops"]["bfloat16"]["64"] == 600.0 and got["later"] == "kept"
    quiet = _measurement().to_json()
    for bad, what in (("{", "not valid JSON"), ("[1]", "JSON object"), ('{"host_read_gbs": 30}', "not a calibration of format 2"),
                      (json.dumps({"format": 2, "measurements": [{**quiet, "figures": {"host_read_gbs": -1}}]}), "host_read_gbs"),
                      (json.dumps({"format": 2, "measurements": [{**quiet, "figures": {"cpu_matmul_gflops": {"bfloat16": 5}}}]}), "cpu_matmul_gflops"),
                      (json.dumps({"format": 2, "measurements": [{"figures": {}}]}), "lacks time, cpu, cores, load_avg, spread")):  # fmt: skip
        f.write_text(bad)
        with pytest.raises(ValueError, match=what) as e:
            calibration.load()
        assert str(f) in str(e.value)


def test_a_stored_calibration_says_when_on_which_cpu_and_under_what_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The file records the time, the CPU's model string, the cores, the load average, the spread
    of the repeats and the format's version; it is written atomically (a temporary file in the
    same folder, then os.replace), 0600 in a 0700 folder of its own; a later measurement keeps the
    earlier one's other figures, and those of another CPU are never used."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(cache))
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((str(a), str(b))), real_replace(a, b))[1])
    first = _measurement(figures={"host_read_gbs": 20.0, "disk_read_gbs": 2.5})
    where = calibration.store(first)
    assert where == cache / f"calibration-{os.getuid()}.json" and len(replaced) == 1
    tmp, dst = replaced[0]
    assert Path(tmp).parent == cache and dst == str(where) and not Path(tmp).exists()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and stat.S_IMODE(where.stat().st_mode) == 0o600
    data = json.loads(where.read_text())
    assert data["format"] == 2
    rec = data["measurements"][0]
    assert rec["time"] == "2026-12-05T10:11:12+00:00" and rec["cpu"] == calibration.cpu_model() and rec["cpu"]
    assert rec["load_avg"] == 0.5 and rec["spread"] == 0.05 and rec["cores"] == 2 and rec["repeats"] == 5
    assert rec["figures"] == {"host_read_gbs": 20.0, "disk_read_gbs": 2.5}
    # a later measurement of the host read: the disk's figure stays, with its own record
    calibration.store(_measurement(figures={"host_read_gbs": 30.0}, time="2026-12-06T08:00:00+00:00"))
    cal = calibration.read()
    assert cal.figures == {"host_read_gbs": 30.0, "disk_read_gbs": 2.5}
    rate, m = cal.rate("disk_read_gbs")  # type: ignore[misc]
    assert rate == 2.5 and m.time == first.time and cal.source["host_read_gbs"].time.startswith("2026-12-06")
    # another CPU's measurement (a $HOME shared between machines) is not used
    data = json.loads(where.read_text())
    data["measurements"].append({**_measurement(figures={"host_read_gbs": 1.0}).to_json(), "cpu": "Some Other CPU"})
    where.write_text(json.dumps(data))
    cal = calibration.read()
    assert cal.figures["host_read_gbs"] == 30.0 and [m.cpu for m in cal.other] == ["Some Other CPU"]


@pytest.mark.parametrize("load, spread, why", [
    (2.5, 0.05, r"the load average, 2.50, was above the 2 cores"),
    (0.5, 0.35, r"its repeats spread by 35%, above 20%"),
])  # fmt: skip
def test_a_calibration_taken_under_load_is_not_stored(load: float, spread: float, why: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    calibration.store(_measurement())
    before = calibration.path().read_bytes()
    with pytest.raises(calibration.Unsettled, match=why):
        calibration.store(_measurement(load_avg=load, spread=spread, figures={"host_read_gbs": 1.0}))
    assert calibration.path().read_bytes() == before and os.listdir(tmp_path) == [calibration.path().name]


def test_measure_records_the_load_average_and_the_spread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """costs.measure takes the load average as it begins (os.getloadavg) and the spread of each
    figure's repeats: a machine under load is measured, and refused at the store."""
    from offload_adam.runtime import costs

    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 1.5, 1.0, 1.0))
    m = costs.measure(dtypes=(torch.float32,), quick=True, rounds=3, by="the test")
    assert m.load_avg == cores + 1.5 and m.cores == cores and m.repeats == 3 and m.by == "the test"
    assert m.cpu == calibration.cpu_model() and m.time.endswith("+00:00") and 0 <= m.spread < 1
    assert set(m.figures) == {"host_read_gbs", "cpu_matmul_gflops"} and set(m.figures["cpu_matmul_gflops"]["float32"]) == {"1", "64"}
    assert calibration.unsettled(m) is not None
    with pytest.raises(calibration.Unsettled, match="load average"):
        calibration.store(m)
    assert not calibration.path().exists()
    assert calibration.spread([10.0, 10.0, 9.9, 5.0, 10.0]) == 0.0  # one slow repeat is not contention
    assert calibration.spread([10.0, 6.0, 6.0, 6.0, 9.0]) == pytest.approx(0.4)


def test_calibrate_says_what_it_measured_and_stores_only_a_quiet_measurement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    from offload_adam.runtime import costs

    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    busy = _measurement(load_avg=7.5)
    monkeypatch.setattr(costs, "measure", lambda **kw: busy)
    assert main(["calibrate"]) == 1
    out = capsys.readouterr()
    assert busy.describe() in out.out and "load average 7.50" in out.out
    assert f"not stored in {calibration.path()}: the load average, 7.50, was above the 2 cores" in out.err
    assert not calibration.path().exists()
    quiet = _measurement()
    monkeypatch.setattr(costs, "measure", lambda **kw: quiet)
    assert main(["calibrate", "--dry-run"]) == 0
    assert "not stored (--dry-run)" in capsys.readouterr().out and not calibration.path().exists()
    assert main(["calibrate"]) == 0
    assert f"stored in {calibration.path()}" in capsys.readouterr().out
    assert calibration.measurements() == [quiet]
    assert main(["env"]) == 0
    assert f"calibration: {calibration.path()}: cpu_matmul_gflops, host_read_gbs {quiet.describe()}" in capsys.readouterr().out


def test_calibrate_says_what_it_measures_as_it_goes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """calibrate printed nothing until its figures (a minute for the full run): each measurement
    is now said on stderr before it runs, and its result after; stdout keeps the figures."""
    from offload_adam.runtime import costs

    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "host_read_rates", lambda nbytes, rounds: [10.0, 11.0])
    monkeypatch.setattr(costs, "cpu_matmul_rates", lambda dt, rows, d, rounds: [5.0, 5.0])
    assert main(["calibrate", "--quick", "--dry-run"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["measuring the host memory's read bandwidth (128 MiB, 5 rounds) ...", "  11.00 GB/s (best of 2, spread 5%)"]
    assert "measuring the CPU's bfloat16 matmul of 1 row by 2048x2048 (5 rounds) ..." in err
    assert "measuring the CPU's float32 matmul of 64 rows by 2048x2048 (5 rounds) ..." in err


def test_bench_charts_draws_the_json_of_a_bench_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench-charts draws the speedups and the step times of the bench's JSON into PNGs; a file
    that is not a bench's JSON is refused naming it."""
    pytest.importorskip("matplotlib")
    run = [
        {"case": "4000 tensors x 10k fp32", "params": 40_000_000, "rounds": 3, "baseline": "torch AdamW(fused=True)", "speedup": 1.83,
         "offload_adam": {"median_s": 0.0283, "ratio_peer_over_ours": 1.0},
         "torch AdamW(fused=True)": {"median_s": 0.0519, "ratio_peer_over_ours": 1.83}},
        {"case": "1 tensor x 100M fp32", "params": 100_000_000, "rounds": 3, "baseline": "torch AdamW(fused=True)", "speedup": 0.99,
         "offload_adam": {"median_s": 0.0626, "ratio_peer_over_ours": 1.0},
         "torch AdamW(fused=True)": {"median_s": 0.0616, "ratio_peer_over_ours": 0.99}},
    ]  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps(run))
    assert main(["bench-charts", str(tmp_path / "b.json"), "--out", str(tmp_path / "img")]) == 0
    out = capsys.readouterr().out
    for name in ("bench-speedup.png", "bench-times.png"):
        png = tmp_path / "img" / name
        assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    (tmp_path / "bad.json").write_text(json.dumps({"read_path": {}}))
    assert main(["bench-charts", str(tmp_path / "bad.json"), "--out", str(tmp_path / "img2")]) == 1
    assert "not the JSON of python -m offload_adam bench --json" in capsys.readouterr().err
    assert not (tmp_path / "img2").exists()
