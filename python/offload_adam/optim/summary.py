"""What an optimizer of offload_adam holds, in words: ``repr(optimizer)`` (one line: storage,
parameters, the state's dtypes and bytes) and ``optimizer.summary()`` (a line per subject: the
parameters and where they are, the state's dtypes, the bytes of each tier, the options that
change the step). Both read the optimizer's configuration and ``memory_report()`` only; a tier it
does not use is left out (no GPU line without parameters on a GPU, no NVMe line with
``storage="cpu"``)."""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.units import size


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _counts(opt: Any) -> tuple[int, int, int, int]:
    """(tensors, elements, of which tensors on an accelerator, elements on an accelerator)."""
    ps = [p for g in opt.param_groups for p in g["params"]]
    acc = [p for p in ps if p.device.type not in ("cpu", "meta")]
    return len(ps), sum(p.numel() for p in ps), len(acc), sum(p.numel() for p in acc)


def _moments(cfg: dict[str, Any]) -> str:
    d = cfg["state_dtype"]
    if d == torch.uint8:
        return "8-bit blocks (uint8 codes and a scale per block)"
    if d == torch.float8_e4m3fn:
        return "fp8 blocks (float8_e4m3fn codes and a scale per block)"
    return _dtype(d)


def _masters(cfg: dict[str, Any], offloaded: bool) -> str:
    if cfg.get("master_dtype", torch.float32) == torch.bfloat16:
        return "none: bfloat16 weights with Kahan compensation"
    return "float32" if offloaded else "the parameters themselves"


def describe(opt: Any) -> str:
    """``repr(optimizer)``: one line."""
    cfg = opt._config
    n, numel, acc, _ = _counts(opt)
    mem = opt.memory_report()
    held = [f"host {size(mem['host_bytes'])}"]
    if mem.get("gpu_bytes"):
        held.append(f"GPU {size(mem['gpu_bytes'])}")
    if "nvme_bytes" in mem:
        held.append(f"NVMe {size(mem['nvme_bytes'])}")
    return (
        f"<{type(opt).__name__} storage={opt.storage!r}: {n} tensors, {numel / 1e6:.2f}M parameters; "
        f"moments {_moments(cfg)}, masters {_masters(cfg, bool(acc))}; " + ", ".join(held) + ">"
    )


def summary(opt: Any) -> str:
    """``optimizer.summary()``: a line per subject (see the module documentation)."""
    cfg = opt._config
    n, numel, acc, acc_numel = _counts(opt)
    mem = opt.memory_report()
    groups = len(opt.param_groups)
    where = (
        f"{acc} of them ({acc_numel / 1e6:.2f}M) on a GPU: their state on the host, gradients streamed down, weights back"
        if acc
        else "on the CPU: the step runs on them in place"
    )
    lines = [
        f"{type(opt).__name__}: {groups} group{'s' if groups != 1 else ''}, {n} tensors, {numel / 1e6:.2f}M parameters, {where}",
        f"state: moments {_moments(cfg)}, master weights {_masters(cfg, bool(acc))}"
        + (", amsgrad's maximum too" if any(g.get("amsgrad") for g in opt.param_groups) else ""),
    ]
    host = f"RAM {size(mem['host_bytes'])} held ({size(mem['host_tight_bytes'])} for the state and gradients themselves)"
    if acc:
        host += f"; GPU {size(mem['gpu_bytes'])} kept between steps"
    lines.append(f"storage {opt.storage}: {host}")
    if "nvme_bytes" in mem:
        lines.append(
            f"NVMe: {size(mem['nvme_bytes'])} of state under {cfg['nvme_dir']}; RAM window {size(mem['window_bytes'])}, "
            f"state kept in RAM by host_budget_gb {size(mem['host_state_bytes'])}"
        )
    opts = [k for k in ("async_step", "free_gradients") if cfg.get(k)]
    lines.append(
        f"step: the native kernel ({opt._engine.num_threads} thread{'s' if opt._engine.num_threads != 1 else ''})"
        + (", " + ", ".join(opts) if opts else "")
        + ("" if cfg["bias_correction"] else ", no bias correction")
    )
    return "\n".join(lines)
