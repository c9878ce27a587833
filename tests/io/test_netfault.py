"""The loopback fault proxy of the development stack (shared/devstack/netfault.py) on a plain
echo server: it forwards both ways; a partition refuses connects and resets open connections,
and heal() listens on the same port again; a black hole holds bytes without losing them;
latency delays each chunk and keeps the order. Its lossy path (``loss_path=True``: upstream
connections cross a veth into a private network namespace, with an eBPF packet dropper on the
veth, shared/devstack/lossy_link.py) carries every byte both ways intact under 5 % packet loss,
really drops packets each way, is deleted when the proxy stops or its process dies, and is
refused with the reason where the machine cannot build it. The stack's own use of the proxies
(a broker that advertises its proxy) is in tests/services/test_sink_network_faults.py and
bench/chaos.py."""

from __future__ import annotations

import os
import random
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.devstack.lossy_link import LossyLink, check_prerequisites, sweep_stale_links
from shared.devstack.netfault import FaultProxy, LossPathUnavailableError, _ephemeral_range, stable_port

REPO = Path(__file__).resolve().parents[2]


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo_port: int) -> Iterator[FaultProxy]:
    with FaultProxy(echo_port, name="echo", seed=1) as p:
        yield p


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


# -- the lossy path (packet loss on a veth in a private network namespace) -----------------------


def _loss_path_skip_reason() -> str | None:
    """Why this machine cannot run the lossy path's tests (root, iproute2 with ``ip netns``,
    Linux >= 6.6 for tcx), or None. Past these checks the lossy path must work: a failure to
    build it then fails the test, with the reason."""
    try:
        check_prerequisites()
    except LossPathUnavailableError as e:
        return e.reason
    if subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30, check=False).returncode != 0:
        return "`ip netns list` fails: no network namespace support in iproute2 or the kernel"
    return None


_SKIP_REASON = _loss_path_skip_reason()
needs_loss_path = pytest.mark.skipif(_SKIP_REASON is not None, reason=f"no lossy path here: {_SKIP_REASON}")


@pytest.fixture
def lossy_proxy(echo_port: int) -> Iterator[FaultProxy]:
    with FaultProxy(echo_port, name="echo-lossy", seed=2, loss_path=True) as p:
        assert p.loss_unavailable is None, f"expected the lossy path built on this machine, found: {p.loss_unavailable}"
        yield p


def _echo_concurrently(s: socket.socket, data: bytes, timeout_s: float = 60.0) -> bytes:
    """Send ``data`` from a thread while reading the echo here (a large payload sent first
    would fill both directions' buffers); every wait is bounded by the socket's timeout."""
    s.settimeout(timeout_s)
    failure: list[BaseException] = []

    def send() -> None:
        try:
            s.sendall(data)
        except OSError as e:
            failure.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    got = bytearray()
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    sender.join(timeout_s)
    assert not failure, f"expected the payload sent, found {failure[0]!r}"
    return bytes(got)


def _link_listed(name: str) -> bool:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30, check=False).stdout
    return f" {name}@" in out or f" {name}:" in out


def _wait_link_gone(name: str, timeout_s: float = 10.0) -> bool:
    """The kernel frees a namespace (and its veth) asynchronously: poll, bounded."""
    deadline = time.monotonic() + timeout_s
    while _link_listed(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@needs_loss_path
def test_the_loss_path_carries_every_byte_both_ways_under_5_percent_packet_loss(lossy_proxy: FaultProxy) -> None:
    payload = random.Random(5).randbytes(2_000_000)
    with _connect(lossy_proxy, timeout_s=60.0) as s:
        assert _echo_concurrently(s, b"before the loss") == b"before the loss"
        before = lossy_proxy.loss_counters()
        lossy_proxy.loss(5.0)
        assert lossy_proxy.loss_percent == 5.0
        assert _echo_concurrently(s, payload) == payload  # a connection opened before the loss
        with _connect(lossy_proxy, timeout_s=60.0) as s2:  # and one opened under it
            assert _echo_concurrently(s2, payload[:300_000]) == payload[:300_000]
    lossy = lossy_proxy.loss_counters()
    # Real packets were lost each way (requests out to the relay, echoes back), near 5 %.
    out_seen = lossy.out_passed + lossy.out_dropped - before.out_passed - before.out_dropped
    in_seen = lossy.in_passed + lossy.in_dropped - before.in_passed - before.in_dropped
    assert lossy.out_dropped > 0 and lossy.in_dropped > 0, lossy
    assert out_seen > 500 and in_seen > 200, lossy
    assert 0.01 < lossy.out_dropped / out_seen < 0.12 and 0.01 < lossy.in_dropped / in_seen < 0.12, lossy
    assert lossy_proxy.counters.relayed == 2 and lossy_proxy.counters.losses == 1
    lossy_proxy.heal()
    assert lossy_proxy.loss_percent == 0.0
    # The closed connections' last segments (FINs, ACKs, retransmissions) may still have met
    # the dropper between the count above and the heal: the count after it is the baseline.
    at_heal = lossy_proxy.loss_counters()
    with _connect(lossy_proxy, timeout_s=60.0) as s3:
        assert _echo_concurrently(s3, payload[:300_000]) == payload[:300_000]
    healed = lossy_proxy.loss_counters()
    assert (healed.out_dropped, healed.in_dropped) == (at_heal.out_dropped, at_heal.in_dropped), healed  # no dropper


@needs_loss_path
def test_a_partition_through_the_loss_path_resets_both_hops_and_heals(lossy_proxy: FaultProxy) -> None:
    s = _connect(lossy_proxy)
    assert _echo(s, b"before") == b"before"
    lossy_proxy.partition()
    with pytest.raises(ConnectionResetError):
        s.sendall(b"x")
        s.recv(10)
    s.close()
    lossy_proxy.heal()
    with _connect(lossy_proxy) as s2:
        assert _echo(s2, b"after") == b"after"
    assert lossy_proxy.counters.relayed == 2


@needs_loss_path
def test_the_loss_path_is_deleted_when_the_proxy_stops(echo_port: int) -> None:
    p = FaultProxy(echo_port, name="echo-lossy", loss_path=True).start()
    try:
        assert p.loss_unavailable is None, p.loss_unavailable
        assert p._link is not None
        name = p._link.host_ifname
        assert _link_listed(name)
        p.loss(5.0)
    finally:
        p.stop()
    assert _wait_link_gone(name), f"expected {name} deleted with the proxy, found it still there"


@needs_loss_path
def test_a_killed_process_leaves_no_link_and_a_stale_one_is_swept() -> None:
    # A child builds a link, turns the loss on and is SIGKILLed: the kernel frees its
    # namespace, the veth pair and the dropper.
    code = ("import time; from shared.devstack.lossy_link import LossyLink; "
            "link = LossyLink().open(); link.set_loss(5.0); print(link.host_ifname, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()  # bounded: the child prints or dies
        assert name.startswith("snf") and _link_listed(name), name
    finally:
        child.kill()
        child.wait(30)
    assert _wait_link_gone(name), f"expected {name} gone with its killed process, found it still there"
    # A device named like ours whose process is gone (a pid above any pid_max) is swept.
    stale = "snf99999999x0h"
    subprocess.run(["ip", "link", "add", stale, "type", "veth", "peer", "name", "snf99999999x0n"],
                   check=True, timeout=30, capture_output=True)
    try:
        assert stale in sweep_stale_links()
        assert not _link_listed(stale)
    finally:
        subprocess.run(["ip", "link", "del", stale], capture_output=True, timeout=30, check=False)


def test_without_root_the_loss_path_is_refused_with_the_reason_and_the_proxy_still_forwards(
    echo_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LossPathUnavailableError, match="needs root") as e:
        LossyLink().open()
    assert "uid 1000" in e.value.reason
    with FaultProxy(echo_port, name="echo-no-loss", loss_path=True) as p:
        assert p.loss_unavailable == e.value.reason
        with _connect(p) as s:
            assert _echo(s, b"direct") == b"direct"
        with pytest.raises(LossPathUnavailableError) as refused:
            p.loss(5.0)
        assert refused.value.reason == e.value.reason and p.counters.relayed == 0


def test_a_proxy_started_without_the_loss_path_refuses_loss(proxy: FaultProxy) -> None:
    with pytest.raises(LossPathUnavailableError, match="without loss_path=True"):
        proxy.loss(5.0)
    assert proxy.loss_percent == 0.0 and proxy.loss_counters().out_dropped == 0
