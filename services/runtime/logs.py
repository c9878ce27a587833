"""The services' logs: structured (JSON) lines on stderr."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

log = logging.getLogger("shardsink")


def configure_logging(service: str) -> None:
    """Structured (JSON) logs on stderr; secrets are never logged (settings repr masks them)."""
    class _Json(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            out: dict[str, Any] = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "service": service,
                "msg": record.getMessage(),
            }
            for k in ("sink_id", "collection_id", "shard_id"):
                v = getattr(record, k, None)
                if v is not None:
                    out[k] = v
            if record.exc_info:
                out["exc"] = self.formatException(record.exc_info)
            return json.dumps(out)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Json())
    root = logging.getLogger("shardsink")
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("SHARDSINK_LOG_LEVEL", "INFO").upper())
    root.propagate = False
