"""The S3 object store (boto3, and obstore for the requests of a sink's steps:
shared/io/s3_requests.py), for AWS S3, MinIO and moto.

The only atomic primitive used is the conditional PUT (``If-None-Match: *``). botocore errors
are translated here, at the boundary, into the project's typed errors:

| botocore                                   | ours                                     |
| ------------------------------------------ | ---------------------------------------- |
| 412 PreconditionFailed                     | PreconditionFailedError (determinate)    |
| 409 ConditionalRequestConflict             | ConflictRetryError (re-read and retry)   |
| 404 NoSuchKey                              | ObjectNotFoundError                      |
| read timeout / connection closed after send| IndeterminateError                       |
| (also a reset urllib3 lets through)        |                                          |
| connect timeout / other client errors      | ObjectStoreError (determinate)            |

Settings come from :class:`S3Settings` (environment variables ``SHARDSINK_S3_ENDPOINT``,
``SHARDSINK_S3_BUCKET``, ``SHARDSINK_S3_PREFIX`` and the standard AWS credential chain, or
``AWS_ACCESS_KEY_ID_FILE`` / ``AWS_SECRET_ACCESS_KEY_FILE`` for mounted secrets).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from urllib3.exceptions import HTTPError as URLLib3Error

from shared.errors import (
    ObjectNotFoundError,
    ObjectStoreError,
)
from shared.io.s3_requests import CLIENTS, NotServed, ObstoreRequests, available, storage_error
from shared.objectstore import ObjectInfo


def _read_secret(name: str, env: dict[str, str]) -> str | None:
    """``NAME`` from the environment, else the contents of the file named by ``NAME_FILE``
    (a mounted Kubernetes or compose secret)."""
    v = env.get(name)
    if v:
        return v
    path = env.get(f"{name}_FILE")
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return None


@dataclass(frozen=True, slots=True)
class S3Settings:
    bucket: str
    endpoint: str | None = None
    prefix: str = ""
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_pool_connections: int = 32
    #: What sends GET, PUT and HEAD of one object: ``obstore`` (shared/io/s3_requests.py) or
    #: ``boto3`` (``SHARDSINK_S3_CLIENT``). Everything else goes through boto3.
    client: str = "obstore"

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("expected a non-empty S3 bucket name, found ''")
        if self.prefix and (self.prefix.startswith("/") or ".." in self.prefix.split("/")):
            raise ValueError(f"expected a relative S3 prefix without '..', found {self.prefix!r}")
        if self.client not in CLIENTS:
            raise ValueError(f"expected SHARDSINK_S3_CLIENT to be one of {', '.join(CLIENTS)}, found {self.client!r}")

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> S3Settings:
        e = dict(os.environ if env is None else env)
        return S3Settings(
            bucket=e.get("SHARDSINK_S3_BUCKET", "shardsink"),
            endpoint=e.get("SHARDSINK_S3_ENDPOINT") or None,
            prefix=e.get("SHARDSINK_S3_PREFIX", ""),
            region=e.get("AWS_DEFAULT_REGION", e.get("AWS_REGION", "us-east-1")),
            access_key=_read_secret("AWS_ACCESS_KEY_ID", e),
            secret_key=_read_secret("AWS_SECRET_ACCESS_KEY", e),
            client=e.get("SHARDSINK_S3_CLIENT") or "obstore",
        )

    def __repr__(self) -> str:  # never print secrets
        return (
            f"S3Settings(bucket={self.bucket!r}, endpoint={self.endpoint!r}, prefix={self.prefix!r}, "
            f"region={self.region!r}, access_key={'***' if self.access_key else None})"
        )


#: What a call of the client raises: botocore's errors, and the connection's that botocore lets
#: through (a connection reset while it reads an error response's body, such as a 404's,
#: reaches the caller as urllib3's ProtocolError).
_CLIENT_ERRORS = (ClientError, BotoCoreError, URLLib3Error, ConnectionError)


def _code(e: ClientError) -> tuple[str, int]:
    err = e.response.get("Error", {})
    status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return str(err.get("Code", "")), status


_CLIENT_LOCK = threading.Lock()


class S3ObjectStore:
    """:class:`shared.objectstore.ObjectStore` over boto3, with GET, PUT and HEAD of one object
    through obstore (``settings.client``; not with a ``client`` given, which serves them all)."""

    def __init__(self, settings: S3Settings, client: Any | None = None) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self._prefix = settings.prefix.rstrip("/") + "/" if settings.prefix else ""
        self._client = client
        self._fast = (
            ObstoreRequests(settings)
            if client is None and settings.client == "obstore" and available()
            else None
        )

    @property
    def client(self) -> Any:
        """The boto3 client, made on first use: a process whose requests all go through obstore
        never loads the S3 service model (0.2 s of a first client on a 2-core machine)."""
        if self._client is None:
            with _CLIENT_LOCK:  # boto3's default session is not safe to make clients from at once
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        import boto3  # here: a process that only gets, puts and heads never loads it
        from botocore.config import Config

        s = self.settings
        return boto3.client(
            "s3",
            endpoint_url=s.endpoint,
            region_name=s.region,
            aws_access_key_id=s.access_key,
            aws_secret_access_key=s.secret_key,
            config=Config(
                connect_timeout=s.connect_timeout_s,
                read_timeout=s.read_timeout_s,
                retries={"max_attempts": 3, "mode": "standard"},
                max_pool_connections=s.max_pool_connections,
                s3={"addressing_style": "path"},
            ),
        )

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _translate(self, e: Exception, op: str, key: str, *, sent: bool) -> Exception:
        if isinstance(e, ClientError):
            code, status = _code(e)
            if status == 412 or code == "PreconditionFailed":
                kind = "precondition"
            elif status == 409 or code == "ConditionalRequestConflict":
                kind = "conflict"
            elif status == 404 or code in ("NoSuchKey", "404", "NotFound"):
                kind = "missing"
            elif status >= 500 and sent and op == "put":
                kind = "indeterminate"
            else:
                return storage_error("other", op, key, f"{code or status}: {e}")
            return storage_error(kind, op, key, f"server error {status} {code}")
        if isinstance(e, (ConnectTimeoutError, EndpointConnectionError)):
            return storage_error("connect", op, key, str(e))
        if isinstance(e, (ReadTimeoutError, ConnectionClosedError, URLLib3Error, ConnectionError)) and sent:
            return storage_error("indeterminate", op, key, str(e))
        return storage_error("other", op, key, str(e))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if self._fast is not None:
            try:
                self._fast.put(self._k(key), data, if_absent=if_absent)
                return
            except NotServed:
                pass
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self._k(key), "Body": data}
        if if_absent:
            kw["IfNoneMatch"] = "*"
        try:
            self.client.put_object(**kw)
        except _CLIENT_ERRORS as e:
            raise self._translate(e, "put", key, sent=True) from e

    def get(self, key: str) -> bytes:
        if self._fast is not None:
            with contextlib.suppress(NotServed):
                return self._fast.get(self._k(key))
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
            return bytes(resp["Body"].read())
        except _CLIENT_ERRORS as e:
            raise self._translate(e, "get", key, sent=False) from e

    def exists(self, key: str) -> bool:
        if self._fast is not None:
            with contextlib.suppress(NotServed):
                return self._fast.exists(self._k(key))
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except ClientError as e:
            code, status = _code(e)
            if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._translate(e, "head", key, sent=False) from e
        except (BotoCoreError, URLLib3Error, ConnectionError) as e:
            raise self._translate(e, "head", key, sent=False) from e

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))
        except _CLIENT_ERRORS as e:
            err = self._translate(e, "delete", key, sent=False)
            if not isinstance(err, ObjectNotFoundError):
                raise err from e

    def delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            try:
                resp = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self._k(k)} for k in chunk], "Quiet": True},
                )
            except _CLIENT_ERRORS as e:
                raise self._translate(e, "delete", chunk[0], sent=False) from e
            errors = resp.get("Errors") or []
            if errors:
                raise ObjectStoreError(
                    f"expected to delete {len(chunk)} objects, {len(errors)} failed: {errors[:3]}"
                )

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._k(prefix)}
        if start_after is not None:
            kw["StartAfter"] = self._k(start_after)
        n = len(self._prefix)
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(**kw):
                for obj in page.get("Contents", []) or []:
                    yield ObjectInfo(
                        key=obj["Key"][n:],
                        size=int(obj["Size"]),
                        last_modified_ms=int(obj["LastModified"].timestamp() * 1000),
                    )
        except _CLIENT_ERRORS as e:
            raise self._translate(e, "list", prefix, sent=False) from e
