"""``bench --moe``: the harness at its tiny size (every case, the figures' fields, the token
comparison), the GGUF it writes for llama.cpp read back, and the expert figures it takes from an
offload's report. Its figures mean nothing at this size: no timing is asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_adam.tools import moe_bench


@pytest.fixture(autouse=True, scope="module")
def _threads_kept() -> Any:
    """The tiny runs decode on one thread (torch.set_num_threads, process-wide): set back after."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("moe")
    res = moe_bench.run(str(root), tiny=True, isolate=False, threads=1)
    res["root"] = str(root)
    return res


def test_every_case_runs_and_reports_its_figures(tiny_run: dict[str, Any]) -> None:
    cases = {c["case"]: c for c in tiny_run["cases"]}
    llama = moe_bench.llama_cpp_missing() is None
    want = set(moe_bench.CASES) if llama else {c for c in moe_bench.CASES if not c.startswith("e-")}
    assert set(cases) == want
    if not llama:
        assert any("(e) skipped: llama-cpp-python not installed" in n for n in tiny_run["notes"])
    for name, c in cases.items():
        assert "error" not in c, (name, c.get("error"))
        assert len(c["tokens"]) == tiny_run["run"]["tokens"]
        assert c["tokens_s"] > 0 and c["ttft_s"] > 0 and c["peak_rss_bytes"] > 0
        assert c["read_bytes_per_token"] >= 0 and c["bound_by"] in ("disk", "host") and c["bound_tokens_s"] > 0
        for key in ("tokens_vs_eager", "tokens_vs_default"):
            assert c[key] == "same" or c[key].startswith("differ at "), (name, key)
        assert "hit_rate" in c["experts"]
    assert cases["a-eager"]["tokens_vs_eager"] == "same" and cases["a-eager"]["experts_implementation"] == "eager"
    assert cases["a-default"]["tokens_vs_default"] == "same"
    assert cases["a-default"]["experts_implementation"] != "eager"
    # ours from the SSD within a quarter of the weights reads some every token, through O_DIRECT
    assert cases["c-ours-nvme"]["decode_read_bytes"] > 0
    assert cases["c-ours-nvme"]["report"]["storage"] == "nvme"
    m, mach = tiny_run["model"], tiny_run["machine"]
    assert 0 < m["active_bytes_per_token"] < m["checkpoint_bytes"] and mach["disk_read_gbs"] > 0 and mach["host_read_gbs"] > 0
    json.dumps(tiny_run)  # what --json writes


def test_the_checkpoint_is_written_once_and_reused(tiny_run: dict[str, Any]) -> None:
    ckpt = tiny_run["model"]["checkpoint"]
    stamp = {f: os.stat(os.path.join(ckpt, f)).st_mtime_ns for f in os.listdir(ckpt)}
    assert moe_bench.checkpoint(tiny_run["root"], moe_bench.TINY) == ckpt
    assert {f: os.stat(os.path.join(ckpt, f)).st_mtime_ns for f in os.listdir(ckpt)} == stamp
    # the accelerate case's offload folder is removed after it; the offload's NVMe run directory too
    assert not os.path.exists(os.path.join(tiny_run["root"], "accelerate-offload"))
    assert os.listdir(os.path.join(tiny_run["root"], "nvme")) == []


def test_a_case_runs_in_its_own_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line: one case, in a subprocess of its own (its RSS its own), and the JSON."""
    from offload_adam.tools.bench import main

    assert main(["--moe", str(tmp_path), "--tiny", "--moe-cases", "a-eager", "--threads", "1", "--json", str(tmp_path / "m.json")]) == 0
    res = json.loads((tmp_path / "m.json").read_text())
    (c,) = res["cases"]
    assert c["case"] == "a-eager" and res["run"]["isolated"] and "error" not in c
    assert c["peak_rss_bytes"] > 0 and c["tokens_vs_eager"] == "same"
    assert "tokens vs eager" in capsys.readouterr().out


def test_unknown_case_and_no_round_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cases: \['nope'\] unknown"):
        moe_bench.run(str(tmp_path), tiny=True, cases=("nope",))
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        moe_bench.run(str(tmp_path), tiny=True, rounds=0)


def test_rounds_interleave_and_each_case_keeps_its_median_round(tmp_path: Path) -> None:
    res = moe_bench.run(str(tmp_path), tiny=True, cases=("a-eager",), isolate=False, rounds=3, threads=1)
    for c in res["cases"]:
        assert len(c["rounds_tokens_s"]) == 3 and len(c["rounds_ttft_s"]) == 3
        assert c["tokens_s"] == sorted(c["rounds_tokens_s"])[1]
        assert all(t == "same" or t.startswith("differ at ") for t in c["rounds_tokens_vs_eager"])


@pytest.mark.parametrize("qtype", ["bf16", "q8_0"])
def test_gguf_has_llama_cpp_qwen3moe_names_and_shapes(tmp_path: Path, qtype: str) -> None:
    """The GGUF read back with gguf's reader: every tensor llama.cpp's qwen3moe graph loads, by
    gguf's own names for the architecture, in its shapes; bf16 bits equal to the checkpoint's
    (the fused gate_up_proj split into gate then up); Q8_0 within its rounding."""
    import gguf  # type: ignore[import-untyped]
    from safetensors import safe_open

    shape = moe_bench.TINY
    ckpt = moe_bench.checkpoint(str(tmp_path), shape)
    path = moe_bench.write_gguf(ckpt, shape, str(tmp_path / f"m-{qtype}.gguf"), qtype)
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert r.fields["qwen3moe.expert_count"].contents() == shape.experts
    assert r.fields["qwen3moe.expert_used_count"].contents() == shape.top_k
    assert r.fields["qwen3moe.expert_feed_forward_length"].contents() == shape.expert_width
    tensors = {t.name: t for t in r.tensors}
    arch = gguf.MODEL_ARCH.QWEN3MOE
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for name in tensors:
        base = name.removesuffix(".weight")
        assert base.replace(base.split(".")[1], "{bid}", 1) in allowed if base.startswith("blk.") else base in allowed, name
    H, E, I = shape.hidden, shape.experts, shape.expert_width
    expect = {"token_embd.weight": (shape.vocab, H), "output.weight": (shape.vocab, H), "blk.0.ffn_gate_inp.weight": (E, H),
              "blk.0.ffn_gate_exps.weight": (E, I, H), "blk.0.ffn_up_exps.weight": (E, I, H), "blk.0.ffn_down_exps.weight": (E, H, I),
              "blk.0.attn_q.weight": (shape.heads * shape.head_dim, H), "blk.0.attn_k_norm.weight": (shape.head_dim,)}  # fmt: skip
    for name, np_shape in expect.items():
        assert tuple(int(d) for d in reversed(tensors[name].shape)) == np_shape, name  # GGUF lists dims innermost first
    assert len(tensors) == 3 + 12 * shape.layers
    with safe_open(os.path.join(ckpt, "model-00001-of-00005.safetensors"), "pt") as f:
        gate_up = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").float()
    for name, want in (("blk.0.ffn_gate_exps.weight", gate_up[:, :I]), ("blk.0.ffn_up_exps.weight", gate_up[:, I:])):
        t = tensors[name]
        if qtype == "bf16":
            got = torch.from_numpy(t.data.copy()).view(torch.bfloat16).float().reshape(E, I, H)
            assert torch.equal(got, want), name
        else:
            got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(E, I, H)
            assert (got - want).abs().max() <= want.abs().amax(-1, keepdim=True).max() / 127, name


def test_expert_figures_take_the_decode_hit_rate_from_a_report() -> None:
    rep = {
        "weights_bytes": 10, "read_bytes": 99,
        "experts": {"prompt": {"calls": 4, "hits": 0, "misses": 40, "read_bytes": 4000},
                    "decode": {"calls": 8, "hits": 6, "misses_copied": 1, "misses_cpu": 1, "read_bytes": 200}},
    }  # fmt: skip
    f = moe_bench.expert_figures(rep)
    assert f["hit_rate"] == 6 / 8
    assert f["figures"]["experts.decode.read_bytes"] == 200 and "read_bytes" not in f["figures"]
    flat = moe_bench.expert_figures({"expert_hits": 3, "expert_misses": 1})
    assert flat["hit_rate"] == 0.75
    assert moe_bench.expert_figures({"read_bytes": 5, "calls": {"decode": {"cpu": 3}}})["hit_rate"] is None  # layer-granular


def test_accelerate_keeps_within_the_budget_what_ours_keeps_first() -> None:
    model = moe_bench._empty_model(moe_bench.config(moe_bench.TINY))
    total = sum(p.numel() * 2 for p in model.parameters())
    dmap = moe_bench.accelerate_device_map(model, 0.25 * total)
    on_cpu = sum(p.numel() * 2 for n, p in model.named_parameters() if any(
        dmap.get(m) == "cpu" and (n == m or n.startswith(m + ".")) for m in dmap))  # fmt: skip
    assert 0 < on_cpu <= 0.25 * total
    assert dmap["model.embed_tokens"] == "cpu" and "disk" in dmap.values()
    assert set(dmap) >= {f"model.layers.{i}" for i in range(moe_bench.TINY.layers)}


def test_the_resident_model_holds_its_weights_in_ram(tmp_path: Path) -> None:
    """(a) is resident: its weights are copies, not views of the checkpoint's mapping (those the
    page cache drops, and the decode read them back from the SSD: 3.2 GB of page cache and an
    18 s TTFT at the full size). The checkpoint overwritten in place leaves them as they were."""
    shape = moe_bench.TINY
    ckpt = moe_bench.checkpoint(str(tmp_path), shape)
    model = moe_bench._load_resident(ckpt, moe_bench.config(shape))
    for shard in moe_bench._shards(ckpt):
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            f.seek(size // 2)
            f.write(bytes(size - size // 2))
    for n, p in model.named_parameters():
        assert torch.equal(p, moe_bench._tensor(n, p.shape)), n


def test_a_failed_accelerate_load_leaves_no_offload_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate writes the offloaded weights as it loads: a load that fails halfway removes
    them too (a gigabyte-sized folder left under DIR at the full size)."""
    import accelerate  # type: ignore[import-untyped]

    def half(model: Any, ckpt: str, *, offload_folder: str, **kw: Any) -> Any:
        os.makedirs(offload_folder, exist_ok=True)
        Path(offload_folder, "model.layers.0.weight.dat").write_bytes(b"x" * 4096)
        raise RuntimeError("disk full")

    monkeypatch.setattr(accelerate, "load_checkpoint_and_dispatch", half)
    shape = moe_bench.TINY
    spec = {"shape": moe_bench.asdict(shape), "checkpoint": moe_bench.checkpoint(str(tmp_path), shape), "dir": str(tmp_path),
            "prompt": [3, 4, 5], "tokens": 2, "threads": torch.get_num_threads(), "budget_bytes": 1e5}  # fmt: skip
    with pytest.raises(RuntimeError, match="disk full"):
        moe_bench.run_case("d-accelerate-disk", spec)
    assert not (tmp_path / "accelerate-offload").exists()


def test_ours_reads_the_routed_experts_from_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(c) offloads the empty model with checkpoint= (its routed experts too, read one expert at
    a time): never loaded into RAM first, and "loaded" says so; a read-ahead the budget refuses
    falls back to less."""
    import offload_adam

    real = offload_adam.plan_weights
    seen: list[tuple[bool, int]] = []

    def plan(model: Any, *a: Any, checkpoint: Any = None, prefetch: int = 2, **kw: Any) -> Any:
        seen.append((checkpoint is not None, prefetch))
        if prefetch > 1:
            raise ValueError("host_budget_gb: smaller than the ring")
        return real(model, *a, checkpoint=checkpoint, prefetch=prefetch, **kw)

    monkeypatch.setattr(offload_adam, "plan_weights", plan)
    monkeypatch.setattr(moe_bench, "_load_resident", lambda *a: pytest.fail("loaded into RAM first"))
    shape = moe_bench.TINY
    (tmp_path / "nvme").mkdir()
    spec = {"shape": moe_bench.asdict(shape), "checkpoint": moe_bench.checkpoint(str(tmp_path), shape), "dir": str(tmp_path),
            "prompt": [3, 4, 5, 6], "tokens": 3, "threads": torch.get_num_threads(), "budget_bytes": 1 << 30}  # fmt: skip
    out = moe_bench.run_case("c-ours-nvme", spec)
    assert out["loaded"] == "from the checkpoint (checkpoint=)"
    assert out["prefetch"] == 1 and len(out["tokens"]) == 3 and out["report"]["storage"] == "nvme"
    assert seen == [(True, 2), (True, 1)]
    assert os.listdir(tmp_path / "nvme") == []
