"""How fast desired-topic messages decode on one core.

``decode_updates_benchmark(n)`` encodes ``n`` desired updates (rows of a small order schema,
single-object encoded inside the DesiredMessage) and returns how many per second
:func:`shared.desired.decode_desired` turns back into ``DesiredUpdate`` values (the rows stay
encoded, as the write service keeps them). Run alone it also measures the layers underneath and
prints one JSON object as its last line::

    .venv/bin/python bench/bench_decode.py [--n 200000]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fastavro

from shared.codec import RowCodec, message_codec
from shared.desired import DesiredUpdate, decode_desired, encode_update

ROW_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "bench",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount_cents", "type": "long"},
        {"name": "status", "type": ["null", "string"], "default": None},
    ],
}


def _messages(n: int) -> tuple[RowCodec, list[bytes]]:
    rows = RowCodec(ROW_SCHEMA)
    distinct = min(n, 4096)
    encoded = [
        encode_update(
            rows.encode(
                {
                    "id": i,
                    "customer": f"customer-{i % 997}",
                    "amount_cents": i * 37,
                    "status": "open",
                }
            ),
            1_700_000_000_000 + i,
            1 if i % 3 else -1,
        )
        for i in range(distinct)
    ]
    return rows, [encoded[i % distinct] for i in range(n)]


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def decode_updates_benchmark(n: int = 200_000) -> float:
    """Desired updates decoded per second on one core (single-object DesiredMessage ->
    ``DesiredUpdate``)."""
    _, messages = _messages(n)
    decode_desired(messages[0])  # warm the codec cache
    start = time.perf_counter()
    for m in messages:
        decode_desired(m)
    elapsed = time.perf_counter() - start
    return _rate(n, elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args(argv)
    n = args.n
    rows, messages = _messages(n)
    codec = message_codec("desired")
    parsed = codec._parsed
    sample = decode_desired(messages[0])
    assert isinstance(sample, DesiredUpdate)

    start = time.perf_counter()
    for m in messages:
        fastavro.schemaless_reader(io.BytesIO(m[10:]), parsed, None, return_record_name=True)
    raw = _rate(n, time.perf_counter() - start)

    start = time.perf_counter()
    for m in messages:
        codec.decode(m)
    framed = _rate(n, time.perf_counter() - start)

    updates = decode_updates_benchmark(n)

    row_bytes = [decode_desired(m).row for m in messages[: min(n, 50_000)]]  # type: ignore[union-attr]
    start = time.perf_counter()
    for r in row_bytes:
        rows.decode(r)
    row_rate = _rate(len(row_bytes), time.perf_counter() - start)

    start = time.perf_counter()
    for r in row_bytes:
        rows.partition_key(r)
    key_rate = _rate(len(row_bytes), time.perf_counter() - start)

    print(
        json.dumps(
            {
                "n": n,
                "message_bytes": len(messages[0]),
                "raw_fastavro_body_per_s": round(raw),
                "codec_decode_per_s": round(framed),
                "decode_updates_per_s": round(updates),
                "row_decode_per_s": round(row_rate),
                "row_partition_key_per_s": round(key_rate),
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
