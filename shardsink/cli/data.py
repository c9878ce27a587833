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
upper is where the previous chunk left it): the updates of the input (JSON lines or CSV, as
for ``produce``) up to each progress line (``--advance-to`` after the last one; without
either, the upper goes to the largest time + 1), split into chunks of ``--chunk-rows``.

``peek`` sends ``Peek`` and prints the (row, count) pairs it answers, inline or from the
S3 Parquet object the answer names. ``tail`` sends ``Subscribe`` with a fresh output topic
(``--topic`` to name one), prints each change as ``time<TAB>diff<TAB>row-json``, each error
row as ``error<TAB>time<TAB>diff<TAB>reason`` and, with ``--progress``, each progress statement as ``progress<TAB>T`` (``progress<TAB>closed`` at the
end). It stops when the subscribe ends (``--up-to`` reached, collection dropped) or on
Ctrl-C, which cancels the subscribe (exit 130).

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
from collections.abc import Iterator, Sequence
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
from shared.errors import InvalidUsageError


def register(sub: Any) -> None:
    from shardsink.cli.produce import add_input_args

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("append", help="append updates to a collection through the controller (table writes)",
                       description=_APPEND, formatter_class=fmt)
    p.add_argument("collection_id", help="the collection to append to")
    add_input_args(p)
    p.add_argument("--chunk-rows", type=int, default=5000, help="updates per Append command (default 5000)")
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
    p.add_argument("--topic", default=None, help="the output topic (default: a fresh one, left on the broker at the end)")
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

The input is JSON lines or CSV, as for produce. The updates up to each progress line
(--advance-to after the last one; without either, the upper goes to the largest time + 1)
are sent in chunks of --chunk-rows, each committed iff the upper is where the previous
chunk left it. All or nothing on the CLI's side: the whole input is checked (JSON, schema,
times not below the collection's upper) before anything is sent."""

_PEEK = """\
Print a collection's (row, count) pairs as of a time, sorted by row, as a table, CSV or
Parquet. The controller answers inline or with an S3 Parquet object, read from there."""

_TAIL = """\
Subscribe to a collection and print each change as time<TAB>diff<TAB>row-json, like kcat;
each error row (an update the sink could not write as a row) as error<TAB>time<TAB>diff<TAB>reason;
with --progress also progress<TAB>T lines (progress<TAB>closed at the end).

The subscribe writes to a fresh output topic (--topic to name one), left on the broker at the
end (deleted when the controller refused the subscribe). It
stops when the subscribe ends (--up-to reached, collection dropped) or on Ctrl-C, which
cancels the subscribe (exit 130)."""

_STATUS = """\
Print upper, since, lag, batches, rows, error rows and bytes of every live collection, read from the
catalog and the shards on S3 directly (no controller needed; nothing is created).

lag is the desired frontier of the collection's sinks (the last progress statement of every
partition of the desired topic, among its last --lag-window messages) minus the upper, in
time units; - when there is no sink or no progress statement was found. The upper is not
compared with the wall clock: times are the producer's, not necessarily milliseconds."""


# ==================================================================================================
# append
# ==================================================================================================
def chunk_updates(
    updates: Sequence[tuple[Any, int, int]], new_upper: int | None, chunk_rows: int
) -> Iterator[tuple[list[tuple[Any, int, int]], int | None]]:
    """Updates sorted by time in chunks of about ``chunk_rows`` cut at time boundaries, each
    with the upper after it (the next chunk's first time; ``new_upper`` after the last)."""
    ordered = sorted(updates, key=lambda u: u[1])
    chunks: list[list[tuple[Any, int, int]]] = []
    cur: list[tuple[Any, int, int]] = []
    for u in ordered:
        if len(cur) >= chunk_rows and u[1] != cur[-1][1]:
            chunks.append(cur)
            cur = []
        cur.append(u)
    chunks.append(cur)
    for i, c in enumerate(chunks):
        yield c, (chunks[i + 1][0][1] if i + 1 < len(chunks) else new_upper)


def _append(args: argparse.Namespace) -> int:
    """Two passes over the input: check all of it, then send it in chunks."""
    import contextlib

    from shardsink.cli.produce import check_input, encode_row, open_input, parse_advance, read_numbered
    from shared.errors import ContractViolationError, EncodeError
    from shared.shard import Shard

    if args.chunk_rows < 1:
        raise InvalidUsageError(f"expected --chunk-rows >= 1, found {args.chunk_rows}")
    s = settings(args)
    codec = row_codec(s, args.collection_id)
    schema = json.dumps(codec.schema)
    advance, advance_to = parse_advance(args.advance_to)
    sent = appends = 0
    upper: Any = None
    with contextlib.ExitStack() as stack:
        stream = open_input(args.input, stack)
        current = Shard.open(s.store(), args.collection_id).refresh().upper
        try:  # 1. check everything; nothing is sent yet
            checked = check_input(read_numbered(args, stream, schema), codec, current,
                                  advance=(advance, advance_to),
                                  what=f"the upper of collection {args.collection_id!r} (or a progress line)")
        except (EncodeError, ContractViolationError) as e:
            raise type(e)(f"{e}; nothing was appended to {args.collection_id!r}", **e.fields) from None
        stream.seek(0)
        session = stack.enter_context(ControllerSession(args))
        bar = stack.enter_context(ProgressBar(f"append {args.collection_id}", checked.updates, unit="updates"))
        pending: list[tuple[bytes, int, int]] = []

        def flush(new_upper: int | None) -> None:
            nonlocal sent, appends, upper
            for chunk, up in chunk_updates(pending, new_upper, args.chunk_rows):
                body = {
                    "collection_id": args.collection_id,
                    "updates": [{"row": r, "time": t, "diff": d} for r, t, d in chunk],
                    "expected_upper": upper,
                    "new_upper": up,
                }
                upper = results(session.call("Append", body)).get("upper")
                sent += len(chunk)
                appends += 1
                bar.update(len(chunk))
            pending.clear()

        for n, kind, payload in read_numbered(args, stream, schema):  # 2. send, chunk by chunk
            if kind == "update":
                row, t, d = payload
                pending.append((encode_row(codec, row, n), t, d))
            else:
                flush(payload)
        if advance:
            flush(advance_to)
        elif pending:
            flush(max(t for _, t, _ in pending) + 1)
    print_json({"collection": args.collection_id, "updates": sent, "appends": appends, "upper": upper})
    return 0


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
    from shared.io.client import _sorted_by_row

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
    table = _sorted_by_row(table, [f["name"] for f in codec.schema.get("fields", [])])
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
        return json.dumps(v, default=str, sort_keys=True)
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
    fresh = args.topic is None
    topic = args.topic or f"shardsink-tail-{args.collection_id}-{uuid.uuid4().hex[:12]}"
    ensure_topic(s.kafka, topic, 1)
    with OffsetProbe(s.kafka) as probe:
        start = 0 if fresh else probe.ends([(topic, 0)])[(topic, 0)]
    sub_codec = message_codec("subscribe_output")
    consumer = new_consumer(s.kafka, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "50"})
    consumer.assign([TopicPartition(topic, 0, start)])
    session = ControllerSession(args)
    sid: str | None = None
    done = acked = False
    try:
        sid = session.send("Subscribe", {
            "collection_id": args.collection_id, "output_topic": topic, "as_of": args.as_of,
            "up_to": args.up_to, "with_snapshot": not args.no_snapshot,
        })
        session.wait(sid, "Subscribe")
        acked = True
        codec = row_codec(s, args.collection_id)
        out = sys.stdout
        while not done:
            for m in consumer.consume(num_messages=1000, timeout=0.2):
                if m.error() is not None:
                    continue
                msg = sub_codec.decode(m.value() or b"")
                if msg["subscribe_id"] != sid:
                    continue
                if msg["progressed"]:
                    if msg["time"] is None:
                        done = True
                    if args.progress:
                        out.write(f"progress\t{'closed' if msg['time'] is None else msg['time']}\n")
                elif msg.get("error") is not None:  # an error row: no row, the reason instead
                    reason = " ".join(str(msg["error"]).split())  # one line, whatever it holds
                    out.write(f"error\t{msg['time']}\t{msg['diff']}\t{reason}\n")
                else:
                    row = json.dumps(codec.decode(msg["row"]), default=_json_default, sort_keys=False)
                    out.write(f"{msg['time']}\t{msg['diff']}\t{row}\n")
                if done:
                    break
            out.flush()
    except KeyboardInterrupt:
        if sid is not None:
            _cancel(session, sid)
        raise
    finally:
        consumer.close()
        session.close()
        # A fresh topic the controller never wrote to (the subscribe was refused) is deleted.
        # One it wrote to is left: the controller's producer has it in its metadata cache,
        # and on the embedded broker (Tansu) deleting a topic a live client has cached makes
        # librdkafka crash that client (a NULL topic name in the next metadata update).
        if fresh and not acked:
            _delete_topic(s.kafka, topic)
        elif fresh:
            print(f"output topic {topic} left on the broker", file=sys.stderr)
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
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


def sink_quarantines(s: Any, sinks: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """The desired ranges each sink's writer quarantined (its current epoch)."""
    from shared.catalog import sink_quarantine

    out = {}
    for k in sinks:
        q = sink_quarantine(s.store(), k.sink_id, k.epoch)
        if q:
            out[k.sink_id] = q
    return out


def collection_status(s: Any, lag_window: int = 1000) -> list[dict[str, Any]]:
    """One dict per live collection (see the module docstring)."""
    from shared.errors import ShardsinkError
    from shared.shard import Shard

    from shardsink.cli.common import read_catalog

    state = read_catalog(s).state()
    out = []
    cols = state.live_collections()
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
            desired = [desired_frontier(s.kafka, k.desired_topic, lag_window) for k in sinks]
            known = [f for f in desired if f is not None]
            if sinks and len(known) == len(desired):
                furthest = max(known, key=lambda f: (f.is_empty(), f.time or 0))
                if furthest.is_empty():
                    lag = 0 if st.upper.is_empty() else None
                elif not st.upper.is_empty():
                    lag = max(0, (furthest.time or 0) - (st.upper.time or 0))
            health = sink_refusals(s, sinks)
            if health:
                entry["refusing"] = health
            quarantined = sink_quarantines(s, sinks)
            if quarantined:
                entry["quarantined"] = quarantined
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
    for r in rows:
        if r.get("errors"):
            print(f"warning: {r['collection']} holds {r['errors']} error rows (updates the sink could not "
                  f"write as rows; read them with snapshot(include_errors=True) or tail)", file=sys.stderr)
        for sid, msg in r.get("refusing", {}).items():
            print(f"error: sink {sid} refuses to write: {msg}", file=sys.stderr)
        for sid, ranges in r.get("quarantined", {}).items():
            offsets = sum(int(q["end"]) - int(q["start"]) for q in ranges)
            parts = ", ".join(f"{q['topic']}/{q['partition']}@[{q['start']},{q['end']})" for q in ranges)
            print(
                f"warning: sink {sid} quarantined {offsets} desired offsets to the error collection "
                f"after repeated write failures ({ranges[-1]['reason']}): {parts}",
                file=sys.stderr,
            )
    return 0
