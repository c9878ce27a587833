"""``shardsink produce``: write a desired collection to its topic from JSON lines.

Each input line is one JSON object, either an update or a progress statement::

    {"row": {"id": 1, "name": "a"}, "time": 5, "diff": 1}     # diff defaults to 1
    {"progress": 6}                                          # null: the empty frontier

Rows are encoded with the Avro record schema of ``--schema`` (so JSON values must be what
fastavro accepts for each field: numbers, strings, booleans, lists, objects; fields of type
``bytes``/``fixed`` cannot be given in JSON). Updates are hashed to partitions; a progress
line flushes the updates and then sends the frontier to every partition. Blank lines are
skipped. The last line printed is a JSON summary::

    {"frontier": 6, "partitions": 4, "progress": 4, "topic": "desired-orders", "updates": 2}

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
    p.add_argument("--input", default="-", help="JSON lines file (default stdin)")
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


def _produce(args: argparse.Namespace) -> int:
    import os

    from shared.cli import print_json
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
    with open(args.schema, encoding="utf-8") as f:
        schema = f.read()
    if args.partitions is not None:
        ensure_topic(settings, args.topic, args.partitions)
    with contextlib.ExitStack() as stack:
        stream: IO[str] = (
            sys.stdin
            if args.input == "-"
            else stack.enter_context(open(args.input, encoding="utf-8"))
        )
        producer = stack.enter_context(DesiredProducer(settings, args.topic, schema))
        for kind, payload in parse_lines(stream):
            if kind == "update":
                row, time, diff = payload
                producer.send(row, time, diff)
            else:
                producer.advance_to(payload)
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
