"""Network faults on loopback: a TCP proxy that forwards a listen port to a target port and,
on command, partitions, black-holes, delays or heals the path (tests and fault campaigns).

::

    with FaultProxy(target_port=stack_s3_port) as proxy:
        endpoint = f"http://{proxy.address}"    # the clients under test use this
        proxy.partition()   # refused: the listener is closed (new connects get ECONNREFUSED)
                            # and every open connection is reset (SO_LINGER 0: an RST each way)
        proxy.heal()        # listening and forwarding again, on the same port
        proxy.blackhole()   # connects are accepted, nothing is forwarded either way (held, not
                            # dropped: after heal() the streams go on intact, as TCP would)
        proxy.latency(50, jitter_ms=20)  # every chunk delayed by 30-70 ms, order kept
        proxy.heal()        # back to plain forwarding (no latency)

    with FaultProxy(target_port=port, loss_path=True) as proxy:
        proxy.loss(5.0)     # 5 % of the packets lost each way (real packets: see below)
        proxy.heal()

Packet loss needs a real network device: a proxy cannot lose a packet, TCP hides it. With
``loss_path=True`` the proxy's upstream connections cross a veth pair into a private network
namespace, where a relay (in the proxy's own loop) connects back to the target, and
``loss()`` attaches a packet dropper to the veth (:mod:`shared.devstack.lossy_link`). Where
the machine cannot do that (not root, no namespaces, no tcx eBPF) the proxy forwards
directly, ``loss_unavailable`` holds the reason, and ``loss()`` raises
:class:`LossPathUnavailableError` with it.

The proxy runs an asyncio loop in a daemon thread; the commands are synchronous: when
``partition()`` returns, the listener is closed and every connection reset. ``heal()``
re-binds the same port, so the proxy's port is picked below the kernel's ephemeral range
(:func:`stable_port`): no client's own ephemeral port can be it, which would make a connect
to the closed port connect to itself (TCP simultaneous open on loopback) or keep the port
from being bound again.

For Kafka the broker must advertise the proxy's address, or the clients bypass it after
bootstrap (``EmbeddedStack(net_faults=True)`` does that: see ``embedded.py``).
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from shared.devstack.lossy_link import LossCounters, LossPathUnavailableError, LossyLink

__all__ = ["FaultProxy", "LossCounters", "LossPathUnavailableError", "NetFaultError", "ProxyCounters", "stable_port"]

Mode = Literal["pass", "partition", "blackhole"]

#: Bytes read from one side at a time (one "chunk" for the latency).
CHUNK = 64 * 1024
#: Chunks held per direction before the proxy stops reading that side (backpressure).
QUEUED_CHUNKS = 64


class NetFaultError(RuntimeError):
    """The fault proxy could not start, bind its port again or carry out a command."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def stable_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A free TCP port on ``host`` below the kernel's ephemeral port range (so no outgoing
    connection is given it as its own port); any free port when that range starts too low."""
    lo, _ = _ephemeral_range()
    r = rng or random.Random()
    if lo > 12000:
        for _ in range(200):
            port = r.randrange(10000, lo)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ProxyCounters:
    """What the proxy did so far (read them from any thread)."""

    accepted: int = 0
    upstream_refused: int = 0
    resets: int = 0
    bytes_forwarded: int = 0
    partitions: int = 0
    blackholes: int = 0
    losses: int = 0
    heals: int = 0
    #: Connections the relay in the lossy path's namespace carried (``loss_path=True``).
    relayed: int = 0


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with an RST (SO_LINGER on, timeout 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for w in (self.client, self.upstream):
            _reset(w)
        for t in self.tasks:
            t.cancel()


class FaultProxy:
    """Forwards ``host:port`` (``listen_port`` 0: a :func:`stable_port`) to
    ``target_host:target_port``; see the module docstring for the faults."""

    def __init__(
        self,
        target_port: int,
        *,
        listen_port: int = 0,
        host: str = "127.0.0.1",
        target_host: str = "127.0.0.1",
        name: str = "proxy",
        seed: int | None = None,
        loss_path: bool = False,
    ) -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = listen_port
        self.name = name
        self.counters = ProxyCounters()
        self._rng = random.Random(seed)
        self._mode: Mode = "pass"
        self._latency_s = (0.0, 0.0)  # (base, jitter)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._conns: set[_Conn] = set()
        #: Lossy path (``loss_path=True``): the veth link, the relay's listener in its
        #: namespace, and the relay's connections.
        self._want_loss_path = loss_path
        self._link: LossyLink | None = None
        self._relay_sock: socket.socket | None = None
        self._relay_server: asyncio.Server | None = None
        self._relay_conns: set[_Conn] = set()
        #: Why ``loss()`` cannot work here (None: it can, or it was not asked for).
        self.loss_unavailable: str | None = None

    # -- addresses and state ----------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port`` of the listener, for clients."""
        return f"{self.host}:{self.port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def loss_percent(self) -> float:
        """The packet loss on the upstream path now (0 without a loss fault)."""
        return self._link.loss_percent if self._link is not None else 0.0

    def loss_counters(self) -> LossCounters:
        """Packets the lossy path saw and dropped each way (zeros without one)."""
        return self._link.counters() if self._link is not None else LossCounters()

    @property
    def connections(self) -> int:
        """Connections being forwarded (or held) now."""
        return len(self._conns)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        self.port = self.port or stable_port(self.host, self._rng)
        if self._want_loss_path:
            self._open_loss_path()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._flowing = asyncio.Event()
                self._flowing.set()
                loop.run_until_complete(self._listen())
            except BaseException as e:  # noqa: BLE001 - handed to start()
                failure.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"netfault-{self.name}", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            self._thread = None
            self._close_loss_path()
            raise NetFaultError(f"expected the {self.name} proxy to listen on {self.address}, found: {failure[0]}")
        return self

    def _open_loss_path(self) -> None:
        """The veth link and the relay's listener, or the reason there are none."""
        try:
            link = LossyLink(self._rng).open()
        except LossPathUnavailableError as e:
            self.loss_unavailable = e.reason
            return
        try:
            self._relay_sock = link.listen_socket()
        except BaseException:
            link.close()
            raise
        self._link = link

    def _close_loss_path(self) -> None:
        link, self._link = self._link, None
        sock, self._relay_sock = self._relay_sock, None
        if sock is not None:
            sock.close()
        if link is not None:
            link.close()

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None
            self._close_loss_path()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the faults -------------------------------------------------------------------------
    def partition(self) -> None:
        """Refuse: close the listener (a connect is refused) and reset every connection."""
        self._call(self._partition())

    def blackhole(self) -> None:
        """Accept connects, forward nothing in either direction (held until :meth:`heal`)."""
        self._call(self._set_mode("blackhole"))

    def latency(self, ms: float, jitter_ms: float = 0.0) -> None:
        """Delay every chunk forwarded by ``ms`` plus or minus up to ``jitter_ms`` (uniform,
        never below 0), keeping the order of each direction's bytes."""
        if ms < 0 or jitter_ms < 0:
            raise ValueError(f"expected a latency and jitter >= 0 ms, found {ms} and {jitter_ms}")
        self._latency_s = (ms / 1000.0, jitter_ms / 1000.0)

    def loss(self, percent: float) -> None:
        """Lose ``percent`` % of the packets each way on the path to the target (open
        connections included) until :meth:`heal`. Needs ``loss_path=True`` and a machine that
        can build it; raises :class:`LossPathUnavailableError` otherwise."""
        if self._link is None:
            reason = self.loss_unavailable or f"the {self.name} proxy was started without loss_path=True"
            raise LossPathUnavailableError(reason)
        self._link.set_loss(percent)
        self.counters.losses += 1

    def heal(self) -> None:
        """Listen and forward again, without latency or loss; held bytes go on their way."""
        self._latency_s = (0.0, 0.0)
        if self._link is not None:
            self._link.clear()
        self._call(self._heal())

    # -- inside the loop --------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, None], timeout_s: float = 30.0) -> None:
        if self._loop is None or self._thread is None:
            coro.close()
            raise NetFaultError(f"expected the {self.name} proxy started, found it stopped")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _listen(self) -> None:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self._server = await asyncio.start_server(
                    self._on_client, self.host, self.port, reuse_address=True, backlog=512
                )
                if self._relay_sock is not None and self._relay_server is None:
                    self._relay_server = await asyncio.start_server(self._on_relay, sock=self._relay_sock)
                return
            except OSError as e:
                # Another socket may hold the port for a moment (see stable_port).
                if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise NetFaultError(
                        f"expected to listen on {self.address} for the {self.name} proxy, found: {e}"
                    ) from e
                await asyncio.sleep(0.1)

    async def _set_mode(self, mode: Mode) -> None:
        assert self._flowing is not None
        self._mode = mode
        if mode == "blackhole":
            self.counters.blackholes += 1
            self._flowing.clear()
        else:
            self._flowing.set()

    async def _partition(self) -> None:
        self._mode = "partition"
        self.counters.partitions += 1
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        self._reset_all()
        assert self._flowing is not None
        self._flowing.set()  # nothing is held: every connection is gone

    async def _heal(self) -> None:
        self.counters.heals += 1
        if self._server is None:
            await self._listen()
        await self._set_mode("pass")

    async def _shutdown(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        if self._relay_server is not None:
            relay, self._relay_server = self._relay_server, None
            relay.close()
        self._reset_all()
        relayed, self._relay_conns = self._relay_conns, set()
        for c in relayed:
            c.reset()
        for _ in range(3):  # let the cancelled pumps finish
            await asyncio.sleep(0)

    def _reset_all(self) -> None:
        conns, self._conns = self._conns, set()
        for c in conns:
            c.reset()
            self.counters.resets += 1

    def _partitioned(self) -> bool:
        return self._mode == "partition"

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partitioned():  # accepted just before the listener closed
            _reset(writer)
            return
        self.counters.accepted += 1
        # Through the veth to the relay in the lossy path's namespace, or straight on.
        upstream = (self._link.ns_ip, self._relay_port()) if self._link is not None else self.target
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            self.counters.upstream_refused += 1
            _reset(writer)
            return
        if self._partitioned():  # partitioned while connecting upstream
            _reset(writer)
            _reset(up_writer)
            return
        conn = _Conn(writer, up_writer)
        self._conns.add(conn)
        conn.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, conn)),
            asyncio.create_task(self._pump(up_reader, writer, conn)),
        ]
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        if conn in self._conns:
            self._conns.discard(conn)
            for w in (writer, up_writer):
                w.close()

    def _relay_port(self) -> int:
        assert self._relay_sock is not None
        return int(self._relay_sock.getsockname()[1])

    async def _on_relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The far end of the lossy path (accepted in the namespace): plain forwarding to the
        target on the host's loopback. A reset on either side resets the other."""
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self.counters.upstream_refused += 1
            _reset(writer)
            return
        self.counters.relayed += 1
        conn = _Conn(writer, up_writer)
        self._relay_conns.add(conn)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(CHUNK):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()
            except (ConnectionError, OSError):
                if conn in self._relay_conns:
                    self._relay_conns.discard(conn)
                    conn.reset()

        conn.tasks = [asyncio.create_task(pipe(reader, up_writer)), asyncio.create_task(pipe(up_reader, writer))]
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        if conn in self._relay_conns:
            self._relay_conns.discard(conn)
            for w in (writer, up_writer):
                w.close()

    def _delay(self) -> float:
        base, jitter = self._latency_s
        if base <= 0 and jitter <= 0:
            return 0.0
        return max(0.0, base + self._rng.uniform(-jitter, jitter))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Conn) -> None:
        """One direction: read chunks, stamp each with its delivery time, deliver in order."""
        assert self._flowing is not None
        flowing = self._flowing
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUED_CHUNKS)

        async def deliver() -> None:
            try:
                while True:
                    item = await queue.get()
                    if item is None:
                        if dst.can_write_eof():
                            dst.write_eof()
                        return
                    at, data = item
                    wait = at - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await flowing.wait()
                    dst.write(data)
                    self.counters.bytes_forwarded += len(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                self._break(conn)

        sender = asyncio.create_task(deliver())
        last = 0.0
        try:
            while True:
                await flowing.wait()
                data = await src.read(CHUNK)
                if not data:
                    break
                last = max(last, loop.time() + self._delay())
                await queue.put((last, data))
            await queue.put(None)
            await sender
        except (ConnectionError, OSError):
            self._break(conn)
        finally:
            sender.cancel()

    def _break(self, conn: _Conn) -> None:
        """One side of a connection reset or failed: reset the other too (as a broken path
        would)."""
        if conn in self._conns:
            self._conns.discard(conn)
            conn.reset()
