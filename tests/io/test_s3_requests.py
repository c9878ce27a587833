"""The S3 store's requests through obstore (shared/io/s3_requests.py): against the embedded S3
server they read and write the very objects boto3 does, under the same keys; a conditional
PUT has one winner; the errors are the boto3 adapter's taxonomy (determinate or not), checked
against servers that refuse, hang up, stall or answer with a status; and a process forked after
obstore's runtime started sends its requests with boto3 instead of waiting forever."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shared.errors import (
    ConflictRetryError,
    IndeterminateError,
    ObjectNotFoundError,
    ObjectStoreError,
    PreconditionFailedError,
)
from shared.io.s3 import S3ObjectStore, S3Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def settings(stack: Any) -> S3Settings:
    return S3Settings(
        bucket=stack.bucket, endpoint=stack.s3_endpoint, access_key="testing", secret_key="testing",
        prefix=f"obstore-{uuid.uuid4().hex[:8]}",
    )


class _NoBoto3:
    """A boto3 client that must not be called."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"boto3's {name} was called for a request obstore serves")


def test_obstore_serves_get_put_and_head_on_the_objects_boto3_sees(settings: S3Settings) -> None:
    fast = S3ObjectStore(settings)
    slow = S3ObjectStore(replace(settings, client="boto3"))
    fast._client = _NoBoto3()
    keys = ["parts/a/b=1/c:2.parquet", "name with spaces", "é/ü", "x%20y", "a{b}+c"]
    for k in keys:
        fast.put(k, k.encode())
        assert slow.get(k) == k.encode()
        slow.put(k + "~", b"from boto3")
        assert fast.get(k + "~") == b"from boto3"
        assert fast.exists(k) and fast.exists(k + "~")
    # The embedded server decodes a key's "%20" whichever client sent it: the two agree above.
    assert {k for k in keys if "%" not in k} <= {o.key for o in slow.list("")}
    assert not fast.exists("missing")
    with pytest.raises(ObjectNotFoundError):
        fast.get("missing")
    fast.put("state/1", b"first", if_absent=True)
    with pytest.raises(PreconditionFailedError):
        fast.put("state/1", b"second", if_absent=True)
    assert slow.get("state/1") == b"first"
    fast.put("state/1", b"overwritten")
    assert slow.get("state/1") == b"overwritten"


def test_without_keys_in_the_settings_it_signs_with_boto3s_credential_chain(
    settings: S3Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = S3ObjectStore(replace(settings, access_key=None, secret_key=None))
    store._client = _NoBoto3()
    store.put("chain/1", b"signed")
    assert store.get("chain/1") == b"signed"
    provider = store._fast.store().credential_provider  # type: ignore[union-attr]
    assert provider.credentials.get_frozen_credentials().access_key == "testing"
    assert S3ObjectStore(replace(settings, client="boto3")).get("chain/1") == b"signed"


def test_keys_obstore_will_not_take_as_they_are_go_through_boto3(settings: S3Settings) -> None:
    fast = S3ObjectStore(settings)
    slow = S3ObjectStore(replace(settings, client="boto3"))
    fast.put("a//b", b"empty segment")
    assert slow.get("a//b") == b"empty segment"
    assert fast.get("a//b") == b"empty segment"
    assert fast.exists("a//b")


def test_racing_conditional_puts_have_exactly_one_winner(settings: S3Settings) -> None:
    stores = [S3ObjectStore(settings) for _ in range(6)]
    won: list[int] = []
    lost: list[int] = []

    def race(i: int) -> None:
        try:
            stores[i].put("race/0", str(i).encode(), if_absent=True)
            won.append(i)
        except PreconditionFailedError:
            lost.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(lost) == len(stores) - 1
    assert stores[0].get("race/0") == str(won[0]).encode()


# -- the taxonomy, against servers that fail in one way each ---------------------------------------


def _store_at(port: int, read_timeout_s: float = 10.0, client: str = "obstore") -> S3ObjectStore:
    return S3ObjectStore(
        S3Settings(
            bucket="bucket", endpoint=f"http://127.0.0.1:{port}", access_key="k", secret_key="s",
            connect_timeout_s=2.0, read_timeout_s=read_timeout_s, client=client,
        )
    )


@pytest.fixture
def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _serve(handle: Any) -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    yield int(listener.getsockname()[1])
    listener.close()
    for c in held:
        c.close()


def _read_request(conn: socket.socket) -> None:
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk


@pytest.fixture
def hang_up_port() -> Iterator[int]:
    """Reads each request and closes the connection without an answer."""

    def handle(conn: socket.socket) -> None:
        _read_request(conn)
        conn.close()

    yield from _serve(handle)


@pytest.fixture
def stalled_port() -> Iterator[int]:
    """Reads each request and never answers."""
    yield from _serve(_read_request)


def test_a_refused_connect_is_determinate_for_every_request(closed_port: int) -> None:
    store = _store_at(closed_port)
    for call in (lambda: store.put("k", b"v", if_absent=True), lambda: store.put("k", b"v"),
                 lambda: store.get("k"), lambda: store.exists("k")):
        with pytest.raises(ObjectStoreError) as e:
            call()
        assert not isinstance(e.value, IndeterminateError), e.value
        assert "could not connect" in str(e.value)


def test_a_put_whose_connection_dies_after_sending_is_indeterminate_and_a_read_is_not(hang_up_port: int) -> None:
    store = _store_at(hang_up_port)
    with pytest.raises(IndeterminateError):
        store.put("k", b"v", if_absent=True)
    with pytest.raises(IndeterminateError):
        store.put("k", b"v")
    for call in (lambda: store.get("k"), lambda: store.exists("k")):
        with pytest.raises(ObjectStoreError) as e:
            call()
        assert not isinstance(e.value, IndeterminateError), e.value


def test_a_stalled_answer_times_out_indeterminate_for_a_put(stalled_port: int) -> None:
    store = _store_at(stalled_port, read_timeout_s=0.5)
    with pytest.raises(IndeterminateError):
        store.put("k", b"v", if_absent=True)
    with pytest.raises(ObjectStoreError) as e:
        store.get("k")
    assert not isinstance(e.value, IndeterminateError)


class _Status(http.server.BaseHTTPRequestHandler):
    status = 500

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        body = b"<Error><Code>Any</Code><Message>answered</Message></Error>"
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("client", ["obstore", "boto3"])
@pytest.mark.parametrize(
    ("status", "put_error", "get_error"),
    [
        (500, IndeterminateError, ObjectStoreError),
        (503, IndeterminateError, ObjectStoreError),
        (409, ConflictRetryError, ConflictRetryError),
        (412, PreconditionFailedError, PreconditionFailedError),
        (403, ObjectStoreError, ObjectStoreError),
        (404, ObjectNotFoundError, ObjectNotFoundError),
    ],
)
def test_each_status_is_the_boto3_adapters_error(status: int, put_error: type, get_error: type, client: str) -> None:
    handler = type("Handler", (_Status,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = _store_at(server.server_address[1], client=client)
        with pytest.raises(put_error) as e:
            store.put("k", b"v", if_absent=True)
        if put_error is ObjectStoreError or put_error is ConflictRetryError:
            assert not isinstance(e.value, IndeterminateError)
        with pytest.raises(get_error) as g:
            store.get("k")
        assert not isinstance(g.value, IndeterminateError)
    finally:
        server.shutdown()
        server.server_close()


def _private_ca(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA of its own and a server certificate for 127.0.0.1 it signed: (CA, server
    certificate, server key) in PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool) -> Any:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("shardsink test CA", ca_key, "shardsink test CA", ca_key, True)
    server = cert("127.0.0.1", server_key, "shardsink test CA", ca_key, False)
    files = (tmp / "ca.pem", tmp / "server.pem", tmp / "server-key.pem")
    files[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return files


class _Object(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "6")
        self.end_headers()
        self.wfile.write(b"secret")

    def log_message(self, *args: Any) -> None:
        pass


def test_it_trusts_the_certificates_of_aws_ca_bundle_as_boto3_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ssl

    ca_file, cert_file, key_file = _private_ca(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Object)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = S3Settings(bucket="bucket", endpoint=f"https://127.0.0.1:{server.server_address[1]}",
                          access_key="k", secret_key="s", connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
        with pytest.raises(ObjectStoreError) as e:
            S3ObjectStore(settings).get("k")  # an unknown issuer: no request is made
        assert not isinstance(e.value, IndeterminateError)
        monkeypatch.setenv("AWS_CA_BUNDLE", str(ca_file))
        for client in ("obstore", "boto3"):
            store = S3ObjectStore(replace(settings, client=client))
            if client == "obstore":
                store._client = _NoBoto3()
            assert store.get("k") == b"secret", client
    finally:
        server.shutdown()
        server.server_close()


def test_a_process_forked_after_obstores_runtime_started_uses_boto3(settings: S3Settings) -> None:
    """obstore's runtime does not survive a fork: a request through it in the child would wait
    forever (a new client too). The child's requests go through boto3 and succeed."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from shared.io.s3 import S3ObjectStore, S3Settings
        st = S3ObjectStore(S3Settings(bucket={settings.bucket!r}, endpoint={settings.endpoint!r},
                                      access_key="testing", secret_key="testing", prefix={settings.prefix!r}))
        st.put("fork/parent", b"parent")
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            ok = st.get("fork/parent") == b"parent"
            st.put("fork/child", b"child", if_absent=True)
            fresh = S3ObjectStore(st.settings)
            ok = ok and fresh.get("fork/child") == b"child" and fresh.exists("fork/parent")
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        assert st.get("fork/child") == b"child"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
