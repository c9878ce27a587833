"""``shardsink up``: run the embedded Kafka + S3 stack in the foreground."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "up", help="run the embedded Tansu broker and moto S3 server",
        description="Run the embedded Kafka (Tansu) + S3 (moto) stack in the foreground and print the "
        "environment variables that point at it; a busy port is refused in one line.",
    )
    p.add_argument("--kafka-port", type=int, default=9092, help="the Kafka broker's port (default 9092)")
    p.add_argument("--s3-port", type=int, default=5000, help="the S3 server's port (default 5000)")
    p.add_argument("--bucket", default="shardsink", help="the bucket to create (default shardsink)")
    p.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from shared.devstack.embedded import main

    return main(
        ["--kafka-port", str(args.kafka_port), "--s3-port", str(args.s3_port), "--bucket", args.bucket]
    )
