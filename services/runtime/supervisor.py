"""The supervisor that follows the catalog and runs one streaming query per sink (so sinks are
added and dropped at runtime without restarting the services), and the wrapper that lets a
stopped query's ``foreachBatch`` end cleanly."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.runtime.checkpoints import checkpoint_owner
from services.runtime.settings import ServiceSettings
from shared.catalog import Catalog, SinkDef

log = logging.getLogger("shardsink")


@dataclass
class SinkRunner:
    """One running streaming query for one sink."""

    sink: SinkDef
    query: Any
    stop_fn: Callable[[], None] | None = None


@dataclass
class Supervisor:
    """Follows the catalog and keeps one streaming query per live sink.

    ``start_query(sink)`` builds and starts the sink's query and returns it; a query whose
    sink is dropped (or re-created with another epoch) is stopped. A query that failed is
    restarted on the next poll (its state is rebuilt from the topics and the shard).
    """

    name: str
    settings: ServiceSettings
    start_query: Callable[[SinkDef], Any]
    #: Called when a running sink's definition changes in place (read-only -> writable).
    on_change: Callable[[SinkDef], None] | None = None
    running: dict[str, SinkRunner] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    restarts: int = 0
    #: Backoff doubles from ``backoff_s`` up to ``max_backoff_s``; a query that stays up for
    #: ``max_backoff_s`` resets it. Without it, a loaded machine feeds a restart storm.
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    #: Per sink: consecutive failures and the monotonic time before which no restart is tried.
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)

    _catalog: Catalog | None = None
    #: Deletes this service's checkpoints whose folder name the given predicate rejects
    #: (see :func:`remove_checkpoints`); None: checkpoints are left alone.
    reap: Callable[[Callable[[str], bool]], Any] | None = None
    _reaped: bool = False
    #: Called with the sink and the exception of a query that failed (before its restart).
    on_failure: Callable[[SinkDef, Any], object] | None = None

    def _keep_checkpoint(self, name: str, live: dict[str, SinkDef]) -> bool:
        owner = checkpoint_owner(name)
        if owner is None:
            return True  # not a sink's checkpoint
        sink_id, epoch = owner
        if epoch < 0:
            return False  # a fresh-per-start checkpoint of an older version
        if not self.settings.serves(sink_id):
            return True  # another instance's sink
        sink = live.get(sink_id)
        return sink is not None and sink.epoch == epoch  # else dropped, or an older epoch

    def poll_once(self) -> None:
        if self._catalog is None:
            self._catalog = self.settings.catalog()
        catalog = self._catalog
        live = {s.sink_id: s for s in catalog.state().live_sinks()}
        wanted = {sid: s for sid, s in live.items() if self.settings.serves(sid)}
        stopped = self._poll(wanted)
        if self.reap is not None and (stopped or not self._reaped):
            self._reaped = True
            try:
                gone = self.reap(lambda name: self._keep_checkpoint(name, live))
                if gone:
                    log.info("removed %s checkpoints %s", self.name, gone)
            except Exception as e:  # noqa: BLE001 - a failed clean-up must not stop the service
                log.warning("removing old %s checkpoints failed: %s", self.name, e)
        self._start_wanted(wanted)

    def _poll(self, wanted: dict[str, SinkDef]) -> bool:
        """Stop the queries of dropped, re-created or failed sinks; True if any stopped."""
        stopped = False
        for sink_id, runner in list(self.running.items()):
            want = wanted.get(sink_id)
            if want is not None and want.epoch == runner.sink.epoch and want != runner.sink:
                runner.sink = want
                if self.on_change is not None:
                    self.on_change(want)
            failed = runner.query is not None and not runner.query.isActive
            if want is None or want.epoch != runner.sink.epoch or failed:
                if not failed and self._initializing(runner):
                    continue  # stopped at a later poll, once its sources are up
                if failed:
                    exc = runner.query.exception()
                    n = self._failures.get(sink_id, (0, 0.0))[0]
                    if self.clock() - self._started_at.get(sink_id, 0.0) > self.max_backoff_s:
                        n = 0  # it ran long enough: a fresh failure, not a crash loop
                    delay = min(self.max_backoff_s, self.backoff_s * 2**n)
                    self._failures[sink_id] = (n + 1, self.clock() + delay)
                    log.error("query failed, restarting in %.1fs: %s", delay, exc, extra={"sink_id": sink_id})
                    self.restarts += 1
                    if self.on_failure is not None:
                        try:
                            self.on_failure(runner.sink, exc)
                        except Exception as e:  # noqa: BLE001 - the supervisor must outlive it
                            log.warning("handling the failure failed: %s", e, extra={"sink_id": sink_id})
                self._stop_runner(runner)
                del self.running[sink_id]
                stopped = True
        return stopped

    def _start_wanted(self, wanted: dict[str, SinkDef]) -> None:
        for sink_id, sink in wanted.items():
            if sink_id not in self.running:
                if self.clock() < self._failures.get(sink_id, (0, 0.0))[1]:
                    continue  # backing off after a failure
                query = self.start_query(sink)
                if query is None:
                    continue  # not startable yet (e.g. its desired topic does not exist): retry
                log.info("started %s for sink", self.name, extra={"sink_id": sink_id})
                self.running[sink_id] = SinkRunner(sink, query)
                self._started_at[sink_id] = self.clock()

    def _initializing(self, runner: SinkRunner) -> bool:
        """Whether a query is still starting its sources (at most a minute after its start).
        A query stopped then leaves the Python processes Spark is starting for its sources
        unable to connect back, each printing a traceback on the service's stderr; a dropped
        sink's query is stopped once they are up, a poll or a few later."""
        query = runner.query
        if query is None or self.clock() - self._started_at.get(runner.sink.sink_id, 0.0) > 60.0:
            return False
        try:
            return bool(query.isActive and query.status.get("message") == "Initializing sources")
        except Exception:  # noqa: BLE001 - a query that cannot say is not waited for
            return False

    def _stop_runner(self, runner: SinkRunner) -> None:
        stop_query(runner.query, extra={"sink_id": getattr(runner.sink, "sink_id", None)})

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - the supervisor must outlive bad polls
                log.error("catalog poll failed: %s", e, exc_info=True)
            self._stop.wait(self.settings.catalog_poll_ms / 1000.0)

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self.run_forever, name=f"{self.name}-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for runner in list(self.running.values()):
            self._stop_runner(runner)
        self.running.clear()


def stop_query(query: Any, extra: dict[str, Any] | None = None) -> None:
    """Stop a query, marked as being stopped meanwhile (see :func:`interruptible`): whatever its
    micro-batch fails with now is this stop. A failed query that raises again is logged."""
    if query is None:
        return
    name = None
    try:
        name = query.name
        with _STOPPING_LOCK:
            _STOPPING.add(name)
        query.stop()
    except Exception as e:  # noqa: BLE001 - stopping a failed query may raise again
        log.warning("stopping query %s: %s", name, e, extra=extra)
    finally:
        if name is not None:
            with _STOPPING_LOCK:
                _STOPPING.discard(name)


#: Java exceptions that mean "interrupted" (a query being stopped interrupts its thread).
_INTERRUPTIONS = (
    "java.lang.InterruptedException",
    "java.io.InterruptedIOException",
    "java.nio.channels.ClosedByInterruptException",
)


#: Names of the queries being stopped by their supervisor (see :func:`interruptible`).
_STOPPING: set[str] = set()
_STOPPING_LOCK = threading.Lock()


class QueryInterruptedError(Exception):
    """A ``foreachBatch`` function interrupted by its query's stop (see :func:`interruptible`)."""


def interruptible(fn: Callable[[Any, int], None], name: str | None = None) -> Callable[[Any, int], None]:
    """Wrap a ``foreachBatch`` function so that an interruption by ``query.stop()`` reaches Spark
    as a short error.

    When a query stops during a micro-batch, the function's call into the JVM (``toArrow()``...)
    fails with a ``Py4JJavaError`` whose text holds the whole Java stack trace, and the error
    Spark gets back holds that and the Python traceback. Spark decides whether the failure was
    its own stop by matching that text with ``Py4JJavaError: An error occurred while
    calling((.|\r\n|\r|\n)*)(<interruption>)`` (StreamExecution.isInterruptionException), a
    pattern that recurses once per character: on a text of some thousands of characters the
    stream execution thread dies of a ``StackOverflowError`` (1,024 ``java.util.regex`` frames
    in the service log at shutdown). Raising instead a short error in the shape that pattern
    expects, without the chained traceback, lets Spark recognise the stop and end the query
    cleanly.

    The pattern's recursion runs on whatever a micro-batch fails with while its query stops,
    not only on interruptions: measured with java.util.regex on a default thread, 2,000
    characters after ``calling`` already overflow. A stop can fail a JVM call in other ways (a
    closed file system, a cancelled job) whose text holds a Java stack trace too. So while the
    query ``name`` is being stopped by its :class:`Supervisor`, any error of the function is
    that stop and is raised in the short form. Every other error passes through unchanged: a
    failure outside a stop is not matched by that pattern, and its whole text reaches the
    query's exception (the write service's quarantine reads it)."""

    def each(batch_df: Any, batch_id: int) -> None:
        try:
            fn(batch_df, batch_id)
        except Exception as e:
            try:
                text = str(e)
            except Exception:  # noqa: BLE001 - the JVM may already be going away
                text = type(e).__name__
            hit = next((n for n in _INTERRUPTIONS if n in text), None)
            if hit is None and name is not None:
                with _STOPPING_LOCK:
                    if name in _STOPPING:
                        hit = _INTERRUPTIONS[0]
            if hit is None:
                raise
            raise QueryInterruptedError(
                f"py4j.protocol.Py4JJavaError: An error occurred while calling foreachBatch (batch {batch_id}).\n: {hit}"
            ) from None

    return each


def wait_forever(stop: threading.Event) -> None:
    def _handler(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    while not stop.is_set():
        time.sleep(0.5)
