"""Routed experts filled from a checkpoint (issue 34): ``offload_weights`` of a model built with
``init_empty_weights`` and ``checkpoint=`` stores each expert's unit straight from the file, one
expert at a time, from the fused tensors of the model's own state dict or from the per-expert
tensors of hub checkpoints (``experts.{e}.gate_proj.weight``..., Mixtral's ``w1``/``w3``/``w2``
under ``block_sparse_moe``), as transformers' conversion mapping fuses them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload_adam
from offload_adam.weights import checkpoint as ckmod
from offload_adam.weights import expertstore

from test_moe import MODELS, experts_modules, host_budget, model, prompt, reference, run, same, unit_bytes
from test_weights import nvme_dir  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from safetensors.torch import save_file  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def per_expert(sd: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """``sd`` with each fused experts tensor split per expert as hub checkpoints store them:
    gate;up (the first half the gate) and down, each expert's ``nn.Linear`` weight; Mixtral's
    named w1 (gate), w3 (up), w2 (down) under ``block_sparse_moe``."""
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith(".experts.gate_up_proj"):
            base, half = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.{names[0]}.weight"] = v[e, :half].clone()
                out[f"{base}{e}.{names[1]}.weight"] = v[e, half:].clone()
        elif k.endswith(".experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.{names[2]}.weight"] = v[e].clone()
        else:
            out[k] = v.clone()
    if arch == "mixtral":
        out = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in out.items()}
    return out


def write(m: torch.nn.Module, arch: str, layout: str, folder: Any) -> str:
    """``m``'s weights as a checkpoint folder (``save_pretrained``'s names, one file), with its
    config: ``layout`` "fused" (the model's own state dict) or "per_expert"."""
    sd = {k: v.detach().contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight" or not m.config.tie_word_embeddings}
    if layout == "per_expert":
        sd = per_expert(sd, arch)
    folder.mkdir(exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    m.config.save_pretrained(str(folder))
    return str(folder)


def empty(arch: str) -> torch.nn.Module:
    with accelerate.init_empty_weights():
        m = MODELS[arch]().to(torch.bfloat16).eval()
    m.set_experts_implementation("eager")
    return m


CASES = [
    ("qwen3moe", "fused", "cpu"),
    ("qwen3moe", "per_expert", "nvme"),
    ("mixtral", "per_expert", "cpu"),
    ("mixtral", "fused", "nvme"),
    ("deepseek_v3", "per_expert", "nvme"),
]


@pytest.mark.parametrize("arch,layout,storage", CASES)
def test_experts_are_filled_from_a_checkpoint_one_expert_at_a_time(
    arch: str, layout: str, storage: str, nvme_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty model offloaded with checkpoint=: logits and 24 greedy tokens bitwise the model
    loaded normally (eager experts loop); every read of the experts is one expert's bytes, and
    the SSD's units are staged one at a time (never a fused tensor, nor a layer's experts)."""
    ck = write(model(arch), arch, layout, tmp_path / "ck")
    reads: list[int] = []
    staged: list[int] = []
    read_pieces = ckmod.Checkpoint.read_pieces

    def counted(self: Any, pieces: Any, unit: torch.Tensor) -> None:
        reads.append(sum(n for _, _, n, _ in pieces))
        read_pieces(self, pieces, unit)

    aligned_empty = expertstore.aligned_empty

    def staging(n: int, dtype: torch.dtype) -> torch.Tensor:
        staged.append(n)
        return aligned_empty(n, dtype)

    monkeypatch.setattr(ckmod.Checkpoint, "read_pieces", counted)
    monkeypatch.setattr(expertstore, "aligned_empty", staging)
    m = empty(arch)
    kw: dict[str, Any] = {"nvme_dir": nvme_dir, "host_budget_gb": host_budget(model(arch), nvme_dir, "small")} if storage == "nvme" else {}
    h = offload_adam.offload_weights(m, device="cpu", storage=storage, checkpoint=ck, native_matmul=False, **kw)
    layers = experts_modules(m)
    experts = sum(e.num_experts for e in layers)
    one = unit_bytes(m)
    assert len(reads) == experts and max(reads) <= one  # one expert at a time
    if storage == "nvme":
        assert staged and max(staged) <= one  # a unit staged, never a layer's experts
    assert same(run(m, prompt()), reference(arch))
    h.close()


def test_the_per_expert_layout_is_what_transformers_loads(tmp_path: Any) -> None:
    """The test's per-expert checkpoint is what transformers' conversion mapping fuses back to
    the model's tensors (gate first): from_pretrained loads it bitwise."""
    for arch in ("qwen3moe", "mixtral"):
        m = model(arch)
        folder = write(m, arch, "per_expert", tmp_path / arch)
        got = type(m).from_pretrained(folder, dtype=torch.bfloat16)
        want = m.state_dict()
        for k, v in got.state_dict().items():
            assert torch.equal(v, want[k]), (arch, k)


def test_a_checkpoint_missing_an_expert_is_refused_before_anything_changes(tmp_path: Any) -> None:
    m = model("qwen3moe")
    sd = per_expert({k: v.detach() for k, v in m.state_dict().items()}, "qwen3moe")
    del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(tmp_path / "x.safetensors"))
    e = empty("qwen3moe")
    before = {n: (p, p.device.type) for n, p in e.named_parameters()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        offload_adam.offload_weights(e, device="cpu", checkpoint=str(tmp_path / "x.safetensors"))
    assert e.config._experts_implementation == "eager"
    for n, p in e.named_parameters():
        assert p is before[n][0] and p.device.type == "meta", n
