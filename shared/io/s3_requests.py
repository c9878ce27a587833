"""The S3 store's hot requests (GET, PUT, HEAD of one object) through obstore.

Every step of every sink makes a few S3 requests: the write tasks stage a part (PUT) and read
back the shard's new state (GET), append commits (a conditional PUT), mint reads a head. With
boto3, a request cost 2.7-3.5 ms of CPU in the calling process on this project's 2-core
machines, against 0.3-0.7 ms through obstore (Rust's ``object_store``, with the GIL released
while the request runs); at a hundred sinks boto3's request path was more than a third of the
write workers' CPU (py-spy, ``--gil``). :class:`S3ObjectStore` sends those three requests here
and keeps boto3 for the rest (listing, deleting: the controller's and the collector's work,
not the steps'). ``SHARDSINK_S3_CLIENT=boto3`` sends everything through boto3, as before.

What stays as it was, and how:

- *Credentials*: obstore signs with what boto3 would: the settings' keys, or else boto3's
  standard chain (a ``boto3.Session`` through obstore's ``Boto3CredentialProvider``, which
  refreshes them).
- *TLS*: the certificates of ``AWS_CA_BUNDLE`` are trusted besides the system's, as boto3
  trusts them.
- *Retries*: none here (``max_retries`` 0). The caller's :class:`RetryingObjectStore` decides,
  as for boto3: obstore's own retries would resend a conditional PUT whose first attempt may
  have landed, and report the caller's own object as another writer's.
- *Errors* (:func:`translate`), the same taxonomy as the boto3 adapter's: 412 (``If-None-Match``)
  is :class:`PreconditionFailedError`, 409 :class:`ConflictRetryError`, 404
  :class:`ObjectNotFoundError`; a PUT that failed after its connection was made (a timeout, a
  reset, a 5xx) is :class:`IndeterminateError`; a refused or timed-out connect and every
  failed read are determinate (:class:`ObjectStoreError`).
- *Processes*: obstore starts a runtime with its own threads at its first request, one per
  process image, and a forked child inherits it without its threads: a request there waits
  forever, through a new client too (measured). So each process makes its own client at its
  first request (:meth:`ObstoreRequests.store`; none is made at import or pickled), and in a
  process forked after this one's runtime started, boto3 serves every request
  (:class:`NotServed`). Spark's Python workers are forked from a daemon that never makes a
  request (``services.runtime.worker_daemon`` checks it has one thread when it forks), so they
  make their own.
- *Keys* that object_store will not take as they are (an empty segment, ``..``): boto3 serves
  them (:class:`NotServed`).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

from shared.errors import (
    ConflictRetryError,
    IndeterminateError,
    ObjectNotFoundError,
    ObjectStoreError,
    PreconditionFailedError,
)

#: ``SHARDSINK_S3_CLIENT``: ``obstore`` (the default) or ``boto3``.
CLIENTS = ("obstore", "boto3")

_STATUS = re.compile(r"status code: (\d{3})")
#: reqwest's kind of a failed connect, in object_store's error text.
_CONNECT = "kind: Connect,"


class NotServed(Exception):
    """Not a request for obstore here (a key it will not take as it is, or a forked process):
    the caller sends it with boto3."""


#: The process whose obstore runtime started (the first client made in this process image).
_runtime_pid: int | None = None


def available() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def storage_error(kind: str, op: str, key: str, detail: str = "") -> Exception:
    """The project's storage error of ``kind`` for ``op`` (get, put, put-if-absent, head) of
    ``key``, with the same message whichever client failed: ``precondition`` (412),
    ``conflict`` (409), ``missing`` (404), ``indeterminate`` (a PUT whose outcome is unknown),
    ``connect`` (no connection made) or ``other``."""
    if kind == "precondition":
        return PreconditionFailedError(f"expected no object at {key!r} ({op}), found one", key=key)
    if kind == "conflict":
        return ConflictRetryError(f"conflicting conditional {op} of {key!r}", key=key)
    if kind == "missing":
        return ObjectNotFoundError(f"expected an object at {key!r}, found none", key=key)
    if kind == "indeterminate":
        return IndeterminateError(f"{op} {key!r}: outcome unknown: {detail}", key=key)
    if kind == "connect":
        return ObjectStoreError(f"{op} {key!r}: could not connect: {detail}", key=key)
    return ObjectStoreError(f"{op} {key!r}: {detail}", key=key)


def translate(e: Exception, op: str, key: str) -> Exception:
    """One of the project's storage errors for obstore's ``e`` on ``op`` of ``key``."""
    from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

    text = str(e)
    first = text.split("\n", 1)[0]
    m = _STATUS.search(first)
    status = int(m.group(1)) if m else 0
    connect_failed = not status and _CONNECT in text
    # object_store reports a 409 to a conditional PUT as AlreadyExists too: the status decides.
    if status == 409:
        kind = "conflict"
    elif status == 412 or isinstance(e, (AlreadyExistsError, PreconditionError)):
        kind = "precondition"
    elif isinstance(e, (NotFoundError, FileNotFoundError)) or status == 404:
        kind = "missing"
    elif op.startswith("put") and (status >= 500 or (not status and not connect_failed)):
        kind = "indeterminate"
    elif connect_failed:
        kind = "connect"
    else:
        kind = "other"
    return storage_error(kind, op, key, first)


class ObstoreRequests:
    """GET, PUT and HEAD of whole objects in one bucket through obstore; keys as S3 has them
    (the caller's prefix included)."""

    def __init__(self, settings: Any) -> None:
        """``settings``: the store's ``shared.io.s3.S3Settings`` (not imported: it imports this)."""
        self.settings = settings
        self._pid = -1
        self._store: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    def store(self) -> Any:
        """This process's client, made on its first request (see the module docstring)."""
        global _runtime_pid
        pid = os.getpid()
        if self._pid != pid:
            # No lock (a forked child could inherit it held): two threads' first requests may
            # both make a client, and one is dropped.
            if _runtime_pid is not None and _runtime_pid != pid:
                raise NotServed("a process forked after obstore's runtime started")
            self._store = self._make()
            self._pid = pid
            _runtime_pid = pid
        return self._store

    def _make(self) -> Any:
        from obstore.store import S3Store

        s = self.settings
        kw: dict[str, Any] = {}
        options: dict[str, Any] = {
            "allow_http": bool(s.endpoint and s.endpoint.startswith("http://")),
            "connect_timeout": timedelta(seconds=s.connect_timeout_s),
            # boto3's read timeout is per read, as this one; object_store's default limit on
            # the whole request (30 s) would fail a large part's GET on a slow link.
            "read_timeout": timedelta(seconds=s.read_timeout_s),
            "timeout": timedelta(minutes=10),
            "pool_max_idle_per_host": str(s.max_pool_connections),
        }
        bundle = os.environ.get("AWS_CA_BUNDLE")
        if bundle and not options["allow_http"]:
            # boto3 trusts the certificates of AWS_CA_BUNDLE (a private CA, a TLS-inspecting
            # proxy); obstore adds them to the system's roots.
            with open(bundle, "rb") as f:
                options["root_certificate"] = f.read()
        if s.endpoint:
            kw["endpoint"] = s.endpoint
        if s.access_key and s.secret_key:
            kw["access_key_id"], kw["secret_access_key"] = s.access_key, s.secret_key
        else:
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider

            kw["credential_provider"] = Boto3CredentialProvider(boto3.Session(region_name=s.region))
        return S3Store(
            s.bucket,
            region=s.region,
            virtual_hosted_style_request=False,
            client_options=options,  # type: ignore[arg-type]
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=s.read_timeout_s)},
            **kw,
        )

    def put(self, key: str, data: bytes, *, if_absent: bool) -> None:
        import obstore

        store = self.store()
        op = "put-if-absent" if if_absent else "put"
        try:
            obstore.put(store, key, data, mode="create" if if_absent else "overwrite")
        except ValueError as e:
            raise NotServed(key) from e
        except Exception as e:
            raise translate(e, op, key) from e

    def get(self, key: str) -> bytes:
        import obstore

        store = self.store()
        try:
            return bytes(obstore.get(store, key).bytes())
        except ValueError as e:
            raise NotServed(key) from e
        except Exception as e:
            raise translate(e, "get", key) from e

    def exists(self, key: str) -> bool:
        import obstore
        from obstore.exceptions import NotFoundError

        store = self.store()
        try:
            obstore.head(store, key)
            return True
        except (NotFoundError, FileNotFoundError):
            return False
        except ValueError as e:
            raise NotServed(key) from e
        except Exception as e:
            raise translate(e, "head", key) from e
