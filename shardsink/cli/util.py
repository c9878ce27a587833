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
