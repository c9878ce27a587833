"""Times and frontiers.

A time is an unsigned 64-bit integer. Times are totally ordered, so an antichain is either a
single time ``{t}`` or empty ``{}``; the empty frontier is "closed": no more updates, ever.

Order: ``Frontier.at(a) <= Frontier.at(b)`` iff ``a <= b``, and every frontier is ``<=`` the
empty frontier (it is the top). ``join`` is the least upper bound (the later of the two),
``meet`` the greatest lower bound (the earlier). An update at time ``t`` is *beyond* a
frontier ``{f}`` when ``t >= f``; nothing is beyond ``{}``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TIME = 0
MAX_TIME = 2**64 - 1


def check_time(t: int) -> int:
    """Return ``t`` if it is a valid time (unsigned 64-bit integer), else raise ``ValueError``."""
    if isinstance(t, bool) or not isinstance(t, int) or not MIN_TIME <= t <= MAX_TIME:
        raise ValueError(f"expected a time in [0, 2**64), found {t!r}")
    return t


@dataclass(frozen=True, slots=True, order=False)
class Frontier:
    """``{t}`` when ``time`` is an int, ``{}`` (closed) when ``time`` is None."""

    time: int | None

    def __post_init__(self) -> None:
        if self.time is not None:
            check_time(self.time)

    # -- constructors ---------------------------------------------------------------------
    @staticmethod
    def at(t: int) -> Frontier:
        return Frontier(check_time(t))

    @staticmethod
    def minimum() -> Frontier:
        return Frontier(MIN_TIME)

    @staticmethod
    def empty() -> Frontier:
        return Frontier(None)

    # -- predicates -----------------------------------------------------------------------
    def is_empty(self) -> bool:
        return self.time is None

    def less_equal(self, other: Frontier) -> bool:
        """Partial-order ``self <= other`` (total here)."""
        if other.time is None:
            return True
        if self.time is None:
            return False
        return self.time <= other.time

    def less_than(self, other: Frontier) -> bool:
        return self.less_equal(other) and self != other

    def beyond(self, t: int) -> bool:
        """Is time ``t`` beyond (at or after) this frontier, i.e. still open to updates?"""
        return self.time is not None and t >= self.time

    def contains_time(self, t: int) -> bool:
        """Alias of :meth:`beyond`: ``t`` is not yet sealed by the frontier."""
        return self.beyond(t)

    # -- lattice --------------------------------------------------------------------------
    def join(self, other: Frontier) -> Frontier:
        """Least upper bound: the later frontier."""
        return other if self.less_equal(other) else self

    def meet(self, other: Frontier) -> Frontier:
        """Greatest lower bound: the earlier frontier."""
        return self if self.less_equal(other) else other

    # -- arithmetic helpers ---------------------------------------------------------------
    def step_back(self) -> Frontier:
        """``{t-1}`` for ``t > 0``; ``{0}`` stays; the empty frontier stays empty."""
        if self.time is None or self.time == 0:
            return self
        return Frontier(self.time - 1)

    # -- comparison operators (total order, so safe) --------------------------------------
    def __le__(self, other: Frontier) -> bool:
        return self.less_equal(other)

    def __lt__(self, other: Frontier) -> bool:
        return self.less_than(other)

    def __ge__(self, other: Frontier) -> bool:
        return other.less_equal(self)

    def __gt__(self, other: Frontier) -> bool:
        return other.less_than(self)

    # -- codec ----------------------------------------------------------------------------
    def to_json(self) -> int | None:
        return self.time

    @staticmethod
    def from_json(v: object) -> Frontier:
        if v is None:
            return Frontier.empty()
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected a time or null for a frontier, found {v!r}")
        return Frontier.at(v)

    def __repr__(self) -> str:
        return "{}" if self.time is None else f"{{{self.time}}}"


def meet_all(frontiers: list[Frontier] | tuple[Frontier, ...], default: Frontier) -> Frontier:
    """The meet of several frontiers, or ``default`` when there are none."""
    out = None
    for f in frontiers:
        out = f if out is None else out.meet(f)
    return default if out is None else out
