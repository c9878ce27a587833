"""The S3 adapter's translation of a broken connection (shared/io/s3.py): botocore lets a
connection reset that happens while it reads an error response's body (a GET of a missing
state object during a network partition) through as urllib3's ProtocolError. It must reach
the caller as one of our errors, which the retrying store retries: a determinate
ObjectStoreError for a read, an IndeterminateError for a PUT that was sent."""

from __future__ import annotations

from typing import Any

import pytest
from urllib3.exceptions import ProtocolError

from shared.errors import IndeterminateError, ObjectStoreError
from shared.io.s3 import S3ObjectStore, S3Settings
from shared.objectstore import RetryingObjectStore


class _ResetClient:
    """A boto3 client whose every call fails as a reset connection does, ``failures`` times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def _call(self, answer: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            reset = ConnectionResetError(104, "Connection reset by peer")
            raise ProtocolError(f"Connection broken: {reset!r}", reset)
        return answer

    def get_object(self, **kw: Any) -> Any:
        class Body:
            def read(self) -> bytes:
                return b"state"

        return self._call({"Body": Body()})

    def put_object(self, **kw: Any) -> Any:
        return self._call({})

    def head_object(self, **kw: Any) -> Any:
        return self._call({})


def _store(failures: int) -> S3ObjectStore:
    return S3ObjectStore(S3Settings(bucket="b"), client=_ResetClient(failures))


def test_a_reset_read_is_a_determinate_error_the_retrying_store_retries() -> None:
    with pytest.raises(ObjectStoreError) as e:
        _store(1).get("k")
    assert not isinstance(e.value, IndeterminateError)
    with pytest.raises(ObjectStoreError):
        _store(1).exists("k")
    assert RetryingObjectStore(_store(2), backoff_s=0.001).get("k") == b"state"  # type: ignore[arg-type]


def test_a_reset_put_is_an_indeterminate_outcome() -> None:
    with pytest.raises(IndeterminateError):
        _store(1).put("k", b"v", if_absent=True)
    with pytest.raises(IndeterminateError):
        _store(1).put("k", b"v")
