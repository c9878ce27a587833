"""What the ``shardsink`` subcommands share: connection flags, a controller session (commands
out, the answer back, errors as one typed line), a collection's row codec, a tiny progress bar.

Settings come from the same environment variables as the services (``services.runtime.settings``),
overridden by flags; the controller's topics from ``SHARDSINK_TOPIC_COMMANDS`` /
``SHARDSINK_TOPIC_RESPONSES`` (``--commands-topic`` / ``--responses-topic``).
"""

from __future__ import annotations

import argparse
import json
import os
from types import TracebackType
from typing import Any

from shardsink.cli.util import ProgressBar, load_schema
from shared.errors import CommandError, KafkaTimeoutError

__all__ = ["ControllerSession", "ProgressBar", "load_schema", "check", "results", "row_codec", "settings"]

#: How long a command waits for its answer by default (``--timeout``).
DEFAULT_TIMEOUT_S = 60.0


def add_connection_args(p: argparse.ArgumentParser, *, controller: bool = True, kafka: bool = True) -> None:
    """The flags of a client command: where Kafka and S3 are (the service-only flags, such as
    ``--master`` or ``--checkpoint-dir``, belong to the services), and with ``controller``
    the controller's topics and how long to wait for its answer."""
    g = p.add_argument_group("connection (flags override the environment)")
    if kafka:
        g.add_argument("--bootstrap", help="Kafka bootstrap servers host:port (default $SHARDSINK_KAFKA_BOOTSTRAP)")
    g.add_argument("--s3-endpoint", help="S3 endpoint URL (default $SHARDSINK_S3_ENDPOINT, else AWS)")
    g.add_argument("--bucket", help="S3 bucket (default $SHARDSINK_S3_BUCKET, else shardsink)")
    g.add_argument("--s3-prefix", help="S3 key prefix (default $SHARDSINK_S3_PREFIX, else none)")
    if controller:
        g.add_argument("--commands-topic", help="the controller's commands topic (default $SHARDSINK_TOPIC_COMMANDS, "
                       "else commands)")
        g.add_argument("--responses-topic", help="the controller's responses topic (default "
                       "$SHARDSINK_TOPIC_RESPONSES, else responses)")
        g.add_argument(
            "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
            help=f"how long to wait for the controller's answer (default {DEFAULT_TIMEOUT_S:g}); a peek at a "
            "time that is not readable yet is answered NotReadableYetError by the controller after its own "
            "peek timeout (30 s by default)",
        )


def add_via(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--via", choices=("auto", "controller", "catalog"), default="auto",
        help="controller: a command to the running controller; catalog: write the catalog on S3 directly; "
        "auto (default): the controller if one has claimed the catalog, else the catalog",
    )


def via_controller(args: argparse.Namespace) -> bool:
    """Whether ``--via`` (auto: a controller epoch is recorded in the catalog) means the controller.
    Deciding creates nothing: without a catalog, auto means the catalog."""
    from shared.catalog import CatalogNotFoundError

    via = getattr(args, "via", "auto")
    if via == "auto":
        try:
            return bool(read_catalog(settings(args)).state().controller_epoch > 0)
        except CatalogNotFoundError:
            return False
    return via == "controller"


def check_bucket(s: Any) -> None:
    """One clear error when the S3 endpoint cannot be reached or the bucket does not exist
    (never creates it)."""
    from shared.errors import ObjectStoreError

    endpoint = s.s3.endpoint or "the AWS S3 endpoint"
    try:
        s.store().client.head_bucket(Bucket=s.s3.bucket)
    except Exception as e:  # noqa: BLE001 - botocore's errors as one of ours
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) if hasattr(e, "response") else ""
        if code in ("404", "NoSuchBucket", "NotFound"):
            found = "no such bucket"
        elif code in ("403", "AccessDenied", "Forbidden"):
            found = "access denied (check the credentials)"
        elif code:
            found = f"{code}"
        else:
            found = f"it unreachable ({type(e).__name__})"
        raise ObjectStoreError(f"expected bucket {s.s3.bucket!r} at {endpoint}, found {found}",
                               bucket=s.s3.bucket) from None


def read_catalog(s: Any) -> Any:
    """The catalog, for a command that only reads: it never creates a catalog or a bucket; a
    missing endpoint, bucket or catalog is one clear error."""
    from shared.catalog import Catalog, CatalogNotFoundError

    check_bucket(s)
    try:
        return Catalog(s.store(), create=False)
    except CatalogNotFoundError:
        prefix = s.s3.prefix.rstrip("/") + "/" if s.s3.prefix else ""
        raise CatalogNotFoundError(
            f"expected a catalog at s3://{s.s3.bucket}/{prefix}catalog/, found none (nothing was created; "
            "check --bucket and --s3-prefix)"
        ) from None


def settings(args: argparse.Namespace) -> Any:
    from services.runtime.settings import ServiceSettings

    return ServiceSettings.from_env_and_args(args)


def topics(args: argparse.Namespace) -> tuple[str, str]:
    cmd = getattr(args, "commands_topic", None) or os.environ.get("SHARDSINK_TOPIC_COMMANDS") or "commands"
    resp = getattr(args, "responses_topic", None) or os.environ.get("SHARDSINK_TOPIC_RESPONSES") or "responses"
    return cmd, resp


class ControllerSession:
    """Send commands to the controller and wait for their answers.

    Reads the responses topic from its end as of the session start (never the whole history).
    An ``Error`` answer raises :class:`CommandError` with ``kind`` (``IdentifierMissing``...),
    which the CLI prints as ``error: <kind>: <message>`` and exits 2.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from shared.io.controller_client import ControllerClient
        from shared.io.kafka import OffsetProbe

        from shardsink.cli.util import check_brokers

        self.settings = settings(args)
        check_brokers(self.settings.kafka.bootstrap)
        self.commands_topic, self.responses_topic = topics(args)
        require_controller(self.settings, self.commands_topic, self.responses_topic)
        self.timeout_s = float(getattr(args, "timeout", DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
        kafka = self.settings.kafka
        with OffsetProbe(kafka) as probe:
            start = probe.ends([(self.responses_topic, 0)])[(self.responses_topic, 0)]
        self.client = ControllerClient(
            kafka, commands_topic=self.commands_topic, responses_topic=self.responses_topic, from_offset=start
        )

    def __enter__(self) -> ControllerSession:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    def send(self, kind: str, body: dict[str, Any]) -> str:
        return self.client.send(kind, body)

    def wait(self, command_id: str, kind: str = "command") -> dict[str, Any]:
        try:
            r = self.client.wait(command_id, self.timeout_s)
        except KafkaTimeoutError:
            raise KafkaTimeoutError(
                f"expected the controller's answer to {kind} on topic {self.responses_topic!r} within "
                f"{self.timeout_s:g}s, found none (is the controller running on {self.commands_topic!r}?)",
                command_id=command_id,
            ) from None
        return check(r)

    def call(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.wait(self.send(kind, body), kind)


def require_controller(s: Any, commands_topic: str, responses_topic: str) -> None:
    """A controller to answer: one has claimed the catalog (its epoch is recorded there) and
    its two topics exist. Checked before anything is sent or created, so a command without a
    controller is one line at once, not a wait for an answer that cannot come, and it leaves
    no topic behind (asking the broker for a missing topic's metadata would create it on
    brokers that create topics on demand, so the check asks a consumer, which never does)."""
    from shared.errors import ControllerNotFoundError, UnknownTopicError
    from shared.io.kafka import OffsetProbe

    if read_catalog(s).state().controller_epoch <= 0:
        prefix = s.s3.prefix.rstrip("/") + "/" if s.s3.prefix else ""
        raise ControllerNotFoundError(
            f"expected a controller serving the catalog at s3://{s.s3.bucket}/{prefix}catalog/, found none has "
            "claimed it (start one: python -m services.controller); nothing was sent"
        )
    missing = []
    with OffsetProbe(s.kafka) as probe:
        for topic in (commands_topic, responses_topic):
            try:
                probe.partitions_of(topic)
            except UnknownTopicError:
                missing.append(topic)
    if missing:
        raise ControllerNotFoundError(
            f"expected the controller's topics {commands_topic!r} and {responses_topic!r}, found no "
            f"{' and no '.join(repr(t) for t in missing)} (is the controller running on {commands_topic!r}? "
            "check --commands-topic and --responses-topic); nothing was sent"
        )


def check(response: dict[str, Any]) -> dict[str, Any]:
    """The response itself, or :class:`CommandError` for an ``Error`` answer."""
    from shared.io.controller_client import body_kind

    if body_kind(response) == "Error":
        b = response["body"][1]
        fields = {k: _loads(v) for k, v in (b.get("fields") or {}).items()}
        raise CommandError(b["message"], kind=b["kind"], **{k: v for k, v in fields.items() if k != "kind"})
    return response


def results(response: dict[str, Any]) -> dict[str, Any]:
    """An ``Ack``'s results, JSON-decoded."""
    return {k: _loads(v) for k, v in response["body"][1].get("results", {}).items()}


def _loads(v: str) -> Any:
    try:
        return json.loads(v)
    except (TypeError, ValueError):
        return v


def row_codec(settings_: Any, collection_id: str) -> Any:
    """The row codec of a collection (from the catalog; dropped collections keep their schema)."""
    from shared.catalog import UnknownCollectionError
    from shared.codec import RowCodec

    c = read_catalog(settings_).state().collections.get(collection_id)
    if c is None:
        raise UnknownCollectionError(f"expected a collection {collection_id!r}, found none", collection_id=collection_id)
    return RowCodec(c.schema)


def print_json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str), flush=True)
