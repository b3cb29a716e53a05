"""The optimizer state in and out: ``state_dict``/``load_state_dict``, state written into
``optimizer.state`` by other code (taken over at the next step), the streaming checkpoints
(``save_state``/``load_state``) and copies (pickling, ``copy.deepcopy``).

As torch's ``Optimizer`` base class does this for its ``Adam``, which keeps to bookkeeping, these
are plain functions over what the optimizer hands them: its :class:`~offload_adam.optim.engine.Engine`
(the groups' state, made resident through its tier), its ``state`` (a :class:`State`), its
``param_groups`` and its ``defaults``. Every entry that comes in is checked against the schema
(``schema.py``) before anything is written: on error nothing changes. Written entries are
copied into the flat buffers, in each slot's codec, and the optimizer's own views reinstalled.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils import _pytree

from . import checkpoint
from .hyper import hyper
from .schema import COMP_KEY, MASTER_KEY, MOMENT, check_moment, copy_moment, moments, write_moment
from .shards import local, localizer
from .state import GroupState

if TYPE_CHECKING:
    from .engine import Engine

Groups = list[dict[str, Any]]  # an optimizer's param_groups


class Entry(dict):  # type: ignore[type-arg]
    """An entry of ``optimizer.state``: notes when code other than ours writes it."""

    def __init__(self, *args: Any, owner: State | None = None, **kw: Any) -> None:
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
# dict it is; without this a dict subclass would be a leaf, its tensors invisible. (The
# serialized name is the one it was registered under from the start: a name in saved tree
# specs, not a module path.)
_pytree.register_pytree_node(
    Entry,
    _pytree._dict_flatten,
    _pytree._dict_unflatten,
    serialized_type_name="offload_adam.optimizer._Entry",
    flatten_with_keys_fn=_pytree._dict_flatten_with_keys,
)


class State(defaultdict):  # type: ignore[type-arg]
    """``optimizer.state``: a defaultdict that notes writes by code other than ours, so that the
    next step takes them over (``ZeroRedundancyOptimizer`` assigns ``optim.state[p] = {...}``)."""

    def __init__(self) -> None:
        super().__init__(dict)
        self.dirty = False

    def __missing__(self, key: Any) -> Any:
        v = Entry(owner=self)
        dict.__setitem__(self, key, v)
        return v

    def install(self, key: Any, value: dict[str, Any]) -> None:
        """Our own write: no takeover needed."""
        dict.__setitem__(self, key, Entry(value, owner=self))

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


def as_state(value: Any) -> State:
    """``optimizer.state = value`` (torch's ``__setstate__`` and ``load_state_dict`` assign it):
    a :class:`State` holding ``value``'s entries, noted as written by others if any."""
    s = State()
    for k, v in dict(value).items():
        dict.__setitem__(s, k, Entry(v, owner=s) if type(v) is dict else v)
    s.dirty = bool(s)
    return s


# Every key the schema may put in an entry, in any codec.
_SCHEMA_KEYS = frozenset({MASTER_KEY, COMP_KEY} | {m.key + s for m in moments(True) for s in ("", "_codes", "_absmax", "_scale")})


def _unaliased(entry: dict[str, Any], ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """``entry`` with every tensor that shares memory with one of ``ranges`` (our buffers)
    replaced by a copy, so that writing the buffers cannot change the source."""

    def aliases(t: Tensor) -> bool:
        st = local(t).untyped_storage()
        lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
        return hi > lo and any(a < hi and lo < b for a, b in ranges)

    return {k: x.clone() if isinstance(x, Tensor) and aliases(x) else x for k, x in entry.items()}


def _same_view(a: Any, b: Tensor) -> bool:
    """Whether ``a`` is the view ``b`` of our buffers (same memory, shape and strides)."""
    return (
        isinstance(a, Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _group(engine: Engine, gi: int) -> GroupState:
    g = engine.groups[gi]
    assert g is not None
    return g


def _buffer_ranges(engine: Engine) -> list[tuple[int, int]]:
    out = []
    for _, g in engine.live_groups():
        for t in g.buffers():
            st = t.untyped_storage()
            out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    return out


def _master_loaded(engine: Engine, g: GroupState, i: int, *, from_checkpoint: bool) -> None:
    """An offloaded slot's state was written: the step's gradients' side notes where its master
    comes from (see :meth:`~offload_adam.optim.grads.StreamedGrads.master_loaded`)."""
    assert engine.streamed is not None
    engine.streamed.master_loaded(g.slots[i].param, from_checkpoint=from_checkpoint)


# -- one entry ----------------------------------------------------------------------------------


def check_entry(engine: Engine, gi: int, i: int, v: Any, amsgrad: bool) -> float:
    """Checks a state entry for parameter ``i`` of group ``gi`` (from a checkpoint, or written
    into ``state`` by other code) against the schema; returns its step count."""
    s = _group(engine, gi).slots[i]
    p, name = s.param, s.name
    if not isinstance(v, dict):
        raise TypeError(f"loaded state of {name}: expected a dict, got {type(v).__name__}")
    if "step" not in v:
        raise ValueError(f"loaded state of {name}: missing key 'step'")
    loc = localizer(s.key, name)
    for m in moments(True):
        if check_moment(v, m, p, name, loc) is None and (amsgrad or not m.amsgrad):
            raise ValueError(
                f"loaded state of {name}: missing key {m.key!r} (or {m.key + '_codes'!r} and {m.key + '_absmax'!r} or {m.key + '_scale'!r})"
            )
    for key in (MASTER_KEY, COMP_KEY):
        t = v.get(key)
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"loaded state of {name}: {key} must be a tensor, got {type(t).__name__}")
        t = loc(t, key)
        if t.shape != p.shape:
            raise ValueError(f"loaded state of {name}: {key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if not (t.is_floating_point() or t.is_complex()) or t.is_complex() != p.is_complex():
            raise TypeError(f"loaded state of {name}: {key} has dtype {t.dtype}, expected one like {p.dtype}")
    step = v["step"]
    step_f = float(step.item() if isinstance(step, Tensor) else step)
    if not (math.isfinite(step_f) and step_f >= 0 and step_f == int(step_f)):
        raise ValueError(f"loaded state of {name}: step must be a whole number >= 0, got {step_f}")
    return step_f


def write_entry(engine: Engine, state: State, gi: int, i: int, v: dict[str, Any], step: float) -> None:
    """Copies a checked entry into the slot's buffers, in the slot's codec (quantizing or
    dequantizing moments), and installs our views (keeping the entry's other keys). The
    caller quiesced the engine and cloned sources that alias our buffers."""
    g = _group(engine, gi)
    s = g.slots[i]
    p = s.param
    views = g.views(i)
    views["step"].fill_(step)
    loc = localizer(s.key, s.name)
    for key in g.moment_buffers():
        m = MOMENT[key]
        if any(k in v for k in (m.key, m.key + "_codes")):
            write_moment(views, s.codec, m, v, loc)
        elif m.amsgrad:
            copy_moment(views, s.codec, m, MOMENT["exp_avg_sq"])
    master, comp = v.get(MASTER_KEY), v.get(COMP_KEY)
    weights: Tensor = s.home if s.home is not None else p
    if MASTER_KEY in views:
        # An fp32 master from the entry, or (bf16 weights with Kahan compensation) the
        # weights plus their compensation, or the weights.
        if master is not None:
            views[MASTER_KEY].copy_(loc(master, MASTER_KEY))
        elif comp is not None:
            views[MASTER_KEY].copy_(weights.float() + loc(comp, COMP_KEY).float())
        else:
            views[MASTER_KEY].copy_(p)
    if COMP_KEY in views:
        # The compensation from the entry, or what the weights lack of an fp32 master.
        if comp is not None:
            views[COMP_KEY].copy_(loc(comp, COMP_KEY))
        elif master is not None:
            views[COMP_KEY].copy_(loc(master, MASTER_KEY).float() - weights.float())
        else:
            views[COMP_KEY].zero_()
    if g.streamed:
        _master_loaded(engine, g, i, from_checkpoint=v.get(MASTER_KEY) is not None)
    extra = {k: x for k, x in v.items() if k not in views and k not in _SCHEMA_KEYS}
    state.install(s.key, {**g.entry(i), **extra})


def reset_slot(engine: Engine, gi: int, i: int) -> None:
    """An entry emptied or deleted by other code: a fresh start at the next step, as torch
    (all-zero codes and absmax are zero moments too)."""
    g = _group(engine, gi)
    for key, t in g.views(i).items():
        if key != MASTER_KEY:
            t.zero_()
    if g.streamed:
        _master_loaded(engine, g, i, from_checkpoint=False)


# -- state written by others, at the next step ----------------------------------------------------


def take_over(engine: Engine, state: State, param_groups: Groups) -> None:
    """Takes over state written into ``state`` by other code since our last look: values and
    step counts are copied into our buffers and our views reinstalled, never silently ignored
    while the kernel steps its own buffers."""
    if not state.dirty:
        return
    engine.quiesce()
    with engine.resident():
        ours = _buffer_ranges(engine)
        plan: list[tuple[int, int, dict[str, Any] | None, float]] = []
        for gi, g in engine.live_groups():
            amsgrad = bool(param_groups[gi]["amsgrad"])
            for i, s in enumerate(g.slots):
                entry = dict.get(state, s.key)
                if not entry:
                    if float(g.steps[i]) != 0.0:
                        plan.append((gi, i, None, 0.0))
                    continue
                views = g.views(i) if float(g.steps[i]) != 0.0 else {}
                if isinstance(entry, Entry) and views and all(entry.get(k) is not None and _same_view(local(entry[k]), t) for k, t in views.items()):
                    continue
                step = check_entry(engine, gi, i, entry, amsgrad)
                plan.append((gi, i, _unaliased(entry, ours), step))
        with torch.no_grad():
            for gi, i, entry_src, step in plan:
                if entry_src is None:
                    reset_slot(engine, gi, i)
                else:
                    write_entry(engine, state, gi, i, entry_src, step)
        state.dirty = False


def switch_on_amsgrad(engine: Engine, state: State, amsgrad: Sequence[bool]) -> None:
    """Groups whose ``amsgrad`` (``amsgrad[gi]``) was switched on since their state was built:
    the maximum starts from the state as it is, and the entries handed out show it."""
    needs_max = [(gi, g) for gi, g in engine.live_groups() if amsgrad[gi] and g.max_exp_avg_sq is None]
    if not needs_max:
        return
    with engine.resident():
        for _, g in needs_max:
            g.ensure_amsgrad()
            for i, s in enumerate(g.slots):
                entry = dict.get(state, s.key)
                if entry:
                    fresh = g.entry(i)
                    for key in s.codec.keys(MOMENT["max_exp_avg_sq"]):
                        dict.__setitem__(entry, key, fresh[key])


# -- state_dict ---------------------------------------------------------------------------------


def state_dict(engine: Engine, full: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``full()`` (torch's ``Optimizer.state_dict``), aliasing the live state as torch's does;
    where the tier's views do not stay valid between steps (``storage="nvme"``), copies."""
    if engine.tier.stable_views:
        return full()
    with engine.resident(write=False):
        sd = full()
        sd["state"] = {
            k: {kk: vv.clone() if isinstance(vv, Tensor) else vv for kk, vv in v.items()} if isinstance(v, dict) else v
            for k, v in sd["state"].items()
        }
    return sd


def merge_groups(
    param_groups: Groups, defaults: dict[str, Any], saved_groups: Groups, *, decoupled: bool
) -> tuple[Groups, dict[Any, tuple[int, int]]]:
    """The param groups a checkpoint's groups make (checked), and the (group, slot) of each
    saved parameter id. ``decoupled``: AdamW's groups always decay decoupled."""
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    where: dict[Any, tuple[int, int]] = {}
    for gi, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        if "params" not in sg or len(sg["params"]) != len(g["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        for i, k in enumerate(sg["params"]):
            where[k] = (gi, i)
    merged = []
    for gi, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        new = {**defaults, **sg, "params": g["params"]}
        if "param_names" in g:
            new["param_names"] = g["param_names"]
        if decoupled:  # as AdamW.__setstate__ does in torch, for subclasses too
            new["decoupled_weight_decay"] = True
        try:
            hyper(new)
        except ValueError as e:
            raise ValueError(f"loaded param group {gi}: {e}") from None
        if isinstance(new["betas"], list):
            new["betas"] = tuple(new["betas"])  # a list from JSON/YAML or DCP's full state dict
        merged.append(new)
    return merged, where


def load_state_dict(
    engine: Engine, state: State, param_groups: Groups, defaults: dict[str, Any], state_dict: dict[str, Any], *, decoupled: bool
) -> None:
    """Loads torch's format into the host buffers, in their dtypes, and the param groups it
    carries into ``param_groups``. Everything is checked first: on error nothing changes."""
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"loaded state dict has no {key!r} key")
    merged, where = merge_groups(param_groups, defaults, state_dict["param_groups"], decoupled=decoupled)
    engine.synchronize()
    engine.materialize()
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
            extras[param_groups[gi]["params"][i]] = Entry()
            continue
        plan.append((gi, i, v, check_entry(engine, gi, i, v, bool(merged[gi]["amsgrad"]))))

    # Everything checked: apply. A source may be a view of our own buffers
    # (`load_state_dict(state_dict())`, or torch.distributed.checkpoint filling the tensors we
    # handed out, then loading them): zeroing the buffers would erase it, so such sources are
    # copied first.
    engine.quiesce()
    for g, new in zip(param_groups, merged):
        g.clear()
        g.update(new)
    live = engine.live_groups()
    ours = _buffer_ranges(engine)
    plan = [(gi, i, _unaliased(v, ours), step) for gi, i, v, step in plan]
    with torch.no_grad(), engine.resident():
        for gi, gs in live:
            if merged[gi]["amsgrad"]:
                gs.ensure_amsgrad()
        dict.clear(state)
        for gi, gs in live:
            for t in gs.state_buffers():
                t.zero_()
            if gs.streamed:
                for i in range(len(gs)):
                    _master_loaded(engine, gs, i, from_checkpoint=False)
        for gi, i, v, step in plan:
            write_entry(engine, state, gi, i, v, step)
        for k, v in extras.items():
            if isinstance(v, Entry):
                v.owner = state
            dict.__setitem__(state, k, v)
    state.dirty = False


# -- streaming checkpoints ------------------------------------------------------------------------


def _ids(param_groups: Groups) -> list[list[int]]:
    """The ``state_dict()`` id of each parameter, by group."""
    out, start = [], 0
    for g in param_groups:
        out.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
    return out


def save_state(engine: Engine, state: State, param_groups: Groups, path: str) -> str:
    """Writes the state to ``path/optimizer.safetensors`` bucket by bucket (see
    :mod:`offload_adam.optim.checkpoint`); returns the file's path."""
    os.makedirs(path, exist_ok=True)
    ids = _ids(param_groups)
    packed = [{**{k: v for k, v in g.items() if k != "params"}, "params": ids[gi]} for gi, g in enumerate(param_groups)]
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    plan: list[tuple[GroupState, list[tuple[int, int, list[str]]]]] = []
    complex_ids = []
    for gi, g in engine.live_groups():
        for rng in g.buckets:
            items = []
            for i in rng:
                p = g.slots[i].key
                if not dict.get(state, p):
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
            with engine.resident((g, [i for i, _, _ in items]), write=False):
                for i, pid, keys in items:
                    views = g.views(i)
                    for key in keys:
                        w.write(f"state.{pid}.{key}", views[key])
        engine.tier.end_step()
        w.commit()
    except BaseException:
        w.abort()
        raise
    return file


def load_state(
    engine: Engine, state: State, param_groups: Groups, defaults: dict[str, Any], path: str, *, decoupled: bool
) -> None:
    """Loads a checkpoint :func:`save_state` wrote (into any tier: the state is read bucket by
    bucket). Everything is checked first: on error nothing changes."""
    r = checkpoint.Reader(os.path.join(path, checkpoint.FILE))
    try:
        _load_state(engine, state, param_groups, defaults, r, decoupled=decoupled)
    finally:
        r.close()


def _load_state(
    engine: Engine, state: State, param_groups: Groups, defaults: dict[str, Any], r: checkpoint.Reader, *, decoupled: bool
) -> None:
    if r.metadata.get("format") != checkpoint.FORMAT:
        raise ValueError(f"{r.path}: not an offload_adam optimizer checkpoint (format {r.metadata.get('format')!r})")
    merged, where = merge_groups(param_groups, defaults, json.loads(r.metadata["param_groups"]), decoupled=decoupled)
    complex_ids = set(json.loads(r.metadata.get("complex", "[]")))
    by_id: dict[int, dict[str, checkpoint.Entry]] = defaultdict(dict)
    for name, e in r.entries.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise ValueError(f"{r.path}: unexpected tensor {name!r}")
        by_id[int(parts[1])][parts[2]] = e
    engine.synchronize()
    engine.materialize()
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
        steps[pid] = check_entry(engine, gi, i, meta, bool(merged[gi]["amsgrad"]))
    # Checked: apply, bucket by bucket.
    engine.quiesce()
    for g, new in zip(param_groups, merged):
        g.clear()
        g.update(new)
    live = engine.live_groups()
    if any(merged[gi]["amsgrad"] and gs.max_exp_avg_sq is None for gi, gs in live):
        with engine.resident():
            for gi, gs in live:
                if merged[gi]["amsgrad"]:
                    gs.ensure_amsgrad()
    dict.clear(state)
    ids = _ids(param_groups)
    with torch.no_grad():
        for gi, gs in live:
            for rng in gs.buckets:
                with engine.resident((gs, rng)):
                    for i in rng:
                        pid = ids[gi][i]
                        if pid not in by_id:
                            views = gs.views(i)
                            for key, v in views.items():
                                if key != "master_param" or not gs.streamed:
                                    v.zero_()
                            if gs.streamed:
                                _master_loaded(engine, gs, i, from_checkpoint=False)
                            continue
                        entry: dict[str, Any] = {}
                        for key in by_id[pid]:
                            t = r.read(f"state.{pid}.{key}")
                            entry[key] = torch.view_as_complex(t) if pid in complex_ids and key != "step" else t
                        write_entry(engine, state, gi, i, entry, steps[pid])
    engine.tier.end_step()
    state.dirty = False


# -- copies -------------------------------------------------------------------------------------


def copied(engine: Engine, state: State) -> dict[Any, Any]:
    """``state`` as a copy (pickling) takes it: our views, or copies of them where the tier's
    views do not stay valid between steps."""
    copy_all = not engine.tier.stable_views
    with engine.resident(write=False):
        return {
            k: {kk: vv.clone() if copy_all and isinstance(vv, Tensor) else vv for kk, vv in v.items()} if isinstance(v, dict) else v
            for k, v in state.items()
        }


def restore(engine: Engine, state: State, param_groups: Groups, saved: dict[Any, Any]) -> None:
    """A copy's state (see :func:`copied`) written into the engine's fresh groups: each entry
    checked and written into its slot, other keys kept as they are."""
    engine.materialize()
    slot = {id(s.key): (gi, i) for gi, g in engine.live_groups() for i, s in enumerate(g.slots)}
    with torch.no_grad(), engine.resident():
        for k, v in saved.items():
            if isinstance(k, Tensor) and id(k) in slot and isinstance(v, dict) and v:
                gi, i = slot[id(k)]
                write_entry(engine, state, gi, i, v, check_entry(engine, gi, i, v, bool(param_groups[gi]["amsgrad"])))
            else:
                dict.__setitem__(state, k, v)
    state.dirty = False
