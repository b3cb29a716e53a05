"""``plan --inference`` for mixture-of-experts configs: active parameters per token, expert bytes
and what an expert cache of the host budget holds, from transformers' config classes (the
models built on the meta device: no weights). The counts are checked against the shapes each
architecture's modeling code gives its parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from offload_adam.tools import moe_plan
from offload_adam.tools.plan import main

H, V = 64, 100


def _qwen3() -> transformers.PretrainedConfig:
    # layer 1 a dense MLP (mlp_only_layers): 2 MoE layers of 3
    return transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        hidden_size=H, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=96, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=V, tie_word_embeddings=False,
    )  # fmt: skip


def _mixtral() -> transformers.PretrainedConfig:
    return transformers.MixtralConfig(
        hidden_size=H, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False,
    )  # fmt: skip


def _deepseek_v3() -> transformers.PretrainedConfig:
    # the first layer dense (first_k_dense_replace), one shared expert, grouped routing, MLA attention
    return transformers.DeepseekV3Config(
        hidden_size=H, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, intermediate_size=96, n_group=2, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, vocab_size=V, tie_word_embeddings=False,
    )  # fmt: skip


def test_qwen3_moe_counts_by_hand() -> None:
    f = moe_plan.moe_figures(_qwen3())
    assert f is not None
    expert = 3 * H * 32  # gate, up [I, H] and down [H, I]
    attn = H * 64 + 2 * (H * 32) + 64 * H + 2 * 16  # q, k, v, o, q_norm, k_norm
    dense = 3 * (attn + 2 * H) + 2 * 8 * H + 3 * H * 96 + 2 * V * H + H  # + layer norms, 2 routers, 1 dense MLP, embeddings, head, norm
    assert (f.moe_layers, f.experts, f.top_k, f.expert_params) == (2, 8, 2, expert)
    assert f.dense_params == dense and f.shared_params == 0 and f.embed_params == V * H
    assert f.total_params == dense + 2 * 8 * expert
    assert f.active_params == dense + 2 * 2 * expert
    assert f.active_bytes == 2 * (dense - V * H + H + 2 * 2 * expert)  # the embedding: one row


def test_mixtral_counts_by_hand() -> None:
    f = moe_plan.moe_figures(_mixtral(), bytes_per_param=1.0)
    assert f is not None
    expert = 3 * H * 32
    dense = 2 * (H * 64 + 2 * H * 32 + 64 * H + 2 * H + 4 * H) + 2 * V * H + H
    assert (f.moe_layers, f.experts, f.top_k, f.expert_params, f.dense_params) == (2, 4, 2, expert, dense)
    assert f.active_params == dense + 2 * 2 * expert and f.expert_bytes == expert


def test_deepseek_v3_shared_experts_are_dense_and_dense_layers_have_no_experts() -> None:
    cfg = _deepseek_v3()
    f = moe_plan.moe_figures(cfg)
    assert f is not None
    total, same = moe_plan.config_params(cfg)
    assert same == f and f.total_params == total
    expert = 3 * H * 32
    assert (f.moe_layers, f.experts, f.top_k, f.expert_params) == (2, 8, 2, expert)
    assert f.shared_params == 2 * 3 * H * 32  # one shared expert of width 32 in each MoE layer
    assert f.active_params == total - 2 * (8 - 2) * expert  # every parameter but the unrouted experts'


def test_the_expert_cache_of_a_budget() -> None:
    f = moe_plan.moe_figures(_qwen3())
    assert f is not None
    dense = f.dense_params * 2
    c = f.cache(dense + f.moe_layers * 3 * f.expert_bytes + f.expert_bytes / 2)  # 3 experts per layer and half one
    assert (c.experts_per_layer, c.hit_rate, c.dense_resident_bytes) == (3, 3 / 8, dense)
    assert c.ssd_bytes_per_token == pytest.approx(f.moe_layers * f.top_k * (5 / 8) * f.expert_bytes)
    assert f.cache(10 * f.total_params).ssd_bytes_per_token == 0 and f.cache(10 * f.total_params).experts_per_layer == 8
    none = f.cache(0)  # nothing in RAM: every routed expert and the dense bytes a token reads
    assert none.experts_per_layer == 0 and none.ssd_bytes_per_token == pytest.approx(f.active_bytes)
    with pytest.raises(ValueError, match="budget_bytes must be at least 0"):
        f.cache(-1)


def test_a_dense_model_has_no_moe_figures() -> None:
    cfg = transformers.LlamaConfig(hidden_size=H, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4, vocab_size=V)
    assert moe_plan.moe_figures(cfg) is None


def test_plan_inference_with_a_moe_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _qwen3().save_pretrained(tmp_path)
    f = moe_plan.moe_figures(_qwen3())
    assert f is not None
    assert main(["--inference", "--config", str(tmp_path), "--gpu-gb", "0", "--host-gb", "1", "--reserve-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{f.total_params / 1e9:.2f}B parameters" in out and "taken as 3 equal layers" in out  # from the config
    assert "Mixture of experts (qwen3_moe): 2 of 3 layers with 8 routed experts, 2 routed per token" in out
    assert f"active parameters per token: {f.active_params / 1e9:.2f}B" in out
    assert "8 of 8 experts per layer stay in RAM" in out and "nothing read from the SSD per token" in out
    # a config.json file too; the parameters given win over the config's
    assert main(["--inference", "--config", str(tmp_path / "config.json"), "--params", "7B", "--gpu-gb", "24", "--host-gb", "1"]) == 0
    assert "7.00B parameters" in capsys.readouterr().out


def test_plan_refuses_a_missing_config_and_needs_params_or_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--inference", "--config", str(tmp_path / "nope"), "--gpu-gb", "24", "--host-gb", "64"])
    assert f"--config {tmp_path / 'nope'}: no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--inference", "--config", str(tmp_path), "--gpu-gb", "24", "--host-gb", "64"])
    assert "no config.json in this folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--inference", "--gpu-gb", "24", "--host-gb", "64"])
    assert "--params is required (or --config" in capsys.readouterr().err


def test_the_planner_page_quotes_what_the_moe_plan_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/plan.md's mixture-of-experts lines, for a config of Qwen3-30B-A3B's shape, are what
    this version prints."""
    import re

    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))  # the default bandwidths, as the page says
    transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        norm_topk_prob=True, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "qwen3-30b-a3b")  # fmt: skip
    page = (Path(__file__).resolve().parents[1] / "docs" / "plan.md").read_text()
    (cmd,) = re.findall(r"```\npython -m offload_adam plan (--inference --config [^\n]*)\n```", page)
    (shown,) = re.findall(r"```\n(Mixture of experts.*?)\n```", page, re.S)
    assert main([a if a != "qwen3-30b-a3b/" else str(tmp_path / "qwen3-30b-a3b") for a in cmd.split()]) == 0
    out = capsys.readouterr().out.splitlines()
    for line in shown.splitlines():
        assert line in out, line
