"""``python -m offload_adam plan``: which training configurations fit a machine.

For a model of ``--params`` parameters (taken as tensors of ``--tensor-params`` elements: the
layout's per-tensor alignment is negligible at that size) and ``--world-size`` ranks, each
configuration's bytes per rank on the GPU, in host memory and on NVMe, and the bytes it moves
per step over PCIe and to the disk. The host bytes of our optimizer come from
:func:`offload_adam.state.layout`, the computation the optimizer allocates its buffers from (a
test checks them against ``memory_report()`` of a real model); the rest (weights, gradients,
FSDP2's shards) are the tensors' own sizes. With the weights streamed (``offload_weights``), the
model is taken as ``--layers`` equal layers, and the device ring is sized by the code that
allocates it (:func:`offload_adam.weights.offload.ring_bytes`).

Activations are not counted: they depend on batch, sequence length and checkpointing, and come
on top of every GPU figure.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..optim.schema import QBLOCK, codec_for
from ..optim.state import SLOT_ALIGN, layout
from ..optim.tier import PAGE_ALIGN
from ..weights.blocks import Block
from ..weights.offload import own_slot_blocks, ring_bytes

GB = 1 << 30


@dataclass
class Config:
    name: str
    gpu: float  # bytes per rank
    host: float
    nvme: float
    pcie: float  # bytes per step per rank, both directions
    disk: float  # bytes per step per rank, read + written
    note: str = ""


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


def streamed_ring_bytes(layers: int, layer_bytes: int, prefetch: int = 2) -> int:
    """Device bytes of the ring ``offload_weights`` allocates for ``layers`` equal layers, every
    one streamed."""
    blocks = [Block(i, f"layers.{i}", [], nbytes=layer_bytes, layer=True) for i in range(layers)]
    return ring_bytes(blocks, range(layers), own_slot_blocks(blocks), prefetch)


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
    ours_w = optimizer_host_bytes(bf16, state_dtype=state_dtype, streamed=True, bucket_bytes=bb, master_dtype=master_dtype)
    on_disk_w = (
        optimizer_host_bytes(bf16, state_dtype=state_dtype, streamed=True, bucket_bytes=bb, page_align=PAGE_ALIGN, master_dtype=master_dtype)
        - landing
    )
    window_w = (2 + 1 + 2) * bb / 2 * ((2 if master_dtype == torch.bfloat16 else 4) + 2 * es)
    ring = streamed_ring_bytes(layers, int(2 * n / layers), prefetch)
    weights = 2 * n  # the bf16 weights, pinned once: the copy the forward streams and the step writes
    return [
        Config(
            "torch.optim.AdamW on the GPU, DDP (fp32 weights, grads, moments)",
            16 * n, 0, 0, 0, 0,
        ),
        Config(
            "FSDP2 on GPUs, torch.optim.AdamW (fp32 shards, grads, moments)",
            16 * shard + biggest, 0, 0, 0, 0,
        ),
        Config(
            "offload_adam offload='cpu', bf16 model, free_gradients (one replica per GPU)",
            2 * n + window, ours_off, 0, 4 * n, 0,
            "masters and moments in pinned RAM; bf16 grads down, bf16 weights up",
        ),
        Config(
            "FSDP2 + CPUOffloadPolicy + offload_adam (fp32 shards)",
            biggest, 8 * shard + ours_fsdp, 0, 8 * shard, 0,
            "FSDP2 keeps fp32 shards and grads in pinned RAM; our state beside them",
        ),
        Config(
            "offload_adam offload='nvme', bf16 model, free_gradients (one replica per GPU)",
            2 * n + window, landing + nvme_window, on_disk, 4 * n, 2 * on_disk,
            "masters and moments on NVMe, paged through a window",
        ),
        Config(
            f"offload_weights + offload_adam offload='cpu', bf16 model, free_gradients (ring of {prefetch + 1} layers)",
            ring + window, weights + ours_w, 0, 6 * n, 0,
            "weights streamed up in forward and again in backward, bf16 grads down; the step writes the host copy",
        ),
        Config(
            f"offload_weights + offload_adam offload='nvme', bf16 model, free_gradients (ring of {prefetch + 1} layers)",
            ring + window, weights + landing + window_w, on_disk_w, 6 * n, 2 * on_disk_w,
            "weights pinned in RAM and streamed; masters and moments on NVMe, paged through a window",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload_adam plan", description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, required=True, help="model parameters, e.g. 13e9")
    ap.add_argument("--gpu-gb", type=float, required=True, help="GPU memory per rank, GiB")
    ap.add_argument("--host-gb", type=float, required=True, help="host memory per rank, GiB")
    ap.add_argument("--nvme-gb", type=float, default=0.0, help="NVMe space per rank, GiB (0: none)")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument(
        "--state-dtype", default="float32", choices=["float32", "bfloat16", "uint8", "float8_e4m3fn"],
        help="the moments' dtype (uint8: 8-bit block-quantized, float8_e4m3fn: fp8 blocks; both 1 B + 4 B per 256 elements)",
    )  # fmt: skip
    ap.add_argument("--bf16-moments", action="store_true", help="the same as --state-dtype bfloat16")
    ap.add_argument(
        "--master-dtype", default="float32", choices=["float32", "bfloat16"],
        help="bfloat16: streamed bf16 weights keep a 2-byte Kahan compensation instead of a 4-byte fp32 master",
    )  # fmt: skip
    ap.add_argument("--tensor-params", type=int, default=50_000_000, help="elements per tensor of the model")
    ap.add_argument("--layers", type=int, default=40, help="layers of the model, for the streamed weights' ring")
    ap.add_argument("--prefetch", type=int, default=2, help="offload_weights(prefetch=...): the ring holds prefetch + 1 layers")
    args = ap.parse_args(argv)
    for name in ("layers", "world_size", "tensor_params"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefetch < 0:
        ap.error("--prefetch must be at least 0")
    sd = torch.bfloat16 if args.bf16_moments else getattr(torch, args.state_dtype)
    cfgs = configurations(
        args.params, world=args.world_size, state_dtype=sd, tensor_params=args.tensor_params, layers=args.layers,
        prefetch=args.prefetch, master_dtype=getattr(torch, args.master_dtype),
    )  # fmt: skip
    print(
        f"{args.params / 1e9:.2f}B parameters, {args.world_size} rank(s) with {args.gpu_gb:g} GiB GPU, "
        f"{args.host_gb:g} GiB host, {args.nvme_gb:g} GiB NVMe each; {str(sd).removeprefix('torch.')} moments, {args.master_dtype} masters; "
        "activations not counted"
    )
    for c in cfgs:
        short = [
            what for what, need, have in (("GPU", c.gpu, args.gpu_gb), ("host", c.host, args.host_gb), ("NVMe", c.nvme, args.nvme_gb))
            if need > have * GB
        ]  # fmt: skip
        verdict = "fits" if not short else "does not fit (" + ", ".join(short) + ")"
        print(f"\n{c.name}: {verdict}")
        print(
            f"  per rank: GPU {c.gpu / GB:.1f} GiB, host {c.host / GB:.1f} GiB, NVMe {c.nvme / GB:.1f} GiB; "
            f"per step: PCIe {c.pcie / GB:.1f} GiB, disk {c.disk / GB:.1f} GiB"
        )
        if c.note:
            print(f"  {c.note}")
    return 0
