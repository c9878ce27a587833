"""``shardsink append | peek | tail | status``: write, read and watch collections.

::

    shardsink append orders --input updates.jsonl            # table writes via the controller
    shardsink append orders --format csv --input rows.csv --advance-to 10
    shardsink peek orders --as-of 5 [--limit 100]            # a table on stdout
    shardsink peek orders --as-of 5 --output parquet --file orders.parquet
    shardsink peek orders --output csv --file orders.csv     # as of the latest readable time
    shardsink tail orders --as-of 5 --up-to 20 --progress    # like kcat: time<TAB>diff<TAB>row
    shardsink status                                          # every collection

``append`` sends the controller's ``Append`` command (a table write that commits iff the
upper is the one the input was checked against) with the whole input (JSON lines or CSV, as
for ``produce``); the upper goes to ``--advance-to``, else past the largest time after the
last progress line, else to the last progress line. An input of more than ``--chunk-rows``
updates is staged first as data objects of the shard (``--chunk-rows`` updates each), which
the one command names: it lands whole or not at all, and a failed append deletes them.

``peek`` sends ``Peek`` and prints the (row, count) pairs it answers, inline or from the
S3 Parquet object the answer names. ``tail`` sends ``Subscribe`` with a fresh output topic
(``--topic`` to name one), prints each change as ``time<TAB>diff<TAB>row-json``, each error
row as ``error<TAB>time<TAB>diff<TAB>reason`` and, with ``--progress``, each progress statement as ``progress<TAB>T`` (``progress<TAB>closed`` at the
end). It stops when the subscribe ends (``--up-to`` reached, collection dropped) or on
Ctrl-C, which cancels the subscribe (exit 130); then it deletes its fresh output topic, once
it has read the subscribe's final progress statement (the controller writes nothing after it).

``status`` reads the catalog and the shards on S3 directly (no controller needed): upper,
since, lag, batches, rows, error rows and bytes per live collection. *lag* is the desired frontier of the
collection's sinks (the last progress statement of every partition of the desired topic,
looked for in the last ``--lag-window`` messages of each partition) minus the upper, in time
units; ``-`` when the collection has no sink or no progress statement was found. The upper is
not compared with the wall clock: times are the producer's, not necessarily milliseconds.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
import uuid
from collections.abc import Sequence
from typing import IO, Any

import pyarrow as pa

from shardsink.cli.common import (
    ControllerSession,
    ProgressBar,
    add_connection_args,
    print_json,
    results,
    row_codec,
    settings,
)
from shared.errors import CommandError, InvalidUsageError


def register(sub: Any) -> None:
    from shardsink.cli.produce import add_input_args

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("append", help="append updates to a collection through the controller (table writes)",
                       description=_APPEND, formatter_class=fmt)
    p.add_argument("collection_id", help="the collection to append to")
    add_input_args(p)
    p.add_argument("--chunk-rows", type=int, default=5000, help="updates sent inline in the command; a larger input is staged in data objects of this many (default 5000)")
    add_connection_args(p)
    p.set_defaults(func=_append)

    p = sub.add_parser("peek", help="read a collection as of a time (through the controller)",
                       description=_PEEK, formatter_class=fmt)
    p.add_argument("collection_id", help="the collection to read")
    p.add_argument("--as-of", type=int, default=None, help="the time to read at (default: the latest readable)")
    p.add_argument("--limit", type=int, default=None, help="print at most N (row, count) pairs, in row order")
    p.add_argument("--output", choices=("table", "csv", "parquet"), default="table",
                   help="the output format (default table)")
    p.add_argument("--file", default=None, help="write to this file (required for parquet; default stdout)")
    p.add_argument("--max-inline-bytes", type=int, default=None,
                   help="answer inline up to this size, else as an S3 object (default: the controller's)")
    add_connection_args(p)
    p.set_defaults(func=_peek)

    p = sub.add_parser("tail", help="subscribe to a collection and print its changes (like kcat)",
                       description=_TAIL, formatter_class=fmt)
    p.add_argument("collection_id", help="the collection to subscribe to")
    p.add_argument("--as-of", type=int, default=None, help="the snapshot time (default: the collection's since)")
    p.add_argument("--up-to", type=int, default=None, help="stop before this time (default: never)")
    p.add_argument("--progress", action="store_true", help="print progress statements too")
    p.add_argument("--no-snapshot", action="store_true", help="only the changes after --as-of, no snapshot")
    p.add_argument("--topic", default=None, help="the output topic, left at the end (default: a fresh one, deleted at the end)")
    add_connection_args(p)
    p.set_defaults(func=_tail)

    p = sub.add_parser("status", help="every collection: upper, since, lag, batches, rows, errors, bytes",
                       description=_STATUS, formatter_class=fmt)
    p.add_argument("--output", choices=("table", "json"), default="table", help="the output format (default table)")
    p.add_argument("--lag-window", type=int, default=1000,
                   help="messages per desired partition read to find the lag (default 1000)")
    add_connection_args(p, controller=False)
    p.set_defaults(func=_status)


_APPEND = """\
Append updates to a collection with the controller's Append command (table writes, no sink).

The input is JSON lines or CSV, as for produce. The upper goes to --advance-to, else past
the largest time after the last progress line, else to the last progress line.

All or nothing: the whole input is checked first (JSON, schema, times not below the
collection's upper), then committed as one batch, iff the upper is still the one checked.
An input of more than --chunk-rows updates is staged first as data objects of the
collection (--chunk-rows updates each) that one command appends; when the append fails
or is interrupted they are deleted, and nothing is appended."""

_PEEK = """\
Print a collection's (row, count) pairs as of a time, sorted by row, as a table, CSV or
Parquet. The controller answers inline or with an S3 Parquet object, read from there."""

_TAIL = """\
Subscribe to a collection and print each change as time<TAB>diff<TAB>row-json, like kcat;
each error row (an update the sink could not write as a row) as error<TAB>time<TAB>diff<TAB>reason;
with --progress also progress<TAB>T lines (progress<TAB>closed at the end).

The subscribe writes to a fresh output topic (--topic to name one), deleted at the end (a
topic named with --topic is left). It stops when the subscribe ends (--up-to reached,
collection dropped) or on Ctrl-C, which cancels the subscribe (exit 130)."""

_STATUS = """\
Print upper, since, lag, batches, rows, error rows and bytes of every live collection, read from the
catalog and the shards on S3 directly (no controller needed; nothing is created).

lag is the desired frontier of the collection's sinks (the last progress statement of every
partition of the desired topic, among its last --lag-window messages) minus the upper, in
time units; - when there is no sink or no progress statement was found, or no Kafka broker
can be reached (a warning says so; the rest is shown at once). The upper is not compared
with the wall clock: times are the producer's, not necessarily milliseconds. A sink whose
write micro-batch keeps failing on its input, or whose writer quarantined input, is warned
of too."""


# ==================================================================================================
# append
# ==================================================================================================
class _Final:
    """Pass 2's view of where the input leaves the upper: ``--advance-to``; else the largest
    time after the last progress line + 1; else the last progress line; else unchanged."""

    def __init__(self) -> None:
        self.progress_seen = False
        self.progress: int | None = None
        self.trailing_max: int | None = None

    def update(self, t: int) -> None:
        self.trailing_max = t if self.trailing_max is None else max(self.trailing_max, t)

    def advance(self, t: int | None) -> None:
        self.progress_seen, self.progress, self.trailing_max = True, t, None

    def upper(self, advance: bool, advance_to: int | None) -> tuple[bool, int | None]:
        """``(changes, new upper)``: whether the input moves the upper, and to what (None:
        closed)."""
        if advance:
            return True, advance_to
        if self.trailing_max is not None:
            return True, self.trailing_max + 1
        return self.progress_seen, self.progress


def _append(args: argparse.Namespace) -> int:
    """Two passes over the input: check all of it, then send it as one ``Append``: inline when
    it fits one command (``--chunk-rows``), else staged first as data objects of the shard,
    ``--chunk-rows`` updates each, and named in the command. The controller commits them as
    one batch, so the input lands whole or not at all; when the append fails (refused,
    interrupted, a staging error) the staged objects are deleted again, and the error says
    nothing was appended. Only an answer that never came leaves the outcome open: the objects
    are then either appended or collected after the grace period."""
    import contextlib

    from shardsink.cli.produce import check_input, encode_row, open_input, parse_advance, read_numbered
    from shared.errors import ContractViolationError, EncodeError, ShardsinkError
    from shared.shard import Shard, StagedBatch

    if args.chunk_rows < 1:
        raise InvalidUsageError(f"expected --chunk-rows >= 1, found {args.chunk_rows}")
    s = settings(args)
    cid = args.collection_id
    codec = row_codec(s, cid)
    schema = json.dumps(codec.schema)
    advance, advance_to = parse_advance(args.advance_to)
    nothing = f"nothing was appended to {cid!r}"
    with contextlib.ExitStack() as stack:
        stream = open_input(args.input, stack)
        shard = Shard.open(s.store(), cid)
        current = shard.refresh().upper
        try:  # 1. check everything; nothing is sent yet
            checked = check_input(read_numbered(args, stream, schema), codec, current, advance=(advance, advance_to),
                                  what=f"the upper of collection {cid!r} (or a progress line)")
        except (EncodeError, ContractViolationError) as e:
            raise type(e)(f"{e}; {nothing}", **e.fields) from None
        stream.seek(0)
        session = stack.enter_context(ControllerSession(args))
        inline = checked.updates <= args.chunk_rows
        bar = stack.enter_context(ProgressBar(f"append {cid}", checked.updates, unit="updates"))
        final = _Final()
        pending: list[tuple[bytes, int, int]] = []
        staged: list[StagedBatch] = []
        sent = False
        try:
            # 2. the updates: kept for the command when they fit it, else staged chunk by chunk
            for n, kind, payload in read_numbered(args, stream, schema):
                if kind == "update":
                    row, t, d = payload
                    pending.append((encode_row(codec, row, n), t, d))
                    final.update(t)
                    if not inline and len(pending) >= args.chunk_rows:
                        staged.append(_stage(shard, codec, pending))
                        bar.update(len(pending))
                        pending.clear()
                else:
                    final.advance(payload)
            if staged and pending:
                staged.append(_stage(shard, codec, pending))
                bar.update(len(pending))
                pending.clear()
            changes, new_upper = final.upper(advance, advance_to)
            if not changes and not pending and not staged:
                upper = current.time if not current.is_empty() else None
                print_json({"collection": cid, "updates": 0, "appends": 0, "staged_parts": 0, "upper": upper})
                return 0
            body = {
                "collection_id": cid,
                "updates": [{"row": r, "time": t, "diff": d} for r, t, d in pending],
                "expected_upper": None if current.is_empty() else current.time,
                "new_upper": new_upper,
                "staged_parts": [p.key for b in staged for p in b.parts],
            }
            # 3. one command: the whole input, committed iff the upper is still the one checked
            sent = True
            upper = results(session.wait(session.send("Append", body), "Append")).get("upper")
            bar.update(len(pending))
        except BaseException as e:
            # Refused, interrupted or failed before the command went out: nothing landed, and
            # what was staged goes. A command out without an answer may still land: its
            # objects stay for it (GC collects them if it never does).
            determinate = not sent or isinstance(e, CommandError)
            if determinate and staged:
                with contextlib.suppress(ShardsinkError):
                    shard.delete_staged(staged)
            if isinstance(e, KeyboardInterrupt):
                print(f"interrupted; {nothing}" if determinate else
                      f"interrupted while waiting for the controller: the append of {cid!r} may still land",
                      file=sys.stderr)
                raise
            if isinstance(e, ShardsinkError):
                if determinate and "nothing was appended" in str(e):  # the controller said so
                    raise
                tail = nothing if determinate else (
                    f"the append of {cid!r} may still land (its staged objects are then appended, else "
                    "collected after the grace period)")
                raise type(e)(f"{e}; {tail}", **e.fields) from None
            raise
    parts = sum(len(b.parts) for b in staged)
    print_json({"collection": cid, "updates": checked.updates, "appends": 1, "staged_parts": parts, "upper": upper})
    return 0


def _stage(shard: Any, codec: Any, updates: Sequence[tuple[bytes, int, int]]) -> Any:
    """One chunk of encoded updates as a staged data object of the shard (decoded to Arrow a
    chunk at a time)."""
    from shared.avro_columns import ColumnCodec
    from shared.codec import MARKER
    from shared.errors import EncodeError
    from shared.shard import DIFF, TIME

    header = len(MARKER + codec.fingerprint)
    decoded = ColumnCodec(codec.schema).decode(pa.array([r for r, _, _ in updates], pa.binary()), skip=header)
    if not decoded.ok.all():  # the rows were encoded by the same schema: a bug, not the input
        raise EncodeError(f"expected the encoded rows to decode, found: {next(iter(decoded.errors.values()))}")
    table = decoded.table.append_column(TIME, pa.array([t for _, t, _ in updates], pa.uint64()))
    table = table.append_column(DIFF, pa.array([d for _, _, d in updates], pa.int64()))
    return shard.stage(table)


# ==================================================================================================
# peek
# ==================================================================================================
def peek_table(session: ControllerSession, collection_id: str, *, as_of: int | None = None,
               limit: int | None = None, max_inline_bytes: int | None = None) -> tuple[int, pa.Table, int]:
    """Send a Peek and return ``(as_of, table, total)``: the row columns and ``count``, sorted
    by row (so ``limit`` always keeps the same rows), and how many rows there are in all.

    The controller's own ``limit`` keeps whichever rows its snapshot lists first, so the CLI
    asks for all of them and applies the limit itself after sorting."""

    from shared.avro_arrow import rows_to_arrow
    from shared.shard_sort import sorted_by_row

    if limit is not None and limit < 0:
        raise InvalidUsageError(f"expected --limit >= 0, found {limit}")
    r = session.call("Peek", {"collection_id": collection_id, "as_of": as_of, "limit": None,
                              "max_inline_bytes": max_inline_bytes})
    codec = row_codec(session.settings, collection_id)
    body = r["body"][1]
    kind, res = body["result"]
    if kind.endswith("InlineRows"):
        rows = [codec.decode(rc["row"]) for rc in res["rows"]]
        table = rows_to_arrow(rows, codec.schema)
        table = table.append_column("count", pa.array([int(rc["count"]) for rc in res["rows"]], pa.int64()))
    else:
        table = _stored_rows(session.settings, res)
        table = table.rename_columns(["count" if c == "_diff" else c for c in table.column_names])
    table = sorted_by_row(table, [f["name"] for f in codec.schema.get("fields", [])])
    table = table.cast(_peek_schema(table.schema, codec.schema))
    total = table.num_rows
    if limit is not None:
        table = table.slice(0, limit)
    return int(body["as_of"]), table, total


def _stored_rows(s: Any, res: dict[str, Any]) -> pa.Table:
    """A ``StoredRows`` answer read back: one Parquet object (format ``parquet``), or every
    object under a folder (``parquet-dataset``: a peek the controller ran on Spark, one object
    per row bucket, always with an ``_error`` column, dropped here when no row has one)."""
    import pyarrow.parquet as pq

    from shared.errors import ObjectStoreError

    if res.get("format", "parquet") != "parquet-dataset":
        return pq.read_table(io.BytesIO(_download(s, res["bucket"], res["key"])))
    client = s.store().client
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=res["bucket"], Prefix=res["key"])
        keys = sorted(o["Key"] for page in pages for o in page.get("Contents", []) or [])
    except Exception as e:  # noqa: BLE001 - botocore errors as one of ours
        raise ObjectStoreError(f"expected to list s3://{res['bucket']}/{res['key']}, found {type(e).__name__}: {e}") from e
    table = pa.concat_tables([pq.read_table(io.BytesIO(_download(s, res["bucket"], k))) for k in keys])
    if "_error" in table.column_names and table["_error"].null_count == table.num_rows:
        table = table.drop_columns(["_error"])
    return table


def _peek_schema(have: pa.Schema, row_schema: dict[str, Any]) -> pa.Schema:
    """What a peek prints or writes, whichever way the controller answered (inline rows or an
    S3 object): the row columns as the Python snapshot has them (the collection's Arrow types,
    nullable, as in every data object), ``count`` (the snapshot's ``_diff``: int64, never null)
    and ``_error`` when the answer holds error rows, in the order the answer has them."""
    from shared.avro_arrow import avro_to_arrow_schema
    from shared.shard import DIFF, part_schema

    part = part_schema(avro_to_arrow_schema(row_schema))
    count = pa.field("count", pa.int64(), nullable=False)
    return pa.schema([
        count if name in ("count", DIFF) else part.field(name) if name in part.names else have.field(name)
        for name in have.names
    ])


def _download(s: Any, bucket: str, key: str) -> bytes:
    """An S3 object by its full key (a progress bar for big ones)."""
    from shared.errors import ObjectStoreError

    client = s.store().client
    try:
        resp = client.get_object(Bucket=bucket, Key=key)
        total = int(resp.get("ContentLength") or 0)
        buf = io.BytesIO()
        with ProgressBar("download", total, unit="bytes") as bar:
            for chunk in resp["Body"].iter_chunks(1 << 20):
                buf.write(chunk)
                bar.update(len(chunk))
        return buf.getvalue()
    except Exception as e:  # noqa: BLE001 - botocore errors as one of ours
        raise ObjectStoreError(f"expected to read s3://{bucket}/{key}, found {type(e).__name__}: {e}") from e


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=_json_default, sort_keys=True)
    return str(v)


def format_table(table: pa.Table) -> str:
    """An aligned text table (header, rule, rows)."""
    cols = table.column_names
    rows = [[_cell(v) for v in r.values()] for r in table.to_pylist()]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) for f in table.schema]
    out = [" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
           "-+-".join("-" * w for w in widths)]
    for r in rows:
        out.append(" | ".join((v.rjust(w) if num else v.ljust(w))
                              for v, w, num in zip(r, widths, numeric, strict=True)))
    return "\n".join(out) + "\n"


def write_csv(table: pa.Table, f: IO[str]) -> None:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(table.column_names)
    for r in table.to_pylist():
        w.writerow([_cell(v) for v in r.values()])


def _peek(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    if args.output == "parquet" and not args.file:
        raise InvalidUsageError("expected --file with --output parquet, found none")
    with ControllerSession(args) as session:
        as_of, table, total = peek_table(session, args.collection_id, as_of=args.as_of, limit=args.limit,
                                  max_inline_bytes=args.max_inline_bytes)
    if args.output == "parquet":
        pq.write_table(table, args.file)
    else:
        text = io.StringIO()
        if args.output == "csv":
            write_csv(table, text)
        else:
            text.write(format_table(table))
        if args.file:
            with open(args.file, "w", encoding="utf-8", newline="") as f:
                f.write(text.getvalue())
        else:
            sys.stdout.write(text.getvalue())
            sys.stdout.flush()
    shown = f"{table.num_rows} rows" if table.num_rows == total else f"{table.num_rows} of {total} rows"
    print(f"{shown} of {args.collection_id} as of {as_of}"
          + (f" written to {args.file}" if args.file else ""), file=sys.stderr)
    return 0


# ==================================================================================================
# tail
# ==================================================================================================
def _tail(args: argparse.Namespace) -> int:
    from confluent_kafka import TopicPartition

    from shared.codec import message_codec
    from shared.io.kafka import OffsetProbe, new_consumer
    from shared.io.kafka_admin import ensure_topic

    from shardsink.cli.util import check_brokers

    s = settings(args)
    check_brokers(s.kafka.bootstrap)
    session = ControllerSession(args)  # a controller to answer, before the topic is created
    fresh = args.topic is None
    topic = args.topic or f"shardsink-tail-{args.collection_id}-{uuid.uuid4().hex[:12]}"
    try:
        ensure_topic(s.kafka, topic, 1)
        with OffsetProbe(s.kafka) as probe:
            start = 0 if fresh else probe.ends([(topic, 0)])[(topic, 0)]
    except BaseException:
        session.close()
        raise
    sub_codec = message_codec("subscribe_output")
    consumer = new_consumer(s.kafka, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "50"})
    consumer.assign([TopicPartition(topic, 0, start)])
    sid: str | None = None
    acked = False
    ended = [False]  # the subscribe's final progress statement was read: the controller is done with the topic
    try:
        sid = session.send("Subscribe", {
            "collection_id": args.collection_id, "output_topic": topic, "as_of": args.as_of,
            "up_to": args.up_to, "with_snapshot": not args.no_snapshot,
        })
        session.wait(sid, "Subscribe")
        acked = True
        codec = row_codec(s, args.collection_id)
        _print_subscribe(consumer, sub_codec, codec, sid, args.progress, sys.stdout, ended)
    except KeyboardInterrupt:
        if sid is not None and _cancel(session, sid):
            # Cancelled: the controller ends the subscribe with its final progress statement;
            # read up to it (not printed), so the topic is no longer the controller's to write.
            try:
                _print_subscribe(consumer, sub_codec, None, sid, False, None, ended, timeout_s=10.0)
            except KeyboardInterrupt:
                pass
        raise
    finally:
        consumer.close()
        session.close()
        # A fresh topic goes when the controller will not write it again: it refused the
        # subscribe, or its final progress statement was read. (The controller's producer does
        # not re-create a topic deleted under it.) Otherwise it is left, and named.
        if fresh and (not acked or ended[0]):
            _delete_topic(s.kafka, topic)
        elif fresh:
            print(f"output topic {topic} left on the broker", file=sys.stderr)
    return 0


def _print_subscribe(consumer: Any, sub_codec: Any, codec: Any, sid: str, progress: bool, out: IO[str] | None,
                     ended: list[bool], timeout_s: float | None = None) -> None:
    """Print subscribe ``sid``'s messages (``out`` None: read them only) until its final
    progress statement (``ended[0]`` then True) or ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ended[0] and (deadline is None or time.monotonic() < deadline):
        for m in consumer.consume(num_messages=1000, timeout=0.2):
            if m.error() is not None:
                continue
            msg = sub_codec.decode(m.value() or b"")
            if msg["subscribe_id"] != sid:
                continue
            if msg["progressed"]:
                ended[0] = msg["time"] is None
                if progress and out is not None:
                    out.write(f"progress\t{'closed' if msg['time'] is None else msg['time']}\n")
            elif out is None:
                pass
            elif msg.get("error") is not None:  # an error row: no row, the reason instead
                reason = " ".join(str(msg["error"]).split())  # one line, whatever it holds
                out.write(f"error\t{msg['time']}\t{msg['diff']}\t{reason}\n")
            else:
                row = json.dumps(codec.decode(msg["row"]), default=_json_default, sort_keys=False)
                out.write(f"{msg['time']}\t{msg['diff']}\t{row}\n")
            if ended[0]:
                break
        if out is not None:
            out.flush()


def _json_default(v: Any) -> Any:
    """JSON for what JSON has no type for: bytes as Avro's JSON encoding has them (one code
    point 0-255 per byte, which ``produce`` reads back), the rest (timestamps, decimals,
    uuids) as the text ``produce`` accepts."""
    if isinstance(v, bytes):
        return v.decode("latin-1")
    return str(v)


def _cancel(session: ControllerSession, sid: str) -> bool:
    """Cancel a subscribe (best effort: a second Ctrl-C or a silent controller gives up);
    whether the controller acknowledged it."""
    try:
        session.timeout_s = min(session.timeout_s, 10.0)
        session.call("CancelSubscribe", {"subscribe_command_id": sid})
        print(f"cancelled subscribe {sid}", file=sys.stderr)
        return True
    except BaseException as e:  # noqa: BLE001 - already interrupted: report, never mask
        print(f"error: could not cancel subscribe {sid}: {e}", file=sys.stderr)
        return False


def _delete_topic(kafka: Any, topic: str) -> None:
    """Delete the tail's own output topic; a failure is one warning line, never an error."""
    try:
        from shared.io.kafka_admin import admin_client

        admin = admin_client(kafka)  # held until the answer: a collected client fails its futures
        futures = admin.delete_topics([topic], operation_timeout=10, request_timeout=10)
        futures[topic].result(timeout=10)
        del admin
    except Exception as e:  # noqa: BLE001 - the output was printed: report, do not fail
        print(f"warning: could not delete the output topic {topic!r}: {' '.join(str(e).split())}", file=sys.stderr)


# ==================================================================================================
# status
# ==================================================================================================
def desired_frontier(kafka: Any, topic: str, window: int = 1000, timeout_s: float = 10.0) -> Any:
    """The desired frontier of ``topic``: the least of every partition's last progress
    statement among its last ``window`` messages; None when unknown (no topic, a partition
    without a progress statement in the window)."""
    from confluent_kafka import TopicPartition

    from shared.desired import DesiredProgress, decode_desired
    from shared.errors import DecodeError, ShardsinkError
    from shared.frontier import Frontier
    from shared.io.kafka import OffsetProbe, new_consumer

    try:
        with OffsetProbe(kafka) as probe:
            starts = probe.start_offsets(topic)
            ends = probe.end_offsets(topic)
    except ShardsinkError:
        return None
    last: dict[int, Frontier] = {}
    todo = {p: e for p, e in ends.items() if e > starts.get(p, 0)}
    if len(todo) < len(ends):
        return None  # an empty partition has no progress statement
    c = new_consumer(kafka, **{"auto.offset.reset": "earliest"})
    try:
        c.assign([TopicPartition(topic, p, max(starts.get(p, 0), e - window)) for p, e in todo.items()])
        deadline = time.monotonic() + timeout_s
        pos = {p: 0 for p in todo}
        while any(pos[p] < e for p, e in todo.items()) and time.monotonic() < deadline:
            for m in c.consume(num_messages=1000, timeout=0.2):
                if m.error() is not None:
                    continue
                p = int(m.partition() or 0)
                pos[p] = max(pos[p], int(m.offset() or 0) + 1)
                try:
                    d = decode_desired(m.value() or b"")
                except DecodeError:
                    continue
                if isinstance(d, DesiredProgress):
                    last[p] = d.frontier
    finally:
        c.close()
    if set(last) != set(ends):
        return None
    out = Frontier.empty()
    for f in last.values():
        out = out.meet(f)
    return out


def sink_refusals(s: Any, sinks: list[Any]) -> dict[str, str]:
    """The sinks whose writer refuses to write (their current epoch), with its reason."""
    from shared.catalog import sink_health

    out = {}
    for k in sinks:
        h = sink_health(s.store(), k.sink_id)
        if h is not None and h.get("state") == "refusing" and h.get("epoch") == k.epoch:
            out[k.sink_id] = str(h.get("message", ""))
    return out


def sink_quarantines(s: Any, sinks: list[Any]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Per sink (its current epoch): the desired ranges its writer quarantined, and the write
    micro-batch failing on its input now (not quarantined yet)."""
    from shared.catalog import quarantine_record

    ranges, failing = {}, {}
    for k in sinks:
        record = quarantine_record(s.store(), k.sink_id, k.epoch)
        if record["ranges"]:
            ranges[k.sink_id] = record["ranges"]
        if record["failing"]:
            failing[k.sink_id] = record["failing"]
    return ranges, failing


def collection_status(s: Any, lag_window: int = 1000) -> list[dict[str, Any]]:
    """One dict per live collection (see the module docstring)."""
    from shared.errors import ShardsinkError
    from shared.shard import Shard

    from shardsink.cli.common import read_catalog

    state = read_catalog(s).state()
    out = []
    cols = state.live_collections()
    kafka_down: str | None = None  # the lag needs Kafka: without it, say so once and show none
    if any(state.live_sinks(c.collection_id) for c in cols):
        from shared.errors import KafkaUnavailableError

        from shardsink.cli.util import check_brokers

        try:
            check_brokers(s.kafka.bootstrap)
        except KafkaUnavailableError as e:
            kafka_down = str(e)
    with ProgressBar("status", len(cols), unit="collections") as bar:
        for c in cols:
            entry: dict[str, Any] = {"collection": c.collection_id}
            sinks = [k for k in state.live_sinks() if k.collection_id == c.collection_id]
            entry["sinks"] = [k.sink_id for k in sinks]
            try:
                st = Shard.open(s.store(), c.collection_id).refresh()
            except ShardsinkError as e:
                entry["error"] = str(e)
                out.append(entry)
                bar.update()
                continue
            lag = None
            desired = [] if kafka_down else [desired_frontier(s.kafka, k.desired_topic, lag_window) for k in sinks]
            known = [f for f in desired if f is not None]
            if sinks and not kafka_down and len(known) == len(desired):
                furthest = max(known, key=lambda f: (f.is_empty(), f.time or 0))
                if furthest.is_empty():
                    lag = 0 if st.upper.is_empty() else None
                elif not st.upper.is_empty():
                    lag = max(0, (furthest.time or 0) - (st.upper.time or 0))
            health = sink_refusals(s, sinks)
            if health:
                entry["refusing"] = health
            quarantined, failing = sink_quarantines(s, sinks)
            if quarantined:
                entry["quarantined"] = quarantined
            if failing:
                entry["failing"] = failing
            if sinks and kafka_down:
                entry["lag_unknown"] = kafka_down
            entry.update({
                "upper": st.upper.to_json(),
                "since": st.since.to_json(),
                "lag": lag,
                "batches": len(st.batches),
                "rows": st.total_rows(),
                "errors": st.total_errors(),
                "bytes": st.total_bytes(),
            })
            out.append(entry)
            bar.update()
    return out


def _status(args: argparse.Namespace) -> int:
    rows = collection_status(settings(args), args.lag_window)
    if args.output == "json":
        for r in rows:
            print_json(r)
        return 0
    cols = ["collection", "upper", "since", "lag", "batches", "rows", "errors", "bytes", "sinks"]

    def show(r: dict[str, Any], c: str) -> Any:
        v = r.get(c)
        if c in ("upper", "since") and c in r and v is None:
            return "closed"
        if c == "sinks":
            return ",".join(v or []) or "-"
        return "-" if v is None else v

    table = pa.table({c: [_cell(show(r, c)) for r in rows] for c in cols})
    sys.stdout.write(format_table(table))
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"warning: {r['collection']}: {r['error']}", file=sys.stderr)
    down = next((r["lag_unknown"] for r in rows if r.get("lag_unknown")), None)
    if down:
        print(f"warning: no lag shown: {down}", file=sys.stderr)
    for r in rows:
        if r.get("errors"):
            print(f"warning: {r['collection']} holds {r['errors']} error rows (updates the sink could not "
                  f"write as rows; read them with snapshot(include_errors=True) or tail)", file=sys.stderr)
        for sid, msg in r.get("refusing", {}).items():
            print(f"error: sink {sid} refuses to write: {msg}", file=sys.stderr)
        for sid, f in r.get("failing", {}).items():
            print(f"warning: sink {sid}: write micro-batch {f['batch_id']} failed {f['failures']} time(s) on its input "
                  f"({f['reason']}); retried, and quarantined to the error collection if it keeps failing",
                  file=sys.stderr)
        for sid, ranges in r.get("quarantined", {}).items():
            offsets = sum(int(q["end"]) - int(q["start"]) for q in ranges)
            parts = ", ".join(f"{q['topic']}/{q['partition']}@[{q['start']},{q['end']})" for q in ranges)
            print(
                f"warning: sink {sid} quarantined {offsets} desired offsets to the error collection "
                f"after repeated write failures ({ranges[-1]['reason']}): {parts}",
                file=sys.stderr,
            )
    return 0
