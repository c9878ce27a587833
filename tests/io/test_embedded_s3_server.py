"""The embedded S3 server decides racing conditional writes one at a time, as S3 does: moto
checks a write's condition and then writes, and under load two ``If-None-Match: *`` PUTs of one
key both won (CI, 2 winners among 6 threads). The race itself against the real server is
``tests/shared/test_shard_concurrency.py``; this pins the middleware with an application that
races the same way, its gap between check and write made wide."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.devstack.moto_server import SerialConditionalWrites


class CheckThenWrite:
    """A store that, like moto, checks ``If-None-Match: *`` and writes some time later."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.closed = 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        key = environ["PATH_INFO"]
        if environ["REQUEST_METHOD"] == "GET":
            start_response("200 OK", [])
            return [self.objects.get(key, b"")]
        if environ.get("HTTP_IF_NONE_MATCH") == "*" and key in self.objects:
            start_response("412 Precondition Failed", [])
            return [b"exists"]
        time.sleep(0.05)
        self.objects[key] = environ["wsgi.input"]
        start_response("200 OK", [])
        return self.Answer(self)

    class Answer(list[bytes]):
        def __init__(self, store: CheckThenWrite) -> None:
            super().__init__([b"written"])
            self.store = store

        def close(self) -> None:
            self.store.closed += 1


def race(app: Callable[..., Iterable[bytes]], writers: int) -> list[int]:
    """``writers`` threads PUT one key with If-None-Match: *; returns who got a 200."""
    barrier = threading.Barrier(writers)

    def put(w: int) -> tuple[int, str]:
        status: list[str] = []
        barrier.wait()
        body = b"".join(app({"REQUEST_METHOD": "PUT", "PATH_INFO": "/b/k", "HTTP_IF_NONE_MATCH": "*", "wsgi.input": b"w%d" % w},
                            lambda s, _h: status.append(s)))
        assert body in (b"written", b"exists")
        return w, status[0]

    with ThreadPoolExecutor(writers) as ex:
        return [w for w, s in ex.map(put, range(writers)) if s.startswith("200")]


def test_conditional_puts_racing_on_a_key_have_exactly_one_winner_and_it_is_stored() -> None:
    raw = CheckThenWrite()
    assert len(race(raw, 6)) > 1, "the application under test does not race: the test proves nothing"
    store = CheckThenWrite()
    winners = race(SerialConditionalWrites(store), 6)
    assert len(winners) == 1
    assert store.objects["/b/k"] == b"w%d" % winners[0]
    assert store.closed == 1  # the winner's answer was closed, as a WSGI server would


def test_reads_and_unconditional_writes_do_not_wait_for_a_conditional_write() -> None:
    store = CheckThenWrite()
    app = SerialConditionalWrites(store)
    with app.lock:  # a conditional write in progress
        got = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/b/x"}, lambda s, h: None))
        assert got == b""
        app({"REQUEST_METHOD": "PUT", "PATH_INFO": "/b/y", "wsgi.input": b"plain"}, lambda s, h: None)
        assert store.objects["/b/y"] == b"plain"
