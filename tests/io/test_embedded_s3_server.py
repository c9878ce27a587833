"""The embedded S3 server decides racing conditional writes one at a time, as S3 does: moto
checks a write's condition and then writes, and under load two ``If-None-Match: *`` PUTs of one
key both won (CI, 2 winners among 6 threads). The race itself against the real server is
``tests/shared/test_shard_concurrency.py``; this pins the middleware with an application that
races the same way, its gap between check and write made wide. The server also counts the
requests it answers by method and object, which ``bench/bench_sinks.py`` reports per step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.devstack.moto_server import SerialConditionalWrites, counts_since, request_kind


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


def test_request_kind_names_the_method_the_condition_and_the_object() -> None:
    def env(method: str, path: str, query: str = "", **headers: str) -> dict[str, Any]:
        return {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query, **headers}

    assert request_kind(env("PUT", "/b/shards/s1-e1/data/abc-w0of2.parquet", HTTP_IF_NONE_MATCH="*")) == "PUT if part"
    assert request_kind(env("GET", "/b/shards/s1-e1/state/00000000000000000012.json")) == "GET state"
    assert request_kind(env("PUT", "/b/shards/s1-e1/state/13.json", HTTP_IF_NONE_MATCH="*")) == "PUT if state"
    assert request_kind(env("GET", "/b/catalog/state/3.json")) == "GET catalog"
    assert request_kind(env("PUT", "/b/shards/s1-e1/hint")) == "PUT hint"
    assert request_kind(env("GET", "/b", "list-type=2&prefix=shards/")) == "GET list"
    assert request_kind(env("HEAD", "/b/elsewhere/x")) == "HEAD other"


def test_the_embedded_server_counts_the_requests_it_answers_by_kind(tmp_path: Any) -> None:
    """A server of its own (the session's stack serves other tests' processes meanwhile)."""
    from shared.devstack.embedded import EMBEDDED_ACCESS_KEY, EMBEDDED_SECRET_KEY, EmbeddedStack, free_port
    from shared.io.s3 import S3ObjectStore, S3Settings

    s3 = EmbeddedStack(bucket="counts", s3_port=free_port())
    try:
        s3._start_s3(tmp_path, timeout_s=60)  # the S3 server alone, its bucket created
        store = S3ObjectStore(S3Settings(bucket="counts", endpoint=s3.s3_endpoint, access_key=EMBEDDED_ACCESS_KEY,
                                         secret_key=EMBEDDED_SECRET_KEY, prefix="p"))
        before = s3.s3_requests()
        store.put("shards/x/data/p-w0of1.parquet", b"part")
        store.put("shards/x/state/1.json", b"{}")
        assert store.get("shards/x/state/1.json") == b"{}"
        assert store.get("shards/x/state/1.json") == b"{}"
        store.put("shards/x/hint", b"1")
        after = s3.s3_requests()
    finally:
        s3.stop()
    assert counts_since(before, after) == {"PUT part": 1, "PUT state": 1, "GET state": 2, "PUT hint": 1}


def test_a_late_bound_port_is_free_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """A port chosen for a process that binds it later (a service's metrics endpoint) lies below
    the kernel's ephemeral range, where no outbound connection's local port or bind of port 0
    can take it meanwhile; one process never gets the same port twice, and each can be bound."""
    import socket

    from shared.devstack.embedded import late_bound_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [late_bound_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
