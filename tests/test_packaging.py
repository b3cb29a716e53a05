"""Packaging: the abi3 extension, the typed stub, the bench command, the GPU check's dry run."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import offload_adam
from offload_adam import _native


def test_extension_is_abi3_and_typed() -> None:
    assert _native.__file__ is not None
    assert Path(_native.__file__).name.endswith(".abi3.so"), _native.__file__
    pkg = Path(offload_adam.__file__).parent
    assert (pkg / "py.typed").exists()
    assert (pkg / "_native.pyi").exists()


def test_stub_matches_the_extension(tmp_path: Path) -> None:
    """stubtest compares the stub's names, parameters and defaults with the extension's. Imports
    of other modules are skipped (``follow_imports = skip``: torch's ``Tensor`` is then ``Any``
    here): mypy analysing torch took 45 of the test's 50 s; ``make lint``'s mypy checks the
    stub's types against torch's."""
    pytest.importorskip("mypy")
    (tmp_path / "mypy.ini").write_text("[mypy]\nfollow_imports = skip\n")
    cmd = [sys.executable, "-m", "mypy.stubtest", "offload_adam._native", "--mypy-config-file", str(tmp_path / "mypy.ini")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
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
    out = _run_example(["examples/train_gpt.py", *small, "--plot", str(tmp_path / "a.png"), "--save", str(tmp_path / "sums")])
    assert "loss curves agree" in out and (tmp_path / "a.png").stat().st_size > 1000
    assert f"wrote {tmp_path / 'a.png'}: both loss curves on one axis" in out
    assert "torch's is" in out or "offload_adam is" in out  # which one is faster, in words
    assert "No benchmark" in out and "python -m offload_adam bench" in out
    # make generate's job: the saved model built empty, loaded from its checkpoint onto NVMe, on the CPU
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = _run_example(["examples/generate.py", "--sums", str(tmp_path / "sums"), "--storage", "nvme", "--nvme-dir", str(nvme)])
    assert "the real CPU path" in out and "accuracy over 100 sums: " in out and "read from the SSD" in out
    assert "answers identical to the checkpoint loaded into RAM" in out
    assert "block calls: prompt " in out and " on the CPU" in out and "bound: O_DIRECT read rate" in out
    assert "VRAM" not in out and "over 0 forwards" not in out  # (no GPU here; the forwards are counted)
    assert list(nvme.iterdir()) == []
    # the offload path, on CPU parameters through the streaming machinery
    out = _run_example(
        ["examples/train_gpt.py", *small, "--async-step", "--simulate", "--plot", str(tmp_path / "b.png"), "--save", ""]
    )
    assert "offload breakdown per step" in out and "loss curves agree" in out


def test_gpu_benchmark_script_smoke_on_cpu(tmp_path: Path) -> None:
    tiny = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "50", "--ctx", "16"]
    out = _run_example([".ci/gpu_bench.py", *tiny, "--batch", "2", "--steps", "3", "--json", str(tmp_path / "g.json")])
    res = json.loads((tmp_path / "g.json").read_text())
    assert {"offload_adam", "offload_adam async_step"} <= set(res["results"])
    assert "cpu_step_s" in res["results"]["offload_adam"]
    assert "step" in out


def _tiny_checkpoint(where: Path) -> None:
    """A 2-layer Llama saved as an HF folder, with a word-level tokenizer of its 500 ids (built
    here: nothing is downloaded)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "the", "capital", "of", "france", "is"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(500 - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(where)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=320, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=500, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(where)


def test_generate_example_runs_and_matches_the_resident_model(tmp_path: Path) -> None:
    small = ["--tokens", "6"]
    out = _run_example(["examples/generate.py", "--layers", "2", "--d-model", "128", "--vocab", "500", "--prompt-len", "8", *small])
    assert "the real CPU path" in out and "tokens identical" in out and "tokens/s" in out and "(random ids)" in out
    assert "VRAM" not in out and "over 0 forwards" not in out  # (it printed a VRAM peak without a GPU)
    # an HF folder with a tokenizer: text in, text out, the weights read from the checkpoint onto NVMe
    _tiny_checkpoint(tmp_path / "ckpt")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = _run_example(
        ["examples/generate.py", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "the capital of france is", *small,
         "--storage", "nvme", "--nvme-dir", str(nvme), "--prefetch", "1"]  # fmt: skip
    )
    assert "(tokenized)" in out and "prompt 1x5 tokens" in out
    assert "tokens identical" in out and "read from the SSD" in out
    assert "output: 'the capital of france is w" in out  # the prompt decoded, then the random model's words
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


def test_weights_bench_simulated_runs_its_gpu_part_and_ours_decodes_the_resident_models_tokens(tmp_path: Path) -> None:
    """--simulate: (b) at tiny sizes on the simulated device (the GPU check's dry run): the model
    resident and ours must run (a peer may not: reported), ours' greedy tokens are the resident
    model's, and no memory figure is made up off CUDA."""
    out = subprocess.run(
        [sys.executable, "-m", "offload_adam", "bench", "--weights", str(tmp_path), "--weights-gb", "0.02", "--rounds", "1",
         "--prefetch", "1", "--simulate", "--json", str(tmp_path / "w.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    g = json.loads((tmp_path / "w.json").read_text())["gpu"]
    ours, resident = g["offload_adam offload_weights"], g["resident on the GPU, plain torch"]
    assert ours["same_tokens"] and resident["same_tokens"]
    assert ours["tokens_per_s"] > 0 and ours["peak_gpu_bytes"] is None and resident["peak_gpu_bytes"] is None
    assert "the simulated device" in out.stdout


def test_weights_bench_raises_when_ours_fails_where_a_peer_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours failing in (b) is an error, not a peer "not measured": the headline figure was lost
    silently that way (a crash at the first forward on a GPU read as a missing row)."""
    import offload_adam.weights
    from offload_adam.tools import benchdev, weights_bench

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("ours broke")

    monkeypatch.setattr(offload_adam.weights, "offload_weights", broken)
    with pytest.raises(RuntimeError, match="ours broke"), benchdev.device(simulate=True) as dev:
        weights_bench.gpu_contenders(dev, layers=2, d=128, vocab=512, tokens=2, prompt=4, prefetch=1, rounds=1)


def _example(name: str) -> Any:
    """An example script imported as a module (its main(argv) runs in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _losses(out: str) -> tuple[float, float]:
    line = next(line for line in out.splitlines() if line.startswith("loss: first"))
    first, last = line.split("first ")[1].split(",")[0], line.split("last ")[1].split(" ")[0]
    return float(first), float(last)


def test_hf_finetune_example_trains_with_streamed_weights_and_offloaded_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ft = _example("finetune_hf")
    # a random Llama from a config, the counting task, state in RAM
    assert ft.main(["--layers", "2", "--d-model", "128", "--vocab", "64", "--steps", "16", "--batch", "4", "--seq", "16", "--lr", "3e-3"]) == 0
    out = capsys.readouterr().out
    first, last = _losses(out)
    assert "simulated device" in out and "5 blocks, 5 streamed" in out and last < 0.8 * first  # (repr(h))
    # an HF folder built empty and filled by offload_weights(checkpoint=), its tokenizer on a text
    # file; compact state on NVMe, checkpointing and activations offloaded; saved after
    _tiny_checkpoint(tmp_path / "ckpt")
    (tmp_path / "t.txt").write_text(" ".join(["the capital of france is"] * 40))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = ["--model", str(tmp_path / "ckpt"), "--text", str(tmp_path / "t.txt"), "--steps", "8", "--batch", "2", "--seq", "16",
            "--offload", "nvme", "--nvme-dir", str(nvme), "--state-dtype", "uint8", "--master-dtype", "bfloat16",
            "--checkpointing", "--offload-activations", "--save", str(tmp_path / "out")]  # fmt: skip
    assert ft.main(args) == 0
    out = capsys.readouterr().out
    first, last = _losses(out)
    assert "from " + str(tmp_path / "ckpt") in out and "storage nvme: RAM" in out and "moments 8-bit blocks" in out and "NVMe: " in out and last < first  # (opt.summary())
    assert (tmp_path / "out" / "model.safetensors").exists() and list(nvme.iterdir()) == []


# -- the GPU check's dry run ------------------------------------------------------------------------


def _gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``GPU_CHECK_DRY=1 .ci/gpu_check.sh`` with this interpreter first on PATH (the script runs
    python3), results under ``out``."""
    root = Path(__file__).resolve().parents[1]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        ["bash", ".ci/gpu_check.sh"], cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": path, "GPU_CHECK_DRY": "1", "OUT": str(out), **env},
    )  # fmt: skip


def test_gpu_check_dry_run_runs_its_preflight_and_the_placement_step_on_the_simulated_device(tmp_path: Path) -> None:
    """The GPU check without a GPU (GPU_CHECK_DRY=1): the preflight on the installed package and
    a stamp of the tree, the CUDA check skipped; the placement bench (the newest step; .ci/run
    runs every step) on the simulated device, each placement in bf16 (and int8 with torchao), its
    results folded into the four files of $OUT."""
    out = tmp_path / "out"
    r = _gpu_check(out, GPU_CHECK_STEPS="placement")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.txt", "env.txt", "tests.txt"]
    env = (out / "env.txt").read_text()
    assert "DRY RUN" in env and "dry run: no CUDA wanted" in env and "wheel stamp" in env and "offload_adam from" in env
    assert re.search(r"^placement +ok", env, re.M) and "every step ok" in env
    res = json.loads((out / "bench.json").read_text())
    assert res["weights"] is None and res["optimizer"] is None and len(res["steps"]) == 1
    dtypes = ["bf16", "int8"] if importlib.util.find_spec("torchao") else ["bf16"]
    cases = res["placement"]["cases"]
    assert [(c["dtype"], c["placement"]) for c in cases] == [(d, p) for d in dtypes for p in ("stream", "cpu", "auto")]
    for c in cases:
        assert c["ttft_s"] > 0 and c["tokens_per_s"] > 0 and c["peak_gpu_bytes"] is None and isinstance(c["same_tokens"], bool)
        assert 0 < c["gpu_resident_bytes"] < res["placement"][f"{c['dtype']}_weights_bytes"]
        if c["placement"] == "stream":
            assert c["calls"]["decode"]["stream"] > 0 and c["h2d_bytes"] > 0 and c["same_tokens"]
        if c["placement"] == "cpu":
            assert c["calls"]["prompt"]["stream"] == c["calls"]["decode"]["stream"] == 0
            assert c["calls"]["decode"]["cpu"] > 0 and c["hidden_bytes"] > 0
    assert "GPU placement bench" in (out / "bench.txt").read_text()


def test_gpu_check_a_step_out_of_its_cap_fails_the_check_and_the_next_steps_run(tmp_path: Path) -> None:
    """A step that runs out of its cap (DEADLINE_S=4 leaves the tests 1 s) is recorded as timed
    out, the steps after it still run, and the check exits non-zero with bench.json written."""
    out = tmp_path / "out"
    r = _gpu_check(out, GPU_CHECK_STEPS="tests csan", DEADLINE_S="4")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    env = (out / "env.txt").read_text()
    assert re.search(r"^tests +TIMED OUT \(cap 1 s\)", env, re.M), env
    assert re.search(r"^csan +skipped", env, re.M) and "FAILED" in env
    assert json.loads((out / "bench.json").read_text())["steps"][0].startswith("tests ")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the preflight of a machine without CUDA")
def test_gpu_check_without_cuda_stops_at_its_preflight(tmp_path: Path) -> None:
    """Not a dry run, on a machine without CUDA (or without a wheel in dist/): the preflight fails
    at once, saying why, and no step runs."""
    out = tmp_path / "out"
    r = _gpu_check(out, GPU_CHECK_DRY="0")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    env = (out / "env.txt").read_text()
    assert "PREFLIGHT FAILED" in env + r.stderr and "--- steps" not in env
    assert (out / "tests.txt").read_text() == "" and (out / "bench.txt").read_text() == ""
