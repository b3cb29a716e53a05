"""The recorded cycle: the order in which streamed blocks run, from the start of a forward to the
end of its backward (or of the forward, in inference), and where this cycle is in it. A pure
order: no device, no tensors (vLLM's ``PrefetchOffloader`` schedule, learnt instead of fixed).

Each activation of a block is an *instance* of it: a block with a slot of its own has one per
cycle, from its first activation to its last; an activation of the block active just before is
the same instance. Instances are numbered across cycles (``g = cycle * instances + index``), so
that prefetch runs cyclically into the next cycle. A cycle whose activations differ from the
recorded one (or the first, whose order is a guess from the model's module order) is
*mismatched*: it is recorded as the new order when it ends (unless a fault cut it short).
"""

from __future__ import annotations

from collections.abc import Sequence


def plan(order: Sequence[int], own: set[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The instances of one cycle of ``order`` (block, first position, last position), in the
    order they are loaded, and the instance of each position. A block with a slot of its own
    has one instance per cycle; any other block one per run of consecutive activations."""
    span: dict[int, list[int]] = {}
    for pos, b in enumerate(order):
        if b in own:
            span.setdefault(b, [pos, pos])[1] = pos
    inst: list[tuple[int, int, int]] = []
    of_pos: list[int] = []
    first: dict[int, int] = {}
    for pos, b in enumerate(order):
        if b in own:
            if b not in first:
                first[b] = len(inst)
                inst.append((b, span[b][0], span[b][1]))
            of_pos.append(first[b])
        elif pos and order[pos - 1] == b:
            j = of_pos[-1]
            inst[j] = (b, inst[j][1], pos)
            of_pos.append(j)
        else:
            of_pos.append(len(inst))
            inst.append((b, pos, pos))
    return inst, of_pos


class Cycle:
    """The recorded order of ``own``-aware instances and the position of the cycle running."""

    def __init__(self, guess: Sequence[int], own: set[int]) -> None:
        self.own = own
        self.order: list[int] = list(guess)
        self.inst, self.of_pos = plan(self.order, own)
        self.ncycle = 0  # cycles ended
        self.pos = 0  # activations in this cycle so far
        self.seen: list[int] = []  # this cycle's order
        self.mismatch = False  # this cycle differs from the recorded one
        self.faulted = False  # a load failed in this cycle: its order is not recorded
        self.next_load = 0  # the cursor: the next instance to prefetch

    def abs(self, pos: int) -> int:
        """Position ``pos`` of this cycle, counted from the first cycle."""
        return self.ncycle * len(self.order) + pos

    def advance(self, b: int, at: int | None = None) -> tuple[int, bool, bool]:
        """Block ``b`` is activated at the next position (``at``: at that position of ``seen``,
        a read found mid-way). Returns the position, whether the recorded order planned it, and
        whether this activation is the first to diverge from it (the caller then drops what it
        loaded for the recorded order)."""
        pos = self.pos
        self.pos += 1
        if at is None:
            self.seen.append(b)
        else:
            self.seen.insert(at, b)
            self.mismatch = True  # the order of this cycle is being discovered
        planned = not self.mismatch and pos < len(self.order) and self.order[pos] == b
        diverged = not planned and not self.mismatch
        if diverged:
            self.mismatch = True
        return pos, planned, diverged

    def instance(self, pos: int) -> tuple[int, int]:
        """The instance planned at ``pos`` (numbered across cycles), and the absolute position of
        its last activation."""
        j = self.of_pos[pos]
        return self.ncycle * len(self.inst) + j, self.abs(self.inst[j][2])

    def at(self, g: int) -> tuple[int, int, int, int]:
        """Instance ``g``: its block, the cycle it belongs to, and the absolute positions of its
        first and last activations."""
        n = len(self.inst)
        b, first, last = self.inst[g % n]
        p = g // n
        return b, p, p * len(self.order) + first, p * len(self.order) + last

    # -- the prefetch cursor --------------------------------------------------------------------

    def due(self, g: int, depth: int) -> tuple[int, int, int, int] | None:
        """The instance at the cursor if it is within ``depth`` after instance ``g`` (the cursor
        first moved past ``g``), as :meth:`at` gives it; None: nothing more to queue now. The
        caller either queues it and moves on (:meth:`skip`), moves on without (loaded already,
        or run elsewhere), or stops (no slot; not ready)."""
        if not self.inst:
            return None
        self.next_load = max(self.next_load, g + 1)
        return self.at(self.next_load) if self.next_load <= g + depth else None

    def skip(self) -> None:
        """The cursor moves to the next instance."""
        self.next_load += 1

    def read_ahead(self, n: int) -> list[int]:
        """The blocks of the ``n`` instances from the cursor on (cyclically): read into host
        memory ahead of their copy."""
        k = len(self.inst)
        return [self.inst[i % k][0] for i in range(self.next_load, self.next_load + n)] if k else []

    def fault(self) -> None:
        """A load failed: this cycle's order is not recorded; the next loads again."""
        self.mismatch = True
        self.faulted = True

    def end(self) -> tuple[bool, bool]:
        """The cycle is over: recorded as the order if it differed (and no fault cut it short).
        Returns whether it differed (what was loaded for the old order is then stale) and whether
        a new order was recorded."""
        changed = self.mismatch or self.seen != self.order
        recorded = False
        if changed and not self.faulted and self.seen:
            self.order = self.seen
            self.inst, self.of_pos = plan(self.order, self.own)
            recorded = True
        self.seen = []
        self.mismatch = self.faulted = False
        self.ncycle += 1
        self.pos = 0
        if changed:
            self.next_load = self.ncycle * len(self.inst)
        return changed, recorded
