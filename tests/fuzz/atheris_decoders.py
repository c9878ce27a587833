"""A coverage-guided fuzzer (atheris) over the decoders: desired messages, every message codec,
the row codec and the sink's micro-batch decode. Any exception other than the typed
DecodeError is a crash (atheris exits non-zero and writes the input to ``crash-*``).

    python tests/fuzz/atheris_decoders.py -runs=50000 [-seed=1]

``tests/campaigns/test_fuzz_inputs.py`` runs it with a fixed number of runs and seeds the corpus with
valid messages of each kind (so mutations start from well-formed inputs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    import pyarrow as pa

    from services.sinkio import KIND_BAD, decode_partition
    from shared.codec import RowCodec, message_codec
    from shared.desired import decode_desired
    from shared.errors import DecodeError

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}, {"name": "v", "type": "string"}]}
ROWS = RowCodec(SCHEMA)
CODECS = [message_codec(n) for n in ("command", "response", "batch_description", "written_batch", "frontier_update", "subscribe_output")]
SINK_DECODE = decode_partition("t", json.dumps(SCHEMA))


def one(data: bytes) -> None:
    if not data:
        return
    which, body = data[0], data[1:]
    try:
        if which % 4 == 0:
            decode_desired(body)
        elif which % 4 == 1:
            CODECS[which % len(CODECS)].decode(body)
        elif which % 4 == 2:
            ROWS.decode(body)
        else:
            rb = pa.RecordBatch.from_pydict({"topic": ["t"], "partition": [0], "offset": [0], "value": [body]})
            (out,) = list(SINK_DECODE(iter([rb])))
            kind = out.column("kind")[0].as_py()
            if kind == "update":
                ROWS.decode(out.column("row")[0].as_py())  # an accepted row must decode
            elif kind == KIND_BAD:
                assert out.column("error")[0].as_py()
    except DecodeError:
        pass


def seeds(directory: Path) -> None:
    """Valid inputs of each kind, as the corpus to start from."""
    from shared.codec import tagged
    from shared.desired import encode_progress, encode_update
    from shared.frontier import Frontier

    directory.mkdir(parents=True, exist_ok=True)
    row = ROWS.encode({"k": 7, "v": "seven"})
    cmd = message_codec("command").encode({"command_id": "c1", "issued_at_ms": 1, "body": tagged("Peek", {
        "collection_id": "c", "as_of": 3, "limit": None, "max_inline_bytes": None})})
    items = {
        "update": b"\x00" + encode_update(row, 5, 1),
        "progress": b"\x00" + encode_progress(1, Frontier(9)),
        "command": b"\x01" + cmd,
        "row": b"\x02" + row,
        "sink": b"\x03" + encode_update(row, 5, -1),
    }
    for name, value in items.items():
        (directory / name).write_bytes(value)


if __name__ == "__main__":
    args = sys.argv[1:]
    corpus = [a for a in args if not a.startswith("-")]
    for c in corpus:
        seeds(Path(c))
    atheris.Setup([sys.argv[0], *args], one)
    atheris.Fuzz()
