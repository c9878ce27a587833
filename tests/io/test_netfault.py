"""The loopback fault proxy of the development stack (shared/devstack/netfault.py) on a plain
echo server: it forwards both ways; a partition refuses connects and resets open connections,
and heal() listens on the same port again; a black hole holds bytes without losing them;
latency delays each chunk and keeps the order. The stack's own use of it (a broker that
advertises its proxy) is in tests/campaigns/test_network_faults.py."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from shared.devstack.netfault import FaultProxy, _ephemeral_range, stable_port


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with FaultProxy(server.server_address[1], name="echo", seed=1) as p:
        yield p
    server.shutdown()
    server.server_close()


def _connect(p: FaultProxy, timeout_s: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=timeout_s)
    return s


def _echo(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_the_proxy_port_is_below_the_ephemeral_range() -> None:
    lo, _ = _ephemeral_range()
    if lo <= 12000:
        pytest.skip(f"the ephemeral range starts at {lo}: no room below it")
    assert 10000 <= stable_port() < lo


def test_it_forwards_both_ways(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        payload = bytes(range(256)) * 1000
        assert _echo(s, payload) == payload
    # The proxy counts a chunk on its own thread once it has handed it on: the echo can reach
    # this thread first, so wait (bounded) for the count rather than read it at once.
    deadline = time.monotonic() + 10.0
    while proxy.counters.bytes_forwarded < 2 * len(payload) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.counters.accepted == 1 and proxy.counters.bytes_forwarded == 2 * len(payload)


def test_a_partition_resets_open_connections_and_refuses_new_ones_until_healed(proxy: FaultProxy) -> None:
    port = proxy.port
    s = _connect(proxy)
    assert _echo(s, b"before") == b"before"
    proxy.partition()
    assert proxy.mode == "partition" and proxy.connections == 0
    with pytest.raises(ConnectionResetError):
        s.sendall(b"x")
        s.recv(10)
    s.close()
    with pytest.raises(ConnectionRefusedError):
        _connect(proxy)
    proxy.heal()
    assert proxy.mode == "pass" and proxy.port == port
    with _connect(proxy) as s2:
        assert _echo(s2, b"after") == b"after"
    assert proxy.counters.resets == 1 and proxy.counters.partitions == proxy.counters.heals == 1


def test_a_black_hole_holds_bytes_until_healed_and_loses_none(proxy: FaultProxy) -> None:
    old = _connect(proxy)
    assert _echo(old, b"1") == b"1"
    proxy.blackhole()
    new = _connect(proxy)  # accepted, though nothing goes through
    old.sendall(b"held-old")
    new.sendall(b"held-new")
    for s in (old, new):
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(10)
        s.settimeout(5.0)
    proxy.heal()
    assert old.recv(100) == b"held-old" and new.recv(100) == b"held-new"
    old.close()
    new.close()


def test_latency_delays_every_chunk_and_keeps_the_order(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        t0 = time.monotonic()
        assert _echo(s, b"a") == b"a"
        fast = time.monotonic() - t0
        proxy.latency(100, jitter_ms=50)
        t0 = time.monotonic()
        assert _echo(s, b"b") == b"b"
        slow = time.monotonic() - t0  # two chunks, each 50-150 ms late
        s.sendall(b"".join(bytes([i]) for i in range(50)))
        got = b""
        while len(got) < 50:
            got += s.recv(100)
        assert got == bytes(range(50))
        proxy.heal()
    assert slow >= 0.1 and slow > fast
