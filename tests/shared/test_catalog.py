"""The catalog on S3: definitions, id rules, idempotent re-creation, fencing, races."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shared.catalog import (
    Catalog,
    CatalogState,
    CollectionDef,
    FencedError,
    IdReuseError,
    SinkDef,
    UnknownCollectionError,
    UnknownSinkError,
)
from shared.devstack.embedded import EmbeddedStack
from shared.errors import InvalidUsageError, SinkBaselineRequiredError
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.objectstore import MemoryObjectStore
from shared.shard import Shard

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]}


@pytest.fixture
def catalog(stack: EmbeddedStack, unique_id: str) -> Catalog:
    store = S3ObjectStore(S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing"))
    return Catalog(store, root=f"catalogs/{unique_id}")


def test_create_is_idempotent_and_reuse_with_another_definition_fails(catalog: Catalog) -> None:
    catalog.create_collection(CollectionDef("c1", SCHEMA))
    seq = catalog.state().seqno
    catalog.create_collection(CollectionDef("c1", SCHEMA))
    assert catalog.state().seqno == seq  # no-op: nothing written
    other = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "string"}]}
    with pytest.raises(IdReuseError):
        catalog.create_collection(CollectionDef("c1", other))


def test_dropped_ids_are_never_reused(catalog: Catalog) -> None:
    catalog.create_collection(CollectionDef("c1", SCHEMA))
    catalog.create_sink(SinkDef("s1", "topic-a", "c1"))
    catalog.drop_collection("c1")
    state = catalog.state()
    assert state.collections["c1"].dropped and state.sinks["s1"].dropped
    assert state.live_sinks() == [] and state.live_collections() == []
    with pytest.raises(IdReuseError):
        catalog.create_collection(CollectionDef("c1", SCHEMA))
    with pytest.raises(UnknownCollectionError):
        catalog.create_sink(SinkDef("s2", "topic-a", "c1"))


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 200, ".hidden", "a..b"])
def test_ids_that_could_escape_their_prefix_are_rejected(catalog: Catalog, bad: str) -> None:
    with pytest.raises(InvalidUsageError):
        catalog.create_collection(CollectionDef(bad, SCHEMA))


def test_sinks_read_only_and_allow_writes(catalog: Catalog) -> None:
    catalog.create_collection(CollectionDef("c1", SCHEMA))
    catalog.create_sink(SinkDef("s1", "t", "c1", read_only=True))
    catalog.create_sink(SinkDef("s2", "t", "c1"))
    state = catalog.state()
    assert state.sink("s1").read_only and not state.sink("s2").read_only
    assert state.sink("s1").epoch != state.sink("s2").epoch
    catalog.allow_writes("s1")
    assert not catalog.state().sink("s1").read_only
    catalog.drop_sink("s1")
    with pytest.raises(UnknownSinkError):
        catalog.allow_writes("s1")


def test_a_newer_controller_fences_the_older_one(catalog: Catalog) -> None:
    first = catalog.claim_controller_epoch()
    second = catalog.claim_controller_epoch()
    assert second == first + 1
    with pytest.raises(FencedError):
        catalog.create_collection(CollectionDef("c1", SCHEMA), epoch=first)
    catalog.create_collection(CollectionDef("c1", SCHEMA), epoch=second)
    assert "c1" in catalog.state().collections


def test_racing_handles_lose_no_definition(stack: EmbeddedStack, unique_id: str) -> None:
    root = f"catalogs/{unique_id}"
    errors: list[Any] = []

    def worker(i: int) -> None:
        try:
            store = S3ObjectStore(S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing"))
            cat = Catalog(store, root=root)
            for j in range(5):
                cat.create_collection(CollectionDef(f"c-{i}-{j}", SCHEMA))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store = S3ObjectStore(S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing"))
    state = Catalog(store, root=root).state()
    assert sorted(state.collections) == sorted(f"c-{i}-{j}" for i in range(4) for j in range(5))


def test_catalog_state_round_trips() -> None:
    s = CatalogState(seqno=3, collections={"c": CollectionDef("c", SCHEMA, 5, {"lag_writes_by": 10})}, sinks={"s": SinkDef("s", "t", "c", 7, True, False, 2)})
    assert CatalogState.decode(s.encode()) == s


def test_supervisor_backs_off_a_failing_query_and_stops_dropped_ones(stack: EmbeddedStack, unique_id: str) -> None:
    """A query that keeps failing is restarted with growing delays, not on every poll."""
    from services.runtime.settings import ServiceSettings
    from services.runtime.supervisor import Supervisor

    settings = ServiceSettings.from_env_and_args(None, {**stack.env(), "SHARDSINK_S3_PREFIX": f"sup-{unique_id}"})
    cat = settings.catalog()
    cat.create_collection(CollectionDef("c", SCHEMA))
    cat.create_sink(SinkDef("s", "t", "c"))

    class DeadQuery:
        isActive = False
        name = "dead"

        def exception(self) -> str:
            return "boom"

        def stop(self) -> None:
            pass

    starts: list[float] = []
    clock = [0.0]
    sup = Supervisor(
        "t", settings, lambda sink: starts.append(clock[0]) or DeadQuery(), backoff_s=1.0, max_backoff_s=8.0, clock=lambda: clock[0]
    )
    for step in range(40):  # 20 s of polls every 0.5 s
        clock[0] = step * 0.5
        sup.poll_once()
    # started at 0, then failing: restarts after 1, 2, 4, 8, 8 s delays, not every poll
    assert len(starts) <= 6, starts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 8.0, gaps
    cat.drop_sink("s")
    clock[0] = 100.0
    sup.poll_once()
    assert sup.running == {}


def test_supervisor_stops_a_dropped_sinks_query_once_its_sources_are_up(stack: EmbeddedStack, unique_id: str) -> None:
    """A query stopped while Spark starts its sources' Python processes leaves them unable to
    connect back (a traceback each on stderr): a sink dropped then is stopped a poll later."""
    from services.runtime.settings import ServiceSettings
    from services.runtime.supervisor import Supervisor

    settings = ServiceSettings.from_env_and_args(None, {**stack.env(), "SHARDSINK_S3_PREFIX": f"sup-init-{unique_id}"})
    cat = settings.catalog()
    cat.create_collection(CollectionDef("c", SCHEMA))
    cat.create_sink(SinkDef("s", "t", "c"))

    class StartingQuery:
        isActive = True
        name = "starting"
        message = "Initializing sources"
        stopped = False

        @property
        def status(self) -> dict[str, str]:
            return {"message": self.message}

        def stop(self) -> None:
            self.stopped = True

    query = StartingQuery()
    clock = [0.0]
    sup = Supervisor("t", settings, lambda sink: query, clock=lambda: clock[0])
    sup.poll_once()
    assert "s" in sup.running
    cat.drop_sink("s")
    clock[0] = 2.0
    sup.poll_once()
    assert "s" in sup.running and not query.stopped  # its sources are still starting
    query.message = "Waiting for data to arrive"
    clock[0] = 3.0
    sup.poll_once()
    assert sup.running == {} and query.stopped
    # A query stuck initializing is stopped anyway a minute after its start.
    cat.create_sink(SinkDef("s2", "t", "c"))
    stuck = StartingQuery()
    sup2 = Supervisor("t2", settings, lambda sink: stuck, clock=lambda: clock[0])
    sup2.poll_once()
    cat.drop_sink("s2")
    clock[0] = 70.0
    sup2.poll_once()
    assert "s2" not in sup2.running and stuck.stopped


# -- a sink on a collection that holds rows says what its topic holds (issue 32) ---------------


def _catalog_with_rows(rows: int, *, upper: int = 3) -> Catalog:
    """A catalog and collection ``c`` whose shard holds ``rows`` rows (in memory)."""
    store = MemoryObjectStore()
    catalog = Catalog(store)
    catalog.create_collection(CollectionDef("c", SCHEMA))
    shard = Shard.create(store, "c", SCHEMA)
    shard.compare_and_append([({"k": i}, 0, 1) for i in range(rows)], 0, upper)
    return catalog


def test_a_sink_on_a_collection_that_holds_rows_without_a_flag_is_refused_and_writes_nothing() -> None:
    catalog = _catalog_with_rows(5)
    before = catalog.state().encode()
    with pytest.raises(SinkBaselineRequiredError) as e:
        catalog.create_sink(SinkDef("s", "t", "c"))
    assert (e.value.collection_id, e.value.sink_id, e.value.rows, e.value.upper) == ("c", "s", 5, 3)
    message = str(e.value)
    assert message.startswith("expected sink 's' on collection 'c', which holds 5 rows (upper 3)"), message
    assert "--adopt-shard" in message and "--replace-contents" in message and "nothing was written" in message
    assert catalog.state().encode() == before  # not one state written


@pytest.mark.parametrize("flag", ["adopt_shard", "replace_contents"])
def test_a_sink_on_a_collection_that_holds_rows_is_created_with_either_flag_and_records_it(flag: str) -> None:
    catalog = _catalog_with_rows(5)
    catalog.create_sink(SinkDef("s", "t", "c", **{flag: True}))
    sink = catalog.state().sink("s")
    assert (sink.adopt_shard, sink.replace_contents) == (flag == "adopt_shard", flag == "replace_contents")
    assert SinkDef.from_json(sink.to_json()) == sink


def test_both_flags_at_once_are_a_usage_error() -> None:
    with pytest.raises(InvalidUsageError, match="at most one of --adopt-shard .* and --replace-contents .*found both") as e:
        SinkDef("s", "t", "c", adopt_shard=True, replace_contents=True)
    assert not isinstance(e.value, SinkBaselineRequiredError)


def test_an_empty_collection_needs_neither_flag_even_with_its_upper_advanced() -> None:
    catalog = _catalog_with_rows(0, upper=7)
    catalog.create_sink(SinkDef("s", "t", "c"))
    assert not catalog.state().sink("s").replace_contents


def test_re_creating_a_sink_with_its_definition_is_a_no_op_once_its_collection_holds_rows() -> None:
    store = MemoryObjectStore()
    catalog = Catalog(store)
    catalog.create_collection(CollectionDef("c", SCHEMA))
    shard = Shard.create(store, "c", SCHEMA)
    catalog.create_sink(SinkDef("s", "t", "c"))  # empty: no flag needed
    shard.compare_and_append([({"k": 1}, 0, 1)], 0, 1)  # the sink wrote a row
    seq = catalog.state().seqno
    catalog.create_sink(SinkDef("s", "t", "c"))
    assert catalog.state().seqno == seq
    with pytest.raises(SinkBaselineRequiredError):  # another sink on it must say
        catalog.create_sink(SinkDef("s2", "t", "c"))


def test_adopting_a_sink_created_with_replace_contents_leaves_only_adopt_shard() -> None:
    catalog = _catalog_with_rows(2)
    catalog.create_sink(SinkDef("s", "t", "c", replace_contents=True))
    catalog.adopt_shard("s")
    sink = catalog.state().sink("s")
    assert (sink.adopt_shard, sink.replace_contents) == (True, False)


def test_a_sink_written_before_replace_contents_existed_decodes_without_it() -> None:
    old = {"sink_id": "s", "desired_topic": "t", "collection_id": "c", "as_of": 0, "read_only": False,
           "dropped": False, "epoch": 1, "adopt_shard": False}
    assert SinkDef.from_json(old) == SinkDef("s", "t", "c", epoch=1)
