"""Read policies: how a collection's since follows its upper (pure).

A policy maps the collection's write frontier (its upper) to the frontier from which reads
must stay valid (the *implied capability*):

- ``ValidFrom(f)``: hold the since at ``f`` whatever the upper (``f`` may be empty: nothing
  needs to stay readable).
- ``LagWritesBy(lag, granularity)``: ``upper - lag`` (saturating at 0), rounded down to a
  multiple of ``granularity`` (of ``lag`` when unset) to cut the number of since changes:
  a reader that accepts ``lag`` accepts anything between ``lag`` and ``lag + granularity``.
  ``lag = 0`` follows the upper exactly. An empty upper (a closed collection) implies the
  minimum frontier (as the reference's ``lag_writes_by`` does): the since is then held by
  the capability reached before, since capabilities never move backwards.
- ``Multiple(policies)``: the least (meet) of the frontiers of its policies.

Policies are plain frozen values; :func:`policy_from_json` / :meth:`to_json` are the catalog
form, :func:`policy_from_avro` the command form (fastavro's ``(record_name, dict)`` unions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from shared.errors import InvalidUsageError, SinceViolationError
from shared.frontier import MAX_TIME, Frontier, check_time


@dataclass(frozen=True, slots=True)
class ValidFrom:
    frontier: Frontier

    def implied(self, upper: Frontier) -> Frontier:
        return self.frontier

    def to_json(self) -> dict[str, Any]:
        return {"kind": "valid_from", "frontier": self.frontier.to_json()}


@dataclass(frozen=True, slots=True)
class LagWritesBy:
    lag: int
    granularity: int | None = None

    def __post_init__(self) -> None:
        try:
            check_time(self.lag)
            if self.granularity is not None:
                check_time(self.granularity)
        except ValueError as e:
            raise InvalidUsageError(f"expected a lag and granularity in [0, 2**64), found: {e}") from None
        if self.granularity == 0:
            raise InvalidUsageError("expected a granularity > 0 (or null: the lag), found 0")

    def implied(self, upper: Frontier) -> Frontier:
        if upper.time is None:
            return Frontier.minimum()
        t = max(upper.time - self.lag, 0)
        step = self.granularity if self.granularity is not None else self.lag
        if step:
            t -= t % step
        return Frontier.at(t)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "lag_writes_by", "lag": self.lag, "granularity": self.granularity}


@dataclass(frozen=True, slots=True)
class Multiple:
    policies: tuple[ValidFrom | LagWritesBy, ...]

    def __post_init__(self) -> None:
        if not self.policies:
            raise InvalidUsageError("expected a Multiple policy with at least one policy, found none")
        for p in self.policies:
            if not isinstance(p, (ValidFrom, LagWritesBy)):
                raise InvalidUsageError(
                    f"expected ValidFrom or LagWritesBy inside Multiple, found {type(p).__name__}"
                )

    def implied(self, upper: Frontier) -> Frontier:
        out = Frontier.empty()
        for p in self.policies:
            out = out.meet(p.implied(upper))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"kind": "multiple", "policies": [p.to_json() for p in self.policies]}


ReadPolicy = Union[ValidFrom, LagWritesBy, Multiple]


def policy_from_json(d: dict[str, Any] | None, *, default_since: int = 0) -> ReadPolicy:
    """The catalog form; ``{}`` or None is ``ValidFrom(default_since)``."""
    if not d:
        return ValidFrom(Frontier.at(default_since))
    try:
        kind = d["kind"]
        if kind == "valid_from":
            return ValidFrom(Frontier.from_json(d["frontier"]))
        if kind == "lag_writes_by":
            g = d.get("granularity")
            return LagWritesBy(int(d["lag"]), None if g is None else int(g))
        if kind == "multiple":
            subs = tuple(policy_from_json(p) for p in d["policies"])
            return Multiple(subs)  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidUsageError(f"expected a read policy object, found {d!r}: {e}") from None
    raise InvalidUsageError(f"expected a read policy kind valid_from, lag_writes_by or multiple, found {kind!r}")


def policy_from_avro(value: Any) -> ReadPolicy:
    """A command's policy union value ``("io.shardsink.v1.ValidFrom", {...})``."""
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
        raise InvalidUsageError(f"expected a read policy (ValidFrom, LagWritesBy or Multiple), found {value!r}")
    kind = value[0].rsplit(".", 1)[-1]
    body = value[1]
    try:
        if kind == "ValidFrom":
            return ValidFrom(Frontier.from_json(body["frontier"]))
        if kind == "LagWritesBy":
            return LagWritesBy(int(body["lag"]), body.get("granularity"))
        if kind == "Multiple":
            subs = tuple(policy_from_avro(p) for p in body["policies"])
            for s in subs:
                if isinstance(s, Multiple):
                    raise InvalidUsageError("expected ValidFrom or LagWritesBy inside Multiple, found Multiple")
            return Multiple(subs)  # type: ignore[arg-type]
    except (KeyError, ValueError) as e:
        raise InvalidUsageError(f"expected a well-formed {kind} policy, found {body!r}: {e}") from None
    raise InvalidUsageError(f"expected a read policy ValidFrom, LagWritesBy or Multiple, found {kind!r}")


def check_reaches_since(policy: ReadPolicy, collection_id: str, since: Frontier, upper: Frontier) -> None:
    """Refuse a policy whose implied since is below the collection's ``since``: compacted
    history does not come back, so such a policy would be acknowledged without taking effect.
    Raises :class:`SinceViolationError` (the controller answers it as ``ReadBeforeSince``)."""
    implied = policy.implied(upper)
    if not since.less_equal(implied):
        raise SinceViolationError(
            f"expected a read policy whose since is at or above collection {collection_id!r}'s since "
            f"{since!r}, found one that implies {implied!r}: history below the since was compacted "
            "away; the policy was not changed",
            collection_id=collection_id, since=since, implied=implied,
        )


__all__ = [
    "MAX_TIME",
    "check_reaches_since",
    "LagWritesBy",
    "Multiple",
    "ReadPolicy",
    "ValidFrom",
    "policy_from_avro",
    "policy_from_json",
]
