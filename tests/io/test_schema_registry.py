"""The HTTP schema registry client against a minimal in-process Confluent-compatible registry
(the two endpoints the codec uses), and codecs configured from the environment."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from shared.codec import Codec, load_schema
from shared.errors import DecodeError, SchemaRegistryError
from shared.io.schema_registry import HttpSchemaRegistry, configured_message_codec


class _Registry(BaseHTTPRequestHandler):
    schemas: ClassVar[list[str]] = []
    requests: ClassVar[list[tuple[str, str, str | None]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        self.requests.append(("POST", self.path, self.headers.get("Authorization")))
        if not self.path.startswith("/subjects/") or not self.path.endswith("/versions"):
            self._answer(404, {"error_code": 404})
            return
        text = json.dumps(json.loads(body["schema"]), sort_keys=True)
        if text not in self.schemas:
            self.schemas.append(text)
        self._answer(200, {"id": self.schemas.index(text) + 1})

    def do_GET(self) -> None:
        self.requests.append(("GET", self.path, self.headers.get("Authorization")))
        prefix = "/schemas/ids/"
        if self.path.startswith(prefix):
            i = int(self.path[len(prefix) :])
            if 1 <= i <= len(self.schemas):
                self._answer(200, {"schema": self.schemas[i - 1]})
                return
            self._answer(404, {"error_code": 40403, "message": "Schema not found"})
            return
        self._answer(500, {"error_code": 500})


@pytest.fixture
def registry_url() -> Iterator[str]:
    _Registry.schemas = []
    _Registry.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_confluent_messages_round_trip_through_an_http_registry(registry_url: str) -> None:
    env = {"SHARDSINK_SCHEMA_REGISTRY_URL": registry_url, "SHARDSINK_WIRE_FORMAT": "confluent"}
    producer = configured_message_codec("frontier_update", env)
    value = {"shard_id": "x", "sink_id": None, "upper": 3, "desc_token": None, "updated_at_ms": 1,
             "appended": {"lower": 2, "parts": ["x/data/a-w0of1.parquet"], "schema_versions": 1}}
    data = producer.encode(value)
    assert data[:5] == b"\x00\x00\x00\x00\x01"
    assert _Registry.requests[0][:2] == (
        "POST",
        "/subjects/io.shardsink.v1.FrontierUpdate-value/versions",
    )
    # a consumer in another process knows nothing but the URL: it fetches the schema by id
    consumer = configured_message_codec(
        "frontier_update", {"SHARDSINK_SCHEMA_REGISTRY_URL": registry_url}
    )
    assert consumer.wire == "single-object"
    assert consumer.decode(data) == value
    assert consumer.decode(consumer.encode(value)) == value
    assert ("GET", "/schemas/ids/1", None) in _Registry.requests
    # ids are cached: a second decode asks nothing
    n = len(_Registry.requests)
    consumer.decode(data)
    assert len(_Registry.requests) == n


def test_an_unknown_id_is_a_decode_error_and_an_unreachable_registry_a_registry_error(
    registry_url: str,
) -> None:
    codec = Codec(load_schema("frontier_update"), registry=HttpSchemaRegistry(registry_url))
    with pytest.raises(DecodeError, match="schema id known to the registry, found 42"):
        codec.decode(b"\x00\x00\x00\x00\x2a\x02")
    dead = Codec(
        load_schema("frontier_update"),
        registry=HttpSchemaRegistry("http://127.0.0.1:9", timeout_s=1),
    )
    with pytest.raises(SchemaRegistryError, match="expected the registry"):
        dead.decode(b"\x00\x00\x00\x00\x01\x02")


def test_basic_auth_is_sent(registry_url: str) -> None:
    reg = HttpSchemaRegistry(registry_url, user="u", password="p")
    assert reg.register("s", {"type": "record", "name": "R", "fields": []}) == 1
    assert _Registry.requests[-1][2] == "Basic dTpw"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(SchemaRegistryError, match="SHARDSINK_SCHEMA_REGISTRY_URL"):
        configured_message_codec("desired", {"SHARDSINK_WIRE_FORMAT": "confluent"})
    with pytest.raises(SchemaRegistryError, match="single-object or confluent"):
        configured_message_codec("desired", {"SHARDSINK_WIRE_FORMAT": "xml"})
    with pytest.raises(SchemaRegistryError, match="http"):
        HttpSchemaRegistry("ftp://x")
    codec = configured_message_codec("desired", {})
    assert codec.wire == "single-object"
