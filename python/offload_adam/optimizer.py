"""Drop-in ``torch.optim.Adam``/``AdamW`` whose step runs in the Rust kernel on host buffers.

The state of each param group lives in flat host buffers, allocated once and imported by the
Rust side once (DLPack): ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) in
``state_dtype``, fp32 master weights for bfloat16/float16 parameters, and the step counts. The
entries of ``optimizer.state[p]`` are views into them, so ``state_dict()`` has torch's format and
``load_state_dict()`` copies into them. No math happens here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _native
from .streaming import Streamer, force_streaming

__all__ = ["Adam", "AdamW"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_OFFLOAD_MODES = ("cpu",)
_DEFAULT_BUCKET_BYTES = 32 << 20
_ALIGN = _native.LANES  # state slots start on a SIMD block boundary
_TENSOR_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _scalar(x: float | Tensor, what: str) -> float:
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        return float(x.item())
    return float(x)


def _check_hyper(lr: float | Tensor, betas: Any, eps: float, weight_decay: float) -> tuple[float, float]:
    """torch's checks and messages, plus NaN (which torch's ``0.0 <= x`` lets through silently)."""
    lr_f = _scalar(lr, "lr")
    if not 0.0 <= lr_f or math.isinf(lr_f):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}") from None
    b1, b2 = _scalar(b1, "betas[0]"), _scalar(b2, "betas[1]")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b1}")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b2}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    return b1, b2


@dataclass
class _Buffers:
    """The flat host buffers of one param group (what the ParamSet imported)."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    steps: Tensor
    offsets: list[int]
    master: Tensor | None
    max_exp_avg_sq: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.master, self.steps) if t is not None]


def _view(flat: Tensor, offset: int, p: Tensor) -> Tensor:
    """The slot of ``p`` in ``flat``, shaped (and strided) like ``p``."""
    if p.is_complex():
        real = torch.as_strided(flat, (*p.shape, 2), (*(2 * s for s in p.stride()), 1), offset)
        return torch.view_as_complex(real)
    return torch.as_strided(flat, p.shape, p.stride(), offset)


def _byte_range(t: Tensor) -> tuple[int, int]:
    """The bytes of ``t``'s storage that ``t`` can reach (its whole storage: cheap and safe)."""
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


def _overlaps_any(t: Tensor, ranges: list[tuple[int, int]]) -> bool:
    lo, hi = _byte_range(t)
    return hi > lo and any(a < hi and lo < b for a, b in ranges)


class Adam(Optimizer):
    r"""Adam on the CPU with a fused SIMD multithreaded kernel; a drop-in for ``torch.optim.Adam``.

    Same arguments, defaults, validation and ``state_dict`` format as :class:`torch.optim.Adam`,
    and the same update, element by element (see the README for the measured agreement).

    Args:
        params: iterable of parameters or named parameters, or of dicts defining param groups.
        lr: learning rate, a float or a 1-element tensor (default: 1e-3).
        betas: coefficients of the running averages of the gradient and its square
            (default: (0.9, 0.999)).
        eps: term added to the denominator (default: 1e-8).
        weight_decay: weight decay; an L2 penalty for ``Adam``, decoupled for ``AdamW``.
        amsgrad: use the AMSGrad variant (default: False).
        maximize: maximize the objective instead of minimizing it (default: False).
        foreach: accepted and ignored: the kernel is always fused over all tensors.
        capturable: must be False: the step runs on the CPU, outside any CUDA graph.
        differentiable: must be False: the step is not recorded by autograd.
        fused: accepted and ignored (None, False or True): the kernel is always fused.
        decoupled_weight_decay: AdamW's decoupled weight decay (default: False for ``Adam``).

    Keyword-only extras:
        num_threads: threads of the kernel's private pool (default: ``torch.get_num_threads()``).
            Results are bitwise identical for any value.
        state_dtype: dtype of the moments, ``torch.float32`` (default) or ``torch.bfloat16``
            (half the memory; the update is computed in fp32 and rounded to nearest even).
        offload: where the optimizer state lives: ``"cpu"`` (host memory, the default). For CUDA
            parameters this means: state in pinned host memory, gradients streamed to the host
            during backward, weights streamed back after the CPU step (see the README).
        bias_correction: apply Adam's bias correction (default: True, as torch).
        free_gradients: CUDA parameters only: free each GPU gradient once it is on the host, so
            the GPU holds at most a window of buckets of gradients (default False: ``p.grad``
            stays, as in torch, for code that reads or edits it between backward and step).
        async_step: CUDA parameters only: ``step()`` returns at once; each module's forward waits
            for the buckets of its own parameters. Read weights outside a forward (an EMA,
            ``model.state_dict()``, ``p.cpu()``) only after ``optimizer.synchronize()``.
        bucket_mb: size of a gradient transfer bucket, in MiB of gradient (default 32).

    Supported parameters: float32, bfloat16, float16 and complex64 tensors on the CPU, dense in
    memory. A bfloat16/float16 parameter gets an fp32 master copy (``state[p]["master_param"]``);
    the kernel updates the master and writes the rounded weights into the parameter in the same
    pass. If the parameter's value no longer equals its rounded master (a checkpoint was loaded
    into the model, or it was edited), the kernel first takes the parameter's value as the master.
    """

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
        offload: str = "cpu",
        bias_correction: bool = True,
        free_gradients: bool = False,
        async_step: bool = False,
        bucket_mb: float = 32,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        b1, b2 = _check_hyper(lr, betas, eps, weight_decay)
        if capturable:
            raise ValueError(
                "capturable=True is not supported: offload_adam runs the step on the CPU, "
                "which a CUDA graph cannot capture"
            )
        if differentiable:
            raise ValueError("differentiable=True is not supported: the fused kernel is not recorded by autograd")
        if fused not in (None, False, True):
            raise ValueError(f"fused must be None, False or True, got {fused!r}")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        if offload not in _OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {_OFFLOAD_MODES}, got {offload!r}")
        if num_threads is None:
            num_threads = torch.get_num_threads()
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        _native.simd_path()  # raises now if OFFLOAD_ADAM_SIMD names a path this CPU lacks
        self._num_threads = num_threads
        self._state_dtype = state_dtype
        self._bias_correction = bool(bias_correction)
        self.offload = offload
        self._free_gradients = bool(free_gradients)
        self._async_step = bool(async_step)
        self._bucket_bytes = int(bucket_mb * (1 << 20))
        # Per param group: the native set of a CPU group (None for a streamed group).
        self._sets: list[_native.ParamSet | None] = []
        self._buffers: list[_Buffers | None] = []
        self._streamer: Streamer | None = None
        self._clip_coef = 1.0
        self._step_supports_amp_scaling = True
        defaults = dict(
            lr=lr,
            betas=(b1, b2),
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

    # -- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, then the group's host buffers and its native ParamSet.

        On any error the optimizer is left as it was.
        """
        if isinstance(param_group, dict):
            hyper = {k: param_group.get(k, self.defaults[k]) for k in ("lr", "betas", "eps", "weight_decay")}
            _check_hyper(hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"])
            for k in ("capturable", "differentiable"):
                if param_group.get(k):
                    raise ValueError(f"{k}=True is not supported by offload_adam")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group, len(self.param_groups) - 1)
            self._build_set(group, len(self.param_groups) - 1)
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
            if p.layout != torch.strided:
                raise TypeError(f"{name}: layout {p.layout} is not supported, only dense (strided) tensors")
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{name}: dtype {p.dtype} is not supported (float32, bfloat16, float16, complex64)")
        devices = {p.device for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(
                f"param group {gi} mixes devices {sorted(map(str, devices))}: put CPU and CUDA parameters in separate groups"
            )
        dev = next(iter(devices), torch.device("cpu"))
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"param group {gi}: parameters on {dev} are not supported (CPU or CUDA)")
        if self._streams(group) and self._streamer is not None and self._streamer.device != self._stream_device(group):
            raise ValueError(
                f"param group {gi}: is on {dev}, the optimizer's other offloaded parameters on "
                f"{self._streamer.device}; use one optimizer per GPU"
            )

    @staticmethod
    def _streams(group: dict[str, Any]) -> bool:
        """Whether a group is offloaded with gradient streaming (CUDA parameters, or the
        ``OFFLOAD_ADAM_FORCE_STREAMING`` testing aid)."""
        return force_streaming() or any(p.is_cuda for p in group["params"])

    @staticmethod
    def _stream_device(group: dict[str, Any]) -> torch.device:
        return next((p.device for p in group["params"]), torch.device("cpu"))

    def _build_set(self, group: dict[str, Any], gi: int) -> None:
        if self._streams(group):
            if self._streamer is None:
                self._streamer = Streamer(
                    self,
                    self._stream_device(group),
                    free_gradients=self._free_gradients,
                    async_step=self._async_step,
                    bucket_bytes=self._bucket_bytes,
                )
            names = [self._name(group, gi, i) for i in range(len(group["params"]))]
            self._streamer.add_group(gi, group, names, self._state_dtype)
            self._sets.append(None)
            self._buffers.append(None)
            return
        params: list[Tensor] = group["params"]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            n = p.numel() * (2 if p.is_complex() else 1)
            total += -(-n // _ALIGN) * _ALIGN
        sd = self._state_dtype
        lowp = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
        bufs = _Buffers(
            exp_avg=torch.zeros(total, dtype=sd),
            exp_avg_sq=torch.zeros(total, dtype=sd),
            steps=torch.zeros(len(params), dtype=torch.float32),
            offsets=offsets,
            master=torch.zeros(total, dtype=torch.float32) if lowp else None,
            max_exp_avg_sq=torch.zeros(total, dtype=sd) if group["amsgrad"] else None,
        )
        exports = [torch.view_as_real(p.detach()) if p.is_complex() else p.detach() for p in params]
        names = [self._name(group, gi, i) for i in range(len(params))]
        pset = _native.ParamSet(
            params, exports, offsets, names, bufs.exp_avg, bufs.exp_avg_sq, bufs.steps, bufs.master, bufs.max_exp_avg_sq
        )
        pset.check_disjoint([s for s in self._sets if s is not None])
        self._sets.append(pset)
        self._buffers.append(bufs)

    def _all_buffers(self, masters: bool = False) -> list[Tensor]:
        """Every flat state buffer a load overwrites; with ``masters``, the streamed groups'
        masters too (a load writes them only where the checkpoint has a master)."""
        out = [t for bufs in self._buffers if bufs is not None for t in bufs.tensors()]
        if self._streamer is not None:
            keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "steps") + (("master",) if masters else ())
            for hg in self._streamer.groups.values():
                out += [t for t in (hg.buffers[k] for k in keys) if t is not None]
        return out

    def _ensure_amsgrad_buffers(self) -> None:
        """Allocates ``max_exp_avg_sq`` for a group whose ``amsgrad`` was switched on later."""
        for gi, group in enumerate(self.param_groups):
            bufs = self._buffers[gi]
            if bufs is None:
                if group["amsgrad"] and self._streamer is not None:
                    buf = self._streamer.ensure_amsgrad(gi)
                    if buf is not None:
                        for i, p in enumerate(group["params"]):
                            if self.state.get(p):
                                self.state[p]["max_exp_avg_sq"] = self._streamer.state_views(gi, i, p)["max_exp_avg_sq"]
                continue
            if group["amsgrad"] and bufs.max_exp_avg_sq is None:
                # torch starts the maximum at zero for a fresh state; for an existing one the
                # current exp_avg_sq is the best stand-in for the maximum so far.
                bufs.max_exp_avg_sq = bufs.exp_avg_sq.clone()
                pset = self._sets[gi]
                assert pset is not None
                pset.set_max_exp_avg_sq(bufs.max_exp_avg_sq)
                for i, p in enumerate(group["params"]):
                    if p in self.state and self.state[p]:
                        self.state[p]["max_exp_avg_sq"] = _view(bufs.max_exp_avg_sq, bufs.offsets[i], p)

    def _init_state(self, gi: int, i: int) -> dict[str, Any]:
        """The ``state[p]`` entry of parameter ``i`` of group ``gi``: views into the flat buffers."""
        p = self.param_groups[gi]["params"][i]
        bufs = self._buffers[gi]
        if bufs is None:
            return self._init_streamed_state(gi, i)
        off = bufs.offsets[i]
        state: dict[str, Any] = {
            "step": bufs.steps[i],
            "exp_avg": _view(bufs.exp_avg, off, p),
            "exp_avg_sq": _view(bufs.exp_avg_sq, off, p),
        }
        if bufs.max_exp_avg_sq is not None:
            state["max_exp_avg_sq"] = _view(bufs.max_exp_avg_sq, off, p)
        if bufs.master is not None and p.dtype in (torch.bfloat16, torch.float16):
            state["master_param"] = _view(bufs.master, off, p)
        self.state[p] = state
        return state

    def _init_streamed_state(self, gi: int, i: int) -> dict[str, Any]:
        assert self._streamer is not None
        p = self.param_groups[gi]["params"][i]
        state: dict[str, Any] = self._streamer.state_views(gi, i, p)
        self.state[p] = state
        return state

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model and returns the loss.
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
        scaler_ready = grad_scale is not None
        if found_inf is not None and float(found_inf) != 0.0:
            if self._streamer is not None:
                self._streamer.skip()
            self._clip_coef = 1.0
            return loss
        if self._streamer is not None and self._streamer.free_gradients and scaler_ready:
            raise NotImplementedError(
                "GradScaler with free_gradients=True is not supported: GradScaler looks for infs in GPU "
                "gradients, which free_gradients frees; use free_gradients=False (bf16 needs no scaler)"
            )
        scale = (1.0 / float(grad_scale)) if grad_scale is not None else 1.0
        scale *= self._clip_coef
        self._ensure_amsgrad_buffers()
        if self._streamer is not None:
            # Checked before the CPU groups move, so that a refused step changes nothing.
            self._streamer.synchronize()
            self._streamer.check_params()
        direct = [(s, g) for s, g in zip(self._sets, self.param_groups) if s is not None]
        if direct:
            first = _native.adam_step(
                [s for s, _ in direct],
                [g for _, g in direct],
                num_threads=self._num_threads,
                grad_scale=scale,
                bias_correction=self._bias_correction,
            )
            direct_gi = [gi for gi, s in enumerate(self._sets) if s is not None]
            for gi, idxs in zip(direct_gi, first):
                for i in idxs:
                    self._init_state(gi, i)
        if self._streamer is not None:
            self._streamer.step(scale, self._bias_correction, self._num_threads, scaler_ready)
        self._clip_coef = 1.0
        return loss

    def synchronize(self) -> None:
        """Waits until an ``async_step=True`` step has updated every weight (a no-op otherwise),
        and raises an error the step's worker met."""
        if self._streamer is not None:
            self._streamer.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; also forgets gradients already streamed to the host."""
        if self._streamer is not None:
            self._streamer.discard_grads()
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
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type: only the 2-norm is supported by the fast path, got {norm_type}")
        views: list[Tensor] = []
        for s, g in zip(self._sets, self.param_groups):
            if s is not None:
                views += [p.grad for p in g["params"] if p.grad is not None]
        if self._streamer is not None:
            self._streamer.synchronize()
            self._streamer.check_params()
            self._streamer._collect(False)
            self._streamer.wait_arrivals()
            views += self._streamer.grad_views()
        sq = _native.grad_sq_norm([v.view(torch.float32) if v.is_complex() else v for v in views], num_threads=self._num_threads)
        total = math.sqrt(sq) * self._clip_coef
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
        keeps between steps)."""
        held = tight = 0
        for bufs in self._buffers:
            for buf in bufs.tensors() if bufs is not None else []:
                n = buf.untyped_storage().nbytes()
                held += n
                tight += n
        if self._streamer is not None:
            h, t = self._streamer.memory()
            held += h
            tight += t
        return {"host_bytes": held, "host_tight_bytes": tight, "gpu_bytes": 0}

    @property
    def last_step_stats(self) -> dict[str, float]:
        """Host-side timing of the last offloaded step (seconds): ``d2h_wait_s`` (waiting for
        gradients to arrive), ``cpu_step_s`` (the kernel), ``h2d_issue_s`` (queueing the
        weight copies), ``forward_wait_s`` (async mode: time forwards waited for weights)."""
        return dict(self._streamer.stats) if self._streamer is not None else {}

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format. Moment tensors are views of this optimizer's buffers (as torch returns
        its own tensors); ``step`` is a fresh tensor."""
        self.synchronize()
        sd = super().state_dict()
        sd["state"] = {k: {**v, "step": v["step"].clone()} for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch's format (from this class or from ``torch.optim.Adam``/``AdamW``) into the
        host buffers, in their dtypes. Everything is checked first: on error nothing changes."""
        self.synchronize()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"loaded state dict has no {key!r} key")
        saved_groups = state_dict["param_groups"]
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
            if type(self) is AdamW:
                new["decoupled_weight_decay"] = True
            try:
                _check_hyper(new["lr"], new["betas"], new["eps"], new["weight_decay"])
            except ValueError as e:
                raise ValueError(f"loaded param group {gi}: {e}") from None
            new["betas"] = tuple(new["betas"])  # a list from JSON/YAML or DCP's full state dict
            merged.append(new)
        plan: list[tuple[int, int, dict[str, Any]]] = []
        for k, v in state_dict["state"].items():
            if k not in where:
                raise ValueError(f"loaded state dict has state for parameter {k!r}, which no group lists")
            gi, i = where[k]
            p = self.param_groups[gi]["params"][i]
            name = self._name(self.param_groups[gi], gi, i)
            if not isinstance(v, dict):
                raise TypeError(f"loaded state of {name}: expected a dict, got {type(v).__name__}")
            needed = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if merged[gi]["amsgrad"] else [])
            for key in needed:
                if key not in v:
                    raise ValueError(f"loaded state of {name}: missing key {key!r}")
            for key in _TENSOR_KEYS:
                t = v.get(key)
                if t is None:
                    continue
                if not isinstance(t, Tensor):
                    raise TypeError(f"loaded state of {name}: {key} must be a tensor, got {type(t).__name__}")
                if t.shape != p.shape:
                    raise ValueError(f"loaded state of {name}: {key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                if not (t.is_floating_point() or t.is_complex()) or t.is_complex() != p.is_complex():
                    raise TypeError(f"loaded state of {name}: {key} has dtype {t.dtype}, expected one like {p.dtype}")
            step = v["step"]
            step_f = float(step.item() if isinstance(step, Tensor) else step)
            if not (math.isfinite(step_f) and step_f >= 0 and step_f == int(step_f)):
                raise ValueError(f"loaded state of {name}: step must be a whole number >= 0, got {step_f}")
            plan.append((gi, i, {**v, "step": step_f}))

        # A source may be a view of our own buffers (`load_state_dict(state_dict())`, or
        # torch.distributed.checkpoint filling the tensors we handed out, then loading them):
        # zeroing the buffers below would erase it. Such sources are copied first.
        ours = [_byte_range(t) for t in self._all_buffers(masters=True)]
        plan = [
            (gi, i, {k: t.clone() if isinstance(t, Tensor) and _overlaps_any(t, ours) else t for k, t in v.items()})
            for gi, i, v in plan
        ]

        # Everything checked: apply.
        for g, new in zip(self.param_groups, merged):
            g.clear()
            g.update(new)
        self._ensure_amsgrad_buffers()
        with torch.no_grad():
            self.state.clear()
            for t in self._all_buffers():
                t.zero_()
            for gi, i, v in plan:
                state = self._init_state(gi, i)
                p = self.param_groups[gi]["params"][i]
                state["step"].fill_(v["step"])
                for key in _TENSOR_KEYS:
                    if key in state:
                        src = v.get(key)
                        if src is not None:
                            state[key].copy_(src)
                        elif key == "master_param":
                            state[key].copy_(p)
                        elif key == "max_exp_avg_sq":
                            state[key].copy_(state["exp_avg_sq"])
                if self._streamer is not None and self._buffers[gi] is None:
                    # The loaded master is the truth; the model's weights are taken over only if
                    # they are written after this point.
                    rec = self._streamer.recs[self._streamer.by_param[id(p)]]
                    if v.get("master_param") is None:
                        rec.param_version = -1
                    else:
                        rec.param_version = p._version
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


class AdamW(Adam):
    r"""AdamW (decoupled weight decay) on the CPU with the fused kernel; a drop-in for
    ``torch.optim.AdamW``. Arguments as :class:`Adam`, with ``weight_decay=1e-2`` by default."""

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
        offload: str = "cpu",
        bias_correction: bool = True,
        free_gradients: bool = False,
        async_step: bool = False,
        bucket_mb: float = 32,
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
            offload=offload,
            bias_correction=bias_correction,
            free_gradients=free_gradients,
            async_step=async_step,
            bucket_mb=bucket_mb,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True

