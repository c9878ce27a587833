"""``shardsink produce``: write a desired collection to its topic from JSON lines or CSV.

Each input line is one JSON object, either an update or a progress statement::

    {"row": {"id": 1, "name": "a"}, "time": 5, "diff": 1}     # diff defaults to 1
    {"progress": 6}                                          # null: the empty frontier

Rows are encoded with the Avro record schema of ``--schema`` (so JSON values must be what
fastavro accepts for each field: numbers, strings, booleans, lists, objects; fields of type
``bytes``/``fixed`` cannot be given in JSON). Updates are hashed to partitions; a progress
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

from shared.errors import EncodeError, KafkaConfigError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "produce",
        help="produce a desired collection (updates and progress) from JSON lines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topic", required=True, help="the desired topic")
    p.add_argument("--schema", required=True, help="the row schema, an Avro record .avsc file")
    p.add_argument(
        "--bootstrap", default=None, help="host:port (default $SHARDSINK_KAFKA_BOOTSTRAP)"
    )
    p.add_argument("--input", default="-", help="JSON lines or CSV file (default stdin)")
    p.add_argument("--format", choices=("jsonl", "csv"), default="jsonl", help="input format (default jsonl)")
    p.add_argument("--time-column", default="time", help="CSV: the time column (default time)")
    p.add_argument("--diff-column", default="diff", help="CSV: the diff column (default diff; absent: 1)")
    p.add_argument("--advance-to", default=None, metavar="T|closed", help="send progress T after the input")
    p.add_argument(
        "--partitions", type=int, default=None, help="create the topic with N partitions if missing"
    )
    p.add_argument(
        "--kafka-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a librdkafka option (repeatable), e.g. security.protocol=SASL_SSL",
    )
    p.set_defaults(func=_produce)


def parse_lines(lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """``("update", (row, time, diff))`` or ``("progress", t_or_None)`` per non-blank line."""
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
            yield "progress", t
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
            yield "update", (obj["row"], time, diff)
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
    for n, record in enumerate(reader, start=2):
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
        yield "update", (row, time, diff)


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
    if getattr(args, "format", "jsonl") == "csv":
        return parse_csv(stream, json.loads(schema_text), time_column=args.time_column, diff_column=args.diff_column)
    return parse_lines(stream)


def _produce(args: argparse.Namespace) -> int:
    import os

    from shardsink.cli.main import print_json
    from shared.io.desired_producer import DesiredProducer
    from shared.io.kafka import KafkaSettings, env_options
    from shared.io.kafka_admin import ensure_topic

    options = env_options(os.environ)
    for item in args.kafka_option:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise KafkaConfigError(f"expected --kafka-option NAME=VALUE, found {item!r}")
        options[name] = value
    bootstrap = args.bootstrap or os.environ.get("SHARDSINK_KAFKA_BOOTSTRAP", "")
    settings = KafkaSettings.of(bootstrap, options)
    from shardsink.cli.util import ProgressBar, load_schema

    schema = json.dumps(load_schema(args.schema))
    advance, advance_to = parse_advance(args.advance_to)
    if args.partitions is not None:
        ensure_topic(settings, args.topic, args.partitions)
    with contextlib.ExitStack() as stack:
        stream: IO[str] = (
            sys.stdin
            if args.input == "-"
            else stack.enter_context(open(args.input, encoding="utf-8", newline=""))
        )
        producer = stack.enter_context(DesiredProducer(settings, args.topic, schema))
        bar = stack.enter_context(ProgressBar(f"produce {args.topic}", unit="updates"))
        for kind, payload in read_input(args, stream, schema):
            if kind == "update":
                row, time, diff = payload
                producer.send(row, time, diff)
                bar.update()
            else:
                producer.advance_to(payload)
        if advance:
            producer.advance_to(advance_to)
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
