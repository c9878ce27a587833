"""The embedded S3 server: moto's S3 backend alone, on waitress (``python -m shared.devstack.moto_server``).

``python -m moto.server`` serves every AWS service moto emulates: for each request it works out
the service from the host, the path and the headers, and lists moto's service modules on disk
to do so (a directory check per module, under a lock shared by all request threads), then logs
the request. With S3 as the only service the embedded stack uses, that dispatch was about half
of the server's CPU: 20 GETs of 410 KB took 50-80 ms of its CPU, 20-40 ms served by the S3
application directly with only server errors logged. Requests are answered by the same moto S3
application (:func:`moto.moto_server.werkzeug_app.create_backend_app`), so its behaviour
(conditional writes included) is moto's.

Served by waitress (a multi-threaded WSGI server with HTTP/1.1 keep-alive), as a real S3
endpoint keeps its connections: werkzeug's development server answers every request with
``Connection: close``, so each request cost a TCP connection and a server thread on both
sides (measured here, 2,400 requests on four threads: per request 1.5-1.7 ms of the server's
CPU and 1.25-1.45 ms of the client's with werkzeug, 1.3 and 1.17 ms with waitress).

moto checks a write's condition and then writes, with nothing between the two: two
``If-None-Match: *`` PUTs of one key, decided on two request threads, could both pass the check
and both answer 200 (seen once in a CI run under load, 2 winners among 6 racing threads). S3
decides a conditional write atomically, and every compare-and-append here is built on that, so
the server takes conditional writes one at a time (:class:`SerialConditionalWrites`).

The server counts the requests it answers by method and kind (:class:`RequestCounts`; ``GET
/_shardsink/requests`` answers them as JSON, and ``_shardsink`` cannot name an S3 bucket), so a
benchmark can say what a step of a sink costs in S3 requests.

Usage: ``python -m shared.devstack.moto_server HOST PORT``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

#: Request threads (moto's backend holds the GIL; more threads only queue on it).
THREADS = 8
#: Open connections the server keeps: every process's client pools its connections (up to
#: 32 each), and a connection past the limit would wait for an idle one to time out.
CONNECTION_LIMIT = 2000


#: The request headers that make a write conditional (WSGI names).
_CONDITIONS = ("HTTP_IF_NONE_MATCH", "HTTP_IF_MATCH")


class SerialConditionalWrites:
    """WSGI middleware: a conditional write (a ``PUT`` or ``POST`` with ``If-None-Match`` or
    ``If-Match``) is answered under one lock, its check and its write together, so that of
    conditional writes racing on a key exactly one wins. Other requests pass untouched."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST") or not any(h in environ for h in _CONDITIONS):
            return self.app(environ, start_response)
        with self.lock:
            result = self.app(environ, start_response)
            try:
                return [b"".join(result)]  # the write is done once its answer is
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()


#: Where the counts are answered (an underscore never starts an S3 bucket's name).
COUNTS_PATH = "/_shardsink/requests"

#: An object's kind, by the first pattern its path matches (a shard's layout, the catalog's).
KINDS = (
    ("catalog", re.compile(r"/catalog/")),
    ("part", re.compile(r"/data/")),
    ("state", re.compile(r"/state/")),
    ("hint", re.compile(r"/hint$")),
)


def request_kind(environ: dict[str, Any]) -> str:
    """``<METHOD>[ if] <kind>``: ``if`` for a conditional write; the kind from :data:`KINDS`,
    ``list`` for a listing, ``other`` for anything else."""
    method = str(environ.get("REQUEST_METHOD", ""))
    cond = " if" if any(h in environ for h in _CONDITIONS) else ""
    path = str(environ.get("PATH_INFO", ""))
    if "list-type" in str(environ.get("QUERY_STRING", "")):
        kind = "list"
    else:
        kind = next((k for k, pattern in KINDS if pattern.search(path)), "other")
    return f"{method}{cond} {kind}"


class RequestCounts:
    """WSGI middleware: counts every request by :func:`request_kind` and answers
    :data:`COUNTS_PATH` with the counts so far (``{"requests": {"GET state": 12, ...}}``)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self.lock:
                body = json.dumps({"requests": dict(self.counts)}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = request_kind(environ)
        with self.lock:
            self.counts[kind] += 1
        return self.app(environ, start_response)


def read_request_counts(endpoint: str, timeout_s: float = 10.0) -> dict[str, int]:
    """The counts a server at ``endpoint`` (``http://host:port``) has so far (:class:`RequestCounts`)."""
    import urllib.request

    with urllib.request.urlopen(f"{endpoint}{COUNTS_PATH}", timeout=timeout_s) as r:
        return {str(k): int(v) for k, v in json.load(r)["requests"].items()}


def counts_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The requests answered between two snapshots of the counts, by kind (kinds with none
    left out), the most frequent first."""
    spent = {k: n - before.get(k, 0) for k, n in after.items()}
    return {k: n for k, n in sorted(spent.items(), key=lambda kv: -kv[1]) if n > 0}


def serve(host: str, port: int) -> None:
    import waitress
    from moto.moto_server.werkzeug_app import create_backend_app

    app = RequestCounts(SerialConditionalWrites(create_backend_app("s3")))
    # Server errors only reach the log (a line per request costs the server a share of its CPU).
    waitress.serve(app, host=host, port=port, threads=THREADS, connection_limit=CONNECTION_LIMIT,
                   channel_timeout=60, asyncore_use_poll=True, ident="shardsink-embedded-s3", _quiet=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m shared.devstack.moto_server HOST PORT", file=sys.stderr)
        return 2
    serve(args[0], int(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
