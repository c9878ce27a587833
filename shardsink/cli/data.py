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
(``--topic`` to name one), prints each change as ``time<TAB>diff<TAB>row-json`` and, with
``--progress``, each progress statement as ``progress<TAB>T`` (``progress<TAB>closed`` at the
end). It stops when the subscribe ends (``--up-to`` reached, collection dropped) or on
Ctrl-C, which cancels the subscribe (exit 130).

``status`` reads the catalog and the shards on S3 directly (no controller needed): upper,
since, lag, batches, rows and bytes per live collection. *lag* is the desired frontier of the
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
    p = sub.add_parser("append", help="append updates to a collection through the controller (table writes)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collection_id")
    p.add_argument("--input", default="-", help="JSON lines or CSV file (default stdin)")
    p.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    p.add_argument("--time-column", default="time")
    p.add_argument("--diff-column", default="diff")
    p.add_argument("--advance-to", default=None, metavar="T|closed", help="the upper after the last update")
    p.add_argument("--chunk-rows", type=int, default=5000, help="updates per Append command (default 5000)")
    add_connection_args(p)
    p.set_defaults(func=_append)

    p = sub.add_parser("peek", help="read a collection as of a time (through the controller)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collection_id")
    p.add_argument("--as-of", type=int, default=None, help="the time (default: the latest readable)")
    p.add_argument("--limit", type=int, default=None, help="at most N (row, count) pairs")
    p.add_argument("--output", choices=("table", "csv", "parquet"), default="table")
    p.add_argument("--file", default=None, help="write to this file (required for parquet; default stdout)")
    p.add_argument("--max-inline-bytes", type=int, default=None, help="answer inline up to this size")
    add_connection_args(p)
    p.set_defaults(func=_peek)

    p = sub.add_parser("tail", help="subscribe to a collection and print its changes (like kcat)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collection_id")
    p.add_argument("--as-of", type=int, default=None, help="the snapshot time (default: the collection's since)")
    p.add_argument("--up-to", type=int, default=None, help="stop before this time (default: never)")
    p.add_argument("--progress", action="store_true", help="print progress statements too")
    p.add_argument("--no-snapshot", action="store_true", help="only the changes after --as-of")
    p.add_argument("--topic", default=None, help="the output topic (default: a fresh one, deleted at the end)")
    add_connection_args(p)
    p.set_defaults(func=_tail)

    p = sub.add_parser("status", help="every collection: upper, since, lag, batches, rows, bytes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", choices=("table", "json"), default="table")
    p.add_argument("--lag-window", type=int, default=1000, help="messages per desired partition read for the lag")
    add_connection_args(p, controller=False)
    p.set_defaults(func=_status)


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
    import contextlib

    from shardsink.cli.produce import parse_advance, read_input

    if args.chunk_rows < 1:
        raise InvalidUsageError(f"expected --chunk-rows >= 1, found {args.chunk_rows}")
    s = settings(args)
    codec = row_codec(s, args.collection_id)
    advance, advance_to = parse_advance(args.advance_to)
    sent = appends = 0
    upper: Any = None
    with contextlib.ExitStack() as stack:
        stream: IO[str] = (
            sys.stdin if args.input == "-" else stack.enter_context(open(args.input, encoding="utf-8", newline=""))
        )
        session = stack.enter_context(ControllerSession(args))
        bar = stack.enter_context(ProgressBar(f"append {args.collection_id}", unit="updates"))
        pending: list[tuple[Any, int, int]] = []

        def flush(new_upper: int | None) -> None:
            nonlocal sent, appends, upper
            for chunk, up in chunk_updates(pending, new_upper, args.chunk_rows):
                body = {
                    "collection_id": args.collection_id,
                    "updates": [{"row": codec.encode(r), "time": t, "diff": d} for r, t, d in chunk],
                    "expected_upper": upper,
                    "new_upper": up,
                }
                upper = results(session.call("Append", body)).get("upper")
                sent += len(chunk)
                appends += 1
                bar.update(len(chunk))
            pending.clear()

        for kind, payload in read_input(args, stream, json.dumps(codec.schema)):
            if kind == "update":
                pending.append(payload)
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
               limit: int | None = None, max_inline_bytes: int | None = None) -> tuple[int, pa.Table]:
    """Send a Peek and return ``(as_of, table)``: the row columns and ``count``."""
    import pyarrow.parquet as pq

    from shared.avro_arrow import rows_to_arrow

    if limit is not None and limit < 0:
        raise InvalidUsageError(f"expected --limit >= 0, found {limit}")
    r = session.call("Peek", {"collection_id": collection_id, "as_of": as_of, "limit": limit,
                              "max_inline_bytes": max_inline_bytes})
    codec = row_codec(session.settings, collection_id)
    body = r["body"][1]
    kind, res = body["result"]
    if kind.endswith("InlineRows"):
        rows = [codec.decode(rc["row"]) for rc in res["rows"]]
        table = rows_to_arrow(rows, codec.schema)
        table = table.append_column("count", pa.array([int(rc["count"]) for rc in res["rows"]], pa.int64()))
    else:
        data = _download(session.settings, res["bucket"], res["key"])
        table = pq.read_table(io.BytesIO(data))
        table = table.rename_columns(["count" if c == "_diff" else c for c in table.column_names])
    return int(body["as_of"]), table


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
        as_of, table = peek_table(session, args.collection_id, as_of=args.as_of, limit=args.limit,
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
    print(f"{table.num_rows} rows of {args.collection_id} as of {as_of}"
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

    s = settings(args)
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
        if fresh and (done or not acked):  # never while the controller may still write to it
            _delete_topic(s.kafka, topic)
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    return str(v)


def _cancel(session: ControllerSession, sid: str) -> None:
    """Cancel a subscribe (best effort: a second Ctrl-C or a silent controller gives up)."""
    try:
        session.timeout_s = min(session.timeout_s, 10.0)
        session.call("CancelSubscribe", {"subscribe_command_id": sid})
        print(f"cancelled subscribe {sid}", file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - already interrupted: report, never mask
        print(f"error: could not cancel subscribe {sid}: {e}", file=sys.stderr)


def _delete_topic(kafka: Any, topic: str) -> None:
    try:
        from shared.io.kafka_admin import admin_client

        futures = admin_client(kafka).delete_topics([topic], operation_timeout=10, request_timeout=10)
        futures[topic].result(timeout=10)
    except Exception:  # noqa: BLE001 - a left-over output topic is harmless
        pass


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


def collection_status(s: Any, lag_window: int = 1000) -> list[dict[str, Any]]:
    """One dict per live collection (see the module docstring)."""
    from shared.errors import ShardsinkError
    from shared.shard import Shard

    state = s.catalog().state()
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
            entry.update({
                "upper": st.upper.to_json(),
                "since": st.since.to_json(),
                "lag": lag,
                "batches": len(st.batches),
                "rows": st.total_rows(),
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
    cols = ["collection", "upper", "since", "lag", "batches", "rows", "bytes", "sinks"]

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
        for sid, msg in r.get("refusing", {}).items():
            print(f"error: sink {sid} refuses to write: {msg}", file=sys.stderr)
    return 0
