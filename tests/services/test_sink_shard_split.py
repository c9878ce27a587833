"""Two instances with ``SHARDSINK_SINK_SHARD=0/2`` and ``1/2`` split a catalog's sinks with no
overlap and no gap (the supervisor of each service asks :meth:`ServiceSettings.serves`), and
neither removes the checkpoints of the other's sinks.

The catalog is the real one on the embedded S3 server; the queries are stand-ins that record
which sinks an instance started (the sinks' queries themselves are the other suites')."""

from __future__ import annotations

from typing import Any

from services.runtime.settings import ServiceSettings
from services.runtime.supervisor import Supervisor
from shared.catalog import Catalog, CollectionDef, SinkDef
from shared.devstack.embedded import EmbeddedStack
from shared.io.s3 import S3ObjectStore, S3Settings

SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "k", "type": "long"}]}


class Running:
    """What a started query answers the supervisor: still running."""

    isActive = True
    name = "stand-in"

    def stop(self) -> None:
        self.isActive = False


def instance(stack: EmbeddedStack, catalog: Catalog, shard: str, started: list[str], reaped: list[str]) -> Supervisor:
    env = {**stack.env(), "SHARDSINK_SINK_SHARD": shard}
    settings = ServiceSettings.from_env_and_args(None, env)

    def start(sink: SinkDef) -> Any:
        started.append(sink.sink_id)
        return Running()

    def reap(keep: Any) -> list[str]:
        gone = [name for name in CHECKPOINTS if not keep(name)]
        reaped.extend(gone)
        return gone

    sup = Supervisor("write", settings, start, reap=reap)
    sup._catalog = catalog
    return sup


CHECKPOINTS: list[str] = []


def test_two_instances_split_ten_sinks_with_no_overlap_and_keep_each_others_checkpoints(
    stack: EmbeddedStack, unique_id: str
) -> None:
    store = S3ObjectStore(S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing"))
    catalog = Catalog(store, root=f"catalogs/{unique_id}")
    sinks = [f"sink-{unique_id}-{k}" for k in range(10)]
    for k, sink in enumerate(sinks):
        catalog.create_collection(CollectionDef(f"c-{unique_id}-{k}", SCHEMA))
        catalog.create_sink(SinkDef(sink, f"desired-{unique_id}-{k}", f"c-{unique_id}-{k}"))
    epochs = {s.sink_id: s.epoch for s in catalog.state().live_sinks()}
    CHECKPOINTS[:] = [f"{sink}-e{epochs[sink]}" for sink in sinks]

    started: list[list[str]] = [[], []]
    reaped: list[str] = []
    instances = [instance(stack, catalog, f"{i}/2", started[i], reaped) for i in range(2)]
    for sup in instances:
        sup.poll_once()

    assert sorted(started[0] + started[1]) == sorted(sinks)  # no gap, none started twice
    assert set(started[0]).isdisjoint(started[1]) and started[0] and started[1]
    assert [sorted(sup.running) for sup in instances] == [sorted(s) for s in started]
    assert reaped == []  # each keeps the checkpoints of the sinks the other serves

    # A dropped sink's checkpoint goes, whichever instance served it; the others stay.
    dropped = sinks[0]
    catalog.drop_sink(dropped)
    for sup in instances:
        sup.poll_once()
    assert reaped == [f"{dropped}-e{epochs[dropped]}"]
    assert sorted(list(instances[0].running) + list(instances[1].running)) == sorted(sinks[1:])


def test_two_shared_query_instances_split_ten_sinks_with_no_overlap(
    stack: EmbeddedStack, unique_id: str, tmp_path: Any
) -> None:
    """The same split with shared queries (``SHARDSINK_QUERIES=shared``): each instance's
    fleet takes its share as members (and writes them to its own members file), and removes
    only its own dropped sinks' state."""
    from services.runtime.fleet import Fleet

    store = S3ObjectStore(S3Settings(bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing"))
    catalog = Catalog(store, root=f"catalogs/{unique_id}")
    sinks = [f"sink-{unique_id}-{k}" for k in range(10)]
    for k, sink in enumerate(sinks):
        catalog.create_collection(CollectionDef(f"c-{unique_id}-{k}", SCHEMA))
        catalog.create_sink(SinkDef(sink, f"desired-{unique_id}-{k}", f"c-{unique_id}-{k}"))
    epochs = {s.sink_id: s.epoch for s in catalog.state().live_sinks()}
    folders = [f"{sink}-e{epochs[sink]}" for sink in sinks] + ["query-0of2", "query-1of2"]
    reaped: list[str] = []
    started: list[int] = []

    def fleet(i: int) -> Fleet:
        env = {**stack.env(), "SHARDSINK_SINK_SHARD": f"{i}/2", "SHARDSINK_QUERIES": "shared",
               "SHARDSINK_CHECKPOINT_DIR": str(tmp_path)}
        settings = ServiceSettings.from_env_and_args(None, env)

        def reap(keep: Any) -> list[str]:
            gone = [name for name in folders if not keep(name) and name not in reaped]
            reaped.extend(gone)
            return gone

        f = Fleet("write", settings, lambda _f: started.append(i) or Running(), reap=reap)
        f._catalog = catalog
        return f

    fleets = [fleet(0), fleet(1)]
    for f in fleets:
        f.poll_once()
    members = [sorted(s.sink_id for s in f.members().values()) for f in fleets]
    assert sorted(members[0] + members[1]) == sorted(sinks)  # no gap, none twice
    assert set(members[0]).isdisjoint(members[1]) and members[0] and members[1]
    assert sorted(started) == [0, 1]  # one query per instance, whatever the number of sinks
    assert fleets[0].members_file != fleets[1].members_file
    assert reaped == []

    dropped = sinks[0]
    catalog.drop_sink(dropped)
    for f in fleets:
        f.poll_once()
    assert reaped == [f"{dropped}-e{epochs[dropped]}"]
    assert sorted(s.sink_id for f in fleets for s in f.members().values()) == sorted(sinks[1:])
    assert sorted(started) == [0, 1]  # the queries stayed
