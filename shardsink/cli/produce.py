"""``shardsink produce``: write a desired collection to its topic from JSON lines or CSV.

Each input line is one JSON object, either an update or a progress statement::

    {"row": {"id": 1, "name": "a"}, "time": 5, "diff": 1}     # diff defaults to 1
    {"progress": 6}                                          # null: the empty frontier

Rows are encoded with the Avro record schema of ``--schema`` (so JSON values must be what
fastavro accepts for each field: numbers, strings, booleans, lists, objects; ``bytes`` and
``fixed`` as strings of code points 0-255, one per byte, as Avro's JSON encoding has them and
``tail`` prints them; timestamps, dates, times and decimals as numbers or as text). Updates are hashed to partitions; a progress
line flushes the updates and then sends the frontier to every partition. Blank lines are
skipped. The last line printed is a JSON summary::

    {"frontier": 6, "partitions": 4, "progress": 4, "topic": "desired-orders", "updates": 2}

CSV (``--format csv``): a header row names the columns; the time and diff columns are named
by ``--time-column`` (default ``time``) and ``--diff-column`` (default ``diff``; a missing
column means diff 1), every other column is a field of the row schema. Cells are converted by
the schema's field types: int/long (and their logical types), float/double, boolean
(true/false/1/0), string, bytes (UTF-8 text); an empty cell is null for a nullable field;
arrays, maps and records are given as JSON. A CSV has no progress lines: use ``--advance-to``.

``--advance-to T`` sends progress T after the input (``closed``: the empty frontier).

All or nothing: the input is read twice. The first pass checks all of it (JSON, the row
schema, times) without keeping it in memory; the second sends it. A line that fails the
check fails the command before anything is sent (stdin is spooled to a temporary file for
the second pass). Times below the progress the topic has already seen (its last progress
statements, see :func:`shared.io.desired_producer.topic_progress`) are refused with
:class:`~shared.errors.ContractViolationError`: the sink would have to drop them as late.

``--partitions N`` creates the topic with N partitions when it does not exist. Kafka client
settings come from ``--bootstrap`` (else ``SHARDSINK_KAFKA_BOOTSTRAP``), ``SHARDSINK_KAFKA_*``
variables, and ``--kafka-option name=value``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

from shared.errors import ContractViolationError, EncodeError, InvalidUsageError, KafkaAdapterError, KafkaConfigError

_DESCRIPTION = """\
Produce a desired collection to its Kafka topic, from JSON lines or CSV.

Each JSON line is an update or a progress statement:
  {"row": {"id": 1, "name": "a"}, "time": 5, "diff": 1}     (diff defaults to 1)
  {"progress": 6}                                          (null: the empty frontier)
Updates are hashed to partitions; progress goes to every partition. Timestamps, dates and
decimals may be given as the text peek and tail print (2024-05-01 12:00:00+00:00), bytes as
tail prints them (one code point 0-255 per byte).

CSV (--format csv): a header row names the columns; --time-column and --diff-column name
those two, every other column is a field of the row schema. A CSV has no progress lines:
use --advance-to.

All or nothing: the whole input is checked first (JSON, schema, times), and nothing is sent
unless every line is valid. Times below the progress the topic has already seen are
refused. The last line printed is a JSON summary."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "produce",
        help="produce a desired collection (updates and progress) to its topic",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topic", required=True, help="the desired topic a sink reads")
    p.add_argument("--schema", required=True, help="the row schema, an Avro record .avsc file")
    p.add_argument(
        "--bootstrap", default=None, help="Kafka bootstrap servers host:port (default $SHARDSINK_KAFKA_BOOTSTRAP)"
    )
    add_input_args(p)
    p.add_argument(
        "--partitions", type=int, default=None, help="create the topic with N partitions if it is missing"
    )
    p.add_argument(
        "--kafka-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a librdkafka option (repeatable), e.g. security.protocol=SASL_SSL",
    )
    p.set_defaults(func=_produce)


def add_input_args(p: argparse.ArgumentParser) -> None:
    """The input flags ``produce`` and ``append`` share."""
    p.add_argument("--input", default="-", help="a JSON lines or CSV file (default: stdin)")
    p.add_argument("--format", choices=("jsonl", "csv"), default="jsonl", help="the input format (default jsonl)")
    p.add_argument("--time-column", default="time", help="CSV: the name of the time column (default time)")
    p.add_argument(
        "--diff-column", default="diff", help="CSV: the name of the diff column (default diff; without it: 1)"
    )
    p.add_argument(
        "--advance-to", default=None, metavar="T|closed",
        help="progress after the input: no more updates below T (closed: none ever)",
    )


def parse_lines(lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """``("update", (row, time, diff))`` or ``("progress", t_or_None)`` per non-blank line."""
    for _, kind, payload in parse_numbered_lines(lines):
        yield kind, payload


def parse_numbered_lines(lines: Iterable[str]) -> Iterator[tuple[int, str, Any]]:
    """:func:`parse_lines` with the line number of each item first."""
    for n, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise EncodeError(
                f"expected a JSON object on line {n}, found invalid JSON ({e.msg})", line=n
            ) from e
        if isinstance(obj, dict) and set(obj) == {"progress"}:
            t = obj["progress"]
            if t is not None and (isinstance(t, bool) or not isinstance(t, int)):
                raise EncodeError(
                    f"expected an integer time or null progress on line {n}, found {t!r}", line=n
                )
            yield n, "progress", t
        elif isinstance(obj, dict) and {"row", "time"} <= set(obj) <= {"row", "time", "diff"}:
            time, diff = obj["time"], obj.get("diff", 1)
            for name, v in (("time", time), ("diff", diff)):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise EncodeError(
                        f"expected an integer {name} on line {n}, found {v!r}", line=n
                    )
            if not isinstance(obj["row"], dict):
                raise EncodeError(
                    f"expected a JSON object as the row on line {n}, found {obj['row']!r}", line=n
                )
            yield n, "update", (obj["row"], time, diff)
        else:
            raise EncodeError(
                f'expected {{"row": ..., "time": t, "diff": d}} or {{"progress": t}} on line {n}, '
                f"found {text[:80]}",
                line=n,
            )


def _convert(value: str, avro_type: Any, field: str, n: int) -> Any:
    """A CSV cell as a value of ``avro_type`` (see the module docstring)."""
    if isinstance(avro_type, list):
        branches = [b for b in avro_type if b != "null"]
        if value == "" and "null" in avro_type:
            return None
        if len(branches) == 1:
            return _convert(value, branches[0], field, n)
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    t = avro_type.get("type") if isinstance(avro_type, dict) else avro_type
    if isinstance(t, (dict, list)):
        return _convert(value, t, field, n)
    if isinstance(avro_type, dict) and avro_type.get("logicalType") in _LOGICAL_TEXT:
        return value  # converted by coerce_row, which knows the logical type
    try:
        if t in ("int", "long"):
            return int(value)
        if t in ("float", "double"):
            return float(value)
        if t == "boolean":
            low = value.strip().lower()
            if low in ("true", "1", "t", "yes"):
                return True
            if low in ("false", "0", "f", "no"):
                return False
            raise ValueError(value)
        if t in ("string", "enum"):
            return value
        if t in ("bytes", "fixed"):
            return value.encode("utf-8")
        return json.loads(value)  # array, map, record
    except (ValueError, json.JSONDecodeError):
        raise EncodeError(
            f"expected a {t} for column {field!r} on line {n}, found {value!r}", line=n, field=field
        ) from None


def parse_csv(
    lines: Iterable[str], schema: dict[str, Any], *, time_column: str = "time", diff_column: str = "diff"
) -> Iterator[tuple[str, Any]]:
    """``("update", (row, time, diff))`` per CSV record after the header (line numbers count
    the header as line 1)."""
    for _, kind, payload in parse_numbered_csv(lines, schema, time_column=time_column, diff_column=diff_column):
        yield kind, payload


def parse_numbered_csv(
    lines: Iterable[str], schema: dict[str, Any], *, time_column: str = "time", diff_column: str = "diff"
) -> Iterator[tuple[int, str, Any]]:
    """:func:`parse_csv` with the line number of each record first."""
    import csv

    reader = csv.reader(lines)
    try:
        header = next(reader)
    except StopIteration:
        return
    fields = {f["name"]: f["type"] for f in schema.get("fields", [])}
    if time_column not in header:
        raise EncodeError(f"expected a time column {time_column!r} in the CSV header, found {header}")
    unknown = [h for h in header if h not in fields and h not in (time_column, diff_column)]
    if unknown:
        raise EncodeError(f"expected CSV columns among the schema's fields {sorted(fields)}, found {unknown}")
    for record in reader:
        n = reader.line_num
        if not record or record == [""]:
            continue
        if len(record) != len(header):
            raise EncodeError(f"expected {len(header)} CSV cells on line {n}, found {len(record)}", line=n)
        row: dict[str, Any] = {}
        time: int | None = None
        diff = 1
        for name, cell in zip(header, record, strict=True):
            if name == time_column:
                time = _convert(cell, "long", name, n)
            elif name == diff_column:
                diff = _convert(cell, "long", name, n)
            else:
                row[name] = _convert(cell, fields[name], name, n)
        assert time is not None
        yield n, "update", (row, time, diff)


def parse_advance(text: str | None) -> tuple[bool, int | None]:
    """``--advance-to``: (given, frontier time or None for closed)."""
    if text is None:
        return False, None
    if text == "closed":
        return True, None
    try:
        return True, int(text)
    except ValueError:
        raise EncodeError(f"expected --advance-to T (an integer) or 'closed', found {text!r}") from None


def read_input(args: argparse.Namespace, stream: IO[str], schema_text: str) -> Iterator[tuple[str, Any]]:
    """The parsed input of ``--format`` (updates and progress statements)."""
    for _, kind, payload in read_numbered(args, stream, schema_text):
        yield kind, payload


def read_numbered(args: argparse.Namespace, stream: IO[str], schema_text: str) -> Iterator[tuple[int, str, Any]]:
    """:func:`read_input` with the line number of each item first."""
    if getattr(args, "format", "jsonl") == "csv":
        return parse_numbered_csv(
            stream, json.loads(schema_text), time_column=args.time_column, diff_column=args.diff_column
        )
    return parse_numbered_lines(stream)


# -- values as text: the way peek and tail print them is accepted back -----------------------
_LOGICAL_TEXT = frozenset({
    "timestamp-millis", "timestamp-micros", "timestamp-nanos", "local-timestamp-millis",
    "local-timestamp-micros", "date", "time-millis", "time-micros", "decimal",
})


def _logical(value: str, logical: str) -> Any:
    import datetime as dt
    import decimal

    if logical == "decimal":
        try:
            return decimal.Decimal(value)
        except decimal.InvalidOperation:
            raise ValueError(value) from None
    if logical == "date":
        return dt.date.fromisoformat(value)
    if logical.startswith("time-"):
        return dt.time.fromisoformat(value)
    stamp = dt.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    if stamp.tzinfo is None and not logical.startswith("local-"):
        stamp = stamp.replace(tzinfo=dt.timezone.utc)  # UTC, never the machine's zone
    return stamp


def coerce(value: Any, avro_type: Any, names: dict[str, Any] | None = None) -> Any:
    """``value`` with text in logical-type fields (timestamps, dates, times, decimals) turned
    into the Python values fastavro encodes, and text in ``bytes``/``fixed`` fields into bytes
    (Avro's JSON encoding: one code point 0-255 per byte, as ``tail`` prints them); everything
    else unchanged. ``names``: the schema's named types (a field may name one defined before)."""
    if names is None:
        names = _named_types(avro_type)
    if isinstance(avro_type, str) and avro_type in names:
        avro_type = names[avro_type]
    if isinstance(avro_type, list):
        if value is None:
            return None
        for branch in avro_type:
            if branch == "null":
                continue
            try:
                return coerce(value, branch, names)
            except ValueError:
                continue
        return value
    if avro_type in ("bytes", "fixed") and isinstance(value, str):
        return value.encode("latin-1")  # UnicodeEncodeError (a ValueError): a code point above 255
    if not isinstance(avro_type, dict):
        return value
    logical, t = avro_type.get("logicalType"), avro_type.get("type")
    if logical in _LOGICAL_TEXT and isinstance(value, str):
        return _logical(value, str(logical))
    if t == "record" and isinstance(value, dict):
        fields = {f["name"]: f["type"] for f in avro_type.get("fields", [])}
        return {k: coerce(v, fields[k], names) if k in fields else v for k, v in value.items()}
    if t == "array" and isinstance(value, list):
        return [coerce(v, avro_type.get("items"), names) for v in value]
    if t == "map" and isinstance(value, dict):
        return {k: coerce(v, avro_type.get("values"), names) for k, v in value.items()}
    if isinstance(t, (dict, list)) or (isinstance(t, str) and t in names) or t in ("bytes", "fixed"):
        return coerce(value, t, names)
    return value


def _named_types(schema: Any, out: dict[str, Any] | None = None, namespace: str = "") -> dict[str, Any]:
    """The named types (records, enums, fixed) a schema defines, by name and full name."""
    out = {} if out is None else out
    if isinstance(schema, list):
        for b in schema:
            _named_types(b, out, namespace)
    elif isinstance(schema, dict):
        ns = schema.get("namespace", namespace)
        if schema.get("type") in ("record", "enum", "fixed") and "name" in schema:
            name = str(schema["name"])
            full = name if "." in name or not ns else f"{ns}.{name}"
            out[name] = out[full] = schema
            ns = full.rpartition(".")[0]
        for f in schema.get("fields", []):
            _named_types(f.get("type"), out, ns)
        for key in ("items", "values"):
            if key in schema:
                _named_types(schema[key], out, ns)
        if isinstance(schema.get("type"), (dict, list)):
            _named_types(schema["type"], out, ns)
    return out


def encode_row(codec: Any, row: dict[str, Any], n: int) -> bytes:
    """The row single-object encoded, or EncodeError naming line ``n`` and the field."""
    schema = codec.schema
    try:
        row = coerce(row, schema)
    except ValueError as e:
        raise EncodeError(f"expected a row matching the schema on line {n}, found a value that does not parse ({e})",
                          line=n) from None
    fields = {f["name"] for f in schema.get("fields", [])}
    unknown = sorted(set(row) - fields)
    if unknown:
        raise EncodeError(f"expected fields among {sorted(fields)} on line {n}, found {unknown}", line=n)
    try:
        return bytes(codec.encode(row))
    except EncodeError as e:
        text = str(e)
        fits = f"expected a row that fits {codec.codec.subject!r}, found: "
        # fastavro's complaint as it is; the row check's own sentence after what it was
        detail = ("a value that does not fit: " + text.split(fits, 1)[1]) if fits in text else \
            f"a value that does not encode ({text.split('does not encode: ', 1)[-1]})"
        raise EncodeError(f"expected a row matching the schema on line {n}, found {detail}", line=n) from None


# -- input files --------------------------------------------------------------------------------
def open_input(path: str, stack: contextlib.ExitStack) -> IO[str]:
    """The input as a text stream that can be read twice (stdin is spooled to a temporary
    file, held in memory only while small); a missing file is one clear error."""
    import tempfile

    if path == "-":
        spool = stack.enter_context(tempfile.SpooledTemporaryFile(max_size=8 << 20, mode="w+", newline=""))
        while chunk := sys.stdin.read(1 << 20):
            spool.write(chunk)
        spool.seek(0)
        return spool
    try:
        return stack.enter_context(open(path, encoding="utf-8", newline=""))
    except OSError as e:
        raise InvalidUsageError(f"expected a readable input file {path!r}, found {(e.strerror or str(e)).lower()}",
                                path=path) from None


class Checked:
    """What the check of a whole input found (pass 1 of an all-or-nothing write)."""

    def __init__(self) -> None:
        self.updates = 0
        self.progress = 0
        self.max_time: int | None = None


def check_input(
    items: Iterable[tuple[int, str, Any]], codec: Any, frontier: Any, *, topic: str | None = None,
    advance: tuple[bool, int | None] = (False, None), what: str | None = None,
) -> Checked:
    """Pass 1: every line parses, every row encodes, and no time is below the frontier (what
    the topic has seen, then each progress line of the input). Nothing is kept in memory."""
    from shared.frontier import Frontier

    out = Checked()
    label = what or (f"the progress of topic {topic!r}" if topic else "the progress")
    for n, kind, payload in items:
        if kind == "update":
            row, t, _ = payload
            encode_row(codec, row, n)
            if not frontier.beyond(t):
                raise ContractViolationError(
                    f"expected update times at or beyond {label} {_show(frontier)}, "
                    f"found time {t} on line {n}", line=n, time=t, frontier=frontier.time)
            out.updates += 1
            out.max_time = t if out.max_time is None else max(out.max_time, t)
        else:
            target = Frontier.empty() if payload is None else Frontier.at(payload)
            if not frontier.less_equal(target):
                raise ContractViolationError(
                    f"expected progress at or beyond {label} {_show(frontier)}, "
                    f"found {_show(target)} on line {n}", line=n, frontier=frontier.time)
            frontier = target
            out.progress += 1
    given, t = advance
    if given:
        target = Frontier.empty() if t is None else Frontier.at(t)
        if not frontier.less_equal(target):
            raise ContractViolationError(
                f"expected --advance-to at or beyond {label} {_show(frontier)}, found {_show(target)}",
                frontier=frontier.time)
    return out


def _show(f: Any) -> str:
    return "closed" if f.is_empty() else str(f.time)


def _produce(args: argparse.Namespace) -> int:
    """Two passes over the input: check all of it, then send it (see the description)."""
    import os

    from shardsink.cli.main import print_json
    from shardsink.cli.util import ProgressBar, check_brokers, load_schema
    from shared.codec import RowCodec
    from shared.frontier import Frontier
    from shared.io.desired_producer import DesiredProducer, topic_progress
    from shared.io.kafka import KafkaSettings, env_options
    from shared.io.kafka_admin import ensure_topic

    options = env_options(os.environ)
    for item in args.kafka_option:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise KafkaConfigError(f"expected --kafka-option NAME=VALUE, found {item!r}")
        options[name] = value
    if args.partitions is not None and args.partitions < 1:
        raise InvalidUsageError(f"expected --partitions >= 1, found {args.partitions}")
    bootstrap = args.bootstrap or os.environ.get("SHARDSINK_KAFKA_BOOTSTRAP", "")
    settings = KafkaSettings.of(bootstrap, options)
    schema_obj = load_schema(args.schema)
    check_brokers(settings.bootstrap)
    schema = json.dumps(schema_obj)
    codec = RowCodec(schema_obj)
    advance, advance_to = parse_advance(args.advance_to)
    with contextlib.ExitStack() as stack:
        stream = open_input(args.input, stack)
        seen = topic_progress(settings, args.topic)
        if seen is None and args.partitions is None:
            from shared.errors import UnknownTopicError

            raise UnknownTopicError(
                f"expected topic {args.topic!r} to exist, found none (give --partitions N to create it)",
                topic=args.topic,
            )
        frontier = seen[1] if seen is not None and seen[1] is not None else Frontier.minimum()
        try:  # 1. check everything; nothing is sent yet
            checked = check_input(read_numbered(args, stream, schema), codec, frontier, topic=args.topic,
                                  advance=(advance, advance_to))
        except (EncodeError, ContractViolationError) as e:
            raise type(e)(f"{e}; nothing was produced to {args.topic!r}", **e.fields) from None
        stream.seek(0)
        if args.partitions is not None:  # 2. the topic, then every record
            ensure_topic(settings, args.topic, args.partitions)
        producer = stack.enter_context(DesiredProducer(settings, args.topic, schema, frontier=frontier))
        bar = stack.enter_context(ProgressBar(f"produce {args.topic}", unit="updates"))
        try:
            for n, kind, payload in read_numbered(args, stream, schema):
                if kind == "update":
                    row, time, diff = payload
                    producer.send_encoded(encode_row(codec, row, n), time, diff)
                    bar.update()
                else:
                    producer.advance_to(payload)
            if advance:
                producer.advance_to(advance_to)
            producer.flush()
        except KafkaAdapterError as e:  # the broker failed us half way: say what may have landed
            producer.abort()
            raise type(e)(
                f"{e}; up to {producer.sent_updates} of the input's {checked.updates} updates and "
                f"{producer.sent_progress} progress statements may be on {args.topic!r}: the sink "
                "counts each update as often as it lands", **e.fields,
            ) from None
    print_json(
        {
            "topic": args.topic,
            "partitions": producer.partitions,
            "updates": producer.sent_updates,
            "progress": producer.sent_progress,
            "frontier": producer.frontier.time,
        }
    )
    return 0
