"""GPU offload: optimizer state in (pinned) host memory, gradients streamed device-to-host during
backward, updated weights streamed back.

Data flow of one step (see DESIGN.md):

* backward: a post-accumulate-grad hook per parameter marks it ready; when every parameter of a
  bucket is ready, the bucket's gradients are copied on a side stream into their slots of the
  flat host landing buffers, in their own dtype, and an event marks the bucket's arrival.
* ``step()``: bucket by bucket, in parameter order (the order the next forward needs them), the
  host waits for the bucket's arrival, the Rust kernel updates the bucket (GIL released), and the
  updated weights (the low-precision copy the kernel wrote, or the fp32 master) are copied back
  on a second side stream, so the kernel on bucket k+1 overlaps the transfer of bucket k.
* default mode: before ``step()`` returns the current stream waits for every copy-back: any later
  read sees the new weights. ``async_step=True``: ``step()`` returns at once, the work runs on a
  worker thread, and a forward pre-hook waits, per module, only for the buckets of that module's
  own parameters.

Everything CUDA-specific (streams, events, pinned memory) sits behind :class:`_Backend`; with
``OFFLOAD_ADAM_FORCE_STREAMING=1`` CPU parameters go through the whole machinery with a host
stand-in, which is how the test suite exercises it without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import _native

FORCE_ENV = "OFFLOAD_ADAM_FORCE_STREAMING"
_KINDS = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN = _native.LANES


def force_streaming() -> bool:
    """Testing aid: ``OFFLOAD_ADAM_FORCE_STREAMING=1`` streams CPU parameters too."""
    return os.environ.get(FORCE_ENV, "").strip() not in ("", "0")


class _Backend:
    """Host stand-in for the CUDA specifics: copies are synchronous, events are no-ops."""

    is_cuda = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h: Any = None
        self.h2d: Any = None

    def empty(self, n: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(n, dtype=dtype)

    def staging(self, like: Tensor) -> Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        yield

    def side_waits_current(self, stream: Any) -> None:
        pass

    def record(self, stream: Any) -> Any:
        return None

    def record_current(self) -> Any:
        return None

    def stream_waits(self, stream: Any, event: Any) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        pass

    def current_waits(self, event: Any) -> None:
        pass

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        pass


class _CudaBackend(_Backend):
    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._cudart = torch.cuda.cudart()

    def empty(self, n: int, dtype: torch.dtype) -> Tensor:
        """Pageable memory of exactly the size asked, then pinned with cudaHostRegister: torch's
        pinned allocator rounds every block up to a power of two."""
        t = torch.zeros(n, dtype=dtype)
        nbytes = t.untyped_storage().nbytes()
        if nbytes:
            rc = self._cudart.cudaHostRegister(t.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(rc)}")
            # The optimizer keeps `t` for its lifetime; views that outlive it stay valid (pageable).
            weakref.finalize(t, self._cudart.cudaHostUnregister, t.data_ptr())
        return t

    def staging(self, like: Tensor) -> Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def side_waits_current(self, stream: Any) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self, stream: Any) -> Any:
        e = torch.cuda.Event()
        e.record(stream)
        return e

    def record_current(self) -> Any:
        return self.record(torch.cuda.current_stream(self.device))

    def stream_waits(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def current_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        t.record_stream(stream)


@dataclass
class _Rec:
    """One streamed parameter."""

    param: Tensor
    name: str
    master_dtype: torch.dtype  # the parameter's dtype when the optimizer was built
    data_ptr: int  # the address of its storage then
    group: int
    index: int
    bucket: int
    grad_slot: Tensor  # host landing view, shaped like the parameter
    copy_src: Tensor  # host view the weights are copied back from (weight copy, or master)
    master: Tensor
    has_grad: bool = False  # the landing slot holds this step's gradient
    pending: Tensor | None = None  # a GPU gradient waiting for its bucket's copy
    accumulate: bool = False  # the pending copy adds to the slot instead of replacing it
    grad_ref: Any = None  # weak reference to the GPU gradient last copied (kept-gradient mode)
    grad_version: int = -1
    param_version: int = -1  # the parameter's version after our last copy-back


@dataclass
class _Bucket:
    group: int
    recs: list[int]
    ready_count: int = 0
    # Gradients to wait for before copying: those that arrived last step (a parameter that
    # never gets one, an unused layer, must not hold its bucket back until step()).
    expected: int = 0
    d2h_event: Any = None
    h2d_event: Any = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _HostGroup:
    host_set: Any
    buffers: dict[str, Tensor | None]
    offsets: list[int]


class Streamer:
    """The streaming machinery of one optimizer (all its streamed param groups)."""

    def __init__(self, opt: Any, device: torch.device, *, free_gradients: bool, async_step: bool, bucket_bytes: int) -> None:
        self.opt = opt
        self.backend: _Backend = _CudaBackend(device) if device.type == "cuda" else _Backend(device)
        self.device = device
        self.free_gradients = free_gradients
        self.async_step = async_step
        self.bucket_bytes = bucket_bytes
        self.recs: list[_Rec] = []
        self.by_param: dict[int, int] = {}
        self.groups: dict[int, _HostGroup] = {}
        self.buckets: list[_Bucket] = []
        self.hooks: list[Any] = []
        self.worker: threading.Thread | None = None
        self.error: BaseException | None = None
        self.in_flight = False
        self.stats: dict[str, float] = {}
        self._cur: dict[str, float] = {}
        self._backward_done: Any = None
        self._called: set[int] = set()  # modules whose forward has run (they wait for themselves)
        self._wait_cache: dict[int, tuple[int, list[int]]] = {}
        me = weakref.ref(self)

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            s = me()
            if s is not None:
                s._forward_pre_hook(module, args)

        def grad_hook(p: Tensor) -> None:
            s = me()
            if s is not None:
                s._on_grad(p)

        self._grad_hook = grad_hook
        self._pre_hook = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
        self._lock = threading.Lock()
        self.test_delay_s = 0.0  # testing aid: sleep in the worker before each bucket
        self.test_interrupt_at = -1  # testing aid: raise KeyboardInterrupt before this bucket

    # -- building -------------------------------------------------------------------------------

    def add_group(self, gi: int, group: dict[str, Any], names: list[str], state_dtype: torch.dtype) -> None:
        params: list[Tensor] = group["params"]
        for p, name in zip(params, names):
            if p.dtype not in _KINDS:
                raise TypeError(f"{name}: dtype {p.dtype} cannot be offloaded (float32, bfloat16, float16)")
            if not p.is_contiguous():
                raise ValueError(f"{name}: an offloaded parameter must be contiguous")
        n_state, state_off = 0, []
        n_grad = [0, 0, 0]
        grad_off, kinds, lens = [], [], []
        for p in params:
            k = _KINDS.index(p.dtype)
            n = p.numel()
            state_off.append(n_state)
            n_state += -(-n // _ALIGN) * _ALIGN
            grad_off.append(n_grad[k])
            n_grad[k] += -(-n // _ALIGN) * _ALIGN
            kinds.append(k)
            lens.append(n)
        be = self.backend
        master, exp_avg, exp_avg_sq = (be.empty(n_state, d) for d in (torch.float32, state_dtype, state_dtype))
        steps = torch.zeros(len(params), dtype=torch.float32)
        bufs: dict[str, Tensor | None] = {
            "master": master,
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
            "max_exp_avg_sq": be.empty(n_state, state_dtype) if group["amsgrad"] else None,
            "steps": steps,
        }
        grads = [be.empty(n_grad[k], _KINDS[k]) if k in kinds else None for k in range(3)]
        # No separate weight-copy buffers: a bf16/fp16 parameter's landing slot receives the new
        # weights once the kernel has read its gradient, and is the source of the copy back.
        outs: list[Tensor | None] = [None, None, None]
        for k in range(3):
            bufs[f"grad_{k}"] = grads[k]
            bufs[f"out_{k}"] = outs[k]
        host_set = _native.HostSet(
            state_off, lens, kinds, grad_off, master, exp_avg, exp_avg_sq, steps, grads, outs, bufs["max_exp_avg_sq"]
        )
        self.groups[gi] = _HostGroup(host_set, bufs, state_off)
        # Buckets: consecutive parameters of the group, up to bucket_bytes of gradient each.
        bucket: list[int] = []
        size = 0
        for i, p in enumerate(params):
            k = kinds[i]
            grad_view = self._view(grads[k], grad_off[i], p)  # type: ignore[arg-type]
            master_view = self._view(master, state_off[i], p)
            copy_src = master_view if k == 0 else grad_view
            r = len(self.recs)
            self.recs.append(
                _Rec(p, names[i], p.dtype, p.data_ptr(), gi, i, len(self.buckets), grad_view, copy_src, master_view)
            )
            self.by_param[id(p)] = r
            self.hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))
            bucket.append(r)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes:
                self.buckets.append(_Bucket(gi, bucket))
                bucket, size = [], 0
        if bucket:
            self.buckets.append(_Bucket(gi, bucket))
        for b in self.buckets:
            b.done.set()

    @staticmethod
    def _view(flat: Tensor, off: int, p: Tensor) -> Tensor:
        return flat[off : off + p.numel()].view(p.shape)

    def state_views(self, gi: int, i: int, p: Tensor) -> dict[str, Tensor]:
        g = self.groups[gi]
        off = g.offsets[i]
        out = {"step": g.buffers["steps"][i]}  # type: ignore[index]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
            buf = g.buffers[key]
            if buf is not None:
                out["master_param" if key == "master" else key] = self._view(buf, off, p)
        return out

    def ensure_amsgrad(self, gi: int) -> Tensor | None:
        g = self.groups[gi]
        if g.buffers["max_exp_avg_sq"] is None:
            buf = self.backend.empty(g.buffers["exp_avg_sq"].numel(), g.buffers["exp_avg_sq"].dtype)  # type: ignore[union-attr]
            buf.copy_(g.buffers["exp_avg_sq"])  # type: ignore[arg-type]
            g.host_set.set_max_exp_avg_sq(buf)
            g.buffers["max_exp_avg_sq"] = buf
            return buf
        return None

    def memory(self) -> tuple[int, int]:
        """(host bytes held, tight host bytes: 4 master + moments + grad landing per parameter)."""
        held = sum(t.untyped_storage().nbytes() for g in self.groups.values() for t in g.buffers.values() if t is not None)
        tight = 0
        for r in self.recs:
            g = self.groups[r.group].buffers
            n = r.param.numel()
            moments = 2 + (g["max_exp_avg_sq"] is not None)
            tight += n * (4 + moments * g["exp_avg"].element_size() + r.param.element_size())  # type: ignore[union-attr]
        return held, tight

    # -- backward -------------------------------------------------------------------------------

    def _on_grad(self, p: Tensor) -> None:
        r = self.recs[self.by_param[id(p)]]
        if p.grad is None or p.grad.dtype != r.master_dtype or p.grad.shape != r.master.shape:
            return  # a moved/re-typed parameter: step() reports it
        r.pending = p.grad
        r.accumulate = r.has_grad and self.free_gradients
        b = self.buckets[r.bucket]
        b.ready_count += 1
        if b.ready_count >= (b.expected or len(b.recs)):
            self._flush(b)

    def _flush(self, b: _Bucket) -> None:
        """Copies the pending gradients of a bucket to the host, on the side stream."""
        pend = [self.recs[i] for i in b.recs if self.recs[i].pending is not None]
        b.ready_count = 0
        if not pend:
            return
        be = self.backend
        be.side_waits_current(be.d2h)
        acc = []
        with torch.profiler.record_function("offload_adam.d2h"), be.on(be.d2h):
            for r in pend:
                g = r.pending
                assert g is not None
                if r.accumulate:
                    staging = be.staging(g)
                    staging.copy_(g, non_blocking=True)
                    acc.append((r, staging))
                else:
                    r.grad_slot.copy_(g, non_blocking=True)
                if self.free_gradients:
                    be.keep_until_done(g, be.d2h)
                    r.param.grad = None
                else:
                    r.grad_ref = weakref.ref(g)
                    r.grad_version = g._version
                r.pending = None
                r.has_grad = True
                r.accumulate = False
            b.d2h_event = be.record(be.d2h)
        if acc:
            # Later micro-batches with freed GPU gradients add on the host, in the gradient's dtype
            # (the rounding torch's own accumulation does); waits for this bucket's copy.
            be.host_wait(b.d2h_event)
            for r, staging in acc:
                _native.grad_accumulate(r.grad_slot, staging)

    def check_params(self) -> None:
        """Raises if a parameter was moved or re-typed after the optimizer was built: its storage
        was replaced (our copies write into the storage in place, so its address never changes)."""
        for r in self.recs:
            p = r.param
            if p.data_ptr() != r.data_ptr or p.dtype is not r.master_dtype:
                raise RuntimeError(
                    f"{r.name}: moved or changed after the optimizer was built (now {p.dtype} on {p.device}, "
                    f"shape {tuple(p.shape)}); build the optimizer after model.to()/.half()/..."
                )

    def _collect(self, scaler_ready: bool) -> None:
        """Before a step: copy gradients the hooks did not see, or that changed after their copy
        (``clip_grad_norm_`` on the model, a manual edit); flush partial buckets. The caller ran
        ``check_params``."""
        for r in self.recs:
            g = r.param.grad
            if g is None or r.pending is not None:
                continue
            if self.free_gradients:
                r.pending, r.accumulate = g, r.has_grad  # a gradient set by hand
                continue
            # GradScaler's inf check multiplies every gradient by 1.0 in place just before a step
            # it drives: that one version bump changes no value.
            expected = r.grad_version + (1 if scaler_ready else 0)
            same = r.grad_ref is not None and r.grad_ref() is g
            if not (r.has_grad and same and g._version in (r.grad_version, expected)):
                r.pending, r.accumulate = g, False
        for b in self.buckets:
            if any(self.recs[i].pending is not None for i in b.recs):
                self._flush(b)

    def discard_grads(self) -> None:
        """``zero_grad``: the host slots no longer hold a gradient. No wait for an async step:
        it works on the gradients it took when it started."""
        for r in self.recs:
            r.has_grad = False
            r.pending = None
            r.grad_ref = None
        for b in self.buckets:
            b.ready_count = 0

    # -- the step -------------------------------------------------------------------------------

    def grad_views(self) -> list[Tensor]:
        return [r.grad_slot.view(-1) for r in self.recs if r.has_grad]

    def wait_arrivals(self) -> None:
        for b in self.buckets:
            self.backend.host_wait(b.d2h_event)

    def step(self, grad_scale: float, bias_correction: bool, num_threads: int, scaler_ready: bool) -> None:
        """One step over every streamed group; the caller has run ``synchronize()`` and
        ``check_params()`` (before it touched any other group)."""
        self._collect(scaler_ready)
        # The step takes this step's gradients now; from here the hooks (a next backward, while
        # an async step runs) may mark new ones.
        work: list[tuple[_Bucket, list[_Rec]]] = []
        for b in self.buckets:
            recs = [self.recs[i] for i in b.recs if self.recs[i].has_grad]
            if recs:
                work.append((b, recs))
        self._cur = {"cpu_step_s": 0.0, "d2h_wait_s": 0.0, "h2d_issue_s": 0.0, "forward_wait_s": 0.0}
        for b, recs in work:
            b.done.clear()
            b.expected = len(recs)
            for r in recs:
                r.has_grad = False
        # Hyper-parameters as they are now: an LR scheduler steps right after step() returns,
        # while an async step may still be updating buckets.
        hypers = {gi: {k: v for k, v in g.items() if k != "params"} for gi, g in enumerate(self.opt.param_groups)}
        # Weights may be overwritten once the work queued so far (the backward that read them)
        # is done; the copy-back waits for this point only, not for a next forward.
        self._backward_done = self.backend.record_current()
        args = (work, hypers, grad_scale, bias_correction, num_threads)
        if self.async_step:
            self.in_flight = True
            self.worker = threading.Thread(target=self._run, args=args, name="offload-adam-step", daemon=True)
            self.worker.start()
        else:
            self._run(*args)
            self._raise()
            for b, _ in work:
                self.backend.current_waits(b.h2d_event)

    def _run(
        self,
        work: list[tuple[_Bucket, list[_Rec]]],
        hypers: dict[int, dict[str, Any]],
        scale: float,
        bias_correction: bool,
        num_threads: int,
    ) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread, and on in a new one
                for k, (b, recs) in enumerate(work):
                    if self.test_delay_s:
                        time.sleep(self.test_delay_s)
                    if k == self.test_interrupt_at:
                        raise KeyboardInterrupt
                    self._step_bucket(b, recs, hypers[b.group], scale, bias_correction, num_threads)
        except BaseException as e:  # raised to the caller on the next step()/synchronize()
            self.error = e
            # Buckets not updated (`done` is set once a bucket's weights are on their way back)
            # keep their gradients for the next step.
            for b, recs in work:
                if not b.done.is_set():
                    for r in recs:
                        r.has_grad = True
        finally:
            for b, _ in work:
                b.done.set()
            self.in_flight = False
            self.stats = self._cur  # the figures of the last finished step

    def _step_bucket(
        self, b: _Bucket, recs: list[_Rec], group: dict[str, Any], scale: float, bias_correction: bool, num_threads: int
    ) -> None:
        be = self.backend
        t0 = time.perf_counter()
        be.host_wait(b.d2h_event)
        t1 = time.perf_counter()
        g = self.groups[b.group]
        for r in recs:
            # First step (no copy-back yet), or the model's weights were written since our
            # copy-back (a checkpoint loaded into the model): the master takes the model's value.
            if r.param._version != r.param_version:
                r.master.copy_(r.param.detach())
        with torch.profiler.record_function("offload_adam.cpu_step"):
            first = _native.host_step(
                g.host_set, group, [r.index for r in recs], num_threads=num_threads, grad_scale=scale,
                bias_correction=bias_correction,
            )  # fmt: skip
        t2 = time.perf_counter()
        # The bucket's host state is updated: from here its weights must reach the model even if
        # an interrupt arrives, so that the bucket is either untouched or fully updated.
        try:
            for i in first:
                self.opt._init_streamed_state(b.group, i)
        finally:
            be.stream_waits(be.h2d, self._backward_done)
            with torch.profiler.record_function("offload_adam.h2d"), be.on(be.h2d):
                for r in recs:
                    r.param.detach().copy_(r.copy_src, non_blocking=True)
                    r.param_version = r.param._version
                b.h2d_event = be.record(be.h2d)
            t3 = time.perf_counter()
            self._cur["d2h_wait_s"] += t1 - t0
            self._cur["cpu_step_s"] += t2 - t1
            self._cur["h2d_issue_s"] += t3 - t2
            b.done.set()

    def skip(self) -> None:
        """A step GradScaler skips: nothing advances, and the host copies of this step's
        gradients are dropped (gradients still on the GPU are copied again if a step uses them)."""
        self.synchronize()
        self.discard_grads()

    def _wait_buckets(self, module: torch.nn.Module) -> list[int]:
        """Buckets a module's forward reads: its own parameters', and those of submodules that
        are never called themselves (``nn.MultiheadAttention`` reads ``out_proj.weight`` without
        calling ``out_proj``), which therefore have no pre-hook of their own."""
        key = id(module)
        hit = self._wait_cache.get(key)
        if hit is not None and hit[0] == len(self._called):
            return hit[1]
        params = [p for p in module._parameters.values() if p is not None]
        stack = [c for c in module._modules.values() if c is not None]
        while stack:
            c = stack.pop()
            if id(c) in self._called:
                continue
            params += [p for p in c._parameters.values() if p is not None]
            stack += [m for m in c._modules.values() if m is not None]
        buckets = sorted({self.recs[self.by_param[id(p)]].bucket for p in params if id(p) in self.by_param})
        self._wait_cache[key] = (len(self._called), buckets)
        return buckets

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._called.add(id(module))
        if not self.in_flight and self.worker is None:
            return
        t0 = time.perf_counter()
        waited = False
        for k in self._wait_buckets(module):
            b = self.buckets[k]
            if not b.done.is_set():
                waited = True
                with torch.profiler.record_function("offload_adam.forward_wait"):
                    b.done.wait()
            self.backend.current_waits(b.h2d_event)
        if waited:
            self._cur["forward_wait_s"] += time.perf_counter() - t0

    def synchronize(self) -> None:
        """Waits for an async step to finish and makes the current stream wait for its copies."""
        w = self.worker
        if w is not None:
            w.join()
            self.worker = None
            for b in self.buckets:
                self.backend.current_waits(b.h2d_event)
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            if isinstance(e, KeyboardInterrupt):
                raise e
            raise RuntimeError(f"offload_adam: the optimizer step failed: {e}") from e

    def __del__(self) -> None:
        for h in self.hooks:
            h.remove()
        self._pre_hook.remove()
