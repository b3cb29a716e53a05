"""``python -m offload_adam plan``: what fits a machine, how fast it steps, what it costs the
machine, and what code to write.

Training: for a model of ``--params`` parameters (taken as tensors of ``--tensor-params``
elements: the layout's per-tensor alignment is negligible at that size) and ``--world-size``
ranks, each configuration's bytes per rank on the GPU, in host memory and on NVMe, the bytes it
moves per step over PCIe and to the disk, the seconds per step those imply and the term that
bounds them, the terabytes written to the SSD per 1000 steps, and the host memory left free
(under 10% free is "tight", not "fits"). Then one recommended configuration, with its code.

The host bytes of our optimizer come from :func:`offload_adam.optim.state.layout`, the
computation the optimizer allocates its buffers from (a test checks them against
``memory_report()`` of a real model); the rest (weights, gradients, FSDP2's shards) are the
tensors' own sizes. With the weights streamed (``offload_weights``), the model is taken as
``--layers`` equal layers, planned as ``offload_weights`` plans a model
(:func:`offload_adam.weights.plan.make_plan`: the ``WeightPlan`` that ``plan_weights`` returns and
the offload's handle keeps): its device ring, and for ``--inference`` the layers each budget keeps
resident.

Time: a step is the forward and backward, then the optimizer step. In the first, the GPU's
compute (6 FLOPs per parameter and token, from ``--tokens-per-step`` and ``--gpu-tflops``) and
the PCIe transfers overlap; in the second, the CPU step, the SSD's reads and writes and the
copy-back overlap. Each phase takes its largest term, so the estimate is a lower bound. The
bandwidths come from the flags, else from the stated defaults: the plan is for the machine the
flags describe, not this one. With ``--this-machine`` a figure no flag gives comes from this
machine's calibration (:mod:`offload_adam.runtime.calibration`, measured by ``python -m
offload_adam calibrate``) before the default. The output says where each figure came from.

Activations are not counted: they depend on batch, sequence length and checkpointing, and come
on top of every GPU figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..optim.schema import QBLOCK, codec_for
from ..optim.state import SLOT_ALIGN, layout
from ..optim.tier import PAGE_ALIGN
from ..runtime import calibration
from ..weights.plan import BlockPlan, WeightPlan, make_plan

GB = 1 << 30  # memory: GiB
G = 1e9  # bandwidth: GB/s

# The bandwidths' defaults, where neither a flag nor (--this-machine) the calibration gives one: (GB/s, why).
DEFAULT_RATES = {
    "pcie": (25.0, "PCIe 4.0 x16 in practice; x8 or x4 slots give half or a quarter"),
    "disk": (3.0, "a consumer NVMe SSD, reads and writes alike"),
    "host": (35.0, "the fp32 step measured on a 2-core AMD EPYC VM: 1270 Mparam/s at 28 B per parameter"),
}
# The 8-bit moments' step is bound by its table lookups, not by memory: on AVX2 it measured at
# 0.37x the rate of the fp32-moment step (docs/benchmarks.md), so it costs 2.7x that step's time.
Q8_STEP_COST = 2.7
# fp8 moments' step against the fp32 moments' on the same AVX2 machine: 0.38-0.58x the speed
# (`bench --cases lowbit,lowbit-gpt2`, December 2026), its codecs bound by instructions, not memory.
FP8_STEP_COST = 2.2
# The recommendation keeps torch's arithmetic (fp32 state) unless compact state is this much faster.
EXACT_WITHIN = 1.5


@dataclass
class Config:
    name: str
    gpu: float  # bytes per rank
    host: float
    nvme: float
    pcie: float  # bytes per step per rank, both directions
    disk: float  # bytes per step per rank, read + written
    note: str = ""
    kind: str = ""  # gpu, fsdp_gpu, offload, fsdp_cpu, nvme, stream, stream_nvme: what code to write
    pcie_step: float = 0.0  # of ``pcie``: what crosses during the optimizer step (the copy-back)
    cpu_bytes: float = 0.0  # host memory the CPU step reads and writes per rank (8-bit: its fp32-equivalent cost)
    state_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    weights: float = 0.0  # bytes of the bf16 weights (streamed configurations: the peak while loading)


@dataclass
class Rates:
    """Bandwidths in GB/s, and where each came from; ``cal``: this machine's calibration where
    ``--this-machine`` asked for it (None: not read)."""

    pcie: float
    disk: float
    host: float
    source: dict[str, str] = field(default_factory=dict)
    cal: calibration.Calibration | None = None


@dataclass
class Timing:
    compute: float | None  # seconds; None: not given
    pcie_fb: float
    pcie_step: float
    cpu: float
    disk: float

    @property
    def phases(self) -> tuple[dict[str, float], dict[str, float]]:
        fb = {"PCIe": self.pcie_fb}
        if self.compute is not None:
            fb["the GPU's compute"] = self.compute
        step = {"the CPU step": self.cpu, "the SSD": self.disk, "PCIe (copy-back)": self.pcie_step}
        return fb, step

    @property
    def seconds(self) -> float:
        fb, step = self.phases
        return max(fb.values()) + max(step.values())

    @property
    def bound(self) -> str:
        fb, step = self.phases
        a, b = max(fb.items(), key=lambda kv: kv[1]), max(step.items(), key=lambda kv: kv[1])
        top = a if a[1] >= b[1] else b
        return top[0] if top[1] > 0 else "nothing offloaded"


def parse_count(text: str) -> float:
    """A count such as ``13B``, ``7e9``, ``350M``, ``1.5T`` or ``125k``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (examples: 13B, 7e9, 350M)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    value = float(m.group(1)) * scale
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return v


def optimizer_host_bytes(
    params: Sequence[tuple[int, torch.dtype]],
    *,
    state_dtype: torch.dtype = torch.float32,
    master_dtype: torch.dtype = torch.float32,
    amsgrad: bool = False,
    streamed: bool,
    bucket_bytes: int = 32 << 20,
    page_align: int = SLOT_ALIGN,
) -> int:
    """Host bytes of one param group of ``offload_adam.AdamW`` over these (numel, dtype)
    parameters: offloaded (``streamed``: masters and landing buffers) or CPU parameters.
    ``master_dtype=torch.bfloat16``: bf16 parameters keep a bf16 Kahan compensation instead of
    an fp32 master (CPU parameters, or weights streamed by offload_weights)."""
    lay = layout(params, bucket_bytes=bucket_bytes, state_dtype=state_dtype, page_align=page_align)
    kahan = master_dtype == torch.bfloat16 and all(dt == torch.bfloat16 for _, dt in params)
    master = not kahan and (streamed or any(dt in (torch.bfloat16, torch.float16) for _, dt in params))
    return lay.host_bytes(amsgrad=amsgrad, master=master, streamed=streamed, comp=kahan)


def weight_plan(layers: int, layer_bytes: int, prefetch: int = 2, budget: int | None = None, storage: str = "cpu") -> WeightPlan:
    """The plan ``offload_weights`` makes on a GPU for ``layers`` equal layers within ``budget``
    bytes (None: every layer streamed), the one ``plan_weights`` returns for such a model."""
    blocks = [BlockPlan(i, f"layers.{i}", layer_bytes, layer=True) for i in range(layers)]
    return make_plan(blocks, device="cuda", storage=storage, placement="stream", prefetch=prefetch, gpu_budget=budget)


def streamed_ring_bytes(layers: int, layer_bytes: int, prefetch: int = 2) -> int:
    """Device bytes of the ring ``offload_weights`` allocates for ``layers`` equal layers, every
    one streamed."""
    return weight_plan(layers, layer_bytes, prefetch).ring_bytes


def _tensors(n: float, per: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
    """``n`` elements as tensors of ``per`` elements (whole blocks of 256, as a model's matrices
    are: what 8-bit moments quantize), and the rest."""
    per = max(QBLOCK, per - per % QBLOCK)
    full, rest = divmod(int(n), per)
    return [(per, dtype)] * full + ([(rest, dtype)] if rest else [])


def configurations(
    params: float, *, world: int, state_dtype: torch.dtype, tensor_params: int, bucket_mb: float = 32, layers: int = 40,
    prefetch: int = 2, master_dtype: torch.dtype = torch.float32,
) -> list[Config]:
    n = float(params)
    shard = n / world
    bb = int(bucket_mb * (1 << 20))
    bf16 = _tensors(n, tensor_params, torch.bfloat16)
    fp32_shard = _tensors(shard, tensor_params, torch.float32)
    es = codec_for(state_dtype, tensor_params, torch.bfloat16).nbytes(tensor_params) / tensor_params  # moment bytes per element
    window = 3 * bb  # gradient buckets in flight on the GPU with free_gradients
    biggest = 2 * 2 * tensor_params  # FSDP2: an all-gathered unit in bf16, and its gradient
    ours_off = optimizer_host_bytes(bf16, state_dtype=state_dtype, streamed=True, bucket_bytes=bb)
    ours_fsdp = optimizer_host_bytes(fp32_shard, state_dtype=state_dtype, streamed=False, bucket_bytes=bb)
    ours_nvme_state = optimizer_host_bytes(bf16, state_dtype=state_dtype, streamed=True, bucket_bytes=bb, page_align=PAGE_ALIGN)
    landing = 2 * n  # bf16 gradients' landing buffers stay in RAM
    on_disk = ours_nvme_state - landing
    nvme_window = (2 + 1 + 2) * bb / 2 * (4 + 2 * es)  # read-ahead 2, one stepping, 2 writing
    # Weights streamed by offload_weights have a host copy the step writes: with
    # master_dtype=torch.bfloat16 it is updated with a 2-byte Kahan compensation, no fp32 master.
    kahan = master_dtype == torch.bfloat16
    ours_w = optimizer_host_bytes(bf16, state_dtype=state_dtype, streamed=True, bucket_bytes=bb, master_dtype=master_dtype)
    on_disk_w = (
        optimizer_host_bytes(bf16, state_dtype=state_dtype, streamed=True, bucket_bytes=bb, page_align=PAGE_ALIGN, master_dtype=master_dtype)
        - landing
    )
    window_w = (2 + 1 + 2) * bb / 2 * ((2 if kahan else 4) + 2 * es)
    ring = streamed_ring_bytes(layers, int(2 * n / layers), prefetch)
    weights = 2 * n  # the bf16 weights, pinned once: the copy the forward streams and the step writes
    # What the CPU step reads and writes per parameter: the gradient, the weights (an fp32 master
    # read and written, and the bf16 copy written; or bf16 weights and their compensation, each
    # read and written) and both moments read and written. 8-bit moments: their fp32-equivalent
    # cost (their step is bound by lookups, not memory).
    q8 = state_dtype in (torch.uint8, torch.float8_e4m3fn)
    moments = 4 * (4.0 if q8 else es)
    cost = Q8_STEP_COST if state_dtype == torch.uint8 else FP8_STEP_COST if q8 else 1.0
    step_bf16 = (2 + 8 + 2 + moments) * cost * n
    step_kahan = ((2 + 4 + 4 + moments) * cost * n) if kahan else step_bf16
    step_fsdp = (4 + 8 + moments) * cost * shard
    sd, md = state_dtype, master_dtype
    return [
        Config(
            "torch.optim.AdamW on the GPU, DDP (fp32 weights, grads, moments)",
            16 * n, 0, 0, 0, 0, kind="gpu",
        ),
        Config(
            "FSDP2 on GPUs, torch.optim.AdamW (fp32 shards, grads, moments)",
            16 * shard + biggest, 0, 0, 0, 0, kind="fsdp_gpu",
        ),
        Config(
            "offload_adam storage='cpu', bf16 model, free_gradients (one replica per GPU)",
            2 * n + window, ours_off, 0, 4 * n, 0,
            "masters and moments in pinned RAM; bf16 grads down, bf16 weights up",
            kind="offload", pcie_step=2 * n, cpu_bytes=step_bf16, state_dtype=sd,
        ),
        Config(
            "FSDP2 + CPUOffloadPolicy + offload_adam (fp32 shards)",
            biggest, 8 * shard + ours_fsdp, 0, 8 * shard, 0,
            "FSDP2 keeps fp32 shards and grads in pinned RAM; our state beside them",
            kind="fsdp_cpu", cpu_bytes=step_fsdp, state_dtype=sd,
        ),
        Config(
            "offload_adam storage='nvme', bf16 model, free_gradients (one replica per GPU)",
            2 * n + window, landing + nvme_window, on_disk, 4 * n, 2 * on_disk,
            "masters and moments on NVMe, paged through a window",
            kind="nvme", pcie_step=2 * n, cpu_bytes=step_bf16, state_dtype=sd,
        ),
        Config(
            f"offload_weights + offload_adam storage='cpu', bf16 model, free_gradients (ring of {prefetch + 1} layers)",
            ring + window, weights + ours_w, 0, 6 * n, 0,
            "weights streamed up in forward and again in backward, bf16 grads down; the step writes the host copy",
            kind="stream", cpu_bytes=step_kahan, state_dtype=sd, master_dtype=md, weights=weights,
        ),
        Config(
            f"offload_weights + offload_adam storage='nvme', bf16 model, free_gradients (ring of {prefetch + 1} layers)",
            ring + window, weights + landing + window_w, on_disk_w, 6 * n, 2 * on_disk_w,
            "weights pinned in RAM and streamed; masters and moments on NVMe, paged through a window",
            kind="stream_nvme", cpu_bytes=step_kahan, state_dtype=sd, master_dtype=md, weights=weights,
        ),
    ]  # fmt: skip


def rates(pcie: float | None = None, disk: float | None = None, host: float | None = None, *, this_machine: bool = False) -> Rates:
    """The bandwidths: a flag's value, else (``this_machine``) this machine's calibration, else
    the default. Without ``this_machine`` the calibration file is not read."""
    cal = calibration.read() if this_machine else None
    out = Rates(0.0, 0.0, 0.0, cal=cal)
    for what, flag, key in (("pcie", pcie, "pcie_h2d_gbs"), ("disk", disk, "disk_read_gbs"), ("host", host, "host_read_gbs")):
        got = cal.rate(key) if cal is not None else None
        if flag is not None:
            value, src = flag, f"--{what}-gbs"
        elif got is not None:
            value, src = got[0], f"this machine's calibration, {_when(got[1])}"
        else:
            value, why = DEFAULT_RATES[what]
            src = f"default: {why}"
        setattr(out, what, float(value))
        out.source[what] = src
    return out


def _when(m: calibration.Measurement) -> str:
    """A measurement's time, as the figures' sources name it (the whole record is printed once)."""
    return f"measured {m.when()}"


def timing(c: Config, r: Rates, *, params: float, world: int, tokens: float | None, tflops: float | None) -> Timing:
    compute = 6 * params * tokens / world / (tflops * 1e12) if tokens and tflops else None
    return Timing(
        compute=compute,
        pcie_fb=(c.pcie - c.pcie_step) / (r.pcie * G),
        pcie_step=c.pcie_step / (r.pcie * G),
        cpu=c.cpu_bytes / (r.host * G),
        disk=c.disk / (r.disk * G),
    )


def verdict(c: Config, gpu_gb: float, host_gb: float, nvme_gb: float) -> tuple[int, str]:
    """(0 fits, 1 tight, 2 does not fit) and its words: under 10% of the RAM left free is tight."""
    short = [
        what for what, need, have in (("GPU", c.gpu, gpu_gb), ("host", c.host, host_gb), ("NVMe", c.nvme, nvme_gb))
        if need > have * GB
    ]  # fmt: skip
    if short:
        return 2, "does not fit (" + ", ".join(short) + ")"
    free = host_gb * GB - c.host
    if c.host > 0 and free < 0.1 * host_gb * GB:
        return 1, f"tight (host: {free / GB:.1f} GiB left free, under 10% of {host_gb:g} GiB)"
    return 0, "fits"


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _exactness(c: Config) -> int:
    """0 for torch's arithmetic on fp32 state; more for each compact choice."""
    return {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2, torch.float8_e4m3fn: 2}[c.state_dtype] + (
        c.master_dtype == torch.bfloat16
    )


def code(c: Config) -> str:
    """The lines to write for a configuration."""
    extra = ""
    if c.state_dtype != torch.float32:
        extra += f", state_dtype=torch.{_dt(c.state_dtype)}"
    if c.master_dtype != torch.float32:
        extra += f", master_dtype=torch.{_dt(c.master_dtype)}"
    nvme = ', storage="nvme", nvme_dir="/path/on/the/ssd"' if c.kind in ("nvme", "stream_nvme") else ""
    loop = [
        "for batch in loader:",
        "    model(**batch).loss.backward()",
        "    opt.step(); opt.zero_grad()",
    ]
    if c.kind == "gpu":
        return "\n".join(
            ["model = model.cuda()   # it fits on the GPU: offload_adam is not needed",
             "opt = torch.optim.AdamW(model.parameters(), lr=1e-5)", *loop]  # fmt: skip
        )
    if c.kind == "fsdp_gpu":
        return "\n".join(
            ["for layer in model.model.layers: fully_shard(layer)   # torchrun, one rank per GPU",
             "fully_shard(model)   # it fits on the GPUs: offload_adam is not needed",
             "opt = torch.optim.AdamW(model.parameters(), lr=1e-5)", *loop]  # fmt: skip
        )
    if c.kind == "fsdp_cpu":
        return "\n".join(
            ["for layer in model.model.layers: fully_shard(layer, offload_policy=CPUOffloadPolicy())",
             "fully_shard(model, offload_policy=CPUOffloadPolicy())",
             f"opt = offload_adam.AdamW(model.parameters(), lr=1e-5{extra})", *loop]  # fmt: skip
        )
    if c.kind in ("offload", "nvme"):
        return "\n".join(
            ["model = model.to(\"cuda\", torch.bfloat16)",
             f"opt = offload_adam.AdamW(model.parameters(), lr=1e-5, free_gradients=True{nvme}{extra})", *loop]  # fmt: skip
        )
    return "\n".join(
        [
            "with accelerate.init_empty_weights():   # no RAM for a second copy while loading",
            "    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR), dtype=torch.bfloat16)",
            "model.tie_weights()",
            "h = offload_adam.offload_weights(model, checkpoint=DIR)   # first: weights to pinned RAM, streamed to the GPU",
            f"opt = offload_adam.AdamW(model.parameters(), lr=1e-5, free_gradients=True{nvme}{extra})",
            *loop,
            "opt.close(); h.close()   # the optimizer first, then the weights",
        ]
    )


def _numerics(c: Config) -> str:
    parts = []
    if c.state_dtype == torch.bfloat16:
        parts.append("bf16 moments (rounded to nearest even)")
    if c.state_dtype == torch.uint8:
        parts.append("8-bit moments (torchao's AdamW8bit)")
    if c.state_dtype == torch.float8_e4m3fn:
        parts.append("float8_e4m3fn moments (torchao's AdamWFp8)")
    if c.master_dtype == torch.bfloat16:
        parts.append("bf16 weights with Kahan compensation instead of fp32 masters")
    if not parts:
        return "fp32 moments and masters: torch's AdamW arithmetic"
    return ", ".join(parts) + ": close to torch's AdamW, not bitwise (see the compact-state guide)"


def _describe(c: Config, t: Timing, args: argparse.Namespace) -> list[str]:
    host_free = args.host_gb * GB - c.host
    lines = [
        f"  per rank: GPU {c.gpu / GB:.1f} GiB of {args.gpu_gb:g} ({max(args.gpu_gb * GB - c.gpu, 0) / GB:.1f} left for activations), "
        f"host {c.host / GB:.1f} GiB of {args.host_gb:g} ({max(host_free, 0) / GB:.1f} free, {max(host_free, 0) / (args.host_gb * GB) * 100:.0f}%), "
        f"NVMe {c.nvme / GB:.1f} GiB",
        f"  per step: PCIe {c.pcie / GB:.1f} GiB, disk {c.disk / GB:.1f} GiB"
        + (f" ({c.disk / 2 / GB:.1f} read + {c.disk / 2 / GB:.1f} written: {c.disk / 2 * 1000 / 1e12:.1f} TB written per 1000 steps)" if c.disk else ""),
    ]  # fmt: skip
    fb, step = t.phases
    if c.kind in ("gpu", "fsdp_gpu"):
        lines.append(
            "  time: the GPU's compute only"
            + (f", {t.compute:.1f} s per step" if t.compute is not None else " (give --tokens-per-step and --gpu-tflops)")
        )
    elif t.seconds > 0:
        terms = "; ".join(
            f"{phase}: " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v > 0 or k == "the GPU's compute")
            for phase, d in (("forward+backward", fb), ("step", step))
            if any(v > 0 for v in d.values())
        )
        lines.append(f"  time: at least {t.seconds:.1f} s per step, bound by {t.bound} ({terms})")
    if c.note:
        lines.append(f"  {c.note}")
    return lines


def train(args: argparse.Namespace, r: Rates) -> None:
    fixed_sd = torch.bfloat16 if args.bf16_moments else (getattr(torch, args.state_dtype) if args.state_dtype else None)
    fixed_md = getattr(torch, args.master_dtype) if args.master_dtype else None
    sd = fixed_sd or torch.float32
    md = fixed_md or torch.float32
    common = dict(world=args.world_size, tensor_params=args.tensor_params, layers=args.layers, prefetch=args.prefetch)
    cfgs = configurations(args.params, state_dtype=sd, master_dtype=md, **common)
    when = dict(params=args.params, world=args.world_size, tokens=args.tokens_per_step, tflops=args.gpu_tflops)
    print(
        f"{args.params / 1e9:.2f}B parameters, {args.world_size} rank(s) with {args.gpu_gb:g} GiB GPU, "
        f"{args.host_gb:g} GiB host, {args.nvme_gb:g} GiB NVMe each; {_dt(sd)} moments, {_dt(md)} masters; "
        "activations not counted"
    )
    _print_rates(r, args)
    for c in cfgs:
        _, status = verdict(c, args.gpu_gb, args.host_gb, args.nvme_gb)
        print(f"\n{c.name}: {status}")
        for line in _describe(c, timing(c, r, **when), args):
            print(line)

    # The recommendation: over the moments' and masters' dtypes the user left open, the best
    # verdict; among those, the one closest to torch's arithmetic within 1.5x of the fastest
    # (compact state changes the arithmetic: it is worth it where it is much faster), then the
    # fastest.
    cands: list[tuple[int, float, int, Config]] = []
    for s in [fixed_sd] if fixed_sd else [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn]:
        for m in [fixed_md] if fixed_md else [torch.float32, torch.bfloat16]:
            for c in configurations(args.params, state_dtype=s, master_dtype=m, **common):
                if m == torch.bfloat16 and c.kind not in ("stream", "stream_nvme"):
                    continue  # Kahan weights need a host copy of the weights: CPU or streamed parameters
                rank, _ = verdict(c, args.gpu_gb, args.host_gb, args.nvme_gb)
                cands.append((rank, timing(c, r, **when).seconds, _exactness(c), c))
    best_rank = min(x[0] for x in cands)
    pool = [x for x in cands if x[0] == best_rank]
    fastest = min(x[1] for x in pool)
    rank, _, _, pick = min((x for x in pool if x[1] <= EXACT_WITHIN * fastest + 1e-9), key=lambda x: (x[2], x[1]))
    if rank == 2:
        print("\nRecommended: nothing fits. Add NVMe space (--nvme-gb), host memory or GPUs, or compact state "
              "(--state-dtype uint8 --master-dtype bfloat16).")  # fmt: skip
        return
    t = timing(pick, r, **when)
    _, status = verdict(pick, args.gpu_gb, args.host_gb, args.nvme_gb)
    print(f"\nRecommended ({status}): {pick.name}")
    if pick.kind not in ("gpu", "fsdp_gpu"):
        print(f"  state: {_numerics(pick)}")
    for line in _describe(pick, t, args)[:3]:
        print(line)
    if pick.kind in ("stream", "stream_nvme") and 2 * pick.weights > args.host_gb * GB:
        print(
            f"  loading: a model read into RAM first (from_pretrained) is held twice while offload_weights copies it "
            f"({2 * pick.weights / GB:.1f} GiB): load with checkpoint=, as below"
        )
    print("  code:")
    for line in code(pick).splitlines():
        print("    " + line)


# Weight-only quantized weights (--weight-dtype), as torchao stores them: int8 and fp8
# (Int8WeightOnlyConfig, Float8WeightOnlyConfig) 1 byte and a float32 scale per output row; int4
# (Int4WeightOnlyConfig) half a byte and a bf16 scale and zero point per group of 128.
INT4_GROUP = 128


def hidden_estimate(params: float, layers: int) -> float:
    """The hidden size of a transformer of ``params`` parameters in ``layers`` layers, about 12
    hidden^2 parameters a layer: sqrt(params / (12 * layers))."""
    return math.sqrt(params / (12 * layers))


def weight_bytes_per_param(weight_dtype: str | None, dtype: str, params: float, layers: int) -> tuple[float, str]:
    """Bytes per parameter of the inference weights, and how they were counted. ``weight_dtype``
    None: plain ``dtype`` weights. int8, fp8: 1 byte and a float32 scale per output row, the row
    taken as the hidden size (:func:`hidden_estimate`: the plan knows no shapes); int4: half a byte
    and 4 bytes per group of 128."""
    if weight_dtype is None:
        return float(torch.empty((), dtype=getattr(torch, dtype)).element_size()), f"{dtype} weights"
    if weight_dtype == "int4":
        return 0.5 + 4 / INT4_GROUP, f"int4 weight-only weights: half a byte, and a bf16 scale and zero point per group of {INT4_GROUP}"
    if weight_dtype not in ("int8", "fp8"):
        raise ValueError(f"weight_dtype: int8, fp8 or int4, got {weight_dtype!r}")
    hidden = hidden_estimate(params, layers)
    return 1 + 4 / hidden, (
        f"{weight_dtype} weight-only weights: 1 byte and a float32 scale per output row, counted as 4 bytes per "
        f"{hidden:.0f} parameters, {hidden:.0f} the hidden size taken as sqrt(params / (12 x layers))"
    )


def inference(args: argparse.Namespace, r: Rates) -> None:
    bpp, counted = weight_bytes_per_param(args.weight_dtype, args.dtype, args.params, args.layers)
    weights = args.params * bpp
    of_w = "" if args.weight_dtype is None else f" of {args.weight_dtype} weights"
    layer = int(weights / args.layers)
    usable = (args.gpu_gb - args.reserve_gb) * GB
    ring = streamed_ring_bytes(args.layers, layer, args.prefetch)
    what = args.dtype if args.weight_dtype is None else f"{args.weight_dtype} weights, {args.dtype} activations"
    print(
        f"{args.params / 1e9:.2f}B parameters in {what} ({weights / GB:.1f} GiB, taken as {args.layers} equal layers); "
        f"GPU {args.gpu_gb:g} GiB, of which {args.reserve_gb:g} kept for the CUDA context, KV cache and activations "
        f"(--reserve-gb); host {args.host_gb:g} GiB; NVMe {args.nvme_gb:g} GiB"
    )
    if args.weight_dtype is not None:
        print(f"weights: {bpp:.4f} bytes per parameter: {counted}")
    _print_rates(r, args)
    if args.moe is not None:
        from . import moe_plan

        figs = dataclasses.replace(args.moe, bytes_per_param=bpp)
        print()
        for line in moe_plan.describe(figs, budget_bytes=0.9 * args.host_gb * GB, disk_gbs=r.disk, host_gbs=r.host):
            print(line)
        print(
            "  (the figures below are the layer-granular offload's: a streamed layer moves all its experts; an expert cache "
            "on the GPU is not planned yet)"
        )
    if weights + args.reserve_gb * GB <= args.gpu_gb * GB:
        print(f"\nThe model fits on the GPU whole ({weights / GB:.1f} GiB): model.cuda(), no offload needed.")
        return
    gemv = cpu_gemv_gflops(args.dtype, r)
    # FLOPs per byte of the weights: a 1-row matmul does 2 per parameter. int8 and fp8 weights run
    # the native kernel (weights.hostmatmul), which reads them at the memory's rate: no matmul bound.
    flops_per_byte = 0.0 if args.weight_dtype in ("int8", "fp8") else 2 / bpp
    if usable < ring:
        print(
            f"\nNo GPU room: the streaming ring alone ({ring / GB:.1f} GiB, prefetch {args.prefetch}) is over the "
            f"{max(usable, 0) / GB:.1f} GiB the GPU has after --reserve-gb"
        )
        cpu_only(args, r, weights, flops_per_byte, gemv)
        return
    print(
        "\nDecode at batch 1: each token's forward copies every streamed (not resident) block to the GPU, so tokens/s is at "
        "most the PCIe bandwidth (storage=\"nvme\": the disk's too) over the streamed bytes; a batch of b sequences makes b "
        "tokens per forward. The GPU's own time comes on top."
    )
    print(
        "placement=\"cpu\" runs the non-resident blocks on the CPU from RAM instead: tokens/s is at most the host's read "
        f"bandwidth over their bytes{_cpu_bound_words(args, gemv, r)}{_quantized_cpu_words(args)}; placement=\"auto\" takes the "
        "better per call (a prompt streams)."
    )
    budgets: list[float | None] = [None] + sorted({round(f * usable / GB, 1) for f in (0.25, 0.5, 0.75)} | {math.floor(usable / GB * 10) / 10})
    print(
        f"  {'gpu_budget_gb':>17}  {'on the GPU':>10}  {'streamed/token':>14}  {'storage=cpu: tokens/s, pinned RAM':>38}  "
        f"{'storage=nvme: tokens/s':>22}  {'placement=cpu: tokens/s':>23}"
    )
    rows = []
    for b in budgets:
        budget = None if b is None else int(b * GB)
        if budget is not None and budget < ring:
            continue
        p = weight_plan(args.layers, layer, args.prefetch, budget)
        resident = sum(p.blocks[i].nbytes for i in p.resident)
        streamed = weights - resident
        ring_b = p.ring_bytes
        cpu_rate = r.pcie * G / streamed if streamed else math.inf
        nvme_rate = min(r.pcie, r.disk) * G / streamed if streamed else math.inf
        host_ok = streamed <= 0.9 * args.host_gb * GB
        nvme_ok = streamed <= args.nvme_gb * GB
        on_cpu = _cpu_rate(r.host * G, gemv, flops_per_byte, streamed)
        rows.append((b, resident, streamed, cpu_rate, nvme_rate, host_ok, nvme_ok, on_cpu, p))
        name = "None (stream all)" if b is None else f"{b:g}"
        cpu_col = f"{cpu_rate:.2f} (PCIe), {streamed / GB:.1f} GiB" + ("" if host_ok else " > 90% of host")
        nvme_col = f"{nvme_rate:.2f} ({'SSD' if r.disk < r.pcie else 'PCIe'})" if nvme_ok else "no NVMe space"
        place_col = f"{on_cpu:.2f}" if host_ok else "needs RAM"
        print(f"  {name:>17}  {(resident + ring_b) / GB:>6.1f} GiB  {streamed / GB:>10.1f} GiB  {cpu_col:>38}  {nvme_col:>22}  {place_col:>23}")
    b, resident, streamed, cpu_rate, nvme_rate, host_ok, nvme_ok, on_cpu, best = rows[-1]
    if host_ok and on_cpu > cpu_rate:
        storage, rate, by, kw = "cpu", on_cpu, "the CPU reading RAM", ', placement="auto"'
    elif host_ok:
        storage, rate, by, kw = "cpu", cpu_rate, "PCIe", ""
    elif nvme_ok:
        storage, rate, by, kw = "nvme", nvme_rate, "the SSD" if r.disk < r.pcie else "PCIe", ', storage="nvme", nvme_dir="/path/on/the/ssd"'
    else:
        print("\nRecommended: nothing fits: the streamed weights need host memory (storage=\"cpu\") or NVMe space (storage=\"nvme\").")
        return
    print(
        f"\nRecommended: gpu_budget_gb={b:g}, storage=\"{storage}\": at most {rate:.2f} tokens/s at batch 1, bound by {by} "
        f"({streamed / GB:.1f} GiB{of_w} streamed per token, {resident / GB:.1f} GiB resident)"
    )
    best = weight_plan(args.layers, layer, args.prefetch, best.gpu_budget, storage)
    print(f"  the plan (plan_weights' WeightPlan of {args.layers} equal layers): " + "; ".join(best.totals()))
    print("  code:")
    config = _config(args)
    for line in (
        *([f"from torchao.quantization import {config}"] if config else []),
        "with accelerate.init_empty_weights():   # no RAM for a second copy while loading",
        f"    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR), dtype=torch.{args.dtype})",
        "model.tie_weights()",
        f"h = offload_adam.offload_weights(model, checkpoint=DIR, gpu_budget_gb={b:g}{kw}{_quantize_kw(args)})",
        "tok = AutoTokenizer.from_pretrained(DIR)",
        "out = model.generate(**tok(\"Hello\", return_tensors=\"pt\").to(\"cuda\"), max_new_tokens=64)",
        "print(tok.decode(out[0])); h.close()",
    ):
        print("    " + line)
    if config:
        print(f"  note: the figures count {args.weight_dtype} weights as torchao's {config} stores them; quantize= quantizes "
              f"each block of the {args.dtype} checkpoint as it loads.")  # fmt: skip
    q4 = args.params * 0.5 * 1.1  # 4-bit weights with their scales, about
    if args.weight_dtype is None and q4 + args.reserve_gb * GB <= args.gpu_gb * GB:
        print(
            f"  note: 4-bit weights (about {q4 / GB:.1f} GiB) would fit this GPU whole, at the GPU's own speed: "
            "--weight-dtype int4 plans them (quantize=Int4WeightOnlyConfig())."
        )


def _config(args: argparse.Namespace) -> str:
    """torchao's config of ``--weight-dtype`` ("" without)."""
    if args.weight_dtype is None:
        return ""
    return {"int8": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig", "int4": "Int4WeightOnlyConfig"}[args.weight_dtype]


def _quantize_kw(args: argparse.Namespace) -> str:
    """``offload_weights``' quantize= argument of ``--weight-dtype`` ("" without)."""
    config = _config(args)
    return f", quantize={config}()" if config else ""


def cpu_gemv_gflops(dtype: str, r: Rates | None = None) -> float:
    """The CPU's matmul rate at one row for ``dtype``: this machine's calibration where ``r``
    read it (``--this-machine``), else the cost model's default."""
    from ..weights import costs

    got = r.cal.matmul(dtype) if r is not None and r.cal is not None else None
    return float(got[0].get("1", costs.DEFAULT_CPU_GFLOPS["1"]) if got is not None else costs.DEFAULT_CPU_GFLOPS["1"])


def _gemv_source(dtype: str, r: Rates) -> str:
    got = r.cal.matmul(dtype) if r.cal is not None else None
    if got is not None:
        return f"this machine's calibration, {_when(got[1])}"
    return "default: --this-machine takes this machine's, measured by python -m offload_adam calibrate"


def _cpu_rate(read_bps: float, gemv: float, flops_per_byte: float, nbytes: float) -> float:
    """Tokens/s at batch 1 of the CPU over ``nbytes`` of weights read at ``read_bps`` bytes/s, and
    at ``gemv`` GFLOP/s over ``flops_per_byte`` FLOPs per byte of them (0: no matmul bound)."""
    if not nbytes:
        return math.inf
    by_memory = read_bps / nbytes
    return min(by_memory, gemv * 1e9 / (flops_per_byte * nbytes)) if flops_per_byte else by_memory


def _cpu_bound_words(args: argparse.Namespace, gemv: float, r: Rates) -> str:
    """What bounds the CPU's decode besides the host's read bandwidth, in words."""
    rate = f", and the CPU's 1-row matmul rate ({gemv:g} GFLOP/s, {_gemv_source(args.dtype, r)}) over 2 FLOPs per parameter"
    return rate if args.weight_dtype in (None, "int4") else ""


def _quantized_cpu_words(args: argparse.Namespace) -> str:
    """How the CPU's bound counts quantized weights, in words ("" for plain weights)."""
    if args.weight_dtype in ("int8", "fp8"):
        words = (
            f" ({args.weight_dtype} weights: the native kernel, offload_adam.weights.hostmatmul, reads them at the memory's "
            "rate, so the host's read bandwidth over their bytes is the bound"
        )
        if args.weight_dtype == "fp8":
            words += "; fp8 decode is compute-bound on AVX2, 4-6 GB/s where int8 read 12 (docs/benchmarks.md): a looser bound"
        return words + ")"
    if args.weight_dtype == "int4":
        return (
            f" (int4 weights run torch's CPU path, not the native kernel: the bound takes the {args.dtype} matmul rate, "
            "no int4 one is measured)"
        )
    return ""


def cpu_only(args: argparse.Namespace, r: Rates, weights: float, flops_per_byte: float, gemv: float) -> None:
    """Without GPU room: the model on the CPU (device="cpu"), from RAM or from the SSD."""
    room = 0.9 * args.host_gb * GB
    if weights <= room:
        rate, by, kw = _cpu_rate(r.host * G, gemv, flops_per_byte, weights), "the CPU reading RAM", 'device="cpu"'
    elif weights <= args.nvme_gb * GB:
        keep = max(room - (args.prefetch + 1) * weights / args.layers, 0.0)
        rate = _cpu_rate(r.disk * G, gemv, flops_per_byte, weights - keep)
        by, kw = "the SSD", f'device="cpu", storage="nvme", nvme_dir="/path/on/the/ssd", host_budget_gb={keep / GB:.0f}'
    else:
        print("On the CPU neither: the weights need RAM or NVMe space.")
        return
    print(f"\nRecommended: the model on the CPU, at most {rate:.2f} tokens/s at batch 1, bound by {by}{_quantized_cpu_words(args)}:")
    print(f"    h = offload_adam.offload_weights(model, checkpoint=DIR, {kw}{_quantize_kw(args)})")


def _print_rates(r: Rates, args: argparse.Namespace) -> None:
    if r.cal is None:
        print("figures: the flags, else stated defaults (this machine's calibration only with --this-machine)")
    else:
        print(f"figures: the flags, else this machine's calibration ({r.cal.where}), else stated defaults")
        used = {id(m): m for m in r.cal.source.values()}
        for m in used.values():
            print(f"  calibration: {m.describe()}")
        if not used:
            print(f"  calibration: none of this CPU ({calibration.cpu_model()}) in {r.cal.where}")
        for m in r.cal.other:
            print(f"  not used, another CPU's: {m.describe()}")
    print(f"bandwidths: PCIe {r.pcie:g} GB/s ({r.source['pcie']})")
    print(f"            SSD {r.disk:g} GB/s ({r.source['disk']})")
    if not args.inference:
        print(f"            CPU step {r.host:g} GB/s of host memory ({r.source['host']})")
    else:
        print(f"            host read {r.host:g} GB/s, the CPU's decode from RAM ({r.source['host']})")
    if not args.inference and (args.tokens_per_step is None or args.gpu_tflops is None):
        print("GPU compute not counted: give --tokens-per-step and --gpu-tflops")


EPILOG = """examples:
  fine-tune a 13B model on one 24 GB GPU, 64 GB of RAM and a 1 TB SSD:
    python -m offload_adam plan --params 13B --gpu-gb 24 --host-gb 64 --nvme-gb 1000
  the same with the GPU's compute counted (2 sequences of 4096 tokens per step, 80 TFLOP/s achieved):
    python -m offload_adam plan --params 13B --gpu-gb 24 --host-gb 64 --nvme-gb 1000 --tokens-per-step 8192 --gpu-tflops 80
  generate with a 13B model on the same machine:
    python -m offload_adam plan --inference --params 13B --gpu-gb 24 --host-gb 64 --nvme-gb 1000

Memory figures are GiB; bandwidths GB/s. The figures are the flags, else stated defaults: the plan
is for the machine the flags describe. --this-machine takes what no flag gives from this machine's
calibration (python -m offload_adam calibrate stores it in calibration-<uid>.json in
$OFFLOAD_ADAM_CACHE_DIR, else in $XDG_CACHE_HOME/offload_adam, else in ~/.cache/offload_adam). The
output says where each figure came from. Activations are not counted."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m offload_adam plan",
        description=textwrap.fill(
            "What fits a machine, how fast it steps (seconds per step and the bounding term: GPU compute, PCIe, "
            "the SSD or the CPU step), what it costs the machine (SSD writes, host memory left) and the code to "
            "write. With --inference: tokens/s bounds per GPU budget for a model larger than the GPU.",
            100,
        ),
        epilog=EPILOG,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=32),
    )
    ap.add_argument(
        "--params", type=parse_count, default=None, metavar="N",
        help="model parameters: 13B, 7e9, 350M (required unless --config gives them)",
    )  # fmt: skip
    ap.add_argument(
        "--config", metavar="PATH", default=None,
        help="a transformers config.json, or a folder with one (no weights): the parameters and layers from it and, for "
        "a mixture of experts, with --inference its active parameters per token, expert bytes and the expert cache of "
        "the host memory",
    )  # fmt: skip
    ap.add_argument("--gpu-gb", type=float, required=True, help="GPU memory per rank, GiB (required)")
    ap.add_argument("--host-gb", type=float, required=True, help="host memory per rank, GiB (required)")
    ap.add_argument("--nvme-gb", type=float, default=0.0, help="NVMe space per rank, GiB (default: 0, none)")
    ap.add_argument("--inference", action="store_true", help="generation instead of training: tokens/s per GPU budget")
    ap.add_argument(
        "--this-machine", action="store_true",
        help="take the figures no flag gives from this machine's calibration (python -m offload_adam calibrate) before "
        "the stated defaults (default: not read: the plan is for the machine the flags describe)",
    )  # fmt: skip
    t = ap.add_argument_group("training")
    t.add_argument("--world-size", type=int, default=1, help="ranks (GPUs), each with the memory above (default: 1)")
    t.add_argument(
        "--state-dtype", default=None, choices=["float32", "bfloat16", "uint8", "float8_e4m3fn"],
        help="the moments' dtype (uint8: 8-bit block-quantized, float8_e4m3fn: fp8 blocks; both 1 B + 4 B per 256 "
        "elements); default: float32 in the table, and the recommendation tries each",
    )  # fmt: skip
    t.add_argument("--bf16-moments", action="store_true", help="the same as --state-dtype bfloat16")
    t.add_argument(
        "--master-dtype", default=None, choices=["float32", "bfloat16"],
        help="bfloat16: streamed bf16 weights keep a 2-byte Kahan compensation instead of a 4-byte fp32 master; "
        "default: float32 in the table, and the recommendation tries both",
    )  # fmt: skip
    t.add_argument("--tensor-params", type=int, default=50_000_000, help="elements per tensor of the model (default: 50000000)")
    t.add_argument("--tokens-per-step", type=parse_count, default=None, metavar="N", help="tokens per optimizer step, all ranks (with --gpu-tflops: the GPU's compute)")
    t.add_argument("--gpu-tflops", type=_positive, default=None, help="TFLOP/s one GPU achieves on the model (not its peak)")
    t.add_argument("--host-gbs", type=_positive, default=None, help="GB/s of host memory the CPU step reads and writes (default: 35; --this-machine: the calibration's first)")
    w = ap.add_argument_group("both")
    w.add_argument(
        "--layers", type=int, default=None,
        help="layers of the model, for the streamed weights' ring; with --config, the config's (default: 40)",
    )  # fmt: skip
    w.add_argument("--prefetch", type=int, default=2, help="offload_weights(prefetch=...): the ring holds prefetch + 1 layers (default: 2)")
    w.add_argument("--pcie-gbs", type=_positive, default=None, help="host-to-device GB/s (default: 25; --this-machine: the calibration's first)")
    w.add_argument("--disk-gbs", type=_positive, default=None, help="SSD GB/s, reads and writes (default: 3; --this-machine: the calibration's first)")
    i = ap.add_argument_group("inference")
    i.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
        help="the weights' dtype, and with --weight-dtype the activations' (default: bfloat16)",
    )  # fmt: skip
    i.add_argument(
        "--weight-dtype", default=None, choices=["int8", "fp8", "int4"],
        help="weight-only quantized weights, as torchao stores them: int8, fp8 1 byte per parameter and a float32 "
        "scale per output row (counted as 4 bytes per hidden size, taken as sqrt(params / (12 x layers))); int4 half "
        "a byte and a bf16 scale and zero point per group of 128 (default: none, --dtype weights)",
    )  # fmt: skip
    i.add_argument("--reserve-gb", type=float, default=3.0, help="GPU GiB kept for the CUDA context, KV cache and activations (default: 3)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    args.moe = None
    if args.config is not None:
        from . import moe_plan

        try:
            cfg = moe_plan.load_config(args.config)
            params, args.moe = moe_plan.config_params(cfg)
        except ValueError as e:
            ap.error(str(e))
        args.params = args.params or float(params)
        if args.layers is None:
            args.layers = int(getattr(cfg, "num_hidden_layers", 40))
    if args.params is None:
        ap.error("--params is required (or --config, a transformers config to take them from)")
    if args.layers is None:
        args.layers = 40
    for name in ("layers", "world_size", "tensor_params"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefetch < 0:
        ap.error("--prefetch must be at least 0")
    for name in ("gpu_gb", "host_gb", "nvme_gb", "reserve_gb"):
        if not getattr(args, name) >= 0:
            ap.error(f"--{name.replace('_', '-')} must be at least 0")
    if args.weight_dtype is not None and not args.inference:
        ap.error("--weight-dtype is for --inference only (the training plans count bf16 weights)")
    if (args.tokens_per_step is None) != (args.gpu_tflops is None):
        ap.error("--tokens-per-step and --gpu-tflops go together (the GPU's compute needs both)")
    try:
        r = rates(args.pcie_gbs, args.disk_gbs, args.host_gbs, this_machine=args.this_machine)
    except ValueError as e:
        ap.error(str(e))
    if args.inference:
        inference(args, r)
    else:
        train(args, r)
    return 0
