"""Drop-in ``torch.optim.Adam``/``AdamW`` whose step runs in the Rust kernel on host buffers.

This module is torch's public surface only, as torch's ``Adam`` is: arguments and their
validation, param groups, ``state``, the step's bookkeeping, hooks. The state of each param
group is a :class:`~offload_adam.optim.state.GroupState` (flat host buffers; the entries of
``optimizer.state[p]`` are views into them, so ``state_dict()`` has torch's format), one
:class:`~offload_adam.optim.engine.Engine` runs the steps, and the state's import and export
(``state_dict``/``load_state_dict``, state written by others, streaming checkpoints, copies) are
the functions of :mod:`offload_adam.optim.state_io`, to which the public methods hand what they
need, as torch's ``Optimizer`` base class does them for its ``Adam``. No math happens here.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import _native
from ..runtime import checks
from ..runtime.device import device_for
from . import ddp, state_io, summary
from .engine import Engine
from .hyper import check_init, hyper, to_scalar
from .schema import STATE_DTYPES
from .shards import is_dtensor
from .state_io import State
from .tier import HostTier, NvmeTier, Tier

# The one reader of `_step_supports_amp_scaling` that gets True (every torch GradScaler, FSDP's
# ShardedGradScaler included, inherits this step).
_GRAD_SCALER_STEP = torch.amp.GradScaler.step.__code__

__all__ = ["Adam", "AdamW"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
STORAGES = ("cpu", "nvme")  # where the optimizer state lives, as offload_weights and offload_activations say it
log = logging.getLogger("offload_adam")


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
      (``storage="cpu"``) or on an SSD (``storage="nvme"``), gradients stream to the host during
      backward, and the updated weights stream back after the step. The GPU keeps only the
      model's own weights and a window of gradients.
    * Weights streamed by ``offload_adam.offload_weights`` (build the optimizer after it) are
      updated in their host copy, which the next forward streams.

    For example:

        opt = offload_adam.{name}(model.parameters(), lr=3e-4, weight_decay=0.1)
        opt = offload_adam.{name}(model.parameters(), lr=3e-4, storage="nvme", nvme_dir="/mnt/nvme/scratch")

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
{decoupled}        num_threads: threads of the kernel's private pool, at most the CPUs this process may
            use (``os.sched_getaffinity``): more is refused (default: None, which means
            ``torch.get_num_threads()``, capped at those CPUs). Results are bitwise identical for
            any value.
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
        storage: where the optimizer state lives between steps (default: None, which means
            ``"cpu"``), the word ``offload_weights`` and ``offload_activations`` use for their
            bytes: ``"cpu"``, host memory (pinned for CUDA parameters); ``"nvme"``, files on an
            SSD under ``nvme_dir``, each bucket a page read into RAM just before its step and
            written back after it, so the RAM the state holds is a window of a few buckets
            whatever the model's size. At construction the optimizer logs (logger
            ``offload_adam``, INFO) the bytes it will write per step and the terabytes per 1000
            steps.
        offload: the former name of ``storage``, kept as an alias (default: None): either may be
            given, not both with different values.
        bias_correction: apply Adam's bias correction (default: True, as torch).
        free_gradients: CUDA parameters only: free each GPU gradient once it is on the host, so
            the GPU holds at most a window of buckets of gradients (default: False: ``p.grad``
            stays, as in torch, for code that reads or edits it between backward and step).
            Refused with GradScaler and under DDP.
        async_step: CUDA parameters only: ``step()`` returns at once and each module's forward
            waits only for the buckets it reads (default: False). Read weights outside a forward
            (an EMA, ``model.state_dict()``, ``p.cpu()``) only after ``optimizer.synchronize()``.
        bucket_mb: size of a gradient transfer bucket, and of a page of the NVMe tier, in MiB of
            gradient (default: 32): a number above 0, at most 1 PiB.
        nvme_dir: with ``storage="nvme"`` (and only then): an existing directory on an SSD, a
            ``str``, ``os.PathLike`` or ``bytes`` path (default: None). The optimizer makes its own run directory under it
            (``offload-adam-run-<host>-<pid>-<random>``), checks the free space at construction
            and removes the directory at ``close()``, at garbage collection and at exit.
        host_budget_gb: with ``storage="nvme"``: GiB of the state kept in RAM instead of on the
            SSD (default: 0.0), at most 1 PiB. The first buckets, which the next forward needs
            first, stay resident and are never written. Refused above 0 with ``storage="cpu"``.
        nvme_read_ahead: with ``storage="nvme"``: buckets read ahead of the one being stepped
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


def _storage(storage: str | None, offload: str | None) -> tuple[str, str]:
    """The state's storage, from ``storage`` or its alias ``offload``; and the argument's name
    as the caller gave it (for the errors that follow)."""
    if storage is not None and offload is not None and storage != offload:
        raise ValueError(
            f"storage and offload name the same choice (offload is storage's former name): got storage={storage!r} "
            f"and offload={offload!r}; give storage only"
        )
    arg = "offload" if storage is None and offload is not None else "storage"
    where = storage if storage is not None else offload if offload is not None else "cpu"
    if where not in STORAGES:
        raise ValueError(f"{arg} must be one of {STORAGES}, got {where!r}")
    return where, arg


def _config(
    *, num_threads: int | None, state_dtype: torch.dtype, master_dtype: torch.dtype, storage: str | None, offload: str | None,
    bias_correction: bool, free_gradients: bool, async_step: bool, bucket_mb: float, nvme_dir: str | None,
    host_budget_gb: float, nvme_read_ahead: int,
) -> dict[str, Any]:  # fmt: skip
    """Our own arguments (beyond torch's), checked, as the optimizer keeps them (``_config``:
    what a copy is rebuilt from)."""
    if master_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"master_dtype must be torch.float32 or torch.bfloat16, got {master_dtype}")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be torch.float32, torch.bfloat16, torch.uint8 or torch.float8_e4m3fn, got {state_dtype}"
        )
    where, arg = _storage(storage, offload)
    if num_threads is None:
        num_threads = checks.default_threads(torch.get_num_threads())
    num_threads = checks.threads(num_threads, "num_threads", optional=False)
    bucket_mb = checks.size(bucket_mb, "bucket_mb", "MiB", positive=True)
    if where == "nvme" and nvme_dir is None:
        raise ValueError(f'{arg}="nvme" needs nvme_dir: a directory on the SSD that holds the state')
    if where != "nvme" and nvme_dir is not None:
        raise ValueError(f'nvme_dir is only used with {arg}="nvme", got {arg}={where!r}')
    if nvme_dir is not None:
        nvme_dir = checks.directory(nvme_dir, "nvme_dir")
    host_budget_gb = checks.size(host_budget_gb, "host_budget_gb")
    if where != "nvme" and host_budget_gb:
        raise ValueError(
            f'host_budget_gb is only used with {arg}="nvme" (the state kept in RAM, the rest on the SSD), '
            f"got {arg}={where!r}: with {arg}='cpu' all of the state is in RAM"
        )
    if isinstance(nvme_read_ahead, bool) or not isinstance(nvme_read_ahead, int) or nvme_read_ahead < 0:
        raise ValueError(f"nvme_read_ahead must be an int >= 0, got {nvme_read_ahead!r}")
    return dict(
        num_threads=num_threads,
        state_dtype=state_dtype,
        master_dtype=master_dtype,
        storage=where,
        bias_correction=bool(bias_correction),
        free_gradients=bool(free_gradients),
        async_step=bool(async_step),
        bucket_bytes=int(bucket_mb * (1 << 20)),
        nvme_dir=None if nvme_dir is None else str(nvme_dir),
        host_budget_bytes=int(host_budget_gb * (1 << 30)),
        nvme_read_ahead=nvme_read_ahead,
    )



def _accelerator(p: Tensor) -> bool:
    """``p`` is on an accelerator the runtime streams through (not the CPU)."""
    if p.device.type in ("cpu", "meta"):
        return False
    try:
        return device_for(p.device) is not None
    except ValueError:
        return False

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
        storage: str | None = None,
        offload: str | None = None,
        bias_correction: bool = True,
        free_gradients: bool = False,
        async_step: bool = False,
        bucket_mb: float = 32,
        nvme_dir: str | None = None,
        host_budget_gb: float = 0.0,
        nvme_read_ahead: int = 2,
    ) -> None:
        check_init(lr, betas, eps, weight_decay, foreach, capturable)
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
        config = _config(
            num_threads=num_threads, state_dtype=state_dtype, master_dtype=master_dtype, storage=storage, offload=offload,
            bias_correction=bias_correction, free_gradients=free_gradients, async_step=async_step, bucket_mb=bucket_mb,
            nvme_dir=nvme_dir, host_budget_gb=host_budget_gb, nvme_read_ahead=nvme_read_ahead,
        )  # fmt: skip
        _native.simd_path()  # raises now if OFFLOAD_ADAM_SIMD names a path this CPU lacks
        self._configure(**config)
        defaults = dict(
            lr=lr,
            betas=(to_scalar(betas[0]), to_scalar(betas[1])),
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
        try:
            super().__init__(params, defaults)
        except BaseException:
            # A failed set-up (a param group refused, a full disk) leaves nothing behind: the
            # parameters unclaimed, the NVMe files closed and removed now, not at garbage collection.
            self._engine.close()
            raise
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
        if "offload" in config:  # pickled by a version that named it so
            config["storage"] = config.pop("offload")
        self._config = config
        self.storage = config["storage"]
        self._clip_coef = 1.0
        tier = self._make_tier(config)
        try:
            self._engine = Engine(
                num_threads=config["num_threads"],
                bias_correction=config["bias_correction"],
                async_step=config["async_step"],
                free_gradients=config["free_gradients"],
                bucket_bytes=config["bucket_bytes"],
                tier=tier,
                master_dtype=config.get("master_dtype", torch.float32),
            )
        except BaseException:
            tier.close()
            raise

    @property
    def offload(self) -> str:
        """The former name of :attr:`storage` (where the state lives: ``"cpu"`` or ``"nvme"``)."""
        return self.storage

    def _make_tier(self, config: dict[str, Any]) -> Tier:
        """Where the state lives between steps, as ``storage`` chose (a subclass may hold it
        elsewhere: the tests' evicting tier)."""
        if config["storage"] == "nvme":
            return NvmeTier(config["nvme_dir"], host_budget_bytes=config["host_budget_bytes"], read_ahead=config["nvme_read_ahead"])
        return HostTier()

    @property  # type: ignore[override]
    def state(self) -> State:
        # AttributeError, not KeyError, where it is missing: a wrapper that takes our class
        # without our instance dict (Lightning's LightningOptimizer) then forwards to us.
        try:
            return self.__dict__["_state"]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError("state") from None

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_state"] = state_io.as_state(value)

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
        memory: with ``storage="nvme"`` its files are removed (also done when the optimizer is
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
            hyper({**self.defaults, **param_group})
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
            if type(p).__torch_dispatch__ is not Tensor.__torch_dispatch__ and not is_dtensor(p) and not _accelerator(p):
                # A wrapper subclass has no memory of its own to update in place; a DTensor
                # (FSDP2) is stepped through its local shard; a tensor of a device the runtime
                # streams through (the test suite's simulated GPU) is streamed as a GPU's.
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
                hypers.append(hyper(g))
            except ValueError as e:
                raise ValueError(f"param group {gi}: {e}") from None
        state_io.take_over(self._engine, self.state, self.param_groups)
        state_io.switch_on_amsgrad(self._engine, self.state, [h[6] for h in hypers])
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
            self.state.install(new.slots[i].key, new.entry(i))
        if not self._config["async_step"]:
            self._drop_unstepped()
        return loss

    def _drop_unstepped(self) -> None:
        for gi, i in self._engine.unstepped():
            g = self._engine.groups[gi]
            assert g is not None
            dict.pop(self.state, g.slots[i].key, None)

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
        keeps between steps). With ``storage="nvme"``: ``nvme_bytes`` (state on the SSD),
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

    def __repr__(self) -> str:
        if "_engine" not in self.__dict__ or "param_groups" not in self.__dict__:  # (a set-up that failed half-way)
            return f"<{type(self).__name__}: not set up>"
        return summary.describe(self)  # (optim/summary.py)

    def summary(self) -> str:
        """The optimizer in words, a line per subject: its parameters and where they are, the
        state's dtypes (moments, master weights), the bytes of each tier it uses (RAM, the GPU
        where it has parameters there, NVMe with ``storage="nvme"``), the step's options
        (``optim/summary.py``)."""
        return summary.summary(self)

    @property
    def last_step_stats(self) -> dict[str, float]:
        """Host-side timing of the last offloaded step (seconds): ``d2h_wait_s`` (waiting for
        gradients to arrive), ``cpu_step_s`` (the kernel), ``h2d_issue_s`` (queueing the
        weight copies), ``forward_wait_s`` (async mode: time forwards waited for weights),
        ``d2h_bytes`` (the gradients copied to the host for it, over all its micro-batches) and
        ``h2d_bytes`` (the weights it copied back; none for weights streamed by
        ``offload_weights``, which the step writes in their host copy). With
        ``storage="nvme"`` (every step): ``read_bytes``, ``write_bytes`` and ``io_wait_s`` (time the
        step waited for the disk), and ``cpu_step_s``."""
        return dict(self._engine.stats)

    # -- the state in and out (state_io.py) ------------------------------------------------------

    def _take_over(self) -> None:
        """State written into ``self.state`` by other code since our last look is taken over."""
        state_io.take_over(self._engine, self.state, self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """torch's format, aliasing the live state as torch's does: each parameter's entry is the
        very dict ``optimizer.state[p]`` holds, its tensors (``step`` included) views of this
        optimizer's buffers, so a state dict held while training goes on stays consistent. Where
        the tier's views do not stay valid between steps (``storage="nvme"``), copies."""
        self.synchronize()
        self._take_over()
        return state_io.state_dict(self._engine, super().state_dict)

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
        state_io.load_state_dict(
            self._engine, self.state, self.param_groups, self.defaults, state_dict, decoupled=isinstance(self, AdamW)
        )
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

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
        return state_io.save_state(self._engine, self.state, self.param_groups, path)

    def load_state(self, path: str) -> None:
        """Loads a checkpoint written by ``save_state`` (into any tier: the state is read bucket by
        bucket). Everything is checked first: on error nothing changes.

        Args:
            path: the directory ``save_state`` wrote.
        """
        self.synchronize()
        state_io.load_state(self._engine, self.state, self.param_groups, self.defaults, path, decoupled=isinstance(self, AdamW))

    # -- copies ---------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        self.synchronize()
        self._take_over()
        state = state_io.copied(self._engine, self.state)
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
            self._engine.add_group(gi, group["params"], names, self._config["state_dtype"], bool(group["amsgrad"]))
        state_io.restore(self._engine, self.state, self.param_groups, saved)


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
        storage: str | None = None,
        offload: str | None = None,
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
            storage=storage,
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
