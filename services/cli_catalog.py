"""``shardsink collection ...`` and ``shardsink sink ...``: manage the catalog directly.

These write the catalog on S3 themselves (with the same conditional writes the controller
uses), for deployments without the controller and for tests. With a controller running, send
commands to it instead.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shared.cli import print_json


def _settings(args: argparse.Namespace) -> Any:
    from services.common import ServiceSettings

    return ServiceSettings.from_env_and_args(args)


def register(sub: Any) -> None:
    from services.common import ServiceSettings

    col = sub.add_parser("collection", help="create, list or drop collections (direct catalog access)")
    csub = col.add_subparsers(dest="collection_cmd", required=True)
    p = csub.add_parser("create", help="create a collection and its shard")
    p.add_argument("collection_id")
    p.add_argument("--schema", required=True, help="Avro record schema file (.avsc) of the rows")
    p.add_argument("--since", type=int, default=0)
    ServiceSettings.add_arguments(p)
    p.set_defaults(func=_collection_create)
    p = csub.add_parser("list", help="list collections with upper, since and batch counts")
    ServiceSettings.add_arguments(p)
    p.set_defaults(func=_collection_list)

    sk = sub.add_parser("sink", help="create, drop, allow writes on, or list sinks (direct catalog access)")
    ssub = sk.add_subparsers(dest="sink_cmd", required=True)
    p = ssub.add_parser("create", help="register a sink: desired topic -> collection")
    p.add_argument("sink_id")
    p.add_argument("--topic", required=True, help="the desired topic")
    p.add_argument("--collection", required=True)
    p.add_argument("--as-of", type=int, default=0)
    p.add_argument("--read-only", action="store_true")
    ServiceSettings.add_arguments(p)
    p.set_defaults(func=_sink_create)
    for name, fn, hlp in (
        ("drop", _sink_drop, "drop a sink"),
        ("allow-writes", _sink_allow, "leave read-only mode"),
    ):
        p = ssub.add_parser(name, help=hlp)
        p.add_argument("sink_id")
        ServiceSettings.add_arguments(p)
        p.set_defaults(func=fn)
    p = ssub.add_parser("list", help="list sinks")
    ServiceSettings.add_arguments(p)
    p.set_defaults(func=_sink_list)


def create_collection(settings: Any, collection_id: str, schema: dict[str, Any], since: int = 0) -> None:
    """Catalog entry first (validates the id and refuses reuse), then the shard."""
    from shared.avro_arrow import parse_row_schema
    from shared.catalog import CollectionDef
    from shared.shard import Shard

    parsed = parse_row_schema(schema)
    settings.catalog().create_collection(CollectionDef(collection_id, parsed, since))
    Shard.create(settings.store(), collection_id, parsed, since=since)


def _collection_create(args: argparse.Namespace) -> int:
    with open(args.schema, encoding="utf-8") as f:
        schema = json.load(f)
    create_collection(_settings(args), args.collection_id, schema, args.since)
    print_json({"created": args.collection_id})
    return 0


def _collection_list(args: argparse.Namespace) -> int:
    from shared.shard import Shard

    s = _settings(args)
    for c in s.catalog().state().live_collections():
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
    from shared.catalog import SinkDef

    _settings(args).catalog().create_sink(
        SinkDef(args.sink_id, args.topic, args.collection, as_of=args.as_of, read_only=args.read_only)
    )
    print_json({"created": args.sink_id})
    return 0


def _sink_drop(args: argparse.Namespace) -> int:
    _settings(args).catalog().drop_sink(args.sink_id)
    print_json({"dropped": args.sink_id})
    return 0


def _sink_allow(args: argparse.Namespace) -> int:
    _settings(args).catalog().allow_writes(args.sink_id)
    print_json({"allowed_writes": args.sink_id})
    return 0


def _sink_list(args: argparse.Namespace) -> int:
    for s in _settings(args).catalog().state().live_sinks():
        print_json(s.to_json())
    return 0
