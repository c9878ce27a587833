"""Small helpers of the command line: schema files with one-line errors, a progress bar."""

from __future__ import annotations

import json
import sys
import time
from types import TracebackType
from typing import IO, Any


def load_schema(path: str) -> dict[str, Any]:
    """An Avro record schema file, with a one-line error for a missing or invalid file."""
    from shared.errors import SchemaError

    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise SchemaError(f"expected a readable schema file {path!r}, found: {e.strerror}", path=path) from None
    except json.JSONDecodeError as e:
        raise SchemaError(f"expected JSON in schema file {path!r}, found invalid JSON ({e.msg})", path=path) from None
    if not isinstance(schema, dict):
        raise SchemaError(f"expected an Avro record schema object in {path!r}, found {type(schema).__name__}")
    return schema


def check_brokers(bootstrap: str, timeout_s: float = 3.0) -> None:
    """One clear error, at once, when none of the bootstrap servers accepts a connection
    (instead of librdkafka retrying for its whole timeout)."""
    import socket

    from shared.errors import KafkaUnavailableError

    last = "no address given"
    for server in [b.strip() for b in bootstrap.split(",") if b.strip()]:
        server = server.split("://", 1)[-1]
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as e:
            last = (getattr(e, "strerror", None) or str(e) or type(e).__name__).lower()
    raise KafkaUnavailableError(
        f"expected a Kafka broker at {bootstrap or '(none)'}, found none reachable ({last}); "
        "check --bootstrap or SHARDSINK_KAFKA_BOOTSTRAP",
        bootstrap=bootstrap,
    )


def quiet_logging() -> None:
    """The CLI's logging: ``warning: ...`` lines on stderr (level from SHARDSINK_LOG_LEVEL,
    default WARNING); librdkafka's own lines only when it is DEBUG."""
    import logging
    import os

    root = logging.getLogger("shardsink")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SHARDSINK_LOG_LEVEL", "WARNING").upper())
        root.propagate = False
    from shared.io.kafka import quiet_client_logs

    # librdkafka's own lines (connection failures it retries by itself) only when debugging:
    # an unreachable broker is reported once, by the commands, naming its address.
    quiet_client_logs(None if root.level <= logging.DEBUG else 2)


class ProgressBar:
    """A tiny progress bar on stderr (only when it is a terminal, unless ``force``).

    ``total`` None shows a counter. Redraws at most every ``interval_s``; ``close()`` ends
    the line. Never writes to stdout, so piped output stays clean.
    """

    def __init__(
        self, desc: str, total: int | None = None, *, unit: str = "rows", stream: IO[str] | None = None,
        force: bool = False, interval_s: float = 0.1, width: int = 30,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or (hasattr(self.stream, "isatty") and self.stream.isatty())
        self.n = 0
        self.interval_s, self.width = interval_s, width
        self._start = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.enabled and time.monotonic() - self._last >= self.interval_s:
            self._draw()

    def _draw(self) -> None:
        self._last = time.monotonic()
        rate = self.n / max(self._last - self._start, 1e-9)
        if self.total:
            frac = min(self.n / self.total, 1.0)
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            text = f"\r{self.desc} [{bar}] {self.n}/{self.total} {self.unit} ({rate:,.0f}/s)"
        else:
            text = f"\r{self.desc} {self.n} {self.unit} ({rate:,.0f}/s)"
        self.stream.write(text)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
