"""What an offload being set up changes on the model, and how to put it back: ``offload_weights``
either completes or leaves the model exactly as it was, with the error (a write error storing a
block, a ``quantize=`` that raises, a device out of memory): every parameter the same object
under the same names (so ties hold) with its type, dtype, device, ``requires_grad`` and bytes;
the buffers; the modules' attributes, with nothing of the offload's left on them.

:class:`Undo` records, as they are made, the steps that put each change back, and runs them in
reverse on failure (a context manager: on success it lets them go). Host memory stays that of
a set-up that succeeds, so each parameter comes back one of three ways:

- **its own tensor, kept** until the set-up completes: a parameter on the meta device (a model
  filled from a checkpoint comes back empty, as it was: no memory), one whose bytes go to NVMe
  or to the GPU (the host holds it before the call anyway), one a quantization changes;
- **its bytes, from their copy in host memory**, where the set-up copies them there (the pinned
  host copy, blocks kept in RAM) and frees its own tensor, so that the host never holds the
  model twice: read back into a tensor of its own (as ``close()`` hands weights back), or, with
  no memory left for that, a view of the copy;
- a block resident on the CPU as the device keeps its copy, an ordinary host tensor.

The first step recorded for a parameter puts it back whatever follows (later ones are not
recorded). The modules' registries (``_parameters``, ``_buffers``, ``_modules``) and attributes
are copied at the start (references only) and put back last: a parameter a quantization
replaced returns to its module, a tie ``tie_weights()`` made is undone, a buffer moved to the
device returns, the handle's attribute goes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
from torch import Tensor

from ..runtime.device import set_data, swap
from ..runtime.pinned import trim_host_memory
from .blocks import Entry, wrapped


class Undo:
    """The steps that put ``model`` back (see the module documentation)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]
        self.own = {id(p) for *_, ps, _, _ in self.modules for p in ps.values() if p is not None}
        self.held: set[int] = set()  # parameters a step puts back
        self.steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        """``step`` runs on failure (an offload's part to close)."""
        self.steps.append(step)

    def holds(self, p: Tensor) -> bool:
        """Whether ``p`` needs no more steps: a step puts it back already, or it is none of the
        model's (a quantization made it: its module gets its own back)."""
        return id(p) in self.held or id(p) not in self.own

    def keep(self, p: Tensor, back: Callable[[], None]) -> None:
        """``back`` puts ``p`` back as it was before its first change (it holds what it needs)."""
        if not self.holds(p):
            self.held.add(id(p))
            self.steps.append(back)

    def hold(self, p: Tensor) -> None:
        """``p`` is put back as it is now, from its own tensors, kept (not on the meta device:
        one there is put back by the step that takes it off)."""
        if self.holds(p) or p.device.type == "meta":
            return
        if wrapped(p) and hasattr(p, "__tensor_flatten__"):
            e = Entry(p, [""])  # type: ignore[arg-type]
            held = e.rebuild(e.tensors())  # its type over its own inner tensors (no copy)
            held.__dict__.update(p.__dict__)
            self.keep(p, lambda: swap(p, held))
            return
        old, grad = p.detach(), p.requires_grad

        def back() -> None:
            set_data(p, old)
            p.requires_grad_(grad)

        self.keep(p, back)

    def undo(self) -> None:
        """Runs every step, the last first (each one, even if one before raised: the first
        error is raised after), then puts back the modules' registries and attributes."""
        failed: BaseException | None = None
        for step in reversed(self.steps):
            try:
                step()
            except BaseException as err:  # noqa: BLE001 (put back everything that can be)
                failed = failed or err
        self.steps.clear()
        for m, attrs, params, buffers, children in self.modules:
            for k in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
            for reg, was in ((m._parameters, params), (m._buffers, buffers), (m._modules, children)):
                reg.clear()
                reg.update(was)  # type: ignore[arg-type]
        if failed is not None:
            raise failed

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.undo()
            return
        self.steps.clear()  # the tensors kept for a failure go
        self.modules.clear()
        trim_host_memory()


def from_copy(e: Entry, host: Tensor) -> Callable[[], None]:
    """What puts ``e``'s parameter back from its bytes in ``host`` (its block's copy in host
    memory, about to be freed): tensors of their own, as ``close()`` hands weights back; with no
    memory for them, views of the copy (which then stays as long as they do)."""

    def back() -> None:
        views = e.views(host)
        try:
            own = [v.clone() for v in views]
        except (MemoryError, RuntimeError):
            own = views
        e.attach(own)

    return back


__all__ = ["Undo", "from_copy"]
