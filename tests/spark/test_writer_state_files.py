"""The write query's per-partition state versions (shared/spark/state_files.py) and its
input partitions (services/write/source.py): the protocol the writer's recovery rests on.

- a task of batch N loads the newest version written before N: a version a failed attempt of
  N (or of a later batch that never committed) left behind is never read, and is replaced;
- a partition without input keeps its newest version live;
- old versions are pruned, never the newest ones;
- the same holds on an ``s3a://`` checkpoint (the moto server), where executors write the
  versions with the services' S3 credentials;
- every writer partition gets the control range of a batch that has one; otherwise only the
  partitions with desired records are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared.spark import state_files
from services.write.source import writer_partitions
from shared.spark.state_files import KEEP, WriterStateFiles
from shared.devstack.embedded import EmbeddedStack
from shared.io.s3 import S3Settings
from shared.spark.kafka_source import KafkaInputPartition


def decode(b: bytes) -> dict[str, Any]:
    return {"from": b.decode()}


def check_protocol(files: WriterStateFiles) -> None:
    state_files._CACHE.clear()
    assert files.load(0, 5, decode) is None  # a new partition
    files.save(0, 1, b"v1", {"from": "v1"})
    files.save(0, 2, b"v2", {"from": "v2"})
    files.save(1, 2, b"p1v2", {"from": "p1v2"})
    state_files._CACHE.clear()  # another process: read from storage
    assert files.load(0, 3, decode) == (2, {"from": "v2"})
    assert files.load(0, 2, decode) == (1, {"from": "v1"})  # a re-run of batch 2 starts from 1
    assert files.load(1, 9, decode) == (2, {"from": "p1v2"})  # no input since: 2 stays live
    # An attempt of batch 3 that never committed wrote version 3; batch 3 runs again: it
    # starts from 2 and replaces 3.
    files.save(0, 3, b"bad", {"from": "bad"})
    state_files._CACHE.clear()
    assert files.load(0, 3, decode) == (2, {"from": "v2"})
    files.save(0, 3, b"v3", {"from": "v3"})
    assert files.load(0, 4, decode) == (3, {"from": "v3"})
    # The process's cache serves the version it saved last, the object itself.
    mine = {"from": "cached"}
    files.save(0, 4, b"v4", mine)
    got = files.load(0, 5, decode)
    assert got is not None and got[1] is mine
    # ...but never a version that is not the newest before the batch.
    files.save(0, 5, b"v5", {"from": "v5"})
    state_files._CACHE[(files.checkpoint, 0)] = (4, {"from": "stale"})
    assert files.load(0, 6, decode) == (5, {"from": "v5"})
    # Pruning keeps the newest KEEP versions.
    for v in range(6, 12):
        files.save(0, v, f"v{v}".encode(), {"from": f"v{v}"})
    assert files.versions(0) == list(range(12 - KEEP, 12))
    assert files.versions(1) == [2]


def test_state_versions_on_a_local_checkpoint(tmp_path: Path) -> None:
    files = WriterStateFiles(str(tmp_path / "ck"))
    check_protocol(files)
    assert sorted(p.name for p in (tmp_path / "ck" / "writer-state" / "0").iterdir()) == ["10", "11", "9"]
    assert WriterStateFiles(f"file://{tmp_path}/ck").versions(0) == [9, 10, 11]


def test_state_versions_on_an_s3a_checkpoint(stack: EmbeddedStack, unique_id: str) -> None:
    env = stack.env()
    s3 = S3Settings.from_env({**env, "SHARDSINK_S3_BUCKET": "other-bucket-name-ignored"})
    files = WriterStateFiles(f"s3a://{stack.bucket}/ckpts/{unique_id}/write/sink-e1", s3)
    check_protocol(files)
    from shared.io.s3 import S3ObjectStore

    keys = sorted(o.key for o in S3ObjectStore(S3Settings.from_env(env)).list(f"ckpts/{unique_id}/"))
    assert keys == [f"ckpts/{unique_id}/write/sink-e1/writer-state/0/{v}" for v in (10, 11, 9)] + [
        f"ckpts/{unique_id}/write/sink-e1/writer-state/1/2"
    ]


def test_a_save_prunes_from_what_its_batchs_load_listed(tmp_path: Path, monkeypatch: Any) -> None:
    """A unit lists its partition's versions once: the save of the batch its load listed prunes
    from that listing and the version it wrote (one LIST request fewer per unit on an ``s3a://``
    checkpoint), keeping the newest KEEP exactly as a fresh listing would; a save with no load of
    its batch before it (or after a discard) lists again."""
    files = WriterStateFiles(str(tmp_path / "ck"))
    for v in range(1, KEEP + 2):
        files.save(0, v, f"v{v}".encode(), {"from": f"v{v}"})
    assert files.versions(0) == list(range(2, KEEP + 2))
    listings: list[int] = []
    real = WriterStateFiles.versions

    def counted(self: WriterStateFiles, wp: int) -> list[int]:
        listings.append(wp)
        return real(self, wp)

    monkeypatch.setattr(WriterStateFiles, "versions", counted)
    nxt = KEEP + 2
    assert files.load(0, nxt, decode) == (KEEP + 1, {"from": f"v{KEEP + 1}"})
    files.save(0, nxt, b"new", {"from": "new"})
    assert listings == [0]  # the load's listing served the save
    assert real(files, 0) == list(range(nxt - KEEP + 1, nxt + 1))
    # A save of another batch than the one loaded, and a save after a discard, list again.
    files.load(0, nxt + 1, decode)
    files.save(0, nxt + 2, b"later", {"from": "later"})
    assert listings == [0, 0, 0]
    files.load(0, nxt + 3, decode)
    files.discard(0, nxt + 3)
    files.save(0, nxt + 3, b"again", {"from": "again"})
    assert listings == [0, 0, 0, 0, 0, 0]
    assert real(files, 0) == [nxt, nxt + 2, nxt + 3][-KEEP:]


def test_an_unsupported_checkpoint_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="hdfs://nn/x"):
        WriterStateFiles("hdfs://nn/x")


def test_writer_partitions_read_control_everywhere_and_desired_where_it_is() -> None:
    d1 = KafkaInputPartition("desired", 1, 10, 20)
    d2 = KafkaInputPartition("desired", 2, 0, 5, lost_from=None)
    c = KafkaInputPartition("descs", 0, 7, 8)
    only_data = writer_partitions([d1, d2], "desired", 3)
    assert [(p.wp, p.desired, p.control) for p in only_data] == [(1, d1, ()), (2, d2, ())]
    with_control = writer_partitions([d2, c], "desired", 3)
    assert [(p.wp, p.desired, p.control) for p in with_control] == [(0, None, (c,)), (1, None, (c,)), (2, d2, (c,))]
    assert writer_partitions([], "desired", 3) == []
