"""Peeks: a snapshot of a collection as of a time, answered on ``responses``.

Contract:

- inputs: ``Peek`` and ``CancelPeek`` commands; the shards' heads on every tick;
- state: waiting peeks (in memory, and logged as ``pending`` in the command log so that a
  restart resumes them); a waiting peek holds its collection's since at its as-of
  (capabilities.py);
- outputs: ``PeekResult`` with the rows inline (small results) or as a Parquet object on
  S3 that the answer names (format ``parquet``), or, for a peek of a large collection with a
  Spark master set, as a folder of Parquet objects written by Spark's executors, one per
  row bucket (format ``parquet-dataset``: the row columns, ``_error``, ``_diff``;
  ``services/controller/spark_jobs.py``); ``PeekCanceled``; typed errors (``ReadBeforeSince`` at once,
  ``NotReadableYet`` after the peek timeout, ``IdentifierMissing`` when the collection is
  dropped while the peek waits);
- invariants: a peek is answered exactly once (its pending log entry is replaced by the
  answer in one commit); the time is readable iff ``since <= as_of < upper``
  (:func:`shared.controller_state.is_readable`).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from services.controller.context import AnswerUndelivered, ControllerContext
from services.controller.model import OpenCollection, PendingPeek, Tick, b64, digest, unb64
from services.controller.spark_jobs import StoredPeek
from shared.avro_arrow import arrow_to_rows
from shared.catalog import CatalogState, FencedError
from shared.codec import message_codec, tagged
from shared.controller_state import CommandRejected, ControllerSection, is_readable
from shared.errors import NotReadableYetError, ShardDroppedError, SinceViolationError
from shared.frontier import Frontier
from shared.shard import DIFF, ERROR, dictionary_columns


class PeeksRoom:
    """The controller's peeks room (see the module docstring)."""

    def __init__(self, ctx: ControllerContext) -> None:
        self.ctx = ctx
        self.cmd_codec = message_codec("command")

    # -- peeks ------------------------------------------------------------------------------------
    def peek(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        peek, ready = self.prepare_peek(cid, b)
        if ready:
            self.ctx.answer(cid, self._peek_response(peek), where=where, offset=off)
            return
        # Not readable yet: wait (logged as pending, so that it survives a restart).
        max_entries = self.ctx.settings.log_max_entries

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.record(cid, {"o": where, "pending": b64(raw)}, max_entries)
            sec.offsets[str(off[0])] = off[1] + 1

        self.ctx.commit(t)
        self.ctx.peeks[cid] = peek

    def prepare_peek(self, cid: str, b: dict[str, Any]) -> tuple[PendingPeek, bool]:
        """Validate a peek; returns it and whether it is readable now."""
        collection_id = b["collection_id"]
        self.ctx.catalog.state().collection(collection_id)
        col = self.ctx.collections[collection_id]
        state = col.shard.refresh()
        as_of = b.get("as_of")
        if as_of is None:
            as_of = max((state.upper.time or 1) - 1, 0) if not state.upper.is_empty() else 0
        as_of = int(as_of)
        if not state.since.less_equal(Frontier.at(as_of)):
            raise SinceViolationError(
                f"expected as_of >= since {state.since!r}, found {as_of}",
                collection_id=collection_id, as_of=as_of, since=state.since,
            )
        limit = b.get("limit")
        if limit is not None and int(limit) < 0:
            raise CommandRejected("InvalidUsage", f"expected a limit >= 0, found {limit}")
        max_inline = b.get("max_inline_bytes")
        peek = PendingPeek(
            cid, collection_id, as_of, None if limit is None else int(limit),
            self.ctx.settings.max_inline_bytes if max_inline is None else int(max_inline),
            time.monotonic() + self.ctx.settings.peek_timeout_ms / 1000.0,
        )
        return peek, is_readable(as_of, state.upper)

    def _peek_response(self, peek: PendingPeek) -> bytes:
        col = self.ctx.collections[peek.collection_id]

        def here() -> pa.Table:
            table = col.shard.snapshot(peek.as_of)
            return table if peek.limit is None else table.slice(0, peek.limit)

        name = f"peeks/{peek.collection_id}/{digest(peek.command_id)}"
        got = here() if self.ctx.spark_jobs is None else self.ctx.spark_jobs.peek(
            col.shard, peek.as_of, peek.limit, f"{name}/", here)
        result: tuple[str, dict[str, Any]] | None = None
        if isinstance(got, StoredPeek):
            # Answered by Spark: one object per bucket under the folder, or inline when few.
            assert self.ctx.spark_jobs is not None
            if got.errors == 0 and got.nbytes <= 4 * peek.max_inline + 1024:
                result = self._inline_rows(col, self.ctx.spark_jobs.read_peek(col.shard, got), peek.max_inline)
                if result is not None:
                    self.ctx.store.delete_many([o["key"] for o in got.objects])
            if result is None:
                result = tagged("StoredRows", {"bucket": self.ctx.settings.service.s3.bucket, "key": self._full_key(got.folder),
                                               "format": "parquet-dataset", "row_count": got.rows})
        else:
            table = got
            has_errors = table.num_rows > 0 and table[ERROR].null_count != table.num_rows
            if not has_errors and table.nbytes <= 4 * peek.max_inline + 1024:
                result = self._inline_rows(col, table, peek.max_inline)
            if result is None:
                out = table.select([*col.shard.row_columns, *([ERROR] if has_errors else []), DIFF])
                buf = io.BytesIO()
                pq.write_table(out, buf, compression="snappy", use_dictionary=dictionary_columns(out))
                key = f"{name}.parquet"
                self.ctx.store.put(key, buf.getvalue())
                result = tagged("StoredRows", {"bucket": self.ctx.settings.service.s3.bucket, "key": self._full_key(key),
                                               "format": "parquet", "row_count": out.num_rows})
        return self.ctx.encode_response(
            peek.command_id, "PeekResult", {"collection_id": peek.collection_id, "as_of": peek.as_of, "result": result}
        )

    @staticmethod
    def _inline_rows(col: OpenCollection, table: pa.Table, max_inline: int) -> tuple[str, dict[str, Any]] | None:
        """The rows as ``InlineRows`` when they encode within ``max_inline`` bytes (no error rows)."""
        if table.num_rows and table[ERROR].null_count != table.num_rows:
            return None
        rows = arrow_to_rows(table.select(col.shard.row_columns), col.row_codec.schema)
        encoded = [col.row_codec.encode(r) for r in rows]
        if sum(len(e) + 10 for e in encoded) > max_inline:
            return None
        diffs = table[DIFF].to_pylist()
        return tagged("InlineRows", {"rows": [{"row": e, "count": int(d)} for e, d in zip(encoded, diffs, strict=True)]})

    def _full_key(self, key: str) -> str:
        prefix = self.ctx.settings.service.s3.prefix
        return (prefix.rstrip("/") + "/" if prefix else "") + key

    def retire_peek(self, peek: PendingPeek, response: bytes | Callable[[str], bytes] | None = None) -> None:
        """Answer a logged (pending) peek: replace its log entry by the response."""
        resp = response if response is not None else self._peek_response(peek)
        self.ctx.peeks.pop(peek.command_id, None)
        self.ctx.answer(peek.command_id, resp, where="peek")

    def cancel_peek(self, cid: str, b: dict[str, Any], where: str, off: tuple[int, int], raw: bytes) -> None:
        target = b["peek_command_id"]
        peek = self.ctx.peeks.pop(target, None)
        if peek is None:
            self.ctx.answer(cid, self.ctx.ack(cid, peek_command_id=target, canceled=False), where=where, offset=off)
            return
        canceled = self.ctx.encode_response(target, "PeekCanceled", {"peek_command_id": target})
        entry = self.ctx.log_entry(target, canceled, "peek")
        max_entries = self.ctx.settings.log_max_entries

        def t(s: CatalogState, sec: ControllerSection) -> None:
            sec.record(target, entry, max_entries)

        self.ctx.commit(t)
        self.ctx.send(canceled, target)
        self.ctx.answer(cid, self.ctx.ack(cid, peek_command_id=target, canceled=True), where=where, offset=off)

    # -- peeks -------------------------------------------------------------------------------------
    def resume_pending(self) -> None:
        """Recovery: restart the waiting peeks from their logged (``pending``) commands; one
        readable now is answered at once, one that fails is answered as an error."""
        ctx = self.ctx
        for cid, entry in list(ctx.section.log.items()):
            if "pending" in entry:
                try:
                    body = self.cmd_codec.decode(unb64(entry["pending"]))["body"]
                    peek, ready = self.prepare_peek(cid, body[1])
                    if ready:
                        self.retire_peek(peek)
                    else:
                        ctx.peeks[cid] = peek
                except FencedError:
                    raise
                except Exception as e:  # noqa: BLE001 - answered as an error, never dropped
                    ctx.answer(cid, ctx.error(e), where="peek")

    def retire_peeks(self, tick: Tick) -> None:
        """Tick step: answer the waiting peeks that became readable, whose collection was
        dropped, or whose timeout passed."""
        for peek in list(self.ctx.peeks.values()):
            st = tick.heads.get(peek.collection_id)
            if st is None:
                err = ShardDroppedError(f"expected a live collection {peek.collection_id!r}, found it dropped",
                                        collection_id=peek.collection_id)
                self.retire_peek(peek, self.ctx.error(err))
            elif is_readable(peek.as_of, st.upper):
                try:
                    self.retire_peek(peek)
                except (FencedError, AnswerUndelivered):
                    raise
                except Exception as e:  # noqa: BLE001 - this peek is answered as an error; the tick goes on
                    self.retire_peek(peek, self.ctx.error(e))
            elif time.monotonic() >= peek.deadline:
                err2 = NotReadableYetError(
                    f"expected as_of < upper {st.upper!r} within the peek timeout of "
                    f"{self.ctx.settings.peek_timeout_ms} ms, found {peek.as_of}",
                    collection_id=peek.collection_id, as_of=peek.as_of, upper=st.upper,
                    timeout_ms=self.ctx.settings.peek_timeout_ms,
                )
                self.retire_peek(peek, self.ctx.error(err2))
