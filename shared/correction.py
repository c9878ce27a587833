"""The correction buffer: ``desired - persist`` for one writer partition.

The write service inserts the desired updates positively and the shard's own contents (the
snapshot at start, then every appended batch) negatively. What remains is exactly what has to
be written so that the shard equals the desired collection: the self-correcting loop of the
sink. Writing a batch does not take anything out of the buffer; the batch comes back through
the shard read-back, negated, and cancels then.

Representation (chosen for memory: the issue's budget is peak bytes <= 1.5x the collection's
Arrow size during hydration, where the buffer briefly holds the collection twice):

* a row is an opaque key: its encoded bytes (the Avro body), or an error string's UTF-8
  bytes for the error collection. Keys live in Arrow ``binary`` arrays (one contiguous data
  buffer plus int32 offsets: 4 bytes of overhead per update), times in ``uint64`` and diffs
  in ``int64`` numpy arrays;
* **chunks**: a list of sorted, consolidated runs with disjoint, increasing key ranges (a
  B-tree of depth one). Each chunk is sorted by ``(key, time)`` and has no two entries with
  the same ``(key, time)`` and no zero diff. A key never spans two chunks;
* a **stage**: the unsorted inserts since the last flush. It is flushed (sorted,
  consolidated, and merged into the chunks it touches) as soon as it holds more than
  ``stage_fraction`` of the chunks' entries (and at least ``min_stage``), so consolidation is
  eager and amortised: each flush costs O(N log c) and happens after N * stage_fraction
  inserts. Peak memory is about ``(1 + 2 * stage_fraction) * N`` entries plus one chunk of
  merge scratch, because a merge only ever rewrites one chunk at a time.

Key-first order is what makes ``advance_since`` cheap and safe: clamping times to
``max(t, since)`` is monotone, so a chunk stays sorted and only adjacent entries of one key
can collide (they are summed in place). ``updates_before`` is a vectorised scan.

Invariants (checked by the property tests against a naive ``Counter`` model):

1. the multiset ``{(key, max(t, since)): diff}`` of everything inserted (negated inserts
   counting negatively) equals the buffer's contents, consolidated;
2. every chunk is sorted by ``(key, time)``, consolidated, non-empty, and its keys are all
   greater than the previous chunk's keys;
3. after ``advance_since(s)`` no chunk entry has a time below ``s``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from shared.errors import InvalidUsageError
from shared.frontier import MAX_TIME, Frontier

_Bytes = bytes  # the class below has a method named ``bytes``
Keys = Union[pa.Array, pa.ChunkedArray, Sequence[bytes]]
TimesLike = Union[npt.NDArray[Any], Sequence[int], int]
DiffsLike = Union[npt.NDArray[Any], Sequence[int], int]

_EMPTY_KEYS = pa.nulls(0, pa.binary())  # not pa.array([]): converting a Python list makes pyarrow import pandas (0.5 s)
DEFAULT_CHUNK_TARGET = 16_384
DEFAULT_MIN_STAGE = 16_384
DEFAULT_STAGE_FRACTION = 0.125
STAGE_MAX_BYTES = 256 << 20  # flush before a stage's key bytes near the 2 GiB binary limit
CHUNK_MAX_BYTES = 64 << 20


# -- values ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsolidatedUpdates:
    """Consolidated updates: no two with the same ``(key, time)``, no zero diff.

    Columnar: ``keys`` (Arrow binary), ``times`` (uint64), ``diffs`` (int64), equal lengths.
    Ordered by ``(key, time)``.
    """

    keys: pa.Array
    times: npt.NDArray[np.uint64]
    diffs: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        if not (len(self.keys) == len(self.times) == len(self.diffs)):
            raise InvalidUsageError(
                "expected keys, times and diffs of equal length, found "
                f"{len(self.keys)}, {len(self.times)}, {len(self.diffs)}"
            )

    @staticmethod
    def empty() -> ConsolidatedUpdates:
        return ConsolidatedUpdates(
            _EMPTY_KEYS, np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64)
        )

    def __len__(self) -> int:
        return len(self.times)

    def is_empty(self) -> bool:
        return len(self.times) == 0

    def to_list(self) -> list[tuple[bytes, int, int]]:
        """As ``[(key, time, diff), ...]`` (for tests and small batches)."""
        return [
            (k, int(t), int(d))
            for k, t, d in zip(self.keys.to_pylist(), self.times.tolist(), self.diffs.tolist())
        ]

    def to_table(self) -> pa.Table:
        """As an Arrow table with columns ``key`` (binary), ``time`` (uint64), ``diff`` (int64)."""
        return pa.table(
            {
                "key": self.keys,
                "time": pa.array(self.times, type=pa.uint64()),
                "diff": pa.array(self.diffs, type=pa.int64()),
            }
        )

    def nbytes(self) -> int:
        return _keys_bytes(self.keys) + int(self.times.nbytes) + int(self.diffs.nbytes)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """A sorted, consolidated run of updates (invariant 2 of the module docstring)."""

    keys: pa.Array
    times: npt.NDArray[np.uint64]
    diffs: npt.NDArray[np.int64]
    min_time: int
    first_key: bytes

    @staticmethod
    def of(u: ConsolidatedUpdates) -> _Chunk:
        return _Chunk(u.keys, u.times, u.diffs, int(u.times.min()), _key_at(u.keys, 0))

    def __len__(self) -> int:
        return len(self.times)

    def nbytes(self) -> int:
        return _keys_bytes(self.keys) + int(self.times.nbytes) + int(self.diffs.nbytes)

    def as_updates(self) -> ConsolidatedUpdates:
        return ConsolidatedUpdates(self.keys, self.times, self.diffs)


# -- the buffer -----------------------------------------------------------------------------


class Correction:
    """``desired - persist`` for one writer partition, eagerly consolidated.

    ``insert`` adds updates, ``insert_negated`` subtracts them, ``advance_since(t)`` moves
    every buffered time below ``t`` up to ``t`` (the seeds advance to the persist upper: the
    sink only ever writes at or beyond it), ``updates_before(upper)`` returns the consolidated
    updates at times ``< upper`` without removing them.
    """

    def __init__(
        self,
        *,
        chunk_target: int = DEFAULT_CHUNK_TARGET,
        min_stage: int = DEFAULT_MIN_STAGE,
        stage_fraction: float = DEFAULT_STAGE_FRACTION,
    ) -> None:
        if chunk_target < 2:
            raise InvalidUsageError(f"expected chunk_target >= 2, found {chunk_target}")
        if min_stage < 1:
            raise InvalidUsageError(f"expected min_stage >= 1, found {min_stage}")
        if not 0.0 < stage_fraction <= 4.0:
            raise InvalidUsageError(f"expected 0 < stage_fraction <= 4, found {stage_fraction}")
        self._chunk_target = chunk_target
        self._min_stage = min_stage
        self._stage_fraction = stage_fraction
        self._since = 0
        self._chunks: list[_Chunk] = []
        self._chunk_len = 0
        self._stage: list[tuple[pa.Array, npt.NDArray[np.uint64], npt.NDArray[np.int64]]] = []
        self._stage_len = 0
        self._stage_key_bytes = 0
        self._flushes = 0

    # -- observation ------------------------------------------------------------------------
    @property
    def since(self) -> int:
        """Every buffered time is (treated as) at least this."""
        return self._since

    def size(self) -> int:
        """The number of buffered entries (staged entries are not yet consolidated)."""
        return self._chunk_len + self._stage_len

    def bytes(self) -> int:
        """Bytes held by the buffer's arrays (keys' data and offsets, times, diffs)."""
        total = sum(c.nbytes() for c in self._chunks)
        for k, t, d in self._stage:
            total += _keys_bytes(k) + int(t.nbytes) + int(d.nbytes)
        return total

    def stats(self) -> dict[str, int]:
        return {
            "entries": self.size(),
            "bytes": self.bytes(),
            "chunks": len(self._chunks),
            "staged": self._stage_len,
            "flushes": self._flushes,
            "since": self._since,
        }

    # -- inserts ----------------------------------------------------------------------------
    def insert(self, keys: Keys, times: TimesLike, diffs: DiffsLike = 1) -> None:
        """Add updates ``(keys[i], times[i], diffs[i])``; a scalar time or diff applies to all."""
        self._insert(keys, times, diffs, negate=False)

    def insert_negated(self, keys: Keys, times: TimesLike, diffs: DiffsLike = 1) -> None:
        """Subtract updates (the shard's own contents read back)."""
        self._insert(keys, times, diffs, negate=True)

    def insert_updates(self, updates: Iterable[tuple[_Bytes, int, int]]) -> None:
        """Add ``(key, time, diff)`` tuples (convenience for small inputs and tests)."""
        ks, ts, ds = _unzip(updates)
        if ks:
            self.insert(ks, ts, ds)

    def insert_negated_updates(self, updates: Iterable[tuple[_Bytes, int, int]]) -> None:
        ks, ts, ds = _unzip(updates)
        if ks:
            self.insert_negated(ks, ts, ds)

    def _insert(self, keys: Keys, times: TimesLike, diffs: DiffsLike, *, negate: bool) -> None:
        k = _as_binary(keys)
        n = len(k)
        if n == 0:
            return
        t = as_times(times, n)
        d = as_diffs(diffs, n)
        if negate:
            d = np.negative(d)
        self._stage.append((k, t, d))
        self._stage_len += n
        self._stage_key_bytes += _keys_bytes(k)
        threshold = max(self._min_stage, int(self._chunk_len * self._stage_fraction))
        if self._stage_len >= threshold or self._stage_key_bytes >= STAGE_MAX_BYTES:
            self.consolidate()

    # -- frontier ---------------------------------------------------------------------------
    def advance_since(self, since: Frontier | int) -> None:
        """Advance every buffered time below ``since`` to ``since`` (monotone; regressions
        are ignored). An empty frontier means no time will ever be written again: the buffer
        is cleared."""
        if isinstance(since, Frontier):
            if since.is_empty():
                self.clear()
                self._since = MAX_TIME
                return
            s = int(since.time)  # type: ignore[arg-type]
        else:
            s = int(since)
        if s <= self._since:
            return
        self._since = s
        # Clamp chunk by chunk, releasing each old chunk as its replacement is built, so the
        # scratch space is one chunk. The stage is clamped when it is flushed
        # (max(max(t, a), b) == max(t, b), so late clamping is the same).
        old = self._take_chunks()
        out: list[_Chunk] = []
        for i, c in enumerate(old):
            old[i] = None
            if c is None or c.min_time >= s:
                if c is not None:
                    out.append(c)
                continue
            clamped = np.maximum(c.times, np.uint64(s))
            u = _consolidate_sorted(c.keys, clamped, c.diffs)
            del c, clamped
            if len(u):
                out.append(_Chunk.of(u))
        self._set_chunks(out)

    # -- reads ------------------------------------------------------------------------------
    def updates_before(self, upper: Frontier | int | None) -> ConsolidatedUpdates:
        """The consolidated updates at times ``< upper`` (all of them for an empty frontier or
        None). Non-destructive: writing them does not remove them; their read-back does."""
        self.consolidate()
        if upper is None or (isinstance(upper, Frontier) and upper.is_empty()):
            bound: int | None = None
        else:
            bound = int(upper.time) if isinstance(upper, Frontier) else int(upper)  # type: ignore[arg-type]
        ks: list[pa.Array] = []
        ts: list[npt.NDArray[np.uint64]] = []
        ds: list[npt.NDArray[np.int64]] = []
        for c in self._chunks:
            if bound is None:
                ks.append(c.keys)
                ts.append(c.times)
                ds.append(c.diffs)
                continue
            if c.min_time >= bound:
                continue
            mask = c.times < np.uint64(bound)
            if mask.all():
                ks.append(c.keys)
                ts.append(c.times)
                ds.append(c.diffs)
            else:
                idx = np.flatnonzero(mask)
                ks.append(c.keys.take(pa.array(idx)))
                ts.append(c.times[idx])
                ds.append(c.diffs[idx])
        if not ks:
            return ConsolidatedUpdates.empty()
        return ConsolidatedUpdates(
            pa.concat_arrays(ks) if len(ks) > 1 else ks[0],
            np.concatenate(ts) if len(ts) > 1 else ts[0],
            np.concatenate(ds) if len(ds) > 1 else ds[0],
        )

    def contents(self) -> ConsolidatedUpdates:
        """Everything buffered, consolidated."""
        return self.updates_before(None)

    def restore(self, contents: ConsolidatedUpdates, since: int) -> None:
        """Replace the buffer with ``contents`` (as :meth:`contents` returned them: sorted by
        ``(key, time)`` and consolidated) at ``since``: the inverse of a checkpoint."""
        self.clear()
        self._since = int(since)
        if len(contents):
            self._merge_into_chunks(contents)

    def map_keys(self, convert: Callable[[pa.Array], pa.Array]) -> int:
        """Replace every key ``k`` by ``convert(keys)[i]`` (a function of a binary array of keys
        giving one key per key, in order), then consolidate again: keys that become equal
        meet. For a change of the keys' encoding (the row schema changed: the same row value
        gets the new schema's canonical bytes). Returns the number of entries converted.

        Invariant 1 holds with the multiset's keys mapped: ``{(convert(k), t): d}`` summed."""
        contents = self.contents()
        n = len(contents)
        if n == 0:
            return 0
        converted = convert(contents.keys)
        if converted is contents.keys:
            return 0  # nothing changed
        keys = _as_binary(converted)
        if len(keys) != n:
            raise InvalidUsageError(f"expected convert to give {n} keys, found {len(keys)}")
        since = self._since
        self.clear()
        self._since = since
        staged = _sort_consolidate(keys, contents.times, contents.diffs)
        del contents, keys
        if len(staged):
            self._merge_into_chunks(staged)
        return n

    # -- maintenance ------------------------------------------------------------------------
    def clear(self) -> None:
        self._set_chunks([])
        self._stage.clear()
        self._stage_len = 0
        self._stage_key_bytes = 0

    def consolidate(self) -> None:
        """Flush the stage: sort and consolidate it, then merge it into the chunks."""
        if not self._stage:
            return
        self._flushes += 1
        parts = self._stage
        self._stage = []
        self._stage_len = 0
        self._stage_key_bytes = 0
        if len(parts) == 1:
            keys, times, diffs = parts[0]
        else:
            keys = pa.concat_arrays([p[0] for p in parts])
            times = np.concatenate([p[1] for p in parts])
            diffs = np.concatenate([p[2] for p in parts])
        del parts
        if self._since:
            times = np.maximum(times, np.uint64(self._since))
        staged = _sort_consolidate(keys, times, diffs)
        del keys, times, diffs
        if len(staged):
            self._merge_into_chunks(staged)

    def _merge_into_chunks(self, s: ConsolidatedUpdates) -> None:
        if not self._chunks:
            self._set_chunks(self._split(s))
            return
        chunks = self._take_chunks()
        # Chunk i owns keys in [chunks[i].first_key, chunks[i+1].first_key); chunk 0 also owns
        # everything below its first key and the last chunk everything above.
        cuts = [0]
        for c in chunks[1:]:
            assert c is not None
            cuts.append(_bisect_left(s.keys, c.first_key, cuts[-1]))
        cuts.append(len(s))
        out: list[_Chunk] = []
        for i, c in enumerate(chunks):
            chunks[i] = None  # release the old chunk as soon as it is replaced
            assert c is not None
            a, b = cuts[i], cuts[i + 1]
            if a == b:
                out.append(c)
                continue
            merged = _sort_consolidate(
                pa.concat_arrays([c.keys, s.keys.slice(a, b - a)]),
                np.concatenate([c.times, s.times[a:b]]),
                np.concatenate([c.diffs, s.diffs[a:b]]),
            )
            del c
            out.extend(self._split(merged))
            del merged
        self._set_chunks(self._coalesce(out))

    def _split(self, u: ConsolidatedUpdates) -> list[_Chunk]:
        """Cut a sorted run into chunks of about ``chunk_target`` entries, never splitting a
        key. Pieces are copied so no chunk pins another's buffers."""
        n = len(u)
        if n == 0:
            return []
        limit = 2 * self._chunk_target
        if n <= limit and _keys_bytes(u.keys) <= CHUNK_MAX_BYTES:
            return [_Chunk.of(u)]
        pieces = max(-(-n // self._chunk_target), -(-_keys_bytes(u.keys) // (CHUNK_MAX_BYTES // 2)))
        step = max(1, n // pieces)
        out: list[_Chunk] = []
        a = 0
        while a < n:
            b = min(n, a + step)
            if n - b < step // 2:
                b = n
            while b < n and _key_at(u.keys, b) == _key_at(u.keys, b - 1):
                b += 1
            out.append(
                _Chunk.of(
                    ConsolidatedUpdates(
                        _copy_keys(u.keys.slice(a, b - a)), u.times[a:b].copy(), u.diffs[a:b].copy()
                    )
                )
            )
            a = b
        return out

    def _coalesce(self, chunks: list[_Chunk]) -> list[_Chunk]:
        """Join neighbours that cancellation left small (they are ordered and disjoint, so
        concatenation keeps the order: no sort needed)."""
        small = self._chunk_target // 2
        out: list[_Chunk] = []
        for c in chunks:
            if out and len(out[-1]) < small and len(out[-1]) + len(c) <= self._chunk_target:
                p = out.pop()
                out.append(
                    _Chunk(
                        pa.concat_arrays([p.keys, c.keys]),
                        np.concatenate([p.times, c.times]),
                        np.concatenate([p.diffs, c.diffs]),
                        min(p.min_time, c.min_time),
                        p.first_key,
                    )
                )
            else:
                out.append(c)
        return out

    def _take_chunks(self) -> list[_Chunk | None]:
        """Move the chunk list out of the buffer, so replaced chunks can be freed one by one."""
        chunks: list[_Chunk | None] = list(self._chunks)
        self._chunks = []
        return chunks

    def _set_chunks(self, chunks: list[_Chunk]) -> None:
        self._chunks = chunks
        self._chunk_len = sum(len(c) for c in chunks)

    def check_invariants(self) -> None:
        """Assert invariants 2 and 3 (for tests)."""
        prev_last: bytes | None = None
        for c in self._chunks:
            assert len(c) > 0, "empty chunk"
            keys = c.keys.to_pylist()
            pairs = list(zip(keys, c.times.tolist()))
            assert pairs == sorted(pairs), "chunk not sorted"
            assert len(set(pairs)) == len(pairs), "chunk not consolidated"
            assert bool((c.diffs != 0).all()), "zero diff in chunk"
            assert c.min_time == int(c.times.min()), "stale min_time"
            assert c.first_key == keys[0], "stale first_key"
            assert int(c.times.min()) >= self._since, "time below since"
            if prev_last is not None:
                assert prev_last < keys[0], "chunks overlap"
            prev_last = keys[-1]


# -- row codecs for tuple rows --------------------------------------------------------------


def encode_tuple_row(row: tuple[Any, ...]) -> bytes:
    """A deterministic key for a tuple of plain values (int, float, str, bytes, bool, None):
    equal tuples of the same types give equal bytes. Avro rows should be passed as their
    encoded bytes instead."""
    if not isinstance(row, tuple):
        raise InvalidUsageError(f"expected a tuple row, found {type(row).__name__}")
    return repr(row).encode()


def decode_tuple_row(key: bytes) -> tuple[Any, ...]:
    value = ast.literal_eval(key.decode())
    if not isinstance(value, tuple):
        raise InvalidUsageError(f"expected an encoded tuple row, found {key[:40]!r}")
    return value


# -- vectorised helpers ---------------------------------------------------------------------


def sort_consolidate(
    keys: pa.Array, times: npt.NDArray[np.uint64], diffs: npt.NDArray[np.int64]
) -> ConsolidatedUpdates:
    """Updates as :class:`ConsolidatedUpdates`: sorted by ``(key, time)``, equal ``(key, time)``
    summed, zero sums dropped."""
    return _sort_consolidate(_as_binary(keys), times, diffs)


def _sort_consolidate(
    keys: pa.Array, times: npt.NDArray[np.uint64], diffs: npt.NDArray[np.int64]
) -> ConsolidatedUpdates:
    """Sort by ``(key, time)``, sum the diffs of equal ``(key, time)``, drop zeros."""
    n = len(times)
    if n == 0:
        return ConsolidatedUpdates.empty()
    t_arr = pa.array(times, type=pa.uint64())
    order = pc.sort_indices(
        pa.table({"k": keys, "t": t_arr}),
        sort_keys=[("k", "ascending"), ("t", "ascending")],
    )
    del t_arr
    idx = order.to_numpy()
    if bool((idx[1:] > idx[:-1]).all()):
        # Already sorted (common for a consolidated chunk extended with later keys).
        return _consolidate_sorted(keys, times, diffs)
    return _consolidate_sorted(keys.take(order), times[idx], diffs[idx])


def _consolidate_sorted(
    keys: pa.Array, times: npt.NDArray[np.uint64], diffs: npt.NDArray[np.int64]
) -> ConsolidatedUpdates:
    """Consolidate updates already sorted by ``(key, time)``."""
    n = len(times)
    if n == 0:
        return ConsolidatedUpdates.empty()
    if n > 1:
        same = pc.equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
        same &= times[1:] == times[:-1]
        if same.any():
            starts = np.flatnonzero(np.concatenate(([True], ~same)))
            sums = np.add.reduceat(diffs, starts)
            keep = sums != 0
            sel = starts[keep]
            return ConsolidatedUpdates(
                keys.take(pa.array(sel)), times[sel], sums[keep].astype(np.int64, copy=False)
            )
    keep = diffs != 0
    if bool(keep.all()):
        return ConsolidatedUpdates(keys, times, diffs)
    sel = np.flatnonzero(keep)
    return ConsolidatedUpdates(keys.take(pa.array(sel)), times[sel], diffs[sel])


def _bisect_left(keys: pa.Array, key: bytes, lo: int = 0) -> int:
    hi = len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if _key_at(keys, mid) < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _key_at(keys: pa.Array, i: int) -> bytes:
    v = keys[i].as_py()
    assert isinstance(v, bytes)
    return v


def _keys_bytes(keys: pa.Array) -> int:
    return int(keys.get_total_buffer_size())


def _copy_keys(keys: pa.Array) -> pa.Array:
    """A compact copy of a (possibly sliced) binary array."""
    return keys.take(pa.array(np.arange(len(keys), dtype=np.int64)))


def _as_binary(keys: Keys) -> pa.Array:
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks() if keys.num_chunks != 1 else keys.chunk(0)
    if isinstance(keys, pa.Array):
        if keys.null_count:
            raise InvalidUsageError(f"expected non-null keys, found {keys.null_count} nulls")
        if pa.types.is_binary(keys.type):
            return keys
        if (
            pa.types.is_large_binary(keys.type)
            or pa.types.is_string(keys.type)
            or pa.types.is_large_string(keys.type)
        ):
            return keys.cast(pa.binary())
        raise InvalidUsageError(f"expected binary keys, found an Arrow array of {keys.type}")
    try:
        return pa.array(keys, type=pa.binary())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        raise InvalidUsageError(f"expected a sequence of bytes keys, found: {e}") from e


def as_times(times: TimesLike, n: int) -> npt.NDArray[np.uint64]:
    if isinstance(times, bool):
        raise InvalidUsageError(f"expected times, found {times!r}")
    if isinstance(times, (int, np.integer)):
        t = int(times)
        if not 0 <= t <= MAX_TIME:
            raise InvalidUsageError(f"expected a time in [0, 2**64), found {t}")
        return np.full(n, t, dtype=np.uint64)
    if isinstance(times, np.ndarray):
        if times.dtype == np.uint64:
            arr = times
        elif np.issubdtype(times.dtype, np.integer):
            if len(times) and int(times.min()) < 0:
                raise InvalidUsageError(f"expected times >= 0, found {int(times.min())}")
            arr = times.astype(np.uint64)
        else:
            raise InvalidUsageError(f"expected integer times, found dtype {times.dtype}")
    else:
        arr = _int_array(times, np.uint64, "times in [0, 2**64)")
    if arr.shape != (n,):
        raise InvalidUsageError(f"expected {n} times, found shape {arr.shape}")
    return arr


def as_diffs(diffs: DiffsLike, n: int) -> npt.NDArray[np.int64]:
    if isinstance(diffs, bool):
        raise InvalidUsageError(f"expected diffs, found {diffs!r}")
    if isinstance(diffs, (int, np.integer)):
        return np.full(n, int(diffs), dtype=np.int64)
    if isinstance(diffs, np.ndarray):
        if not np.issubdtype(diffs.dtype, np.integer):
            raise InvalidUsageError(f"expected integer diffs, found dtype {diffs.dtype}")
        arr = diffs.astype(np.int64, copy=False)
    else:
        arr = _int_array(diffs, np.int64, "64-bit integer diffs")
    if arr.shape != (n,):
        raise InvalidUsageError(f"expected {n} diffs, found shape {arr.shape}")
    return arr


def _int_array(values: Sequence[int], dtype: type[np.integer[Any]], what: str) -> npt.NDArray[Any]:
    """Integers (never silently truncated floats or bools) as a numpy array of ``dtype``."""
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values):
        bad = next(v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer)))
        raise InvalidUsageError(f"expected {what}, found {bad!r}")
    try:
        return np.array(values, dtype=dtype)
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidUsageError(f"expected {what}, found: {e}") from e


def _unzip(updates: Iterable[tuple[bytes, int, int]]) -> tuple[list[bytes], list[int], list[int]]:
    ks: list[bytes] = []
    ts: list[int] = []
    ds: list[int] = []
    for k, t, d in updates:
        ks.append(k)
        ts.append(t)
        ds.append(d)
    return ks, ts, ds
