"""``shardsink collection ...`` and ``shardsink sink ...``: manage collections and sinks.

With ``--via controller`` a change is a command to the running controller (it owns the
catalog, the read holds and the reclaiming of dropped collections) and the CLI waits for its
answer. ``--via catalog`` writes the catalog on S3 directly (with the same conditional writes
the controller uses), for deployments without the controller and for tests. The default,
``--via auto``, is the controller when one has claimed the catalog (a controller epoch is
recorded), else the catalog.

::

    shardsink collection create orders --schema orders.avsc [--since 0] [--read-policy lag:1000]
    shardsink collection alter orders --read-policy lag:3600000:60000
    shardsink collection alter orders --schema orders-v2.avsc    # a compatible new row schema
    shardsink collection drop orders
    shardsink collection list                       # direct catalog/shard reads
    shardsink sink create orders-sink --topic orders-desired --collection orders [--read-only]
                    [--adopt-shard | --replace-contents]   # one of them when orders holds rows
    shardsink sink allow-writes [orders-sink]       # no id: every sink (controller only)
    shardsink sink adopt orders-sink                # after lost desired history: see docs/operations.md
    shardsink sink drop orders-sink
    shardsink sink list

Read policies (``--read-policy``): ``valid-from:T`` (hold since at T; ``valid-from:closed``
lets it go), ``lag:L[:G]`` (since follows the upper L behind, rounded down to multiples of G,
default L), several joined by ``,`` for the least of them (``multiple``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardsink.cli.main import print_json


def _settings(args: argparse.Namespace) -> Any:
    from services.runtime.settings import ServiceSettings

    return ServiceSettings.from_env_and_args(args)


def register(sub: Any) -> None:
    from shardsink.cli.common import add_connection_args, add_via

    fmt = argparse.RawDescriptionHelpFormatter
    col = sub.add_parser("collection", help="create, alter, drop or list collections",
                         description="Create, alter, drop or list collections.\n\n" + _VIA, formatter_class=fmt)
    csub = col.add_subparsers(dest="collection_cmd", required=True, metavar="COMMAND", help="what to do")
    p = csub.add_parser("create", help="create a collection and its shard",
                        description="Create a collection (its catalog entry and its shard).\n\n" + _POLICIES,
                        formatter_class=fmt)
    p.add_argument("collection_id", help="the new collection's id (never reused, even after a drop)")
    p.add_argument("--schema", required=True, help="the rows' Avro record schema file (.avsc)")
    p.add_argument("--since", type=int, default=0, help="the initial since: the first readable time (default 0)")
    p.add_argument("--read-policy", default=None,
                   help="valid-from:T | lag:L[:G] | A,B (default valid-from:SINCE)")
    add_via(p)
    add_connection_args(p)
    p.set_defaults(func=_collection_create)
    p = csub.add_parser("alter", help="change a collection's read policy or row schema",
                        description="Change a collection's read policy, or its row schema.\n\n" + _POLICIES
                        + "\n\n" + _EVOLUTION, formatter_class=fmt)
    p.add_argument("collection_id", help="the collection")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--read-policy", help="valid-from:T | lag:L[:G] | A,B")
    what.add_argument("--schema", help="the new Avro record schema of the rows (.avsc): a compatible evolution")
    add_via(p)
    add_connection_args(p)
    p.set_defaults(func=_collection_alter)
    p = csub.add_parser("drop", help="drop a collection (its id is never reused)",
                        description="Drop a collection: its since and upper go to the empty frontier and its "
                        "storage is reclaimed later; the id is never reused.")
    p.add_argument("collection_id", help="the collection")
    add_via(p)
    add_connection_args(p)
    p.set_defaults(func=_collection_drop)
    p = csub.add_parser("list", help="list collections with upper, since, batches, rows and bytes",
                        description="List the live collections (one JSON object per line), read from the catalog "
                        "and the shards on S3 directly; nothing is created.")
    add_connection_args(p, controller=False, kafka=False)
    p.set_defaults(func=_collection_list)

    sk = sub.add_parser("sink", help="create, drop, allow writes on, or list sinks",
                        description="Create, drop, allow writes on, or list sinks.\n\n" + _VIA, formatter_class=fmt)
    ssub = sk.add_subparsers(dest="sink_cmd", required=True, metavar="COMMAND", help="what to do")
    p = ssub.add_parser("create", help="register a sink: desired topic -> collection",
                        description="Register a sink: the services keep the collection equal to the desired "
                        "collection on the topic.\n\n" + _BASELINE, formatter_class=fmt)
    p.add_argument("sink_id", help="the new sink's id")
    p.add_argument("--topic", required=True, help="the desired topic the sink reads")
    p.add_argument("--collection", required=True, help="the collection the sink writes")
    p.add_argument("--as-of", type=int, default=None,
                   help="the start time (default: the collection's upper)")
    p.add_argument("--read-only", action="store_true",
                   help="observe without writing until sink allow-writes")
    p.add_argument(
        "--adopt-shard", action="store_true",
        help="the topic holds only the changes from the collection's upper on: take the collection's "
        "current contents as the desired baseline and correct only from its upper on (no row of "
        "them is retracted unless the topic retracts it)",
    )
    p.add_argument(
        "--replace-contents", action="store_true",
        help="the topic is the whole truth: correct the collection to the topic's contents, "
        "retracting the rows the topic does not hold",
    )
    add_via(p)
    add_connection_args(p)
    p.set_defaults(func=_sink_create)
    p = ssub.add_parser(
        "adopt", help="a sink refusing to write after lost desired history: adopt the shard's contents",
        description="The sink starts over (a new epoch, a fresh write checkpoint) taking its "
        "collection's current contents as the desired baseline; it corrects only from the "
        "shard's upper on. Written to the catalog directly.",
    )
    p.add_argument("sink_id", help="the sink")
    add_connection_args(p)
    p.set_defaults(func=_sink_adopt)
    p = ssub.add_parser("drop", help="drop a sink", description="Drop a sink (the services stop its queries).")
    p.add_argument("sink_id", help="the sink")
    add_via(p)
    add_connection_args(p)
    p.set_defaults(func=_sink_drop)
    p = ssub.add_parser("allow-writes", help="leave read-only mode",
                        description="Let read-only sinks write (no id: every sink, through the controller only).")
    p.add_argument("sink_id", nargs="?", default=None, help="the sink (default: every sink; controller only)")
    add_via(p)
    add_connection_args(p)
    p.set_defaults(func=_sink_allow)
    p = ssub.add_parser("list", help="list sinks",
                        description="List the live sinks (one JSON object per line), read from the catalog on S3; "
                        "nothing is created.")
    add_connection_args(p, controller=False, kafka=False)
    p.set_defaults(func=_sink_list)


_VIA = """\
--via controller sends a command to the running controller and waits for its answer;
--via catalog writes the catalog on S3 directly (deployments without a controller);
--via auto (the default) is the controller once one has claimed the catalog."""

_BASELINE = """\
A collection that holds rows needs one of --adopt-shard and --replace-contents: they say what
the topic holds. --adopt-shard: only the changes from the collection's upper on (the rows stay
as they are; the sink corrects from there). --replace-contents: the whole truth (the sink
retracts every row the topic does not hold). Without either the sink is refused
(SinkBaselineRequiredError, naming the collection and its rows) and nothing is written; both
at once is a usage error. An empty collection needs neither."""

_POLICIES = """\
Read policies (--read-policy): valid-from:T holds since at T (valid-from:closed lets it
go); lag:L[:G] lets since follow the upper L behind, rounded down to multiples of G
(default L); several joined by , take the least of them."""


_EVOLUTION = """\
A new row schema (--schema) is accepted when rows of every earlier version read as it
(Avro's schema resolution): fields added with a default, fields that had a default removed,
a field made nullable, promotions (int to long, float or double; long to float or double;
float to double; string to bytes), enum symbols added (or removed when the enum has a
default), renames through aliases. Anything else is refused (IncompatibleSchemaError naming
the field and the rule) and the collection is unchanged. Readers see every row, old ones
included, in the new schema; a running sink follows the change without a restart."""


def parse_read_policy(text: str) -> Any:
    """``valid-from:T`` | ``valid-from:closed`` | ``lag:L[:G]`` | several joined by ``,``."""
    from shared.errors import InvalidUsageError
    from shared.frontier import Frontier
    from shared.read_policy import LagWritesBy, Multiple, ValidFrom

    def one(part: str) -> Any:
        kind, _, rest = part.strip().partition(":")
        try:
            if kind == "valid-from":
                return ValidFrom(Frontier.empty() if rest == "closed" else Frontier.at(int(rest)))
            if kind == "lag":
                lag_s, _, g = rest.partition(":")
                return LagWritesBy(int(lag_s), int(g) if g else None)
        except ValueError:
            pass
        raise InvalidUsageError(
            f"expected a read policy valid-from:T, valid-from:closed or lag:L[:G], found {part.strip()!r}"
        )

    parts = [one(p) for p in text.split(",") if p.strip()]
    if not parts:
        raise InvalidUsageError(f"expected a read policy, found {text!r}")
    return parts[0] if len(parts) == 1 else Multiple(tuple(parts))


def policy_to_avro(policy: Any) -> tuple[str, dict[str, Any]]:
    """A read policy as the command schema's union value."""
    from shared.read_policy import LagWritesBy, Multiple, ValidFrom

    ns = "io.shardsink.v1."
    if isinstance(policy, ValidFrom):
        return (ns + "ValidFrom", {"frontier": policy.frontier.to_json()})
    if isinstance(policy, LagWritesBy):
        return (ns + "LagWritesBy", {"lag": policy.lag, "granularity": policy.granularity})
    assert isinstance(policy, Multiple)
    return (ns + "Multiple", {"policies": [policy_to_avro(p) for p in policy.policies]})


def _via_controller(args: argparse.Namespace) -> bool:
    from shardsink.cli.common import via_controller

    return via_controller(args)


def _call(args: argparse.Namespace, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    from shardsink.cli.common import ControllerSession, results

    with ControllerSession(args) as session:
        return results(session.call(kind, body))


def create_collection(settings: Any, collection_id: str, schema: dict[str, Any], since: int = 0) -> Any:
    """Catalog entry first (validates the id and refuses reuse), then the shard; returns the
    shard's state."""
    from shared.avro_arrow import parse_row_schema
    from shared.catalog import CollectionDef
    from shared.shard import Shard

    parsed = parse_row_schema(schema)
    settings.catalog().create_collection(CollectionDef(collection_id, parsed, since))
    return Shard.create(settings.store(), collection_id, parsed, since=since).refresh()


def _collection_create(args: argparse.Namespace) -> int:
    from shardsink.cli.common import load_schema

    schema = load_schema(args.schema)
    policy = None if args.read_policy is None else parse_read_policy(args.read_policy)
    if _via_controller(args):
        body = {
            "collection_id": args.collection_id,
            "row_schema": json.dumps(schema),
            "initial_since": args.since,
            "read_policy": None if policy is None else policy_to_avro(policy),
        }
        r = _call(args, "CreateCollection", body)
        print_json({"created": args.collection_id, "since": r.get("since"), "upper": r.get("upper")})
        return 0
    s = _settings(args)
    st = create_collection(s, args.collection_id, schema, args.since)
    if policy is not None:
        s.catalog().alter_collection(args.collection_id, policy.to_json())
    print_json({"created": args.collection_id, "since": st.since.to_json(), "upper": st.upper.to_json()})
    return 0


def alter_collection_schema(settings: Any, collection_id: str, schema: dict[str, Any]) -> Any:
    """The catalog path of ``AlterCollection``: the shard first (it checks the evolution against
    every version and records the new one; an incompatible schema changes nothing), then the
    catalog follows. Returns the shard's state."""
    from shared.shard import Shard

    settings.catalog().state().collection(collection_id)  # an unknown or dropped id: its typed error first
    state = Shard.open(settings.store(), collection_id).alter_schema(schema)
    settings.catalog().alter_collection_schema(collection_id, state.schema)
    return state


def _collection_alter(args: argparse.Namespace) -> int:
    if args.schema is not None:
        from shardsink.cli.common import load_schema

        schema = load_schema(args.schema)
        if _via_controller(args):
            r = _call(args, "AlterCollection", {"collection_id": args.collection_id, "row_schema": json.dumps(schema)})
            print_json({"altered": args.collection_id, "schema_version": r.get("schema_version"),
                        "from_upper": r.get("from_upper")})
            return 0
        state = alter_collection_schema(_settings(args), args.collection_id, schema)
        print_json({"altered": args.collection_id, "schema_version": len(state.versions) - 1,
                    "from_upper": state.versions[-1].from_upper.to_json()})
        return 0
    policy = parse_read_policy(args.read_policy)
    if _via_controller(args):
        r = _call(args, "SetReadPolicy", {"collection_id": args.collection_id, "policy": policy_to_avro(policy)})
        print_json({"altered": args.collection_id, "read_policy": policy.to_json(), "since": r.get("since")})
        return 0
    from shared.read_policy import check_reaches_since
    from shared.shard import Shard

    s = _settings(args)
    s.catalog().state().collection(args.collection_id)  # an unknown or dropped id: its typed error first
    state = Shard.open(s.store(), args.collection_id).refresh()
    check_reaches_since(policy, args.collection_id, state.since, state.upper)  # as the controller does
    s.catalog().alter_collection(args.collection_id, policy.to_json())
    print_json({"altered": args.collection_id, "read_policy": policy.to_json(), "since": state.since.to_json()})
    return 0


def _collection_drop(args: argparse.Namespace) -> int:
    """Drops the collection and the sinks that write it, and says which sinks went."""
    if _via_controller(args):
        sinks = _call(args, "DropCollection", {"collection_id": args.collection_id}).get("sinks_dropped", [])
    else:
        from shared.errors import ShardNotFoundError
        from shared.shard import Shard

        s = _settings(args)
        state = s.catalog().state()
        state.collection(args.collection_id)  # an unknown or dropped id: its typed error
        sinks = [k.sink_id for k in state.live_sinks(args.collection_id)]  # they go with it
        s.catalog().drop_collection(args.collection_id)
        try:  # since and upper to the empty frontier; gc reclaims the objects later
            Shard(s.store(), args.collection_id).drop()
        except ShardNotFoundError:
            pass
    print_json({"dropped": args.collection_id, "sinks_dropped": sinks})
    if sinks:
        print(f"dropped with it: sink(s) {', '.join(sinks)} (the write service removes their checkpoints)", file=sys.stderr)
    return 0


def _collection_list(args: argparse.Namespace) -> int:
    from shardsink.cli.common import read_catalog
    from shared.shard import Shard

    s = _settings(args)
    for c in read_catalog(s).state().live_collections():
        st = Shard.open(s.store(), c.collection_id).refresh()
        print_json(
            {
                "collection": c.collection_id,
                "upper": st.upper.to_json(),
                "since": st.since.to_json(),
                "batches": len(st.batches),
                "rows": st.total_rows(),
                "bytes": st.total_bytes(),
            }
        )
    return 0


def _sink_create(args: argparse.Namespace) -> int:
    """Through the controller (``CreateSink``) or the catalog directly; either way a
    collection that holds rows needs ``--adopt-shard`` or ``--replace-contents``
    (:func:`shared.catalog.check_sink_baseline`), and a refusal writes nothing."""
    from shared.catalog import SinkDef, check_baseline_flags

    check_baseline_flags(args.adopt_shard, args.replace_contents)  # before anything is sent
    if _via_controller(args):
        r = _call(args, "CreateSink", {
            "sink_id": args.sink_id, "collection_id": args.collection, "desired_topic": args.topic,
            "as_of": args.as_of, "read_only": bool(args.read_only), "options": {},
            "adopt_shard": bool(args.adopt_shard), "replace_contents": bool(args.replace_contents),
        })
        print_json({"created": args.sink_id, "as_of": r.get("as_of")})
        return 0
    as_of = args.as_of
    if as_of is None:  # as the controller does: the sink starts at the collection's upper
        from shared.shard import Shard

        s = _settings(args)
        s.catalog().state().collection(args.collection)  # an unknown or dropped id: its typed error first
        upper = Shard.open(s.store(), args.collection).refresh().upper
        as_of = upper.time if upper.time is not None else 0
    _settings(args).catalog().create_sink(
        SinkDef(
            args.sink_id, args.topic, args.collection, as_of=as_of, read_only=args.read_only,
            adopt_shard=bool(args.adopt_shard), replace_contents=bool(args.replace_contents),
        )
    )
    print_json({"created": args.sink_id, "as_of": as_of})
    return 0


def _sink_adopt(args: argparse.Namespace) -> int:
    state = _settings(args).catalog().adopt_shard(args.sink_id)
    print_json({"adopted": args.sink_id, "epoch": state.sink(args.sink_id).epoch})
    return 0


def _sink_drop(args: argparse.Namespace) -> int:
    if _via_controller(args):
        _call(args, "DropSink", {"sink_id": args.sink_id})
    else:
        _settings(args).catalog().drop_sink(args.sink_id)
    print_json({"dropped": args.sink_id})
    return 0


def _sink_allow(args: argparse.Namespace) -> int:
    from shared.errors import InvalidUsageError

    if _via_controller(args):
        r = _call(args, "AllowWrites", {"sink_ids": None if args.sink_id is None else [args.sink_id]})
        print_json({"allowed_writes": r.get("sink_ids")})
        return 0
    if args.sink_id is None:
        raise InvalidUsageError("expected a sink id with --via catalog, found none")
    _settings(args).catalog().allow_writes(args.sink_id)
    print_json({"allowed_writes": [args.sink_id]})
    return 0


def _sink_list(args: argparse.Namespace) -> int:
    from shardsink.cli.common import read_catalog

    for s in read_catalog(_settings(args)).state().live_sinks():
        print_json(s.to_json())
    return 0
