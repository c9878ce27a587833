"""The embedded S3 server: moto's S3 backend alone, on werkzeug (``python -m shared.devstack.moto_server``).

``python -m moto.server`` serves every AWS service moto emulates: for each request it works out
the service from the host, the path and the headers, and lists moto's service modules on disk
to do so (a directory check per module, under a lock shared by all request threads), then logs
the request. With S3 as the only service the embedded stack uses, that dispatch was about half
of the server's CPU: 20 GETs of 410 KB took 50-80 ms of its CPU, 20-40 ms served by the S3
application directly with only server errors logged. Requests are answered by the same moto S3
application (:func:`moto.moto_server.werkzeug_app.create_backend_app`), so its behaviour
(conditional writes included) is moto's.

Usage: ``python -m shared.devstack.moto_server HOST PORT``.
"""

from __future__ import annotations

import sys
from typing import Any


def serve(host: str, port: int) -> None:
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = create_backend_app("s3")

    class Handler(MotoRequestHandler):
        def log_request(self, code: Any = "-", size: Any = "-") -> None:
            # Server errors only: a line per request costs the server a share of its CPU.
            if isinstance(code, int) and code >= 500 or str(code).startswith("5"):
                super().log_request(code, size)

    run_simple(host, port, app, threaded=True, request_handler=Handler)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m shared.devstack.moto_server HOST PORT", file=sys.stderr)
        return 2
    serve(args[0], int(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
