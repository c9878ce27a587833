"""A small client of a Confluent-compatible schema registry, and codecs wired from settings.

Only the two calls the codec needs (``shared.codec.SchemaRegistry``):

- ``register(subject, schema)``: ``POST /subjects/{subject}/versions`` -> the schema id
  (idempotent on the registry's side: the same schema gets the same id);
- ``get_schema(id)``: ``GET /schemas/ids/{id}`` -> the schema, or None on 404.

Settings (environment):

===================================  ==========================================================
``SHARDSINK_SCHEMA_REGISTRY_URL``    the registry's base URL; unset: no registry (single-object
                                     encoding only)
``SHARDSINK_SCHEMA_REGISTRY_USER``   basic-auth user (with ``..._PASSWORD``), optional
``SHARDSINK_WIRE_FORMAT``            ``single-object`` (default) or ``confluent``: what the
                                     codecs produce; with a registry both are decoded
===================================  ==========================================================
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from shared.codec import Codec, load_schema, previous_schemas
from shared.errors import SchemaRegistryError

__all__ = ["HttpSchemaRegistry", "configured_message_codec", "registry_from_env"]

_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class HttpSchemaRegistry:
    """The registry at ``url`` (answers are cached: ids and schemas never change)."""

    def __init__(
        self,
        url: str,
        *,
        user: str | None = None,
        password: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise SchemaRegistryError(f"expected an http(s) registry URL, found {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._auth = None
        if user is not None:
            token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
            self._auth = f"Basic {token}"
        self._ids: dict[tuple[str, str], int] = {}
        self._schemas: dict[int, dict[str, Any]] = {}

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", _CONTENT_TYPE)
        if data is not None:
            req.add_header("Content-Type", _CONTENT_TYPE)
        if self._auth:
            req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise SchemaRegistryError(
                f"{method} {path}: expected a 2xx answer from the registry, found {e.code} "
                f"{e.reason}",
                status=e.code,
            ) from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SchemaRegistryError(
                f"{method} {path}: expected the registry at {self.url} to answer, found {e}"
            ) from e

    def register(self, subject: str, schema: Mapping[str, Any]) -> int:
        text = json.dumps(schema, sort_keys=True)
        cached = self._ids.get((subject, text))
        if cached is not None:
            return cached
        path = f"/subjects/{urllib.parse.quote(subject, safe='')}/versions"
        answer = self._call("POST", path, {"schema": text})
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), int):
            raise SchemaRegistryError(
                f"POST {path}: expected an answer with an integer id, found {answer!r}"
            )
        self._ids[(subject, text)] = answer["id"]
        return int(answer["id"])

    def get_schema(self, schema_id: int) -> dict[str, Any] | None:
        if schema_id in self._schemas:
            return self._schemas[schema_id]
        answer = self._call("GET", f"/schemas/ids/{int(schema_id)}")
        if answer is None:
            return None
        try:
            schema = json.loads(answer["schema"])
        except (TypeError, KeyError, ValueError) as e:
            raise SchemaRegistryError(
                f"GET /schemas/ids/{schema_id}: expected {{'schema': JSON text}}, found {answer!r}"
            ) from e
        if answer.get("schemaType", "AVRO") != "AVRO" or not isinstance(schema, dict):
            return None  # a Protobuf or JSON schema id, or not a record: not one of ours
        self._schemas[schema_id] = schema
        return schema


def registry_from_env(environ: Mapping[str, str] | None = None) -> HttpSchemaRegistry | None:
    env = os.environ if environ is None else environ
    url = env.get("SHARDSINK_SCHEMA_REGISTRY_URL", "")
    if not url:
        return None
    return HttpSchemaRegistry(
        url,
        user=env.get("SHARDSINK_SCHEMA_REGISTRY_USER") or None,
        password=env.get("SHARDSINK_SCHEMA_REGISTRY_PASSWORD") or None,
    )


def configured_message_codec(name: str, environ: Mapping[str, str] | None = None) -> Codec:
    """The codec of topic schema ``name`` as the environment configures it (see module doc)."""
    env = os.environ if environ is None else environ
    registry = registry_from_env(env)
    wire = env.get("SHARDSINK_WIRE_FORMAT", "single-object")
    if wire not in ("single-object", "confluent"):
        raise SchemaRegistryError(
            f"expected SHARDSINK_WIRE_FORMAT single-object or confluent, found {wire!r}"
        )
    if wire == "confluent" and registry is None:
        raise SchemaRegistryError(
            "expected SHARDSINK_SCHEMA_REGISTRY_URL with SHARDSINK_WIRE_FORMAT=confluent, "
            "found it unset"
        )
    return Codec(
        load_schema(name),
        previous=previous_schemas(name),
        registry=registry,
        wire="confluent" if wire == "confluent" else "single-object",
    )
