"""The mixture-of-experts figures of ``python -m offload_adam plan --inference --config DIR``
(and of ``bench --moe``'s bounds): from a transformers config alone, no weights.

The model is built on the meta device from the config (transformers' own classes: no bytes are
allocated) and its parameters are sorted by what a decode token reads:

- routed experts: the fused experts modules (the classes decorated with transformers'
  ``use_experts_implementation``, whose parameters lead with the expert dimension E), or a
  ``ModuleList`` named ``experts`` of E equal modules; one expert's parameters are the module's
  parameters over E;
- dense: everything else (embeddings, attention, norms, the routers, shared experts, the dense MLP
  layers such as DeepSeek-V3's first three); ``shared``: the shared experts among them.

Per decode token at batch 1 the model reads its dense parts (of the input embedding only one row)
and ``top_k`` experts in each MoE layer: the active bytes. An expert cache of a host budget holds
the dense parts first (every token reads them), then the same number of experts in every MoE
layer; under a uniform routing each routed expert is then a hit with probability
``cached / experts`` whatever the cache's policy (a cache of c of E equally likely items), so the
expected SSD bytes per token are ``moe_layers * top_k * (1 - cached / experts)`` experts, plus the
dense bytes the budget does not hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "top_k")


@dataclass(frozen=True)
class MoeCache:
    """What an expert cache of ``budget_bytes`` in host RAM holds (see the module's documentation)."""

    budget_bytes: int
    dense_resident_bytes: int  # of the dense parts, what the budget holds (they come first)
    experts_per_layer: int  # routed experts of each MoE layer kept in RAM
    hit_rate: float  # of a routed expert at a uniform routing: experts_per_layer / experts
    ssd_bytes_per_token: float  # expected: the missed experts and the dense bytes not held


@dataclass(frozen=True)
class MoeFigures:
    """Parameters of a transformers MoE model by what a decode token reads (counts, not bytes,
    except where named; ``bytes_per_param`` turns them into bytes)."""

    model_type: str
    layers: int
    moe_layers: int
    experts: int  # routed experts per MoE layer
    top_k: int  # routed per token
    hidden: int
    total_params: int
    dense_params: int  # every parameter that is not a routed expert's
    shared_params: int  # of dense: the shared experts'
    embed_params: int  # of dense: the input embedding (a token reads one row of it; 0 when tied to the head)
    expert_params: int  # one routed expert
    bytes_per_param: float = 2.0

    @property
    def routed_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters per token as model cards count them: the dense parts and top-k experts per
        MoE layer (shared experts among the dense parts)."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.bytes_per_param

    @property
    def dense_read_bytes(self) -> float:
        """The dense bytes a decode token reads: the input embedding is one row."""
        return (self.dense_params - self.embed_params + (self.hidden if self.embed_params else 0)) * self.bytes_per_param

    @property
    def active_bytes(self) -> float:
        """Bytes a decode token reads at batch 1: the dense ones and its ``top_k`` experts per MoE layer."""
        return self.dense_read_bytes + self.moe_layers * self.top_k * self.expert_bytes

    def cache(self, budget_bytes: float) -> MoeCache:
        """An expert cache of ``budget_bytes`` of host RAM: the dense parts first, then as many
        experts per MoE layer as fit, the same in each layer."""
        if not budget_bytes >= 0:
            raise ValueError(f"budget_bytes must be at least 0, got {budget_bytes!r}")
        dense = self.dense_params * self.bytes_per_param
        held = min(float(budget_bytes), dense)
        left = float(budget_bytes) - dense
        per_layer = 0
        if left > 0 and self.moe_layers and self.expert_bytes:
            per_layer = min(self.experts, int(left // (self.moe_layers * self.expert_bytes)))
        hit = per_layer / self.experts if self.experts else 1.0
        dense_missed = max(self.dense_read_bytes * (1 - held / dense), 0.0) if dense else 0.0
        ssd = dense_missed + self.moe_layers * self.top_k * (1 - hit) * self.expert_bytes
        return MoeCache(int(budget_bytes), int(held), per_layer, hit, ssd)


def _top_k(config: Any) -> int | None:
    for key in TOP_K_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _meta_model(config: Any) -> Any:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 (any model transformers cannot build: said with its config's type)
        raise ValueError(f"config: transformers cannot build a causal LM of model_type {getattr(config, 'model_type', '?')!r} ({type(e).__name__}: {e})") from e


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, module, E) of each routed-experts module: a fused one (decorated by
    ``use_experts_implementation``: it has the layout flags) or a ``ModuleList`` named ``experts``."""
    out = []
    for name, m in model.named_modules():
        if "shared_expert" in name:
            continue
        own = list(m.parameters(recurse=False))
        if hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and own:
            out.append((name, m, int(own[0].shape[0])))
        elif isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts" and len(m) > 1:
            out.append((name, m, len(m)))
    return out


def config_params(config: Any) -> tuple[int, MoeFigures | None]:
    """The parameters of ``config``'s model (tied ones once) and its MoE figures (None: no
    routed experts), the model built once on the meta device."""
    model = _meta_model(config)
    return sum(p.numel() for p in model.parameters()), _figures(config, model, 2.0)


def moe_figures(config: Any, *, bytes_per_param: float = 2.0) -> MoeFigures | None:
    """The figures of a transformers ``config`` (a ``PretrainedConfig``), or None when its model
    has no routed experts. ``bytes_per_param``: of the weights as stored (2 for bf16)."""
    if not bytes_per_param > 0:
        raise ValueError(f"bytes_per_param must be positive, got {bytes_per_param!r}")
    return _figures(config, _meta_model(config), bytes_per_param)


def _figures(config: Any, model: Any, bytes_per_param: float) -> MoeFigures | None:
    mods = _experts_modules(model)
    top_k = _top_k(config)
    if not mods or top_k is None:
        return None
    experts = {e for _, _, e in mods}
    if len(experts) != 1:
        raise ValueError(f"config: MoE layers with different expert counts ({sorted(experts)}) are not planned")
    (e,) = experts
    per = {sum(p.numel() for p in m.parameters()) // e for _, m, _ in mods}
    if len(per) != 1:
        raise ValueError(f"config: MoE layers with different expert sizes ({sorted(per)} parameters) are not planned")
    (expert_params,) = per
    total = sum(p.numel() for p in model.parameters())  # tied parameters once
    routed = len(mods) * e * expert_params
    shared = sum(p.numel() for n, p in model.named_parameters() if "shared_expert" in n)
    emb = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    tied = emb is not None and out_emb is not None and emb.weight is out_emb.weight
    embed = 0 if emb is None or tied else emb.weight.numel()
    return MoeFigures(
        model_type=str(getattr(config, "model_type", type(config).__name__)), layers=int(getattr(config, "num_hidden_layers", len(mods))),
        moe_layers=len(mods), experts=e, top_k=min(top_k, e), hidden=int(config.hidden_size), total_params=total,
        dense_params=total - routed, shared_params=shared, embed_params=embed, expert_params=expert_params,
        bytes_per_param=bytes_per_param,
    )  # fmt: skip


def load_config(path: str) -> Any:
    """A transformers config from a ``config.json`` file or a folder holding one (no download)."""
    import os

    import transformers

    if os.path.isfile(path):
        import json

        with open(path) as f:
            d = json.load(f)
        if "model_type" not in d:
            raise ValueError(f"--config {path}: no model_type in it (a transformers config.json has one)")
        return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--config {path}: no config.json in this folder")
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    raise ValueError(f"--config {path}: no such file or folder")


def describe(f: MoeFigures, *, budget_bytes: float | None, disk_gbs: float, host_gbs: float) -> list[str]:
    """The plan's lines for ``f``; with ``budget_bytes`` (host RAM for the weights), the expert cache's."""
    GB = 1 << 30
    lines = [
        f"Mixture of experts ({f.model_type}): {f.moe_layers} of {f.layers} layers with {f.experts} routed experts, "
        f"{f.top_k} routed per token" + (f", shared experts {f.shared_params / 1e9:.2f}B parameters" if f.shared_params else ""),
        f"  active parameters per token: {f.active_params / 1e9:.2f}B of {f.total_params / 1e9:.2f}B "
        f"({f.active_params / f.total_params:.1%}): dense {f.dense_params / 1e9:.2f}B (embeddings, attention, norms, routers, "
        f"shared experts, dense MLPs) + {f.top_k} x {f.moe_layers} experts of {f.expert_params / 1e6:.2f}M",
        f"  expert bytes: {f.expert_bytes / 2**20:.1f} MiB each, {f.routed_params * f.bytes_per_param / GB:.1f} GiB all routed "
        f"experts; dense {f.dense_params * f.bytes_per_param / GB:.1f} GiB",
        f"  a decode token reads {f.active_bytes / GB:.2f} GiB (the input embedding one row): from RAM at most "
        f"{host_gbs * 1e9 / f.active_bytes:.2f} tokens/s at {host_gbs:g} GB/s",
    ]
    if budget_bytes is not None:
        c = f.cache(budget_bytes)
        head = (
            f"  an expert cache in {budget_bytes / GB:.1f} GiB of host RAM (the dense parts first: {c.dense_resident_bytes / GB:.1f} GiB): "
            f"{c.experts_per_layer} of {f.experts} experts per layer stay in RAM"
        )
        if c.ssd_bytes_per_token:
            lines.append(
                f"{head}; at a uniform routing a routed expert hits {c.hit_rate:.0%} of the time, and a token reads "
                f"{c.ssd_bytes_per_token / GB:.2f} GiB from the SSD (at most {disk_gbs * 1e9 / c.ssd_bytes_per_token:.2f} tokens/s "
                f"at {disk_gbs:g} GB/s)"
            )
        else:
            lines.append(f"{head}: the whole model fits, storage=\"cpu\" (nothing read from the SSD per token)")
    return lines


def hit_rate_words(rate: float | None) -> str:
    return "n/a" if rate is None or math.isnan(rate) else f"{rate:.0%}"
