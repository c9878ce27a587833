"""Vectorised Avro <-> Arrow for a collection's rows: many schemaless bodies to columns and back.

:class:`ColumnCodec` does for a whole batch what :class:`~shared.codec.RowCodec` and
:mod:`shared.avro_arrow` do one row at a time, with numpy and Arrow compute instead of a Python
loop over rows:

* :meth:`ColumnCodec.decode`: schemaless bodies -> an Arrow table of
  :func:`~shared.avro_arrow.avro_to_arrow_schema`. Row ``i`` is ok iff
  ``RowCodec(schema).decode(MARKER + fingerprint + body_i)`` succeeds (and ``rows_to_arrow``
  holds the value), and then its table row equals ``rows_to_arrow([that row], schema)``: same
  values, same types, floats bit for bit.
* :meth:`ColumnCodec.encode`: an Arrow table -> canonical bodies; element ``i`` is byte-identical
  to ``RowCodec(schema).encode_body(arrow_to_rows(table, schema)[i])``, and the call raises
  :class:`~shared.errors.EncodeError` for a table on which that raises.

How decoding works (the invariants the code relies on)
------------------------------------------------------
The bodies stay in one contiguous byte buffer. A *lane* is a value being decoded: a cursor
``pos`` into the buffer, the ``end`` of its row's body and the ``row`` it belongs to. A schema
node decodes all its lanes at once and returns one Arrow array with one element per lane.
Lanes are in buffer order and the bytes they read do not overlap: at the top there is one lane
per row; the items of an array or a map are lanes of their own, several per row, one after the
other (strings are cut out of the buffer with one Arrow ``take`` relying on that order).

Records decode their fields one after the other on the same lanes; a union decodes its branch on
the lanes that chose it and scatters the result back. An array or a map goes block by block:
it reads every lane's block count, finds where each item of the block starts (by arithmetic for
fixed-width items, from the varints' last bytes for varint items, by skipping item ``k`` of
every lane at once for other items, in plain Python for the few lanes left with long blocks),
then decodes all the items as lanes in one call; what it cannot skip (arrays or maps inside the
items, a malformed item) it decodes one item of every lane at a time. Python loops run over
schema nodes, blocks and item positions, never over rows.

A lane whose row turns out bad gets its cursor moved to its row's end, so every later read of
that row fails too and yields a neutral value (empty, zero, null); the row is then left out of
the table. A row is bad for a *definite* reason (the per-row decoder rejects the same bytes:
truncated data, an index out of range, an int outside 32 bits, a time outside the day, a decimal
with more digits than its precision, invalid UTF-8, trailing bytes) or is only *unusual*
(a varint longer than 10 bytes, a block count of -2**63, a uuid not in its 36-character form):
an unusual row is decided by the per-row reference, :meth:`RowCodec.decode` then
:func:`rows_to_arrow`, so the vectorised pass never has to reproduce those corners. Bad and
unusual rows are rare; the good path has no per-row Python.

Quirks of the per-row path reproduced here
------------------------------------------
fastavro reads a union branch or enum index with Python list indexing, so ``-len <= i < 0``
decodes as ``i + len``; a boolean is true for any non-zero byte; a float32 NaN is quieted (its
bit 22 set) on the way through Python floats, both ways; a duplicate map key keeps its last
value; on encoding, a null in a non-nullable boolean is written as false (fastavro writes
``None`` as false), a time of day is taken modulo the day (pyarrow's conversion to ``time``),
and a map with a duplicate key, a date or timestamp outside Python's ``datetime`` range, a null
elsewhere in a non-nullable field, an enum symbol not in the schema, a decimal with more digits
than its precision or a text that is no uuid raise.

Pure: numpy and pyarrow, plus the project's own schema mapping and per-row codec (used for
schemas and for the rare unusual rows), no I/O.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from shared.avro_arrow import avro_to_arrow_schema, parse_row_schema, rows_to_arrow
from shared.codec import MARKER, RowCodec
from shared.errors import DecodeError, EncodeError, SchemaError

__all__ = ["ColumnCodec", "Decoded"]

_U8 = npt.NDArray[np.uint8]
_U64 = npt.NDArray[np.uint64]
_I64 = npt.NDArray[np.int64]
_I8 = npt.NDArray[np.int8]
_Bool = npt.NDArray[np.bool_]

_INT64_MIN = -(2**63)
_MS_RANGE = (-62_135_596_800_000, 253_402_300_799_999)  # datetime's range, in milliseconds
_US_RANGE = (_MS_RANGE[0] * 1000, _MS_RANGE[1] * 1000 + 999)
_DATE_RANGE = (-719_162, 2_932_896)  # date(1, 1, 1) .. date(9999, 12, 31), days since 1970
_MS_PER_DAY = 86_400_000
_US_PER_DAY = 86_400_000_000
_MAX_OFFSET = 2**31 - 1

_HEX = np.zeros(256, np.bool_)
_HEX[np.frombuffer(b"0123456789abcdefABCDEF", np.uint8)] = True
_LOWER = np.arange(256, dtype=np.uint8)
_LOWER[0x41:0x47] += 0x20  # A-F -> a-f
_BITLEN = np.array([int(i).bit_length() for i in range(256)], np.int64)
_UUID_HYPHENS = np.array([8, 13, 18, 23])
_UUID_HEX = np.array([i for i in range(36) if i not in (8, 13, 18, 23)])


@dataclass(frozen=True, slots=True, eq=False)
class Decoded:
    """What :meth:`ColumnCodec.decode` gives for ``n`` bodies.

    ``ok[i]`` says whether body ``i`` decoded; ``table`` holds exactly the ok rows, in input
    order (so ``table.num_rows == ok.sum()``); ``errors`` maps the index of every other body to
    a readable reason (naming the field where it can)."""

    table: pa.Table
    ok: _Bool
    errors: dict[int, str]


# -- decoding state ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Lanes:
    """Cursors of the values being decoded, one per lane (mutable: ``pos`` advances).

    Invariant: lanes are in buffer order, the bytes they read do not overlap (their rows are
    in order; lanes of one row are successive items), and ``pos <= end``."""

    pos: _I64
    end: _I64
    row: _I64

    def __len__(self) -> int:
        return len(self.pos)

    def take(self, idx: _I64) -> _Lanes:
        return _Lanes(self.pos[idx], self.end[idx], self.row[idx])


class _State:
    """The byte buffer of one :meth:`ColumnCodec.decode` call and the verdict on each row.

    ``reason[r] >= 0`` marks row ``r`` bad (the first reason found wins), ``refer[r]`` says the
    per-row reference decides it, ``value[r]`` is the number its reason quotes."""

    __slots__ = ("buf", "view", "pabuf", "large", "reason", "value", "refer", "templates", "_codes")

    def __init__(self, buf: _U8, n_rows: int) -> None:
        self.buf = buf
        self.view = memoryview(buf.data)  # for the scalar skips of a few long arrays
        self.pabuf = pa.py_buffer(buf)
        self.large = len(buf) > _MAX_OFFSET
        self.reason = np.full(n_rows, -1, np.int64)
        self.value = np.zeros(n_rows, np.int64)
        self.refer = np.zeros(n_rows, np.bool_)
        self.templates: list[str] = []
        self._codes: dict[str, int] = {}

    def fail(
        self,
        lanes: _Lanes,
        which: _Bool | _I64,
        template: str,
        values: _I64 | None = None,
        *,
        definite: bool = True,
    ) -> None:
        """Mark the rows of lanes ``which`` bad (``{value}`` in ``template`` quotes
        ``values``, aligned with the lanes) and move those lanes to their row's end."""
        idx = np.flatnonzero(which) if which.dtype == np.bool_ else which
        if idx.size == 0:
            return
        lanes.pos[idx] = lanes.end[idx]
        rows = lanes.row[idx]
        fresh = self.reason[rows] < 0
        if not fresh.any():
            return
        code = self._codes.get(template)
        if code is None:
            code = self._codes[template] = len(self.templates)
            self.templates.append(template)
        hit = rows[fresh]
        self.reason[hit] = code
        self.refer[hit] = not definite
        if values is not None:
            self.value[hit] = values[idx][fresh]

    def dead(self, lanes: _Lanes) -> _Bool:
        """Which lanes belong to a row already marked bad."""
        result: _Bool = self.reason[lanes.row] >= 0
        return result

    def windows(self, width: int, base: _I64) -> _U8:
        """The ``width`` bytes at each of ``base``, as an ``(n, width)`` array."""
        view = np.lib.stride_tricks.sliding_window_view(self.buf, width)
        result: _U8 = view[base]
        return result


def _scan_varint(buf: _U8, pos: _I64, end: _I64) -> tuple[_I64, _I64, _I8]:
    """The zig-zag varint at each of ``pos`` (before its ``end``), as fastavro's ``read_long``
    reads it: ``(values, lengths, status)``, status 0 when read, 1 when it runs past the end,
    2 when it is longer than 10 bytes (fastavro keeps reading; left to the per-row reference).
    Over-long encodings up to 10 bytes decode as fastavro decodes them (bits past 64 dropped)."""
    n = len(pos)
    first = buf[pos]
    val = (first & 0x7F).astype(np.uint64)
    length = np.ones(n, np.int64)
    more = np.flatnonzero(first >= 0x80)
    k = 1
    while more.size and k < 10:
        at = pos[more] + k
        past = at >= end[more]
        if past.any():
            length[more[past]] = k + 1
            more, at = more[~past], at[~past]
        b = buf[at]
        val[more] |= (b & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        length[more] = k + 1
        more = more[b >= 0x80]
        k += 1
    value = (val >> np.uint64(1)).view(np.int64) ^ -(val & np.uint64(1)).view(np.int64)
    status = np.where(pos + length > end, 1, 0).astype(np.int8)
    status[more] = 2
    value[status != 0] = 0
    return value, length, status


def _read_varint(st: _State, lanes: _Lanes, what: str) -> _I64:
    """Read one varint per lane (see :func:`_scan_varint`); a bad one marks its row."""
    if len(lanes) == 0:
        return np.zeros(0, np.int64)
    value, length, status = _scan_varint(st.buf, lanes.pos, lanes.end)
    lanes.pos += length
    st.fail(lanes, status == 2, f"expected {what} in at most 10 bytes, found more", definite=False)
    st.fail(lanes, status == 1, f"expected {what}, found the end of the body")
    return value


def _varint_one(view: memoryview, p: int, end: int) -> tuple[int, int]:
    """The scalar :func:`_scan_varint`: ``(value, position after it)``, or ``(0, -1)`` where
    that one's status is not 0."""
    n = 0
    for k in range(10):
        q = p + k
        if q >= end:
            return 0, -1
        b = view[q]
        n |= (b & 0x7F) << (7 * k)
        if b < 0x80:
            n &= 0xFFFF_FFFF_FFFF_FFFF
            return (n >> 1) ^ -(n & 1), q + 1
    return 0, -1


def _skip_varint(st: _State, pos: _I64, end: _I64) -> _I64:
    _, length, status = _scan_varint(st.buf, pos, end)
    result: _I64 = np.where(status == 0, pos + length, -1)
    return result


def _skip_sized(st: _State, pos: _I64, end: _I64) -> _I64:
    """Skip a length and that many bytes (bytes, string, a decimal on bytes)."""
    size, length, status = _scan_varint(st.buf, pos, end)
    after = pos + length
    ok = (status == 0) & (size >= 0) & (size <= end - after)
    result: _I64 = np.where(ok, after + size, -1)
    return result


def _skip_sized_one(view: memoryview, p: int, end: int) -> int:
    size, q = _varint_one(view, p, end)
    if q < 0 or size < 0 or size > end - q:
        return -1
    return q + size


def _equal(per: _I64) -> int | None:
    """The common value of ``per`` when all are equal (fixed-length arrays: fast paths)."""
    if per.size and per.min() == per.max():
        return int(per[0])
    return None


def _repeat(values: _I64, per: _I64) -> _I64:
    """``values[i]`` repeated ``per[i]`` times, in order."""
    same = _equal(per)
    result: _I64 = np.repeat(values, per if same is None else same)
    return result


def _within(per: _I64) -> _I64:
    """``0, 1, .., per[0]-1, 0, 1, .., per[1]-1, ...``"""
    same = _equal(per)
    if same is not None:
        return np.tile(np.arange(same, dtype=np.int64), per.size)
    total = int(per.sum())
    result: _I64 = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    return result


def _read_ranges(st: _State, lanes: _Lanes, where: str) -> tuple[_I64, _I64]:
    """Read a length-prefixed value (bytes or string) per lane: its ``(starts, stops)``."""
    size = _read_varint(st, lanes, f"a length at {where}")
    bad = (size < 0) | (size > lanes.end - lanes.pos)
    st.fail(lanes, bad, f"expected a length in [0, bytes left] at {where}, found {{value}}", size)
    size[bad] = 0
    starts = lanes.pos.copy()
    lanes.pos += size
    return starts, lanes.pos.copy()


def _cut(st: _State, starts: _I64, stops: _I64) -> pa.Array:
    """A binary array of the buffer's bytes ``[starts[i], stops[i])``, the non-empty ranges
    disjoint and in order: the ranges and the gaps between them as one array, then every other
    element."""
    n = len(starts)
    if n == 0:
        return pa.array([], pa.binary())
    empty = stops == starts
    if empty.any():  # put empty ranges where they keep the order (a failed lane may be anywhere)
        before = np.concatenate([[0], np.maximum.accumulate(np.where(empty, 0, stops))[:-1]])
        starts, stops = np.where(empty, before, starts), np.where(empty, before, stops)
    offsets = np.empty(2 * n, np.int64)
    offsets[0::2] = starts
    offsets[1::2] = stops
    if st.large:
        both = pa.Array.from_buffers(
            pa.large_binary(), 2 * n - 1, [None, pa.py_buffer(offsets), st.pabuf]
        )
        return both.take(pa.array(np.arange(0, 2 * n, 2))).cast(pa.binary())
    both = pa.Array.from_buffers(
        pa.binary(), 2 * n - 1, [None, pa.py_buffer(offsets.astype(np.int32)), st.pabuf]
    )
    return both.take(pa.array(np.arange(0, 2 * n, 2)))


def _invalid_utf8(arr: pa.Array, base: int = 0) -> list[int]:
    """Indices of the elements of a binary array that are not valid UTF-8 (what Python's strict
    decoder refuses): one validation of the whole array, halves only when it fails."""
    try:
        arr.view(pa.string()).validate(full=True)
        return []
    except pa.ArrowInvalid:
        if len(arr) == 1:
            return [base]
        half = len(arr) // 2
        return _invalid_utf8(arr.slice(0, half), base) + _invalid_utf8(arr.slice(half), base + half)


def _scatter(values: pa.Array, dest: _I64) -> pa.Array:
    """``values`` reordered so that element ``i`` lands at position ``dest[i]``."""
    order = np.arange(len(dest))
    if np.array_equal(dest, order):
        return values
    perm = np.empty_like(order)
    perm[dest] = order
    return values.take(pa.array(perm))


# -- encoding helpers --------------------------------------------------------------------------


def _binary(offsets: _I64, data: _U8) -> pa.Array:
    """A binary array from int64 offsets (starting at 0) and its bytes."""
    if offsets[-1] > _MAX_OFFSET:
        raise EncodeError(
            f"expected at most {_MAX_OFFSET} bytes of encoded values per call, found "
            f"{int(offsets[-1])} (encode the table in smaller batches)"
        )
    return pa.Array.from_buffers(
        pa.binary(),
        len(offsets) - 1,
        [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(np.ascontiguousarray(data))],
    )


def _offsets_of(arr: pa.Array) -> _I64:
    """The int64 offsets of a binary, string or list array, as its buffers hold them."""
    width = (
        np.int64
        if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
        else np.int32
    )
    raw = np.frombuffer(arr.buffers()[1], width)
    result: _I64 = raw[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    return result


def _fixed_bytes(data: _U8, n: int, width: int) -> pa.Array:
    """A binary array of ``n`` values of ``width`` bytes each."""
    return _binary(np.arange(n + 1, dtype=np.int64) * width, data.reshape(-1))


def _const(n: int, byte: int) -> pa.Array:
    return _fixed_bytes(np.full(n, byte, np.uint8), n, 1)


def _empties(n: int) -> pa.Array:
    return _binary(np.zeros(n + 1, np.int64), np.zeros(0, np.uint8))


def _varints(values: _I64) -> pa.Array:
    """The zig-zag varint encodings of ``values`` (minimal, as fastavro writes them)."""
    n = len(values)
    if n == 0:
        return _empties(0)
    u = ((values << np.int64(1)) ^ (values >> np.int64(63))).view(np.uint64)
    top = int(u.max())
    nbytes = np.ones(n, np.int64)
    k = 1
    while k < 10 and top >= 1 << (7 * k):
        nbytes += u >= np.uint64(1 << (7 * k))
        k += 1
    if k == 1:
        return _fixed_bytes(u.astype(np.uint8), n, 1)
    mat = np.empty((n, k), np.uint8)
    for j in range(k):
        low = ((u >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        mat[:, j] = low | np.where(j < nbytes - 1, 0x80, 0).astype(np.uint8)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(nbytes, out=offsets[1:])
    return _binary(offsets, mat[np.arange(k) < nbytes[:, None]])


def _join(parts: Sequence[pa.Array]) -> pa.Array:
    """Element-wise concatenation of binary arrays of equal length."""
    if len(parts) == 1:
        return parts[0]
    return pc.binary_join_element_wise(*parts, b"")


def _grouped(enc: pa.Array, offsets: _I64) -> pa.Array:
    """Per group ``[offsets[i], offsets[i+1])`` of consecutive elements of the binary array
    ``enc``, their concatenation (no copy: the same bytes with coarser offsets)."""
    n = len(offsets) - 1
    if len(enc) == 0:
        return _empties(n)
    eo = _offsets_of(enc)[offsets]
    data = enc.buffers()[2]
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(eo.astype(np.int32)), data])


def _block_encoding(counts: _I64, items: pa.Array, offsets: _I64) -> pa.Array:
    """Arrays and maps: the count, the items, the 0 that ends the only block (or a single 0)."""
    n = len(counts)
    if len(items) == 0:
        return _const(n, 0)
    nonempty = (counts > 0).astype(np.int64)
    ends = np.zeros(n + 1, np.int64)
    np.cumsum(nonempty, out=ends[1:])
    terminator = _binary(ends, np.zeros(int(ends[-1]), np.uint8))
    return _join([_varints(counts), _grouped(items, offsets), terminator])


def _negate(limbs: _U64) -> _U64:
    """Two's complement negation of little-endian 64-bit limbs, row by row."""
    out: _U64 = ~limbs
    carry = np.ones(len(limbs), np.uint64)
    for j in range(limbs.shape[1]):
        s = out[:, j] + carry
        carry = carry & (s == 0).astype(np.uint64)
        out[:, j] = s
    return out


def _at_least(limbs: _U64, bound: Sequence[int]) -> _Bool:
    """Row by row, whether the unsigned little-endian limbs are >= ``bound`` (limbs too)."""
    n = len(limbs)
    result = np.zeros(n, np.bool_)
    undecided = np.ones(n, np.bool_)
    for j in range(limbs.shape[1] - 1, -1, -1):
        b = np.uint64(bound[j])
        gt = limbs[:, j] > b
        lt = limbs[:, j] < b
        result |= undecided & gt
        undecided &= ~(gt | lt)
    result |= undecided
    return result


# -- schema nodes ------------------------------------------------------------------------------


class _Node:
    """One Avro type of the row schema: its Arrow type, and how to decode lanes into an array of
    that type (:meth:`decode`) and encode such an array into one body fragment per element
    (:meth:`encode`). Immutable once built."""

    __slots__ = ("arrow_type", "where", "width", "flat", "vskip", "varint")

    def __init__(
        self,
        arrow_type: pa.DataType,
        path: str,
        width: int = 0,
        *,
        flat: int | None = None,
        vskip: bool = True,
        varint: bool = False,
    ) -> None:
        self.arrow_type = arrow_type
        self.where = f"field {path!r}"
        self.width = width  # the bytes a fixed-width value reads at once (the buffer's padding)
        self.flat = flat  # the size of every value's encoding, when it is fixed
        self.vskip = vskip  # whether :meth:`skip` is there (no array or map inside)
        self.varint = varint  # whether a value is one varint

    def skip(self, st: _State, pos: _I64, end: _I64) -> _I64:
        """Where the value starting at each of ``pos`` ends, or -1 where decoding it would mark
        its row (for any position before ``end``, vectorised; only when :attr:`vskip`).

        What it accepts is decoded at the same positions, so item positions found by skipping
        are the decoder's own; what it refuses is left to the decoder, which says why."""
        if self.varint:
            return _skip_varint(st, pos, end)
        if self.flat is None:
            raise NotImplementedError
        result: _I64 = np.where(pos + self.flat <= end, pos + self.flat, -1)
        return result

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        """:meth:`skip` of one position, in plain Python (for the few lanes of long arrays)."""
        if self.varint:
            return _varint_one(view, p, end)[1]
        if self.flat is None:
            raise NotImplementedError
        return p + self.flat if p + self.flat <= end else -1

    def decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        """One element of :attr:`arrow_type` per lane; advances the lanes' cursors."""
        if len(lanes) == 0:
            return pa.array([], self.arrow_type)
        return self._decode(st, lanes)

    def encode(self, arr: pa.Array) -> pa.Array:
        """One body fragment (binary) per element of ``arr``."""
        if len(arr) == 0:
            return _empties(0)
        return self._encode(arr)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        raise NotImplementedError

    def _encode(self, arr: pa.Array) -> pa.Array:
        raise NotImplementedError

    def children(self) -> list[_Node]:
        return []

    def _require_values(self, arr: pa.Array) -> None:
        if arr.null_count:
            raise EncodeError(
                f"expected a value in non-nullable {self.where}, found null "
                f"({arr.null_count} row(s))",
                field=self.where,
            )


class _NullNode(_Node):
    __slots__ = ()

    def __init__(self, path: str) -> None:
        super().__init__(pa.null(), path, flat=0)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        return pa.nulls(len(lanes))

    def _encode(self, arr: pa.Array) -> pa.Array:
        return _empties(len(arr))


class _BoolNode(_Node):
    __slots__ = ()

    def __init__(self, path: str) -> None:
        super().__init__(pa.bool_(), path, width=1, flat=1)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        value = st.buf[lanes.pos]
        lanes.pos += 1
        bad = lanes.pos > lanes.end
        st.fail(lanes, bad, f"expected a boolean at {self.where}, found the end of the body")
        value[bad] = 0
        return self.from_bytes(value, len(lanes))

    @staticmethod
    def from_bytes(raw: _U8, n: int) -> pa.Array:
        """The values of ``n`` booleans' bytes: any byte but 0 is true, as fastavro reads it."""
        return pa.array(raw != 0, pa.bool_())

    def _encode(self, arr: pa.Array) -> pa.Array:
        # fastavro writes None as false: a null in a non-nullable boolean is not refused
        values = np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), np.uint8)
        return _fixed_bytes(values, len(arr), 1)


@dataclass(frozen=True, slots=True)
class _IntRule:
    """What an Avro int or long column holds: its Arrow storage, the values the per-row
    decoder accepts, and what encoding does with a value."""

    dtype: type[np.signedinteger[Any]]
    lo: int | None = None
    hi: int | None = None
    what: str = ""
    modulo: int | None = None  # encoding takes the value modulo this (times of day)
    encode_lo: int | None = None  # encoding refuses values outside [encode_lo, encode_hi]
    encode_hi: int | None = None


_INT32 = _IntRule(np.int32, -(2**31), 2**31 - 1, "an int in 32 bits")
_INT_RULES: dict[str, _IntRule] = {
    "int": _INT32,
    "long": _IntRule(np.int64),
    "int-date": _IntRule(np.int32, *_DATE_RANGE, "a date in years 1..9999", None, *_DATE_RANGE),
    "int-time-millis": _IntRule(
        np.int32, 0, _MS_PER_DAY - 1, "a time-millis in [0, 86400000)", _MS_PER_DAY
    ),
    "long-time-micros": _IntRule(
        np.int64, 0, _US_PER_DAY - 1, "a time-micros in [0, 86400000000)", _US_PER_DAY, *_US_RANGE
    ),
    "long-timestamp-millis": _IntRule(
        np.int64, *_MS_RANGE, "a timestamp-millis in years 1..9999", None, *_MS_RANGE
    ),
    "long-local-timestamp-millis": _IntRule(
        np.int64, *_MS_RANGE, "a local-timestamp-millis in years 1..9999", None, *_MS_RANGE
    ),
    "long-timestamp-micros": _IntRule(
        np.int64, *_US_RANGE, "a timestamp-micros in years 1..9999", None, *_US_RANGE
    ),
    "long-local-timestamp-micros": _IntRule(
        np.int64, *_US_RANGE, "a local-timestamp-micros in years 1..9999", None, *_US_RANGE
    ),
    # shared.codec reads a u64 below 0 as itself + 2**64, which an int64 column cannot hold
    "long-u64": _IntRule(
        np.int64, 0, 2**63 - 1, "a u64 below 2**63 (an int64 column)", None, 0, 2**63 - 1
    ),
}


class _IntNode(_Node):
    __slots__ = ("rule",)

    def __init__(self, arrow_type: pa.DataType, path: str, rule: _IntRule) -> None:
        super().__init__(arrow_type, path, varint=True)
        self.rule = rule

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        value = _read_varint(st, lanes, f"an integer at {self.where}")
        rule = self.rule
        if rule.lo is not None and rule.hi is not None:
            bad = (value < rule.lo) | (value > rule.hi)
            if bad.any():
                st.fail(lanes, bad, f"expected {rule.what} at {self.where}, found {{value}}", value)
                value[bad] = 0
        storage = value.astype(rule.dtype)
        return pa.Array.from_buffers(self.arrow_type, len(lanes), [None, pa.py_buffer(storage)])

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        n = len(arr)
        storage = np.frombuffer(arr.buffers()[1], self.rule.dtype)[arr.offset : arr.offset + n]
        value = storage.astype(np.int64)
        rule = self.rule
        if rule.encode_lo is not None and rule.encode_hi is not None and n:
            bad = (value < rule.encode_lo) | (value > rule.encode_hi)
            if bad.any():
                raise EncodeError(
                    f"expected a value in [{rule.encode_lo}, {rule.encode_hi}] at {self.where}, "
                    f"found {int(value[bad][0])} (out of range)",
                    field=self.where,
                )
        if rule.modulo is not None:
            value = np.mod(value, rule.modulo)
        return _varints(value)


class _FloatNode(_Node):
    __slots__ = ()

    def __init__(self, arrow_type: pa.DataType, path: str) -> None:
        width = 4 if arrow_type == pa.float32() else 8
        super().__init__(arrow_type, path, width=width, flat=width)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        width = self.width
        ok = lanes.pos + width <= lanes.end
        st.fail(lanes, ~ok, f"expected {width} bytes of a float at {self.where}, found fewer")
        raw = np.ascontiguousarray(st.windows(width, np.where(ok, lanes.pos, 0)))
        lanes.pos[ok] += width
        return self.from_bytes(raw.reshape(-1), len(lanes))

    def from_bytes(self, raw: _U8, n: int) -> pa.Array:
        """The values of ``n`` floats' little-endian bytes (float32 NaNs quieted)."""
        if self.width == 4:  # Avro's bytes are little-endian, Arrow's buffers native
            bits32: npt.NDArray[np.uint32] = raw.view("<u4").astype(np.uint32)
            storage = pa.py_buffer(_quiet_nan32(bits32))
        else:
            storage = pa.py_buffer(raw.view("<u8").astype(np.uint64))
        return pa.Array.from_buffers(self.arrow_type, n, [None, storage])

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        n = len(arr)
        if self.width == 4:
            bits32 = np.frombuffer(arr.buffers()[1], np.uint32)[arr.offset : arr.offset + n]
            little = _quiet_nan32(bits32).astype("<u4")
        else:
            bits64 = np.frombuffer(arr.buffers()[1], np.uint64)[arr.offset : arr.offset + n]
            little = bits64.astype("<u8")
        return _fixed_bytes(little.view(np.uint8), n, self.width)


def _quiet_nan32(bits: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """float32 bits as they come back from a round trip through a Python float: a signalling
    NaN has its quiet bit set."""
    nan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0)
    if not nan.any():
        return bits
    result: npt.NDArray[np.uint32] = np.where(nan, bits | np.uint32(0x00400000), bits)
    return result


class _BytesNode(_Node):
    __slots__ = ("text",)

    def __init__(self, arrow_type: pa.DataType, path: str) -> None:
        super().__init__(arrow_type, path)
        self.text = arrow_type == pa.string()

    def skip(self, st: _State, pos: _I64, end: _I64) -> _I64:
        return _skip_sized(st, pos, end)

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        return _skip_sized_one(view, p, end)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        starts, stops = _read_ranges(st, lanes, self.where)
        arr = _cut(st, starts, stops)
        if not self.text:
            return arr
        invalid = _invalid_utf8(arr)
        if invalid:
            bad = np.array(invalid, np.int64)
            st.fail(lanes, bad, f"expected UTF-8 text at {self.where}, found invalid bytes")
            stops[bad] = starts[bad]
            arr = _cut(st, starts, stops)
        return arr.view(pa.string())

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        arr = arr.view(pa.binary()) if arr.type == pa.string() else arr.cast(pa.binary())
        return _join([_varints(np.diff(_offsets_of(arr))), arr])


class _UuidNode(_Node):
    """A uuid on a string: decoded and encoded as its canonical text (lowercase, hyphenated)."""

    __slots__ = ()

    def __init__(self, path: str) -> None:
        super().__init__(pa.string(), path, width=36)

    def skip(self, st: _State, pos: _I64, end: _I64) -> _I64:
        return _skip_sized(st, pos, end)

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        return _skip_sized_one(view, p, end)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        starts, stops = _read_ranges(st, lanes, self.where)
        n = len(lanes)
        fits = stops - starts == 36
        text = np.ascontiguousarray(st.windows(36, np.where(fits, starts, 0)))
        ok = fits & _uuid_shaped(text)
        if not ok.all():
            st.fail(
                lanes,
                ~ok,
                f"expected a uuid as 36 hex digits and hyphens at {self.where}, found "
                "another text (left to the row decoder)",
                definite=False,
            )
            text[~ok] = 0x30
        return _fixed_bytes(_LOWER[text], n, 36).view(pa.string())

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        n = len(arr)
        arr = arr.cast(pa.string())
        offsets = _offsets_of(arr)
        data = arr.buffers()[2]
        raw = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        fits = np.diff(offsets) == 36
        base = np.where(fits, offsets[:-1], 0)
        if len(raw) < 36:
            raw = np.concatenate([raw, np.zeros(36, np.uint8)])
        text = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(raw, 36)[base])
        ok = fits & _uuid_shaped(text)
        for i in np.flatnonzero(~ok).tolist():  # rare: other spellings uuid.UUID accepts
            try:
                canonical = str(uuid.UUID(arr[i].as_py()))
            except ValueError as e:
                raise EncodeError(
                    f"expected a uuid at {self.where}, found {arr[i].as_py()!r} ({e})",
                    field=self.where,
                ) from e
            text[i] = np.frombuffer(canonical.encode("ascii"), np.uint8)
        prefix = _const(n, 36 * 2)  # the varint of the length 36
        return _join([prefix, _fixed_bytes(_LOWER[text], n, 36)])


def _uuid_shaped(text: _U8) -> _Bool:
    """Rows of 36 bytes that are a uuid in its hyphenated text form (any case)."""
    hyphens = (text[:, _UUID_HYPHENS] == 0x2D).all(axis=1)
    digits = _HEX[text[:, _UUID_HEX]].all(axis=1)
    result: _Bool = hyphens & digits
    return result


class _EnumNode(_Node):
    __slots__ = ("symbols",)

    def __init__(self, path: str, symbols: Sequence[str]) -> None:
        super().__init__(pa.string(), path, varint=True)
        self.symbols = pa.array(list(symbols), pa.string())

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        index = _read_varint(st, lanes, f"an enum index at {self.where}")
        n = len(self.symbols)
        # fastavro indexes a Python list: -n <= index < 0 counts from the end
        bad = (index < -n) | (index >= n)
        st.fail(
            lanes,
            bad,
            f"expected an enum index in [0, {n}) at {self.where}, found {{value}}",
            index,
        )
        index = np.where(bad, 0, np.mod(index, n))
        return self.symbols.take(pa.array(index))

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        index = pc.index_in(arr.cast(pa.string()), value_set=self.symbols)
        if index.null_count:
            missing = arr.filter(index.is_null())[0].as_py()
            raise EncodeError(
                f"expected a symbol of {self.symbols.to_pylist()} at {self.where}, "
                f"found {missing!r}",
                field=self.where,
            )
        return _varints(index.to_numpy(zero_copy_only=False).astype(np.int64))


class _FixedNode(_Node):
    __slots__ = ("size",)

    def __init__(self, path: str, size: int) -> None:
        super().__init__(pa.binary(size), path, width=size, flat=size)
        self.size = size

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        return self.from_bytes(_read_fixed(st, lanes, self).reshape(-1), len(lanes))

    def from_bytes(self, raw: _U8, n: int) -> pa.Array:
        """The values of ``n`` fixed values' bytes, one after the other."""
        return pa.Array.from_buffers(self.arrow_type, n, [None, pa.py_buffer(raw)])

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        return arr.cast(pa.binary())


def _read_fixed(st: _State, lanes: _Lanes, node: _Node) -> _U8:
    """The ``node.width`` bytes of a fixed per lane, ``(n, width)`` (zeros where bad)."""
    size = node.width
    ok = lanes.pos + size <= lanes.end
    st.fail(lanes, ~ok, f"expected {size} bytes at {node.where}, found fewer")
    raw = np.ascontiguousarray(st.windows(size, np.where(ok, lanes.pos, 0)))
    lanes.pos[ok] += size
    raw[~ok] = 0
    return raw


class _DecimalNode(_Node):
    """A decimal on bytes (``size is None``) or on a fixed: a two's complement big-endian
    unscaled value, held in Arrow's 16 or 32-byte little-endian two's complement."""

    __slots__ = ("precision", "size", "bytes_wide", "bound")

    def __init__(self, arrow_type: pa.DataType, path: str, size: int | None) -> None:
        wide = 16 if pa.types.is_decimal128(arrow_type) else 32
        super().__init__(arrow_type, path, width=max(size or 0, wide), flat=size)
        self.precision: int = arrow_type.precision
        self.size = size
        self.bytes_wide = wide
        limit = 10**self.precision
        self.bound = [(limit >> (64 * j)) & (2**64 - 1) for j in range(self.bytes_wide // 8)]

    def skip(self, st: _State, pos: _I64, end: _I64) -> _I64:
        return super().skip(st, pos, end) if self.size is not None else _skip_sized(st, pos, end)

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        if self.size is not None:
            return super().skip_one(view, p, end)
        return _skip_sized_one(view, p, end)

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        n, wide = len(lanes), self.bytes_wide
        if self.size is None:
            starts, stops = _read_ranges(st, lanes, self.where)
            length = stops - starts
        else:
            ok = lanes.pos + self.size <= lanes.end
            st.fail(lanes, ~ok, f"expected {self.size} bytes at {self.where}, found fewer")
            starts = np.where(ok, lanes.pos, 0)
            length = np.where(ok, self.size, 0)
            lanes.pos[ok] += self.size
        negative = (length > 0) & (st.buf[starts] >= 0x80)
        fill = np.where(negative, 0xFF, 0).astype(np.uint8)
        j = np.arange(wide)
        inside = j[None, :] >= (wide - length)[:, None]
        src = np.where(inside, (starts + length - wide)[:, None] + j[None, :], 0)
        be = np.where(inside, st.buf[src], fill[:, None])
        too_big = np.zeros(n, np.bool_)
        longer = np.flatnonzero(length > wide)
        if longer.size:  # the bytes beyond the width may only repeat the sign
            extra = length[longer] - wide
            first = np.repeat(np.cumsum(extra) - extra, extra)
            at = np.repeat(starts[longer], extra) + np.arange(int(extra.sum())) - first
            stray = st.buf[at] != np.repeat(fill[longer], extra)
            owner = np.repeat(np.arange(longer.size), extra)
            too_big[longer] = np.bincount(owner, weights=stray, minlength=longer.size) > 0
            too_big[longer] |= (be[longer, 0] >= 0x80) != negative[longer]
        le = np.ascontiguousarray(be[:, ::-1])
        limbs = le.view(np.uint64).reshape(n, wide // 8)
        magnitude = np.where(negative[:, None], _negate(limbs), limbs)
        too_big |= _at_least(magnitude, self.bound)
        st.fail(
            lanes,
            too_big,
            f"expected a decimal of at most {self.precision} digits at {self.where}, found "
            "a larger unscaled value",
        )
        le[too_big] = 0
        return pa.Array.from_buffers(self.arrow_type, n, [None, pa.py_buffer(le)])

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        n, wide = len(arr), self.bytes_wide
        raw = np.frombuffer(arr.buffers()[1], np.uint8)[arr.offset * wide : (arr.offset + n) * wide]
        le = raw.reshape(n, wide)
        negative = le[:, wide - 1] >= 0x80 if n else np.zeros(0, np.bool_)
        limbs = np.ascontiguousarray(le).view(np.uint64).reshape(n, wide // 8)
        magnitude = np.where(negative[:, None], _negate(limbs), limbs)
        too_big = _at_least(magnitude, self.bound)
        if too_big.any():
            value = arr.filter(pa.array(too_big))[0].as_py()
            raise EncodeError(
                f"expected a decimal of at most {self.precision} digits at {self.where}, "
                f"found {value}",
                field=self.where,
            )
        be = le[:, ::-1]
        if self.size is not None:
            size = self.size
            if size <= wide:
                return _fixed_bytes(np.ascontiguousarray(be[:, wide - size :]), n, size)
            fill = np.where(negative, 0xFF, 0).astype(np.uint8)
            padded = np.concatenate([np.repeat(fill[:, None], size - wide, axis=1), be], axis=1)
            return _fixed_bytes(padded, n, size)
        # fastavro: (|unscaled|.bit_length() + 8) // 8 bytes of two's complement
        mag_bytes = np.ascontiguousarray(magnitude).view(np.uint8).reshape(n, wide)
        nonzero = mag_bytes != 0
        top = wide - 1 - np.argmax(nonzero[:, ::-1], axis=1)
        bits = np.where(nonzero.any(axis=1), 8 * top + _BITLEN[mag_bytes[np.arange(n), top]], 0)
        nbytes = bits // 8 + 1
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(nbytes, out=offsets[1:])
        data = be[np.arange(wide)[None, :] >= (wide - nbytes)[:, None]]
        return _join([_varints(nbytes), _binary(offsets, data)])


class _UnionNode(_Node):
    """A union of null and at most one other type (what the mapping accepts)."""

    __slots__ = ("count", "child", "child_index", "null_index")

    def __init__(
        self, arrow_type: pa.DataType, path: str, branches: Sequence[_Node | None]
    ) -> None:
        child = next((b for b in branches if b is not None), None)
        super().__init__(arrow_type, path, vskip=child is None or child.vskip)
        self.count = len(branches)
        self.null_index = next((i for i, b in enumerate(branches) if b is None), None)
        self.child_index = next((i for i, b in enumerate(branches) if b is not None), None)
        self.child = child

    def skip(self, st: _State, pos: _I64, end: _I64) -> _I64:
        index, length, status = _scan_varint(st.buf, pos, end)
        ok = (status == 0) & (index >= -self.count) & (index < self.count)
        after = pos + length
        result: _I64 = np.where(ok, after, -1)
        if self.child is not None:
            picked = np.flatnonzero(ok & (np.mod(index, self.count) == self.child_index))
            if picked.size:
                result[picked] = self.child.skip(st, after[picked], end[picked])
        return result

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        index, q = _varint_one(view, p, end)
        if q < 0 or not -self.count <= index < self.count:
            return -1
        if self.child is not None and index % self.count == self.child_index:
            return self.child.skip_one(view, q, end)
        return q

    def children(self) -> list[_Node]:
        return [] if self.child is None else [self.child]

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        n = len(lanes)
        index = _read_varint(st, lanes, f"a union branch index at {self.where}")
        bad = (index < -self.count) | (index >= self.count)
        st.fail(
            lanes,
            bad,
            f"expected a union branch index in [0, {self.count}) at {self.where}, found {{value}}",
            index,
        )
        if self.child is None or self.child_index is None:
            return pa.nulls(n)
        fallback = self.child_index if self.null_index is None else self.null_index
        branch = np.where(bad, fallback, np.mod(index, self.count))
        chosen = branch == self.child_index
        if chosen.all():
            return self.child.decode(st, lanes)
        picked = np.flatnonzero(chosen)
        sub = lanes.take(picked)
        values = self.child.decode(st, sub)
        lanes.pos[picked] = sub.pos
        # a null is the element pyarrow makes of None: a null struct has zero-valued children
        # (as rows_to_arrow makes it, and as Parquet wants non-nullable children to be)
        where = np.full(n, picked.size, np.int64)
        where[picked] = np.arange(picked.size)
        nulls = pa.array([None], self.arrow_type)
        return pa.concat_arrays([values, nulls]).take(pa.array(where))

    def _encode(self, arr: pa.Array) -> pa.Array:
        n = len(arr)
        if self.child is None or self.child_index is None:
            assert self.null_index is not None
            return _const(n, 2 * self.null_index)
        mark = 2 * self.child_index  # the zig-zag varint of a branch index below 64
        if self.null_index is None:
            if arr.null_count:
                raise EncodeError(
                    f"expected a value in non-nullable {self.where}, found null "
                    f"({arr.null_count} row(s))",
                    field=self.where,
                )
            return _join([_const(n, mark), self.child.encode(arr)])
        if arr.null_count == 0:
            return _join([_const(n, mark), self.child.encode(arr)])
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        values = self.child.encode(arr.filter(pa.array(valid)))
        where = np.cumsum(valid) - 1
        spread = pc.fill_null(values.take(pa.array(where, mask=~valid)), b"")
        marks = np.where(valid, mark, 2 * self.null_index).astype(np.uint8)
        return _join([_fixed_bytes(marks, n, 1), spread])


_FEW_LANES = 4  # lanes few enough to find their items' positions in plain Python ...
_LONG_BLOCK = 32  # ... when one of them has at least this many items left in its block


class _Repeated(_Node):
    """Arrays and maps: blocks of items (count, then items; a negative count is followed by the
    block's size in bytes), ended by a 0 count.

    Decoding goes block by block: read every lane's block count, find where each item of the
    block starts (by arithmetic for fixed-width items, by finding the varints' last bytes for
    varint items, by skipping item ``k`` of every lane at once for other items), then decode
    all the items of the block in one call, with one lane per item. What cannot be skipped (an
    array or map inside the items, a malformed item) is decoded one item of every lane at a
    time; the positions of a few lanes' long blocks are found in plain Python. The Python loops
    run over blocks and item positions, never over rows."""

    __slots__ = ("entry_flat", "entry_varint", "leaf")

    def __init__(self, arrow_type: pa.DataType, path: str, entries: Sequence[_Node]) -> None:
        super().__init__(arrow_type, path, vskip=False)
        flats = [e.flat for e in entries]
        self.entry_flat = None if None in flats else sum(f for f in flats if f is not None)
        self.entry_varint = len(entries) == 1 and entries[0].varint
        only = entries[0] if len(entries) == 1 else None
        self.leaf = only if isinstance(only, (_FloatNode, _FixedNode, _BoolNode)) else None

    def entries(self) -> list[_Node]:
        raise NotImplementedError

    def read_item(self, st: _State, lanes: _Lanes) -> list[pa.Array]:
        return [node.decode(st, lanes) for node in self.entries()]

    def skip_entry(self, st: _State, pos: _I64, end: _I64) -> _I64:
        at = pos.copy()
        for node in self.entries():
            live = np.flatnonzero(at >= 0)
            at[live] = node.skip(st, at[live], end[live])
        return at

    def skip_entry_one(self, view: memoryview, p: int, end: int) -> int:
        for node in self.entries():
            p = node.skip_one(view, p, end)
            if p < 0:
                return -1
        return p

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        while True:
            count, p = _varint_one(view, p, end)
            if p < 0:
                return -1
            if count == 0:
                return p
            if count < 0:
                if count == _INT64_MIN:
                    return -1
                count = -count
                _, p = _varint_one(view, p, end)
                if p < 0:
                    return -1
            if count > end - p:
                return -1
            for _ in range(count):
                p = self.skip_entry_one(view, p, end)
                if p < 0:
                    return -1

    def blocks(self, st: _State, lanes: _Lanes) -> tuple[_I64, list[pa.Array]]:
        """Decode every lane's items: per lane its item count, and per entry node (the item;
        or the key and the value) the array of all items in lane order."""
        n = len(lanes)
        count = np.zeros(n, np.int64)
        left = np.zeros(n, np.int64)
        # each chunk: its arrays, and the lanes, item counts and items before, of its items
        chunks: list[tuple[list[pa.Array], _I64, _I64, _I64]] = []

        def take_items(idx: _I64, starts: _I64, per_lane: _I64, run: bool = False) -> None:
            """Decode ``per_lane[i]`` items of lane ``idx[i]`` at ``starts`` (in lane order);
            ``run``: the items are fixed-width leaves known to fit, read as runs of bytes."""
            some = per_lane > 0
            idx, per_lane = idx[some], per_lane[some]
            if idx.size == 0:
                return
            if run and self.leaf is not None:  # a block of fixed-width values: one run of bytes
                width = self.leaf.width
                stops = lanes.pos[idx] + per_lane * width
                runs = _cut(st, lanes.pos[idx], stops)
                data = np.frombuffer(runs.buffers()[2], np.uint8)[: int(per_lane.sum()) * width]
                arrays = [self.leaf.from_bytes(data, int(per_lane.sum()))]
                lanes.pos[idx] = stops
            else:
                items = _Lanes(
                    starts, _repeat(lanes.end[idx], per_lane), _repeat(lanes.row[idx], per_lane)
                )
                arrays = self.read_item(st, items)
                lanes.pos[idx] = items.pos[np.cumsum(per_lane) - 1]  # after each lane's last item
            chunks.append((arrays, idx, per_lane, count[idx]))
            count[idx] += per_lane
            left[idx] -= per_lane
            dead = idx[st.dead(lanes.take(idx))]
            lanes.pos[dead] = lanes.end[dead]
            left[dead] = 0

        active = np.arange(n)
        while active.size:
            sub = lanes.take(active)
            left[active] = self._block_count(st, sub)
            lanes.pos[active] = sub.pos
            active = active[left[active] > 0]
            if not active.size:
                break
            resolved, starts = self._item_starts(st, lanes.take(active), left[active])
            take_items(active[resolved], starts, left[active[resolved]], run=True)
            rest = active[~resolved]
            while rest.size:
                if rest.size <= _FEW_LANES and int(left[rest].max()) >= _LONG_BLOCK:
                    starts, per_lane = self._scalar_starts(st, lanes.take(rest), left[rest])
                    take_items(rest, starts, per_lane)
                    rest = rest[left[rest] > 0]
                    if not rest.size:
                        break
                take_items(rest, lanes.pos[rest], np.ones(rest.size, np.int64))
                rest = rest[left[rest] > 0]
            active = active[~st.dead(lanes.take(active))]
        nodes = self.entries()
        if not chunks:
            return count, [pa.array([], node.arrow_type) for node in nodes]
        if len(chunks) == 1:  # one chunk holds every lane's items, in lane order
            return count, chunks[0][0]
        offsets = _list_offsets(count)
        dest = np.concatenate(
            [
                offsets[_repeat(idx, per)] + _repeat(before, per) + _within(per)
                for _, idx, per, before in chunks
            ]
        )
        arrays = [pa.concat_arrays([c[0][j] for c in chunks]) for j in range(len(nodes))]
        return count, [_scatter(a, dest) for a in arrays]

    def _item_starts(self, st: _State, lanes: _Lanes, counts: _I64) -> tuple[_Bool, _I64]:
        """Where each of the ``counts[i]`` items of lane ``i``'s block starts, for the lanes
        where that is found at once (``resolved``); the starts in lane order."""
        m = len(lanes)
        flat = self.entry_flat
        if flat is not None and flat > 0:
            resolved = lanes.pos + counts * flat <= lanes.end
            if self.leaf is not None:  # read as one run of bytes: no starts needed
                return resolved, np.zeros(0, np.int64)
            per = counts[resolved]
            return resolved, _repeat(lanes.pos[resolved], per) + _within(per) * flat
        if self.entry_varint:
            return self._varint_starts(st, lanes, counts)
        if not all(node.vskip for node in self.entries()):
            return np.zeros(m, np.bool_), np.zeros(0, np.int64)
        resolved = np.ones(m, np.bool_)
        at = lanes.pos.copy()
        seen_lane: list[_I64] = []
        seen_pos: list[_I64] = []
        alive = np.arange(m)
        k = 0
        while alive.size:
            if alive.size <= _FEW_LANES and int(counts[alive].max()) - k >= _LONG_BLOCK:
                resolved[alive] = False  # left to the plain Python skip
                break
            seen_lane.append(alive)
            seen_pos.append(at[alive])
            after = self.skip_entry(st, at[alive], lanes.end[alive])
            broken = after < 0
            resolved[alive[broken]] = False
            at[alive] = np.where(broken, at[alive], after)
            alive = alive[~broken & (counts[alive] > k + 1)]
            k += 1
        per = counts[resolved]
        starts = np.zeros(int(per.sum()), np.int64)
        if seen_lane:
            lane = np.concatenate(seen_lane)
            item = np.concatenate([np.full(a.size, j, np.int64) for j, a in enumerate(seen_lane)])
            keep = resolved[lane]
            first = np.cumsum(per) - per
            rank = np.cumsum(resolved) - 1
            starts[first[rank[lane[keep]]] + item[keep]] = np.concatenate(seen_pos)[keep]
        return resolved, starts

    def _varint_starts(self, st: _State, lanes: _Lanes, counts: _I64) -> tuple[_Bool, _I64]:
        """Items that are one varint each: a varint ends at its first byte below 0x80, so the
        block's items end at the first ``count`` such bytes (within 10 bytes per item)."""
        m = len(lanes)
        window = np.minimum(lanes.end - lanes.pos, 10 * counts)
        at = np.repeat(lanes.pos, window) + _within(window)
        lane = np.repeat(np.arange(m), window)
        last = np.flatnonzero(st.buf[at] < 0x80)
        last_lane = lane[last]
        rank = np.arange(last.size) - np.searchsorted(last_lane, last_lane)
        keep = rank < counts[last_lane]
        last, last_lane = last[keep], last_lane[keep]
        resolved = np.bincount(last_lane, minlength=m) == counts
        ends = at[last] + 1
        starts = np.empty_like(ends)
        starts[1:] = ends[:-1]
        firsts = np.searchsorted(last_lane, np.arange(m))
        has = np.flatnonzero(firsts < last.size)
        has = has[last_lane[firsts[has]] == has]  # lanes with at least one item end found
        starts[firsts[has]] = lanes.pos[has]
        too_long = ends - starts > 10  # fastavro reads on; left to the decoder's marks
        resolved &= np.bincount(last_lane[too_long], minlength=m) == 0
        return resolved, starts[resolved[last_lane]]

    def _scalar_starts(self, st: _State, lanes: _Lanes, counts: _I64) -> tuple[_I64, _I64]:
        """The starts of the remaining items of a few lanes' blocks, skipped in plain Python,
        up to an item the skip refuses (the decoder then reads that one and says why)."""
        found: list[int] = []
        per_lane = np.zeros(len(lanes), np.int64)
        view = st.view
        for i, (p, end, c) in enumerate(
            zip(lanes.pos.tolist(), lanes.end.tolist(), counts.tolist(), strict=True)
        ):
            for _ in range(c):
                q = self.skip_entry_one(view, p, end)
                if q < 0:
                    break
                found.append(p)
                per_lane[i] += 1
                p = q
        return np.array(found, np.int64), per_lane

    def _block_count(self, st: _State, lanes: _Lanes) -> _I64:
        count = _read_varint(st, lanes, f"an item count at {self.where}")
        negative = count < 0
        if negative.any():
            lowest = count == _INT64_MIN
            if lowest.any():
                st.fail(
                    lanes,
                    lowest,
                    f"expected an item count above -2**63 at {self.where}, found -2**63 "
                    "(left to the row decoder)",
                    definite=False,
                )
            sized = np.flatnonzero(negative & ~lowest)
            sub = lanes.take(sized)
            _read_varint(st, sub, f"a block size at {self.where}")
            lanes.pos[sized] = sub.pos
            count = np.where(lowest, 0, np.abs(count))
        # every item takes at least one byte (the mapping refuses items of none)
        over = count > lanes.end - lanes.pos
        st.fail(
            lanes,
            over,
            f"expected at most as many items as bytes left at {self.where}, found a block of "
            "{value}",
            count,
        )
        count[over | st.dead(lanes)] = 0
        return count


def _list_offsets(count: _I64) -> _I64:
    offsets = np.zeros(len(count) + 1, np.int64)
    np.cumsum(count, out=offsets[1:])
    return offsets


class _ArrayNode(_Repeated):
    __slots__ = ("item",)

    def __init__(self, arrow_type: pa.DataType, path: str, item: _Node) -> None:
        super().__init__(arrow_type, path, [item])
        self.item = item

    def children(self) -> list[_Node]:
        return [self.item]

    def entries(self) -> list[_Node]:
        return [self.item]

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        count, (values,) = self.blocks(st, lanes)
        offsets = _list_offsets(count)
        return pa.ListArray.from_arrays(
            pa.array(offsets.astype(np.int32)), values, type=self.arrow_type
        )

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        offsets = _offsets_of(arr)
        base = int(offsets[0])
        values = arr.values.slice(base, int(offsets[-1]) - base)
        return _block_encoding(np.diff(offsets), self.item.encode(values), offsets - base)


class _MapNode(_Repeated):
    __slots__ = ("key", "value")

    def __init__(self, arrow_type: pa.DataType, path: str, value: _Node) -> None:
        key = _BytesNode(pa.string(), f"{path}{{}}key")
        super().__init__(arrow_type, path, [key, value])
        self.key = key
        self.value = value

    def children(self) -> list[_Node]:
        return [self.key, self.value]

    def entries(self) -> list[_Node]:
        return [self.key, self.value]

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        n = len(lanes)
        count, (keys, values) = self.blocks(st, lanes)
        total = len(keys)
        owner = _repeat(np.arange(n, dtype=np.int64), count)
        order = np.arange(total, dtype=np.int64)
        sorted_owner, sorted_keys = owner, keys
        if total > 1 and int(count.max()) > 1:
            # canonical order: by the key's UTF-8 bytes; of equal keys the last one read wins
            table = pa.table({"o": owner, "k": keys.view(pa.binary()), "s": order})
            order = pc.sort_indices(
                table, sort_keys=[("o", "ascending"), ("k", "ascending"), ("s", "ascending")]
            ).to_numpy()
            sorted_owner = owner[order]
            sorted_keys = keys.take(pa.array(order))
            same = (sorted_owner[1:] == sorted_owner[:-1]) & pc.equal(
                sorted_keys.slice(1), sorted_keys.slice(0, total - 1)
            ).to_numpy(zero_copy_only=False)
            if same.any():
                keep = np.append(~same, True)
                order, sorted_owner = order[keep], sorted_owner[keep]
                sorted_keys = keys.take(pa.array(order))
            values = values.take(pa.array(order))
        offsets = _list_offsets(np.bincount(sorted_owner, minlength=n).astype(np.int64))
        return pa.MapArray.from_arrays(
            pa.array(offsets.astype(np.int32)), sorted_keys, values, type=self.arrow_type
        )

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        n = len(arr)
        offsets = _offsets_of(arr)
        base, total = int(offsets[0]), int(offsets[-1] - offsets[0])
        entries = arr.values.slice(base, total)  # the struct of keys and values
        keys, values = entries.field(0).cast(pa.string()), entries.field(1)
        count = np.diff(offsets)
        if total and count.max() > 1:
            owner = np.repeat(np.arange(n), count)
            order = pc.sort_indices(
                pa.table({"o": owner, "k": keys.view(pa.binary())}),
                sort_keys=[("o", "ascending"), ("k", "ascending")],
            )
            keys, values = keys.take(order), values.take(order)
            owner = owner[order.to_numpy()]
            same = (owner[1:] == owner[:-1]) & pc.equal(
                keys.slice(1), keys.slice(0, total - 1)
            ).to_numpy(zero_copy_only=False)
            if same.any():
                key = keys[int(np.flatnonzero(same)[0])].as_py()
                raise EncodeError(
                    f"expected distinct keys in each map at {self.where}, found {key!r} twice",
                    field=self.where,
                )
        entries = _join([self.key.encode(keys), self.value.encode(values)])
        return _block_encoding(count, entries, offsets - base)


class _RecordNode(_Node):
    __slots__ = ("fields",)

    def __init__(self, arrow_type: pa.DataType, path: str, fields: list[tuple[str, _Node]]):
        flats = [node.flat for _, node in fields]
        super().__init__(
            arrow_type,
            path,
            flat=None if None in flats else sum(f for f in flats if f is not None),
            vskip=all(node.vskip for _, node in fields),
        )
        self.fields = fields

    def skip(self, st: _State, pos: _I64, end: _I64) -> _I64:
        if self.flat is not None:
            return super().skip(st, pos, end)
        at = pos.copy()
        for _, node in self.fields:
            live = np.flatnonzero(at >= 0)
            at[live] = node.skip(st, at[live], end[live])
        return at

    def skip_one(self, view: memoryview, p: int, end: int) -> int:
        for _, node in self.fields:
            p = node.skip_one(view, p, end)
            if p < 0:
                return -1
        return p

    def children(self) -> list[_Node]:
        return [node for _, node in self.fields]

    def decode_fields(self, st: _State, lanes: _Lanes) -> list[pa.Array]:
        return [node.decode(st, lanes) for _, node in self.fields]

    def _decode(self, st: _State, lanes: _Lanes) -> pa.Array:
        return pa.StructArray.from_arrays(
            self.decode_fields(st, lanes), fields=list(self.arrow_type)
        )

    def encode_fields(self, columns: Sequence[pa.Array]) -> pa.Array:
        return _join(
            [node.encode(col) for (_, node), col in zip(self.fields, columns, strict=True)]
        )

    def _encode(self, arr: pa.Array) -> pa.Array:
        self._require_values(arr)
        return self.encode_fields([arr.field(i) for i in range(len(self.fields))])


# -- compiling a row schema --------------------------------------------------------------------


class _Compiler:
    """Builds the nodes of a parsed row schema (named types resolved; the mapping has refused
    what it cannot hold, so what is left is well-formed)."""

    def __init__(self) -> None:
        self.named: dict[str, Any] = {}

    def field(self, avro: Any, path: str) -> _Node:
        if isinstance(avro, list):
            branches: list[_Node | None] = [
                None if b == "null" else self.field(b, path) for b in avro
            ]
            real = [b for b in branches if b is not None]
            return _UnionNode(real[0].arrow_type if real else pa.null(), path, branches)
        return self.type(avro, path)

    def type(self, avro: Any, path: str) -> _Node:
        if isinstance(avro, str):
            if avro in self.named:
                return self.type(self.named[avro], path)
            return self.primitive(avro, None, path)
        if isinstance(avro, list):
            return self.field(avro, path)
        kind, logical = avro.get("type"), avro.get("logicalType")
        if isinstance(kind, (dict, list)):
            return self.field(kind, path)
        if kind in ("record", "error"):
            self.named[avro["name"]] = avro
            fields = [
                (f["name"], self.field(f["type"], f"{path}.{f['name']}" if path else f["name"]))
                for f in avro["fields"]
            ]
            arrow = pa.struct(
                [pa.field(name, node.arrow_type, nullable=_nullable(node)) for name, node in fields]
            )
            return _RecordNode(arrow, path, fields)
        if kind == "enum":
            self.named[avro["name"]] = avro
            return _EnumNode(path, avro["symbols"])
        if kind == "fixed":
            self.named[avro["name"]] = avro
            dec = _decimal_arrow(avro) if logical == "decimal" else None
            if dec is not None:
                return _DecimalNode(dec, path, int(avro["size"]))
            return _FixedNode(path, int(avro["size"]))
        if kind == "array":
            item = self.field(avro["items"], f"{path}[]")
            arrow = pa.list_(pa.field("item", item.arrow_type, nullable=_nullable(item)))
            return _ArrayNode(arrow, path, item)
        if kind == "map":
            value = self.field(avro["values"], f"{path}{{}}")
            value_field = pa.field("value", value.arrow_type, nullable=_nullable(value))
            return _MapNode(pa.map_(pa.string(), value_field), path, value)
        if isinstance(kind, str) and kind in self.named:
            return self.type(self.named[kind], path)
        if isinstance(kind, str):
            return self.primitive(kind, logical, path, avro)
        raise SchemaError(f"expected an Avro type at {path!r}, found {avro!r}")

    def primitive(
        self, kind: str, logical: Any, path: str, avro: Mapping[str, Any] | None = None
    ) -> _Node:
        if kind == "null":
            return _NullNode(path)
        if kind == "boolean":
            return _BoolNode(path)
        if kind in ("float", "double"):
            return _FloatNode(pa.float32() if kind == "float" else pa.float64(), path)
        if kind == "bytes":
            dec = _decimal_arrow(avro) if avro is not None and logical == "decimal" else None
            return (
                _DecimalNode(dec, path, None) if dec is not None else _BytesNode(pa.binary(), path)
            )
        if kind == "string":
            if logical == "uuid":
                return _UuidNode(path)
            return _BytesNode(pa.string(), path)
        if kind in ("int", "long"):
            key = f"{kind}-{logical}"
            rule = _INT_RULES.get(key) or (_INT32 if kind == "int" else _INT_RULES["long"])
            return _IntNode(_INT_ARROW.get(key, _INT_ARROW[kind]), path, rule)
        raise SchemaError(f"expected an Avro type at {path!r}, found {kind!r}")


_INT_ARROW: dict[str, pa.DataType] = {
    "int": pa.int32(),
    "long": pa.int64(),
    "int-date": pa.date32(),
    "int-time-millis": pa.time32("ms"),
    "long-time-micros": pa.time64("us"),
    "long-timestamp-millis": pa.timestamp("ms", tz="UTC"),
    "long-timestamp-micros": pa.timestamp("us", tz="UTC"),
    "long-timestamp-nanos": pa.timestamp("ns", tz="UTC"),
    "long-local-timestamp-millis": pa.timestamp("ms"),
    "long-local-timestamp-micros": pa.timestamp("us"),
    "long-local-timestamp-nanos": pa.timestamp("ns"),
}


def _decimal_arrow(avro: Mapping[str, Any]) -> pa.DataType | None:
    precision, scale = avro.get("precision"), avro.get("scale", 0)
    if not isinstance(precision, int) or not isinstance(scale, int):
        return None  # the mapping refuses these; nothing to build
    return pa.decimal128(precision, scale) if precision <= 38 else pa.decimal256(precision, scale)


def _nullable(node: _Node) -> bool:
    if isinstance(node, _UnionNode):
        return node.null_index is not None
    return isinstance(node, _NullNode)


def _max_width(node: _Node) -> int:
    return max([node.width, *(_max_width(c) for c in node.children())])


# -- the codec ---------------------------------------------------------------------------------


class ColumnCodec:
    """Vectorised Avro <-> Arrow for one row schema (any schema :func:`parse_row_schema`
    accepts). Immutable; safe to share between threads."""

    def __init__(self, row_schema: Mapping[str, Any] | str) -> None:
        self.row_schema: dict[str, Any] = parse_row_schema(row_schema)
        self.arrow_schema: pa.Schema = avro_to_arrow_schema(self.row_schema)
        compiled = _Compiler().type(self.row_schema, "")
        if not isinstance(compiled, _RecordNode):  # pragma: no cover - parse_row_schema checks
            raise SchemaError("expected a record schema, found another type")
        built = pa.schema(list(compiled.arrow_type))
        if built != self.arrow_schema:  # pragma: no cover - a bug here, not in the input
            raise SchemaError(
                f"expected the column codec's types to be the mapping's {self.arrow_schema}, "
                f"found {built}"
            )
        self._root = compiled
        self._pad = max(16, _max_width(compiled) + 1)
        self._reference = RowCodec(self.row_schema)

    # -- decoding ------------------------------------------------------------------------------
    def decode(self, bodies: pa.Array | pa.ChunkedArray, *, skip: int = 0) -> Decoded:
        """Decode one row per element of ``bodies`` (a binary or large binary array; a null
        element is a bad row), ignoring the first ``skip`` bytes of each (10 for single-object
        encoded rows whose header the caller checked). See :class:`Decoded`."""
        if skip < 0:
            raise ValueError(f"expected skip >= 0, found {skip}")
        if isinstance(bodies, pa.ChunkedArray):
            bodies = bodies.combine_chunks()
        if not (pa.types.is_binary(bodies.type) or pa.types.is_large_binary(bodies.type)):
            raise DecodeError(f"expected a binary array of bodies, found {bodies.type}")
        n = len(bodies)
        offsets = _offsets_of(bodies) if n else np.zeros(1, np.int64)
        first = int(offsets[0])
        offsets = offsets - first
        data = bodies.buffers()[2]
        raw = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        buf = np.zeros(int(offsets[-1]) + self._pad, np.uint8)
        buf[: int(offsets[-1])] = raw[first : first + int(offsets[-1])]
        st = _State(buf, n)
        ends = offsets[1:].copy()
        lanes = _Lanes(np.minimum(offsets[:-1] + skip, ends), ends, np.arange(n, dtype=np.int64))
        if bodies.null_count:
            st.fail(
                lanes,
                bodies.is_null().to_numpy(zero_copy_only=False),
                "expected a row's bytes, found null",
            )
        if skip:
            sizes = np.diff(offsets)
            st.fail(lanes, sizes < skip, f"expected at least {skip} bytes, found {{value}}", sizes)
        columns = self._root.decode_fields(st, lanes)
        trailing = lanes.pos != lanes.end
        st.fail(
            lanes,
            trailing,
            "expected the body to end after its last field, found {value} trailing bytes",
            lanes.end - lanes.pos,
        )
        table = pa.Table.from_arrays(columns, schema=self.arrow_schema)
        return self._verdict(st, table, buf, offsets, skip)

    def _verdict(self, st: _State, table: pa.Table, buf: _U8, offsets: _I64, skip: int) -> Decoded:
        """The table of the ok rows, with the rows left to the per-row reference decided."""
        flagged = st.reason >= 0
        if not flagged.any():
            return Decoded(table, ~flagged, {})
        ok = ~flagged
        errors: dict[int, str] = {}
        extra_rows: list[dict[str, Any]] = []
        extra_index: list[int] = []
        header = MARKER + self._reference.fingerprint
        for i in np.flatnonzero(flagged).tolist():
            if not st.refer[i]:
                template = st.templates[int(st.reason[i])]
                errors[i] = template.replace("{value}", str(int(st.value[i])))
                continue
            body = bytes(buf[int(offsets[i]) + skip : int(offsets[i + 1])])
            try:
                row = self._reference.decode(header + body)
                rows_to_arrow([row], self.row_schema)
            except (DecodeError, EncodeError) as e:
                errors[i] = str(e)
                continue
            extra_rows.append(row)
            extra_index.append(i)
            ok[i] = True
        good = table.filter(pa.array(~flagged))
        if extra_rows:
            extra = rows_to_arrow(extra_rows, self.row_schema)
            position = np.concatenate([np.flatnonzero(~flagged), np.array(extra_index)])
            good = pa.concat_tables([good, extra]).take(pa.array(np.argsort(position)))
        return Decoded(good, ok, errors)

    # -- encoding ------------------------------------------------------------------------------
    def encode(self, table: pa.Table | pa.RecordBatch) -> pa.Array:
        """The canonical body of every row of ``table`` (columns of :attr:`arrow_schema`,
        selected by name: order and extra columns do not matter), as a binary array.

        Raises EncodeError where the per-row path raises (a null in a non-nullable field other
        than a boolean, a duplicate map key, a value out of its type's range, ...)."""
        columns: list[pa.Array] = []
        for field in self.arrow_schema:
            if field.name not in table.schema.names:
                raise EncodeError(
                    f"expected a column {field.name!r} in the table, found columns "
                    f"{table.schema.names}",
                    field=field.name,
                )
            column = table.column(field.name)
            if isinstance(column, pa.ChunkedArray):
                column = column.combine_chunks() if column.num_chunks else pa.array([], column.type)
            if column.type != field.type:
                try:
                    column = column.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise EncodeError(
                        f"expected column {field.name!r} of type {field.type}, found "
                        f"{column.type} ({e})",
                        field=field.name,
                    ) from e
            columns.append(column)
        if table.num_rows == 0:
            return pa.array([], pa.binary())
        try:
            return self._root.encode_fields(columns)
        except pa.ArrowCapacityError as e:  # Arrow's binary arrays stop at 2 GiB
            raise EncodeError(
                f"expected at most {_MAX_OFFSET} bytes of encoded rows per call, found more "
                f"(encode the table in smaller batches): {e}"
            ) from e


# -- a throughput check (python -m shared.avro_columns) -----------------------------------------


def _benchmark(rows: int = 200_000) -> None:  # pragma: no cover - prints figures
    import time

    from shared.avro_arrow import arrow_to_rows

    schema = {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "customer", "type": "string"},
            {"name": "amount", "type": "double"},
            {"name": "category", "type": "string"},
        ],
    }
    rng = np.random.default_rng(7)
    reference = RowCodec(schema)
    categories = ["books", "garden", "électronique", "toys", "food"]
    values = [
        {
            "id": int(i),
            "customer": f"customer-{int(c)}",
            "amount": float(a),
            "category": categories[int(k)],
        }
        for i, c, a, k in zip(
            rng.integers(0, 2**40, rows),
            rng.integers(0, 100_000, rows),
            rng.normal(100, 50, rows),
            rng.integers(0, len(categories), rows),
            strict=True,
        )
    ]
    bodies_list = [reference.encode(v) for v in values]
    bodies = pa.array(bodies_list, pa.binary())
    codec = ColumnCodec(schema)

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        best, result = float("inf"), None
        for _ in range(3):
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
        return best, result

    t_dec, decoded = timed(lambda: codec.decode(bodies, skip=10))
    t_ref_dec, ref_table = timed(
        lambda: rows_to_arrow([reference.decode(b) for b in bodies_list], reference.schema)
    )
    assert decoded.table.equals(ref_table)
    t_enc, encoded = timed(lambda: codec.encode(decoded.table))
    t_ref_enc, ref_bodies = timed(
        lambda: [reference.encode_body(r) for r in arrow_to_rows(ref_table, reference.schema)]
    )
    assert encoded.to_pylist() == ref_bodies
    print(f"{rows} rows of {{id: long, customer: string, amount: double, category: string}}")
    print(
        f"decode: columns {rows / t_dec:>12,.0f} rows/s   per-row {rows / t_ref_dec:>12,.0f} rows/s"
    )
    print(
        f"encode: columns {rows / t_enc:>12,.0f} rows/s   per-row {rows / t_ref_enc:>12,.0f} rows/s"
    )


if __name__ == "__main__":  # pragma: no cover
    _benchmark()
