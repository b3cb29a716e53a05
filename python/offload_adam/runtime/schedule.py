"""The module schedule: forward pre- and post-hooks of every module in the process, handed to the
clients that subscribe (the optimizer's engine waits there for the weights it updates, the
weight streamer loads and releases its blocks), and the recording of what a forward reads.

One :data:`SCHEDULE` per process installs torch's global module hooks while it has subscribers
and calls each subscriber's ``pre_forward(module)`` before a module runs and ``post_forward``
after (also when the forward raises), in subscription order (post in reverse). A *pass* is the
outermost module call of a thread: from the pre-hook that finds the thread's module stack empty
to its post-hook.

A subscriber may ask for the next pass to be *recorded* (:meth:`Subscription.record_next`):
during it a torch-function mode sees every torch call of the thread, asks each recording
subscriber what each tensor argument is to it (``read_key(t)``, None for nothing), and reports
a read (``on_read(module, key)``) attributed to the innermost running module, before the call
runs (a subscriber can still make the tensor valid). This is how a module's own reads are
found: a parent reading a child's weight without calling the child, ``nn.MultiheadAttention``
reading ``out_proj.weight``. ``pass_ended(recorded)`` closes every pass.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


class Subscriber(Protocol):
    def pre_forward(self, module: torch.nn.Module) -> None: ...

    def post_forward(self, module: torch.nn.Module) -> None: ...

    def read_key(self, t: Tensor) -> Any:
        """What ``t`` is to this subscriber (during a recorded pass), None for nothing."""
        ...

    def on_read(self, module: torch.nn.Module, key: Any) -> None: ...

    def pass_ended(self, recorded: bool) -> None: ...


class Subscription:
    """A subscriber's place in the schedule (it is held weakly: it may be garbage-collected
    without unsubscribing)."""

    def __init__(self, schedule: Schedule, sub: Subscriber) -> None:
        self.schedule = schedule
        self.ref = weakref.ref(sub)
        self.record = False  # the next pass records this subscriber's reads

    def record_next(self) -> None:
        """The next pass (or this one, from the next module on, if one is running) is recorded
        for this subscriber."""
        self.record = True

    def cancel(self) -> None:
        self.schedule._remove(self)


class _Recorder(TorchFunctionMode):
    """Reports reads of the recording subscribers' tensors to them (see the module
    documentation)."""

    def __init__(self, schedule: Schedule, subs: list[Subscription]) -> None:
        super().__init__()
        self.schedule = schedule
        self.subs = subs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        loc = self.schedule._local
        if loc.stack and not loc.busy:
            module = loc.stack[-1]
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, Tensor):
                        for s in self.subs:
                            sub = s.ref()
                            if sub is not None:
                                key = sub.read_key(t)
                                if key is not None:
                                    with self.schedule._busy():
                                        sub.on_read(module, key)
        return func(*args, **kwargs)


class _Local(threading.local):
    def __init__(self) -> None:
        self.args: tuple[Any, ...] = ()  # the positional arguments of the module call being pre-hooked
        self.kwargs: dict[str, Any] = {}  # its keyword arguments, for the modules of ``see_kwargs``
        self.stack: list[torch.nn.Module] = []
        self.recorder: _Recorder | None = None
        self.busy = 0  # inside a subscriber's callback: its own torch calls are not the module's reads


class Schedule:
    """The process's module schedule (see the module documentation). Its hooks run at every
    module call of the process while it has subscribers: they are kept short."""

    def __init__(self) -> None:
        self._subs: list[Subscription] = []
        self._refs: tuple[weakref.ref[Any], ...] = ()  # the subscribers, in order (weakly)
        self._handles: list[Any] = []
        self._local = _Local()
        self._lock = threading.Lock()
        # Modules whose calls' keyword arguments the pre-hook is handed (``see_kwargs``).
        self._kw_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def subscribe(self, sub: Subscriber) -> Subscription:
        s = Subscription(self, sub)
        with self._lock:
            self._subs.append(s)
            self._refs = tuple(x.ref for x in self._subs)
            if not self._handles:
                reg = torch.nn.modules.module
                # always_call: a forward that raises still ends its module (and the pass).
                self._handles = [
                    reg.register_module_forward_pre_hook(self._pre),
                    reg.register_module_forward_hook(self._post, always_call=True),
                ]
                for m in self._kw_modules:
                    self._mark_kwargs(m, True)
        return s

    def see_kwargs(self, module: torch.nn.Module, see: bool = True) -> None:
        """The pre-hook of ``module``'s calls is handed their keyword arguments too
        (``call_kwargs``): a decoder layer's attention called as ``self_attn(hidden_states=...)``
        has no positional tensor to size the call by (``see=False``: no longer).

        torch hands a global pre-hook the call's keyword arguments for the modules whose
        ``_forward_pre_hooks_with_kwargs`` holds the hook's id (what ``with_kwargs=True`` records
        for a module's own hook); the global hook has no ``with_kwargs``. A module hook instead
        would run after the global ones, when the call's placement is decided already."""
        with self._lock:
            if see:
                self._kw_modules.add(module)
            else:
                self._kw_modules.discard(module)
            if self._handles:
                self._mark_kwargs(module, see)

    def _mark_kwargs(self, module: torch.nn.Module, see: bool) -> None:
        marks = getattr(module, "_forward_pre_hooks_with_kwargs", None)
        if marks is None:  # a torch without it: calls are sized by their positional arguments
            return
        hid = self._handles[0].id
        if see:
            marks[hid] = True
        else:
            marks.pop(hid, None)

    def _remove(self, s: Subscription) -> None:
        with self._lock:
            if s in self._subs:
                self._subs.remove(s)
            self._refs = tuple(x.ref for x in self._subs)
            if not self._subs and self._handles:
                for m in self._kw_modules:
                    self._mark_kwargs(m, False)
                for h in self._handles:
                    h.remove()
                self._handles = []

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        self._local.busy += 1
        try:
            yield
        finally:
            self._local.busy -= 1

    def _prune(self) -> None:
        for s in list(self._subs):
            if s.ref() is None:
                self._remove(s)

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any] | None = None) -> None:
        loc = self._local
        if loc.recorder is None and any(s.record for s in self._subs) and not torch.compiler.is_compiling():
            wanted = [s for s in self._subs if s.record]
            for s in wanted:
                s.record = False
            loc.recorder = _Recorder(self, wanted)
            loc.recorder.__enter__()
        loc.stack.append(module)
        loc.args = args
        loc.kwargs = kwargs or {}
        loc.busy += 1
        try:
            dead = False
            for r in self._refs:
                sub = r()
                if sub is None:
                    dead = True
                else:
                    sub.pre_forward(module)
            if dead:
                self._prune()
        finally:
            loc.busy -= 1
            loc.args = ()
            loc.kwargs = {}

    def call_args(self) -> tuple[Any, ...]:
        """Inside a subscriber's ``pre_forward``: the positional arguments of the module call
        about to run (a block's hidden states: how many rows the call has)."""
        return self._local.args

    def call_kwargs(self) -> dict[str, Any]:
        """Inside a subscriber's ``pre_forward``: the keyword arguments of the module call about
        to run, for the modules of ``see_kwargs`` (empty for the others)."""
        return self._local.kwargs

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        loc = self._local
        loc.busy += 1
        try:
            for r in reversed(self._refs):
                sub = r()
                if sub is not None:
                    sub.post_forward(module)
        finally:
            loc.busy -= 1
            stack = loc.stack
            if stack and stack[-1] is module:
                stack.pop()
            if not stack:
                self._end_pass(loc)

    def _end_pass(self, loc: _Local) -> None:
        rec, loc.recorder = loc.recorder, None
        if rec is not None:
            rec.__exit__(None, None, None)
        recorded = {id(s) for s in rec.subs} if rec is not None else set()
        with self._busy():
            for s in list(self._subs):
                sub = s.ref()
                if sub is not None:
                    sub.pass_ended(id(s) in recorded)


SCHEDULE = Schedule()
