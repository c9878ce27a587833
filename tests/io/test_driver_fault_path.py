"""The path from a standalone cluster's executors to a client-mode driver through fault proxies
(``DriverFaultPath``, shared/devstack/embedded.py), without Spark: servers bound on 127.0.0.1
at the path's two ports stand for the driver's RPC endpoint and block manager; a client that
connects to the advertised address (127.0.0.2, same ports) reaches them through the proxies, a
partition resets its connection and refuses new ones, and the heal lets it through again. The
driver's Spark options route exactly there. The path under a real driver and real executors is
in tests/services/test_write_cluster.py."""

from __future__ import annotations

import shlex
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from shared.devstack.embedded import DRIVER_PROXY_HOST, DriverFaultPath


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def path() -> Iterator[DriverFaultPath]:
    """The path, with an echo server as the "driver" on each of its ports (127.0.0.1)."""
    with DriverFaultPath() as p:
        servers = []
        for proxy in p.proxies:
            server = socketserver.ThreadingTCPServer(("127.0.0.1", proxy.port), _Echo)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
        yield p
        for server in servers:
            server.shutdown()
            server.server_close()


def _round_trip(port: int, data: bytes) -> bytes:
    with socket.create_connection((DRIVER_PROXY_HOST, port), timeout=5) as s:
        s.sendall(data)
        got = b""
        while len(got) < len(data) and (chunk := s.recv(65536)):
            got += chunk
        return got


def test_the_driver_options_bind_loopback_and_advertise_the_proxies_on_the_same_ports(path: DriverFaultPath) -> None:
    assert path.rpc is not None and path.block_manager is not None
    conf = path.spark_conf()
    assert conf["spark.driver.bindAddress"] == "127.0.0.1"
    assert conf["spark.driver.host"] == DRIVER_PROXY_HOST == path.rpc.host == path.block_manager.host
    assert conf["spark.driver.port"] == str(path.rpc.port) and path.rpc.target == ("127.0.0.1", path.rpc.port)
    assert conf["spark.driver.blockManager.port"] == str(path.block_manager.port)
    assert path.block_manager.target == ("127.0.0.1", path.block_manager.port)
    assert conf["spark.port.maxRetries"] == "0"  # a taken port fails the driver, never bypasses a proxy
    words = shlex.split(path.submit_args("--conf spark.python.authenticate.socketTimeout=120s pyspark-shell"))
    assert words[-1] == "pyspark-shell" and words.count("pyspark-shell") == 1
    pairs = dict(w.split("=", 1) for w in words[1:-1:2])
    assert pairs == {**conf, "spark.python.authenticate.socketTimeout": "120s"}


def test_connections_to_the_advertised_address_go_through_the_proxies_and_a_partition_cuts_them(
    path: DriverFaultPath,
) -> None:
    for proxy in path.proxies:
        assert _round_trip(proxy.port, b"register executor") == b"register executor"
    assert {name: c["accepted"] for name, c in path.counters().items()} == {
        "driver-rpc": 1, "driver-block-manager": 1,
    }
    assert path.rpc is not None
    held = socket.create_connection((DRIVER_PROXY_HOST, path.rpc.port), timeout=5)
    held.sendall(b"x")
    assert held.recv(1) == b"x"

    path.partition()
    with pytest.raises(ConnectionError):  # the open connection was reset
        held.sendall(b"y")
        if not held.recv(1):
            raise ConnectionResetError("closed")
    held.close()
    for proxy in path.proxies:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((DRIVER_PROXY_HOST, proxy.port), timeout=5)
    assert path.counters()["driver-rpc"]["resets"] >= 1

    path.heal()
    for proxy in path.proxies:
        assert _round_trip(proxy.port, b"again") == b"again"


def test_latency_on_the_path_delays_both_proxies_and_the_heal_ends_it(path: DriverFaultPath) -> None:
    import time

    path.latency(150, jitter_ms=0)
    for proxy in path.proxies:
        t0 = time.monotonic()
        assert _round_trip(proxy.port, b"slow") == b"slow"
        assert time.monotonic() - t0 >= 0.25, f"expected each way delayed 150 ms through {proxy.name}"
    path.heal()
    for proxy in path.proxies:
        t0 = time.monotonic()
        assert _round_trip(proxy.port, b"fast") == b"fast"
        assert time.monotonic() - t0 < 0.25, f"expected no delay through {proxy.name} after the heal"


def test_loss_needs_the_lossy_path_and_with_it_both_proxies_lose_packets_until_healed() -> None:
    from shared.devstack.netfault import LossPathUnavailableError
    from tests.io.test_netfault import _SKIP_REASON

    with DriverFaultPath() as plain:
        with pytest.raises(LossPathUnavailableError):
            plain.loss(5.0)
    if _SKIP_REASON is not None:
        pytest.skip(f"no lossy path here: {_SKIP_REASON}")
    with DriverFaultPath(loss_path=True) as lossy:
        assert [p.loss_unavailable for p in lossy.proxies] == [None, None]
        lossy.loss(5.0)
        assert [p.loss_percent for p in lossy.proxies] == [5.0, 5.0]
        lossy.heal()
        assert [p.loss_percent for p in lossy.proxies] == [0.0, 0.0]
