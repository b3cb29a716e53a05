"""Autocast on the simulated device: ``torch.autocast("simgpu", dtype=...)`` casts as CUDA's does.

torch has the dispatch key (``AutocastPrivateUse1``) and the state (``torch.is_autocast_enabled
("simgpu")``, ``torch.get_autocast_dtype("simgpu")``) for a backend registered from Python, but no
kernels: an out-of-tree backend registers its own in C++, and without them every operation under
autocast fails ("Could not run 'aten::matmul' with arguments from the 'Autocastsimgpu' backend").
So this module registers them from Python, at the same place in the dispatcher as CUDA's (above
autograd: the casts are recorded by autograd, and the backward runs outside autocast as on a GPU):

* a fallthrough for every operation (what autocast leaves alone runs as it is);
* for the operations of CUDA's lists (``aten/src/ATen/autocast_mode.cpp``), a kernel that casts
  the floating ``simgpu`` tensors among the arguments (float64 excepted, as CUDA's) and calls
  the operation again with autocast excluded: to the autocast dtype (``mm``, ``linear``,
  ``matmul``, the convolutions, ...), to float32 (``layer_norm``, ``rms_norm``, ``exp``, the
  losses, ...), float32 as the ``dtype=`` of a reduction (``softmax``, ``sum``, ``cumsum``, ...),
  or to the widest floating type among them (``addcmul``, ``cat``-like promotions).
* **The cast cache**, as CUDA's: a cast to the autocast dtype of a float32 leaf that requires
  grad (a parameter) is kept, keyed by the tensor, while ``torch.is_autocast_cache_enabled()``,
  and dropped when the outermost autocast exits (``torch.clear_autocast_cache``, which
  ``torch.autocast``'s exit calls; this module wraps it). A parameter whose memory is swapped
  under the same object (a streamed weight) then gets its previous cast, as on a GPU, unless the
  cache is off.

The simulated device's attention runs the CPU's kernel on the memory
(:mod:`~offload_adam.testing.simbackend`), so :func:`cast_for_attention` gives it the casts
autocast gives ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# CUDA's lists (torch 2.x, aten/src/ATen/autocast_mode.cpp), by operation name (every overload).
LOWER = (
    "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution prelu "
    "addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot "
    "lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention"
).split()
FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm "
    "native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss "
    "cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss "
    "margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
    "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp norm"
).split()
FP32_DTYPE = "prod cumprod cumsum linalg_vector_norm linalg_matrix_norm softmax log_softmax sum".split()
PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()

_KEY = torch._C.DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]
_libs: list[Any] = []
_local = threading.local()  # the cast cache is per thread, as CUDA's (thread_local there)


def _cache() -> dict[int, tuple[Any, Tensor]]:
    c: dict[int, tuple[Any, Tensor]] | None = getattr(_local, "cache", None)
    if c is None:
        c = _local.cache = {}
    return c


def clear_cache() -> None:
    _cache().clear()


def _eligible(t: Any, name: str) -> bool:
    return isinstance(t, Tensor) and t.device.type == name and t.is_floating_point() and t.dtype != torch.float64


def _cast(t: Any, dtype: torch.dtype, name: str) -> Any:
    if isinstance(t, (list, tuple)):
        return type(t)(_cast(x, dtype, name) for x in t)
    if not _eligible(t, name) or t.dtype == dtype:
        return t
    cacheable = (
        dtype == torch.get_autocast_dtype(name) and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
        and not t._is_view() and torch.is_autocast_cache_enabled()
    )  # fmt: skip
    if not cacheable:
        return t.to(dtype)
    cache = _cache()
    hit = cache.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    out = t.to(dtype)
    cache[id(t)] = (weakref.ref(t), out)
    return out


def _widest(args: Any, name: str) -> torch.dtype | None:
    best: torch.dtype | None = None
    for x in torch.utils._pytree.tree_leaves(args):
        if _eligible(x, name):
            best = x.dtype if best is None else torch.promote_types(best, x.dtype)
    return best


def _kernel(op: Any, policy: str, name: str) -> Callable[..., Any]:
    at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            if policy == "lower":
                dtype = torch.get_autocast_dtype(name)
            elif policy == "fp32":
                dtype = torch.float32
            elif policy == "fp32_dtype":
                low = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if _eligible(x, name) and x.dtype != torch.float32]
                if at is None or not low:
                    return op(*args, **kwargs)
                if at < len(args):  # given by position
                    return op(*args[:at], torch.float32 if args[at] is None else args[at], *args[at + 1 :], **kwargs)
                return op(*args, **{**kwargs, "dtype": kwargs.get("dtype") or torch.float32})
            else:
                widest = _widest((args, kwargs), name)
                if widest is None:
                    return op(*args, **kwargs)
                dtype = widest
            return op(*[_cast(a, dtype, name) for a in args], **{k: _cast(v, dtype, name) for k, v in kwargs.items()})

    return kernel


def cast_for_attention(args: Any, kwargs: Any, name: str) -> tuple[Any, Any]:
    """The arguments of ``scaled_dot_product_attention`` as autocast hands them to the kernel
    (unchanged when autocast is off for ``name``)."""
    if not torch.is_autocast_enabled(name):
        return args, kwargs
    dtype = torch.get_autocast_dtype(name)
    return [_cast(a, dtype, name) for a in args], {k: _cast(v, dtype, name) for k, v in kwargs.items()}


def register(name: str) -> None:
    """Registers the kernels (once per process; ``name`` is the renamed PrivateUse1)."""
    if _libs:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    for policy, names in (("lower", LOWER), ("fp32", FP32), ("fp32_dtype", FP32_DTYPE), ("promote", PROMOTE)):
        for opname in names:
            packet = getattr(torch.ops.aten, opname, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
                    continue  # out= and in-place overloads: autocast leaves them alone
                lib.impl(op._schema.name.removeprefix("aten::") + ("" if overload == "default" else f".{overload}"), _kernel(op, policy, name), "AutocastPrivateUse1")
    _libs.extend([fallback, lib])
    original = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        original()
        clear_cache()

    torch.clear_autocast_cache = clear_autocast_cache
