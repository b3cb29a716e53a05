"""Drop-in ``torch.optim.Adam``/``AdamW`` whose step runs in the Rust kernel on host buffers.

This module is torch's public surface only: arguments and their validation, param groups,
``state``, ``state_dict``/``load_state_dict``, hooks, copies. The state of each param group is a
:class:`~offload_adam.optim.state.GroupState` (flat host buffers; the entries of ``optimizer.state[p]``
are views into them, so ``state_dict()`` has torch's format), and one
:class:`~offload_adam.optim.engine.Engine` runs the steps. No math happens here.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils import _pytree

from .. import _native
from . import checkpoint, ddp
from .engine import Engine, Hyper
from .tier import HostTier, NvmeTier, Tier
from .schema import COMP_KEY, MASTER_KEY, MOMENT, STATE_DTYPES, check_moment, copy_moment, moments, write_moment
from .state import GroupState, is_dtensor, same_sharding

# The one reader of `_step_supports_amp_scaling` that gets True (every torch GradScaler, FSDP's
# ShardedGradScaler included, inherits this step).
_GRAD_SCALER_STEP = torch.amp.GradScaler.step.__code__

__all__ = ["Adam", "AdamW"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
_OFFLOAD_MODES = ("cpu", "nvme")
log = logging.getLogger("offload_adam")


def _to_scalar(x: Any) -> Any:
    """torch's ``_to_scalar``: a 1-element tensor becomes 0-d; anything else is kept."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


def _float(x: Any, what: str) -> float:
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        return float(x.item())
    return float(x)


def _check_init(lr: Any, betas: Any, eps: float, weight_decay: float, foreach: bool | None, capturable: bool) -> None:
    """torch's checks of ``Adam.__init__``, in its order and with its messages (plus NaN and inf
    learning rates, which the kernel refuses)."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr or math.isinf(float(lr)):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (
        (isinstance(betas[0], float) and isinstance(betas[1], float))
        or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))
    ):
        raise ValueError("betas must be either both floats or both Tensors")
    for k in (0, 1):
        if isinstance(betas[k], Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{k}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[k].numel() != 1:
                raise ValueError(f"Tensor betas[{k}] must be 1-element")


def _hyper(group: dict[str, Any]) -> Hyper:
    """A param group's hyper-parameters as the kernel takes them, checked: the one place they
    enter the kernel (any pair for betas: a tuple, a list from a config file, tensors)."""
    lr = _float(group["lr"], "lr")
    if not 0.0 <= lr or math.isinf(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    try:
        b1, b2 = group["betas"]
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats, got {group['betas']!r}") from None
    b1, b2 = _float(b1, "betas[0]"), _float(b2, "betas[1]")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b1}")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b2}")
    eps, wd = float(group["eps"]), float(group["weight_decay"])
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= wd:
        raise ValueError(f"Invalid weight_decay value: {wd}")
    return (lr, b1, b2, eps, wd, bool(group["decoupled_weight_decay"]), bool(group["amsgrad"]), bool(group["maximize"]))


class _Entry(dict):  # type: ignore[type-arg]
    """An entry of ``optimizer.state``: notes when code other than ours writes it."""

    def __init__(self, *args: Any, owner: _State | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.owner = owner

    def _touch(self) -> None:
        if self.owner is not None:
            self.owner.dirty = True

    def __setitem__(self, k: Any, v: Any) -> None:
        self._touch()
        super().__setitem__(k, v)

    def __delitem__(self, k: Any) -> None:
        self._touch()
        super().__delitem__(k)

    def update(self, *a: Any, **kw: Any) -> None:
        self._touch()
        super().update(*a, **kw)

    def pop(self, *a: Any) -> Any:
        self._touch()
        return super().pop(*a)

    def setdefault(self, *a: Any) -> Any:
        self._touch()
        return super().setdefault(*a)

    def clear(self) -> None:
        self._touch()
        super().clear()

    def __reduce__(self) -> Any:
        # `state_dict()` hands out these very entries, as torch hands out its state's dicts:
        # pickled (torch.save) as an OrderedDict, which torch.load's weights-only unpickler
        # accepts (it refuses a dict subclass rebuilt through `dict`).
        return (OrderedDict, (list(self.items()),))

    def __copy__(self) -> dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


# torch's pytree (torch.distributed.checkpoint walks state dicts with it) sees an entry as the
# dict it is; without this a dict subclass would be a leaf, its tensors invisible.
_pytree.register_pytree_node(
    _Entry,
    _pytree._dict_flatten,
    _pytree._dict_unflatten,
    serialized_type_name="offload_adam.optimizer._Entry",
    flatten_with_keys_fn=_pytree._dict_flatten_with_keys,
)


class _State(defaultdict):  # type: ignore[type-arg]
    """``optimizer.state``: a defaultdict that notes writes by code other than ours, so that the
    next step takes them over (``ZeroRedundancyOptimizer`` assigns ``optim.state[p] = {...}``)."""

    def __init__(self) -> None:
        super().__init__(dict)
        self.dirty = False

    def __missing__(self, key: Any) -> Any:
        v = _Entry(owner=self)
        dict.__setitem__(self, key, v)
        return v

    def install(self, key: Any, value: dict[str, Any]) -> None:
        """Our own write: no takeover needed."""
        dict.__setitem__(self, key, _Entry(value, owner=self))

    def __setitem__(self, k: Any, v: Any) -> None:
        self.dirty = True
        super().__setitem__(k, v)

    def __delitem__(self, k: Any) -> None:
        self.dirty = True
        super().__delitem__(k)

    def update(self, *a: Any, **kw: Any) -> None:
        self.dirty = True
        super().update(*a, **kw)

    def pop(self, *a: Any) -> Any:
        self.dirty = True
        return super().pop(*a)

    def setdefault(self, *a: Any) -> Any:
        self.dirty = True
        return super().setdefault(*a)

    def clear(self) -> None:
        self.dirty = True
        super().clear()

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


# Every key the schema may put in an entry, in any codec.
_SCHEMA_KEYS = frozenset({MASTER_KEY, COMP_KEY} | {m.key + s for m in moments(True) for s in ("", "_codes", "_absmax", "_scale")})


def _unaliased(entry: dict[str, Any], ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """``entry`` with every tensor that shares memory with one of ``ranges`` (our buffers)
    replaced by a copy, so that writing the buffers cannot change the source."""

    def aliases(t: Tensor) -> bool:
        st = _local(t).untyped_storage()
        lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
        return hi > lo and any(a < hi and lo < b for a, b in ranges)

    return {k: x.clone() if isinstance(x, Tensor) and aliases(x) else x for k, x in entry.items()}


def _optimizer_doc(name: str) -> str:
    """The docstring of ``Adam`` and of ``AdamW``: the same arguments (AdamW has no
    ``decoupled_weight_decay`` and decays by 1e-2 by default), written once, so that
    ``help(AdamW)`` shows them all."""
    adamw = name == "AdamW"
    what = (
        "AdamW (decoupled weight decay) on the CPU with a fused SIMD multithreaded kernel; a drop-in for\n"
        "    ``torch.optim.AdamW``."
        if adamw
        else "Adam on the CPU with a fused SIMD multithreaded kernel; a drop-in for ``torch.optim.Adam``."
    )
    decay = (
        "decoupled weight decay: each step multiplies the weights by\n"
        "            ``1 - lr * weight_decay`` (default: 1e-2)"
        if adamw
        else "an L2 penalty added to the gradient, or decoupled with ``decoupled_weight_decay=True``\n            (default: 0)"
    )
    decoupled = (
        ""
        if adamw
        else "        decoupled_weight_decay: apply the weight decay as AdamW does (default: False).\n"
    )
    return f"""{what}

    Same arguments, defaults, validation and ``state_dict`` format as ``torch.optim.{name}``, and the
    same update, element by element (over 200 steps of every mode, within 2e-5 of torch's weights
    at lr 1e-3; see the docs' optimizer guide). The step runs on the CPU in a Rust kernel, on flat
    host buffers that hold the optimizer state:

    * CPU parameters are updated in place.
    * CUDA parameters are offloaded: their fp32 masters and moments live in pinned host memory
      (``offload="cpu"``) or on an SSD (``offload="nvme"``), gradients stream to the host during
      backward, and the updated weights stream back after the step. The GPU keeps only the
      model's own weights and a window of gradients.
    * Weights streamed by ``offload_adam.offload_weights`` (build the optimizer after it) are
      updated in their host copy, which the next forward streams.

    For example:

        opt = offload_adam.{name}(model.parameters(), lr=3e-4, weight_decay=0.1)
        opt = offload_adam.{name}(model.parameters(), lr=3e-4, offload="nvme", nvme_dir="/mnt/nvme/scratch")

    Args:
        params: iterable of parameters or named parameters, or of dicts defining param groups.
            Supported: float32, bfloat16, float16 and complex64 tensors on the CPU (dense in
            memory), float32/bfloat16/float16 CUDA tensors (offloaded), FSDP2 DTensors.
        lr: learning rate, a float or a 1-element tensor (default: 1e-3).
        betas: coefficients of the running averages of the gradient and of its square
            (default: (0.9, 0.999)).
        eps: term added to the denominator for numerical stability (default: 1e-8).
        weight_decay: {decay}.
        amsgrad: use the AMSGrad variant, which keeps the maximum of the second moment
            (default: False).
        maximize: maximize the objective instead of minimizing it (default: False).
        foreach: accepted and ignored (default: None): the kernel is always fused over all
            tensors.
        capturable: must be False (default): the step runs on the CPU, outside any CUDA graph.
        differentiable: must be False (default): the step is not recorded by autograd.
        fused: accepted and ignored (default: None; False or True accepted too): the kernel is
            always fused.
{decoupled}        num_threads: threads of the kernel's private pool (default: None, which means
            ``torch.get_num_threads()``). Results are bitwise identical for any value.
        state_dtype: dtype of the moments (default: ``torch.float32``). ``torch.bfloat16`` halves
            their memory (the update is computed in fp32 and rounded to nearest even).
            ``torch.uint8``: 8-bit block-quantized moments as torchao's ``AdamW8bit`` defines
            them (blocks of 256 with a float32 absmax, its signed and unsigned dynamic maps, its
            update arithmetic): a quarter of fp32's bytes. Tensors torchao does not quantize
            (under 4096 elements, not whole blocks, complex) keep float32 moments; ``state[p]``
            then holds ``exp_avg_codes``/``exp_avg_absmax`` (and the same for ``exp_avg_sq`` and
            ``max_exp_avg_sq``) instead of ``exp_avg``: ``offload_adam.dequantized`` turns such a
            state dict into one torch loads. ``torch.float8_e4m3fn``: fp8 moments as torchao's
            ``AdamWFp8`` defines them (blocks of 256 with a float32 scale ``absmax / 448``, codes
            ``(x / scale)`` rounded to float8_e4m3fn, its update arithmetic), the same bytes as
            uint8 and the same float32 fallback; ``state[p]`` holds ``exp_avg_codes``
            (float8_e4m3fn) and ``exp_avg_scale``.
        master_dtype: the weights' master copy (default: ``torch.float32``: a bfloat16/float16
            parameter keeps an fp32 master, 4 bytes per parameter). ``torch.bfloat16``: a bfloat16
            parameter keeps none; its weights are updated in place with Kahan compensation, one
            bfloat16 buffer per parameter (``state[p]["kahan_comp"]``, 2 bytes per parameter), as
            torch-optimi's ``kahan_sum``. For CPU parameters and weights streamed by
            ``offload_weights``; float16 parameters keep their fp32 master.
        offload: where the optimizer state lives between steps (default: ``"cpu"``): ``"cpu"``,
            host memory (pinned for CUDA parameters); ``"nvme"``, files on an SSD under
            ``nvme_dir``, each bucket a page read into RAM just before its step and written back
            after it, so the RAM the state holds is a window of a few buckets whatever the
            model's size. At construction the optimizer logs (logger ``offload_adam``, INFO) the
            bytes it will write per step and the terabytes per 1000 steps.
        bias_correction: apply Adam's bias correction (default: True, as torch).
        free_gradients: CUDA parameters only: free each GPU gradient once it is on the host, so
            the GPU holds at most a window of buckets of gradients (default: False: ``p.grad``
            stays, as in torch, for code that reads or edits it between backward and step).
            Refused with GradScaler and under DDP.
        async_step: CUDA parameters only: ``step()`` returns at once and each module's forward
            waits only for the buckets it reads (default: False). Read weights outside a forward
            (an EMA, ``model.state_dict()``, ``p.cpu()``) only after ``optimizer.synchronize()``.
        bucket_mb: size of a gradient transfer bucket, and of a page of the NVMe tier, in MiB of
            gradient (default: 32).
        nvme_dir: with ``offload="nvme"`` (and only then): an existing directory on an SSD
            (default: None). The optimizer makes its own run directory under it
            (``offload-adam-run-<host>-<pid>-<random>``), checks the free space at construction
            and removes the directory at ``close()``, at garbage collection and at exit.
        host_budget_gb: with ``offload="nvme"``: GiB of the state kept in RAM instead of on the
            SSD (default: 0.0). The first buckets, which the next forward needs first, stay
            resident and are never written. Ignored with ``offload="cpu"``.
        nvme_read_ahead: with ``offload="nvme"``: buckets read ahead of the one being stepped
            (default: 2).

    Methods beyond torch's: ``clip_grad_norm_(max_norm)`` (the fast path: the norm on the host
    copies, the coefficient folded into the kernel), ``synchronize()``, ``memory_report()``,
    ``save_state(dir)``/``load_state(dir)`` (streaming checkpoints whose RAM stays within the
    window), ``close()``, ``register_ddp_hook(ddp_model)`` and the property ``last_step_stats``.

    A bfloat16/float16 parameter gets an fp32 master copy (``state[p]["master_param"]``) unless
    ``master_dtype=torch.bfloat16``; the kernel updates the master and writes the rounded weights
    into the parameter in the same pass. If the parameter's value no longer equals its rounded
    master (a checkpoint was loaded into the model, or it was edited), the kernel first takes the
    parameter's value as the master. Parameters on the meta device are bound at the first step,
    once materialized (``module.to_empty()``). Bad input raises before anything changes.
    """


class Adam(Optimizer):
    __doc__ = _optimizer_doc("Adam")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        num_threads: int | None = None,
        state_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        offload: str = "cpu",
        bias_correction: bool = True,
        free_gradients: bool = False,
        async_step: bool = False,
        bucket_mb: float = 32,
        nvme_dir: str | None = None,
        host_budget_gb: float = 0.0,
        nvme_read_ahead: int = 2,
    ) -> None:
        _check_init(lr, betas, eps, weight_decay, foreach, capturable)
        if capturable:
            raise ValueError(
                "capturable=True is not supported: offload_adam runs the step on the CPU, "
                "which a CUDA graph cannot capture"
            )
        if differentiable:
            raise ValueError("differentiable=True is not supported: the fused kernel is not recorded by autograd")
        if fused not in (None, False, True):
            raise ValueError(f"fused must be None, False or True, got {fused!r}")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        if master_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"master_dtype must be torch.float32 or torch.bfloat16, got {master_dtype}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"state_dtype must be torch.float32, torch.bfloat16, torch.uint8 or torch.float8_e4m3fn, got {state_dtype}"
            )
        if offload not in _OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {_OFFLOAD_MODES}, got {offload!r}")
        if num_threads is None:
            num_threads = torch.get_num_threads()
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        if offload == "nvme" and nvme_dir is None:
            raise ValueError('offload="nvme" needs nvme_dir: a directory on the SSD that holds the state')
        if offload != "nvme" and nvme_dir is not None:
            raise ValueError(f'nvme_dir is only used with offload="nvme", got offload={offload!r}')
        if not (isinstance(host_budget_gb, (int, float)) and host_budget_gb >= 0):
            raise ValueError(f"host_budget_gb must be a number >= 0, got {host_budget_gb!r}")
        if offload != "nvme" and host_budget_gb:
            raise ValueError(
                f'host_budget_gb is only used with offload="nvme" (the state kept in RAM, the rest on the SSD), '
                f"got offload={offload!r}: with offload='cpu' all of the state is in RAM"
            )
        if isinstance(nvme_read_ahead, bool) or not isinstance(nvme_read_ahead, int) or nvme_read_ahead < 0:
            raise ValueError(f"nvme_read_ahead must be an int >= 0, got {nvme_read_ahead!r}")
        _native.simd_path()  # raises now if OFFLOAD_ADAM_SIMD names a path this CPU lacks
        self._configure(
            num_threads=num_threads,
            state_dtype=state_dtype,
            master_dtype=master_dtype,
            offload=offload,
            bias_correction=bool(bias_correction),
            free_gradients=bool(free_gradients),
            async_step=bool(async_step),
            bucket_bytes=int(bucket_mb * (1 << 20)),
            nvme_dir=None if nvme_dir is None else str(nvme_dir),
            host_budget_bytes=int(host_budget_gb * (1 << 30)),
            nvme_read_ahead=nvme_read_ahead,
        )
        defaults = dict(
            lr=lr,
            betas=(_to_scalar(betas[0]), _to_scalar(betas[1])),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        eng = self._engine
        if (free_gradients or async_step) and eng.streamed is None and not eng._deferred:
            warnings.warn(
                "offload_adam: free_gradients=True and async_step=True apply to parameters on a GPU (their gradients "
                "copied to the host, the step overlapped with the next forward); every parameter here is on the CPU, "
                "where the step reads .grad in place inside step(): they change nothing",
                stacklevel=2,
            )
        tier = self._engine.tier
        if isinstance(tier, NvmeTier):
            per_step = tier.bytes_per_step() // 2
            log.info(
                "offload_adam: %.3f GB of optimizer state on NVMe under %s (%.3f GB kept in RAM): "
                "%.3f GB written per step, %.2f TB per 1000 steps; weigh it against the drive's rated endurance (TBW)",
                tier.memory()["nvme_bytes"] / 1e9, tier.path, tier.memory()["host_state_bytes"] / 1e9,
                per_step / 1e9, per_step * 1000 / 1e12,
            )  # fmt: skip

    def _configure(self, **config: Any) -> None:
        self._config = config
        self.offload = config["offload"]
        self._clip_coef = 1.0
        self._engine = Engine(
            num_threads=config["num_threads"],
            bias_correction=config["bias_correction"],
            async_step=config["async_step"],
            free_gradients=config["free_gradients"],
            bucket_bytes=config["bucket_bytes"],
            tier=self._make_tier(config),
            master_dtype=config.get("master_dtype", torch.float32),
        )

    def _make_tier(self, config: dict[str, Any]) -> Tier:
        """Where the state lives between steps, as ``offload`` chose (a subclass may hold it
        elsewhere: the tests' evicting tier)."""
        if config["offload"] == "nvme":
            return NvmeTier(config["nvme_dir"], host_budget_bytes=config["host_budget_bytes"], read_ahead=config["nvme_read_ahead"])
        return HostTier()

    @property  # type: ignore[override]
    def state(self) -> _State:
        # AttributeError, not KeyError, where it is missing: a wrapper that takes our class
        # without our instance dict (Lightning's LightningOptimizer) then forwards to us.
        try:
            return self.__dict__["_state"]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError("state") from None

    @state.setter
    def state(self, value: Any) -> None:
        s = _State()
        for k, v in dict(value).items():
            dict.__setitem__(s, k, _Entry(v, owner=s) if type(v) is dict else v)
        s.dirty = bool(s)
        self.__dict__["_state"] = s

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True for torch's GradScaler only: its step then hands ours the scale and the inf
        flag, and the kernel unscales on the host as it reads the gradients (offloaded ones
        cross once, with no unscale on the device that would make them cross again). Every
        other reader sees False, as for torch's AdamW: Lightning's precision plugins refuse to
        clip for an optimizer that declares it (under bf16-mixed too, with no scaler at all),
        and under 16-mixed unscale the gradients themselves before clipping (then the step,
        told so by GradScaler, copies them again: see step)."""
        return sys._getframe(1).f_code is _GRAD_SCALER_STEP
    def register_ddp_hook(self, model: Any, process_group: Any = None) -> None:
        """Makes ``model`` (a ``DistributedDataParallel`` over this optimizer's offloaded
        parameters) hand over its averaged gradients: each crosses to the host once, bucket by
        bucket as DDP reduces them (see ``offload_adam.register_ddp_hook``).

        Args:
            model: the ``DistributedDataParallel`` module.
            process_group: the group DDP's all-reduce runs on (default: None, DDP's own).
        """
        ddp.install(model, self._engine, process_group)

    def close(self) -> None:
        """Waits for a running step and releases what the optimizer holds outside the process's
        memory: with ``offload="nvme"`` its files are removed (also done when the optimizer is
        garbage-collected, and at interpreter exit). The optimizer cannot step afterwards."""
        self._engine.close()

    def __del__(self) -> None:
        engine = self.__dict__.get("_engine")
        if engine is not None:
            try:
                engine.close()
            except Exception:  # interpreter shutdown
                pass

    # -- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, then the group's host state. On any error the optimizer
        is left as it was.

        Args:
            param_group: a dict with ``params`` and any hyper-parameters of the group (the
                optimizer's defaults fill the rest).
        """
        if isinstance(param_group, dict):
            _hyper({**self.defaults, **param_group})
            for k in ("capturable", "differentiable"):
                if param_group.get(k):
                    raise ValueError(f"{k}=True is not supported by offload_adam")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[-1]
        try:
            self._check_group(group, gi)
            names = [self._name(group, gi, i) for i in range(len(group["params"]))]
            self._engine.add_group(gi, group["params"], names, self._config["state_dtype"], bool(group["amsgrad"]))
        except BaseException:
            self.param_groups.pop()
            raise

    def _name(self, group: dict[str, Any], gi: int, i: int) -> str:
        p = group["params"][i]
        names = group.get("param_names")
        label = f"parameter {names[i]!r}" if names else f"parameter {i}"
        return f"{label} of param group {gi} (shape {tuple(p.shape)}, {p.dtype})"

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        params: list[Tensor] = group["params"]
        unique = list(dict.fromkeys(params))
        if len(unique) != len(params):
            # torch warned already; it would step such a parameter twice, we step it once.
            group["params"] = unique
            if "param_names" in group:
                names = dict(zip(map(id, reversed(params)), reversed(group["param_names"])))
                group["param_names"] = [names[id(p)] for p in unique]
        for i, p in enumerate(group["params"]):
            name = self._name(group, gi, i)
            if type(p).__torch_dispatch__ is not Tensor.__torch_dispatch__ and not is_dtensor(p):
                # A wrapper subclass has no memory of its own to update in place; a DTensor
                # (FSDP2) is stepped through its local shard.
                raise TypeError(
                    f"{name}: a {type(p).__name__} is not supported: it has no memory of its own to update "
                    "in place; pass plain tensors, or DTensors (FSDP2) whose local shards are plain tensors"
                )
            if p.layout != torch.strided:
                raise TypeError(f"{name}: layout {p.layout} is not supported, only dense (strided) tensors")
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{name}: dtype {p.dtype} is not supported (float32, bfloat16, float16, complex64)")

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs a single optimization step.

        Args:
            closure: a callable that reevaluates the model and returns the loss (default: None).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # GradScaler (torch.amp) hands a fused optimizer the scale and the inf flag instead of
        # unscaling the gradients itself: a step with an inf/NaN is skipped (nothing advances),
        # otherwise 1/scale is folded into the kernel together with the clipping coefficient.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self._engine.streamed is not None and self._config["free_gradients"] and grad_scale is not None:
            raise NotImplementedError(
                "GradScaler with free_gradients=True is not supported: GradScaler looks for infs in GPU "
                "gradients, which free_gradients frees; use free_gradients=False (bf16 needs no scaler)"
            )
        self.synchronize()
        hypers = []
        for gi, g in enumerate(self.param_groups):
            try:
                hypers.append(_hyper(g))
            except ValueError as e:
                raise ValueError(f"param group {gi}: {e}") from None
        self._take_over()
        needs_max = [(gi, g) for gi, g in self._engine.live_groups() if hypers[gi][6] and g.max_exp_avg_sq is None]
        if needs_max:  # amsgrad switched on: the maximum starts from the state as it is
            with self._engine.resident():
                for gi, state in needs_max:
                    state.ensure_amsgrad()
                    for i, p in enumerate(state.keys):
                        entry = dict.get(self.state, p)
                        if entry:
                            fresh = state.entry(i)
                            for key in state.codecs[i].keys(MOMENT["max_exp_avg_sq"]):
                                dict.__setitem__(entry, key, fresh[key])
        gs = grad_scale if isinstance(grad_scale, Tensor) or grad_scale is None else torch.tensor(float(grad_scale))
        # GradScaler gives an inf flag without a scale when unscale_(self) ran before its step:
        # the device gradients were divided in place (by a kernel that does not bump their
        # version) after the backward's copies were queued, which may have read them before.
        first = self._engine.step(
            hypers, scale=self._clip_coef, grad_scale=gs, found_inf=found_inf, regather=found_inf is not None and gs is None
        )
        self._clip_coef = 1.0
        for gi, i in first:
            new = self._engine.groups[gi]
            assert new is not None
            self.state.install(new.keys[i], new.entry(i))
        if not self._config["async_step"]:
            self._drop_unstepped()
        return loss

    def _drop_unstepped(self) -> None:
        for gi, i in self._engine.unstepped():
            g = self._engine.groups[gi]
            assert g is not None
            dict.pop(self.state, g.keys[i], None)

    def synchronize(self) -> None:
        """Waits until an ``async_step=True`` step has updated every weight (a no-op otherwise),
        and raises an error the step's worker met."""
        try:
            self._engine.synchronize()
        finally:
            self._drop_unstepped()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; also forgets gradients already streamed to the host.

        Args:
            set_to_none: set the gradients to None instead of zeroing them (default: True).
        """
        self._engine.discard_grads()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """Clips the gradients of every parameter of this optimizer by their total 2-norm, like
        ``torch.nn.utils.clip_grad_norm_``, and returns the total norm (of the gradients as they
        are, so unscaled only if GradScaler unscaled them).

        The norm is computed on the host copies of offloaded gradients (and on CPU gradients),
        and the coefficient ``min(1, max_norm / (norm + 1e-6))`` is folded into the next step
        instead of rewriting the gradients: ``p.grad`` keeps its values. It works with
        ``free_gradients=True``, where torch's own function sees no gradients at all.

        Args:
            max_norm: the largest total norm the gradients may have.
            norm_type: must be 2.0 (default): the fast path computes the 2-norm only.
            error_if_nonfinite: raise if the total norm is NaN or infinite (default: False).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type: only the 2-norm is supported by the fast path, got {norm_type}")
        self._drop_unstepped()
        total = math.sqrt(self._engine.grad_sq_norm()) * self._clip_coef
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
        coef = float(max_norm) / (total + 1e-6)
        if coef < 1.0:
            self._clip_coef *= coef
        return torch.tensor(total, dtype=torch.float32)

    def memory_report(self) -> dict[str, int]:
        """Bytes the optimizer holds: ``host_bytes`` (all host buffers), ``host_tight_bytes``
        (4 B master + the moments + the gradient landing buffer per offloaded parameter, plus the
        moments and masters of CPU groups) and ``gpu_bytes`` (GPU memory the optimizer itself
        keeps between steps). With ``offload="nvme"``: ``nvme_bytes`` (state on the SSD),
        ``window_bytes`` (the most RAM its paging holds), ``window_held_bytes`` (the RAM its
        window holds now, leased to resident pages and parked for the next ones) and
        ``host_state_bytes`` (state kept in RAM by ``host_budget_gb``); ``host_bytes`` then counts
        ``window_bytes`` and ``host_state_bytes``, not the paged state."""
        held, tight = self._engine.memory()
        out = {"host_bytes": held, "host_tight_bytes": tight, "gpu_bytes": 0}
        tier = self._engine.tier.memory()
        if tier:
            out.update(tier)
        return out

    @property
    def last_step_stats(self) -> dict[str, float]:
        """Host-side timing of the last offloaded step (seconds): ``d2h_wait_s`` (waiting for
        gradients to arrive), ``cpu_step_s`` (the kernel), ``h2d_issue_s`` (queueing the
        weight copies), ``forward_wait_s`` (async mode: time forwards waited for weights),
        ``d2h_bytes`` (the gradients copied to the host for it, over all its micro-batches) and
        ``h2d_bytes`` (the weights it copied back; none for weights streamed by
        ``offload_weights``, which the step writes in their host copy). With
        ``offload="nvme"`` (every step): ``read_bytes``, ``write_bytes`` and ``io_wait_s`` (time the
        step waited for the disk), and ``cpu_step_s``."""
        return dict(self._engine.stats)

    # -- state written by others, and checkpoints -----------------------------------------------

    def _buffer_ranges(self) -> list[tuple[int, int]]:
        out = []
        for _, g in self._engine.live_groups():
            for t in g.buffers():
                st = t.untyped_storage()
                out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        return out

    def _slot_of(self) -> dict[int, tuple[int, int]]:
        return {id(p): (gi, i) for gi, g in self._engine.live_groups() for i, p in enumerate(g.keys)}

    def _check_entry(self, gi: int, i: int, v: Any, amsgrad: bool) -> float:
        """Checks a state entry for parameter ``i`` of group ``gi`` (from a checkpoint, or written
        into ``state`` by other code) against the schema; returns its step count."""
        g = self._engine.groups[gi]
        assert g is not None
        p = g.params[i]
        name = g.names[i]
        if not isinstance(v, dict):
            raise TypeError(f"loaded state of {name}: expected a dict, got {type(v).__name__}")
        if "step" not in v:
            raise ValueError(f"loaded state of {name}: missing key 'step'")
        local = self._localizer(g.keys[i], name)
        for m in moments(True):
            if check_moment(v, m, p, name, local) is None and (amsgrad or not m.amsgrad):
                raise ValueError(
                    f"loaded state of {name}: missing key {m.key!r} (or {m.key + '_codes'!r} and {m.key + '_absmax'!r} or {m.key + '_scale'!r})"
                )
        for key in (MASTER_KEY, COMP_KEY):
            t = v.get(key)
            if t is None:
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"loaded state of {name}: {key} must be a tensor, got {type(t).__name__}")
            t = local(t, key)
            if t.shape != p.shape:
                raise ValueError(f"loaded state of {name}: {key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            if not (t.is_floating_point() or t.is_complex()) or t.is_complex() != p.is_complex():
                raise TypeError(f"loaded state of {name}: {key} has dtype {t.dtype}, expected one like {p.dtype}")
        step = v["step"]
        step_f = float(step.item() if isinstance(step, Tensor) else step)
        if not (math.isfinite(step_f) and step_f >= 0 and step_f == int(step_f)):
            raise ValueError(f"loaded state of {name}: step must be a whole number >= 0, got {step_f}")
        return step_f

    @staticmethod
    def _localizer(key: Tensor, name: str) -> Callable[[Any, str], Any]:
        """A DTensor entry's local shard, checked against the parameter ``key``."""
        return lambda t, what: _local(t, key, f"loaded state of {name}: {what}")

    def _write_entry(self, gi: int, i: int, v: dict[str, Any], step: float) -> None:
        """Copies a checked entry into the slot's buffers, in the slot's codec (quantizing or
        dequantizing moments), and installs our views (keeping the entry's other keys). The
        caller quiesced the engine and cloned sources that alias our buffers."""
        g = self._engine.groups[gi]
        assert g is not None
        p = g.params[i]
        views = g.views(i)
        views["step"].fill_(step)
        codec = g.codecs[i]
        local = self._localizer(g.keys[i], g.names[i])
        for key in g.moment_buffers():
            m = MOMENT[key]
            if any(k in v for k in (m.key, m.key + "_codes")):
                write_moment(views, codec, m, v, local)
            elif m.amsgrad:
                copy_moment(views, codec, m, MOMENT["exp_avg_sq"])
        master, comp = v.get(MASTER_KEY), v.get(COMP_KEY)
        home = g.homes[i]
        weights: Tensor = home if home is not None else p
        if MASTER_KEY in views:
            # An fp32 master from the entry, or (bf16 weights with Kahan compensation) the
            # weights plus their compensation, or the weights.
            if master is not None:
                views[MASTER_KEY].copy_(local(master, MASTER_KEY))
            elif comp is not None:
                views[MASTER_KEY].copy_(weights.float() + local(comp, COMP_KEY).float())
            else:
                views[MASTER_KEY].copy_(p)
        if COMP_KEY in views:
            # The compensation from the entry, or what the weights lack of an fp32 master.
            if comp is not None:
                views[COMP_KEY].copy_(local(comp, COMP_KEY))
            elif master is not None:
                views[COMP_KEY].copy_(local(master, MASTER_KEY).float() - weights.float())
            else:
                views[COMP_KEY].zero_()
        if g.streamed:
            self._engine.master_loaded(gi, i, from_checkpoint=v.get(MASTER_KEY) is not None)
        extra = {k: x for k, x in v.items() if k not in views and k not in _SCHEMA_KEYS}
        self.state.install(g.keys[i], {**g.entry(i), **extra})

    def _reset_slot(self, gi: int, i: int) -> None:
        """An entry emptied or deleted by other code: a fresh start at the next step, as torch
        (all-zero codes and absmax are zero moments too)."""
        g = self._engine.groups[gi]
        assert g is not None
        for key, t in g.views(i).items():
            if key != MASTER_KEY:
                t.zero_()
        if g.streamed:
            self._engine.master_loaded(gi, i, from_checkpoint=False)

    def _take_over(self) -> None:
        """Takes over state written into ``self.state`` by other code since our last look: values
        and step counts are copied into our buffers and our views reinstalled, never silently
        ignored while the kernel steps its own buffers."""
        st = self.state
        if not st.dirty:
            return
        self._engine.quiesce()
        with self._engine.resident():
            self._take_over_resident(st)

    def _take_over_resident(self, st: _State) -> None:
        ours = self._buffer_ranges()
        plan: list[tuple[int, int, dict[str, Any] | None, float]] = []
        for gi, g in self._engine.live_groups():
            amsgrad = bool(self.param_groups[gi]["amsgrad"])
            for i, p in enumerate(g.keys):
                entry = dict.get(st, p)
                if not entry:
                    if float(g.steps[i]) != 0.0:
                        plan.append((gi, i, None, 0.0))
                    continue
                views = g.views(i) if float(g.steps[i]) != 0.0 else {}
                if isinstance(entry, _Entry) and views and all(entry.get(k) is not None and _same_view(_local(entry[k]), t) for k, t in views.items()):
                    continue
                step = self._check_entry(gi, i, entry, amsgrad)
                plan.append((gi, i, _unaliased(entry, ours), step))
        with torch.no_grad():
            for gi, i, entry_src, step in plan:
                if entry_src is None:
                    self._reset_slot(gi, i)
                else:
                    self._write_entry(gi, i, entry_src, step)
        st.dirty = False

    def state_dict(self) -> dict[str, Any]:
        """torch's format, aliasing the live state as torch's does: each parameter's entry is the
        very dict ``optimizer.state[p]`` holds, its tensors (``step`` included) views of this
        optimizer's buffers, so a state dict held while training goes on stays consistent. Where
        the tier's views do not stay valid between steps (``offload="nvme"``), copies."""
        self.synchronize()
        self._take_over()
        if self._engine.tier.stable_views:
            return super().state_dict()
        with self._engine.resident(write=False):
            sd = super().state_dict()
            sd["state"] = {
                k: {kk: vv.clone() if isinstance(vv, Tensor) else vv for kk, vv in v.items()} if isinstance(v, dict) else v
                for k, v in sd["state"].items()
            }
        return sd

    def _merge_groups(self, saved_groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[Any, tuple[int, int]]]:
        """The param groups a checkpoint's groups make (checked), and the (group, slot) of each
        saved parameter id."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        where: dict[Any, tuple[int, int]] = {}
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if "params" not in sg or len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            for i, k in enumerate(sg["params"]):
                where[k] = (gi, i)
        merged = []
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            new = {**self.defaults, **sg, "params": g["params"]}
            if "param_names" in g:
                new["param_names"] = g["param_names"]
            if isinstance(self, AdamW):  # as AdamW.__setstate__ does in torch, for subclasses too
                new["decoupled_weight_decay"] = True
            try:
                _hyper(new)
            except ValueError as e:
                raise ValueError(f"loaded param group {gi}: {e}") from None
            if isinstance(new["betas"], list):
                new["betas"] = tuple(new["betas"])  # a list from JSON/YAML or DCP's full state dict
            merged.append(new)
        return merged, where

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch's format (from this class or from ``torch.optim.Adam``/``AdamW``) into the
        host buffers, in their dtypes. Everything is checked first: on error nothing changes.

        Args:
            state_dict: what ``state_dict()`` of this class or of torch's Adam/AdamW returned.
        """
        self.synchronize()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"loaded state dict has no {key!r} key")
        merged, where = self._merge_groups(state_dict["param_groups"])
        self._engine.synchronize()
        self._engine.materialize()
        plan: list[tuple[int, int, dict[str, Any], float]] = []
        extras: dict[Any, Any] = {}
        for k, v in state_dict["state"].items():
            if k not in where:
                if isinstance(k, int):
                    raise ValueError(f"loaded state dict has state for parameter {k!r}, which no group lists")
                extras[k] = v  # a non-parameter key (a state_dict pre-hook's): carried, as torch does
                continue
            gi, i = where[k]
            if isinstance(v, dict) and not v:  # an entry read before its first step: no state yet
                extras[self.param_groups[gi]["params"][i]] = _Entry()
                continue
            plan.append((gi, i, v, self._check_entry(gi, i, v, bool(merged[gi]["amsgrad"]))))

        # Everything checked: apply. A source may be a view of our own buffers
        # (`load_state_dict(state_dict())`, or torch.distributed.checkpoint filling the tensors we
        # handed out, then loading them): zeroing the buffers would erase it, so such sources are
        # copied first.
        self._engine.quiesce()
        for g, new in zip(self.param_groups, merged):
            g.clear()
            g.update(new)
        live = self._engine.live_groups()
        ours = self._buffer_ranges()
        plan = [(gi, i, _unaliased(v, ours), step) for gi, i, v, step in plan]
        with torch.no_grad(), self._engine.resident():
            for gi, state in live:
                if merged[gi]["amsgrad"]:
                    state.ensure_amsgrad()
            dict.clear(self.state)
            for gi, state in live:
                for t in state.state_buffers():
                    t.zero_()
                if state.streamed:
                    for i in range(len(state)):
                        self._engine.master_loaded(gi, i, from_checkpoint=False)
            for gi, i, v, step in plan:
                self._write_entry(gi, i, v, step)
            for k, v in extras.items():
                if isinstance(v, _Entry):
                    v.owner = self.state
                dict.__setitem__(self.state, k, v)
        self.state.dirty = False
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- streaming checkpoints ------------------------------------------------------------------

    def _ids(self) -> list[list[int]]:
        """The ``state_dict()`` id of each parameter, by group."""
        out, start = [], 0
        for g in self.param_groups:
            out.append(list(range(start, start + len(g["params"]))))
            start += len(g["params"])
        return out

    def save_state(self, path: str) -> str:
        """Writes the optimizer state to ``path/optimizer.safetensors`` (a directory, created if
        needed), bucket by bucket: RAM stays within the tier's window, whatever the state's size.
        The file is complete or absent: it is written under a temporary name, then renamed over
        the previous one. Returns the file's path. See ``offload_adam.optim.checkpoint``.

        Args:
            path: the checkpoint's directory.
        """
        self.synchronize()
        self._take_over()
        os.makedirs(path, exist_ok=True)
        eng = self._engine
        ids = self._ids()
        packed = [{**{k: v for k, v in g.items() if k != "params"}, "params": ids[gi]} for gi, g in enumerate(self.param_groups)]
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        plan: list[tuple[GroupState, list[tuple[int, int, list[str]]]]] = []
        complex_ids = []
        for gi, g in eng.live_groups():
            for rng in g.buckets:
                items = []
                for i in rng:
                    p = g.keys[i]
                    if not dict.get(self.state, p):
                        continue
                    pid = ids[gi][i]
                    views = g.views(i)
                    keys = list(views)
                    items.append((i, pid, keys))
                    for key in keys:
                        t = views[key]
                        real = torch.view_as_real(t) if t.is_complex() else t
                        layout.append((f"state.{pid}.{key}", real.dtype, tuple(real.shape)))
                    if p.is_complex():
                        complex_ids.append(pid)
                if items:
                    plan.append((g, items))
        meta = {
            "format": checkpoint.FORMAT,
            "param_groups": json.dumps(checkpoint.jsonable(packed)),
            "complex": json.dumps(complex_ids),
        }
        file = os.path.join(path, checkpoint.FILE)
        w = checkpoint.Writer(file, layout, meta)
        try:
            for g, items in plan:
                with eng.resident((g, [i for i, _, _ in items]), write=False):
                    for i, pid, keys in items:
                        views = g.views(i)
                        for key in keys:
                            w.write(f"state.{pid}.{key}", views[key])
            eng.tier.end_step()
            w.commit()
        except BaseException:
            w.abort()
            raise
        return file

    def load_state(self, path: str) -> None:
        """Loads a checkpoint written by ``save_state`` (into any tier: the state is read bucket by
        bucket). Everything is checked first: on error nothing changes.

        Args:
            path: the directory ``save_state`` wrote.
        """
        self.synchronize()
        r = checkpoint.Reader(os.path.join(path, checkpoint.FILE))
        try:
            self._load_state(r)
        finally:
            r.close()

    def _load_state(self, r: checkpoint.Reader) -> None:
        if r.metadata.get("format") != checkpoint.FORMAT:
            raise ValueError(f"{r.path}: not an offload_adam optimizer checkpoint (format {r.metadata.get('format')!r})")
        merged, where = self._merge_groups(json.loads(r.metadata["param_groups"]))
        complex_ids = set(json.loads(r.metadata.get("complex", "[]")))
        by_id: dict[int, dict[str, checkpoint.Entry]] = defaultdict(dict)
        for name, e in r.entries.items():
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
                raise ValueError(f"{r.path}: unexpected tensor {name!r}")
            by_id[int(parts[1])][parts[2]] = e
        eng = self._engine
        eng.synchronize()
        eng.materialize()
        steps: dict[int, float] = {}
        for pid, entries in by_id.items():
            if pid not in where:
                raise ValueError(f"{r.path}: state for parameter {pid}, which no group lists")
            gi, i = where[pid]
            if "step" not in entries:
                raise ValueError(f"{r.path}: parameter {pid} has no step")
            meta: dict[str, Any] = {"step": r.read(f"state.{pid}.step")}
            for key, e in entries.items():
                if key != "step":
                    t = torch.empty(e.shape, dtype=e.dtype, device="meta")
                    meta[key] = torch.view_as_complex(t) if pid in complex_ids else t
            steps[pid] = self._check_entry(gi, i, meta, bool(merged[gi]["amsgrad"]))
        # Checked: apply, bucket by bucket.
        eng.quiesce()
        for g, new in zip(self.param_groups, merged):
            g.clear()
            g.update(new)
        live = eng.live_groups()
        if any(merged[gi]["amsgrad"] and gs.max_exp_avg_sq is None for gi, gs in live):
            with eng.resident():
                for gi, gs in live:
                    if merged[gi]["amsgrad"]:
                        gs.ensure_amsgrad()
        dict.clear(self.state)
        ids = self._ids()
        with torch.no_grad():
            for gi, gs in live:
                for rng in gs.buckets:
                    with eng.resident((gs, rng)):
                        for i in rng:
                            pid = ids[gi][i]
                            if pid not in by_id:
                                views = gs.views(i)
                                for key, v in views.items():
                                    if key != "master_param" or not gs.streamed:
                                        v.zero_()
                                if gs.streamed:
                                    eng.master_loaded(gi, i, from_checkpoint=False)
                                continue
                            entry: dict[str, Any] = {}
                            for key in by_id[pid]:
                                t = r.read(f"state.{pid}.{key}")
                                entry[key] = torch.view_as_complex(t) if pid in complex_ids and key != "step" else t
                            self._write_entry(gi, i, entry, steps[pid])
        eng.tier.end_step()
        self.state.dirty = False

    # -- copies ---------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        self.synchronize()
        self._take_over()
        copy_all = not self._engine.tier.stable_views
        with self._engine.resident(write=False):
            state = {
                k: {kk: vv.clone() if copy_all and isinstance(vv, Tensor) else vv for kk, vv in v.items()}
                if isinstance(v, dict)
                else v
                for k, v in self.state.items()
            }
        return {"defaults": self.defaults, "state": state, "param_groups": self.param_groups, "_config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds the host buffers of a copy (``copy.deepcopy``, ``torch.load`` of a pickled
        optimizer): the copy owns its own and steps identically to the original."""
        state = dict(state)
        config = state.pop("_config", None)
        saved = state.pop("state", {})
        super().__setstate__(state)
        self.state = {}
        if config is None:  # pickled by something else than __getstate__
            raise TypeError("cannot restore an offload_adam optimizer without its configuration")
        self._configure(**config)
        for gi, group in enumerate(self.param_groups):
            names = [self._name(group, gi, i) for i in range(len(group["params"]))]
            self._engine.add_group(gi, group["params"], names, config["state_dtype"], bool(group["amsgrad"]))
        self._engine.materialize()
        slot = self._slot_of()
        with torch.no_grad(), self._engine.resident():
            for k, v in saved.items():
                if isinstance(k, Tensor) and id(k) in slot and isinstance(v, dict) and v:
                    gi, i = slot[id(k)]
                    self._write_entry(gi, i, v, self._check_entry(gi, i, v, bool(self.param_groups[gi]["amsgrad"])))
                else:
                    dict.__setitem__(self.state, k, v)
        self.state.dirty = False


def _local(t: Any, key: Tensor | None = None, what: str = "") -> Any:
    """A DTensor's local shard (checked against the parameter ``key``'s mesh and placements when
    given); anything else as it is."""
    if not is_dtensor(t):
        return t
    if key is not None and not same_sharding(t, key):
        raise ValueError(
            f"{what}: a DTensor with placements {t.placements} does not match its parameter's "  # type: ignore[attr-defined]
            f"{getattr(key, 'placements', 'plain tensor')}"
        )
    return t._local_tensor  # type: ignore[attr-defined]


def _same_view(a: Any, b: Tensor) -> bool:
    """Whether ``a`` is the view ``b`` of our buffers (same memory, shape and strides)."""
    return (
        isinstance(a, Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class AdamW(Adam):
    __doc__ = _optimizer_doc("AdamW")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        num_threads: int | None = None,
        state_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        offload: str = "cpu",
        bias_correction: bool = True,
        free_gradients: bool = False,
        async_step: bool = False,
        bucket_mb: float = 32,
        nvme_dir: str | None = None,
        host_budget_gb: float = 0.0,
        nvme_read_ahead: int = 2,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            num_threads=num_threads,
            state_dtype=state_dtype,
            master_dtype=master_dtype,
            offload=offload,
            bias_correction=bias_correction,
            free_gradients=free_gradients,
            async_step=async_step,
            bucket_mb=bucket_mb,
            nvme_dir=nvme_dir,
            host_budget_gb=host_budget_gb,
            nvme_read_ahead=nvme_read_ahead,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
