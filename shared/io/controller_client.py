"""A small client of the controller's command protocol: produce commands, wait for their
responses. An adapter (Kafka) of the protocol's messages (``schemas/command.avsc``,
``schemas/response.avsc``), beside the controller rather than inside it: the public CLI
(:mod:`shardsink.cli.common`) uses it and imports nothing of ``services/``.

Used by the CLI, tests, the benchmark and scripts::

    client = ControllerClient(kafka_settings)
    cid = client.send("Peek", {"collection_id": "c1", "as_of": 5})
    response = client.wait(cid)          # {"command_id": ..., "body": ("...PeekResult", {...})}
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Producer, TopicPartition

from shared.codec import kind_of, message_codec, tagged
from shared.errors import DecodeError, KafkaTimeoutError
from shared.io.kafka import KafkaSettings, consume_available, new_consumer
from shared.io.kafka_admin import ensure_topic


class ControllerClient:
    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        commands_topic: str = "commands",
        responses_topic: str = "responses",
        from_offset: int = 0,
    ) -> None:
        self.kafka = kafka
        self.commands_topic = commands_topic
        self.responses_topic = responses_topic
        # Producing to a topic that does not exist yet can reorder the first messages on the
        # embedded broker (auto-creation): make sure both topics exist first.
        ensure_topic(kafka, commands_topic, 1)
        ensure_topic(kafka, responses_topic, 1)
        self.cmd_codec = message_codec("command")
        self.resp_codec = message_codec("response")
        self.producer: Any = Producer(kafka.config(**{"enable.idempotence": True, "linger.ms": 1}))
        self.consumer = new_consumer(kafka, **{"auto.offset.reset": "earliest", "fetch.wait.max.ms": "10"})
        self.consumer.assign([TopicPartition(responses_topic, 0, from_offset)])
        #: Every response seen, in order (FrontierUpper reports included).
        self.seen: list[dict[str, Any]] = []
        self._by_id: dict[str, list[dict[str, Any]]] = {}

    def close(self) -> None:
        """Flush the commands sent, close the consumer, and let librdkafka's producer go now
        rather than whenever the garbage collector gets to it: a closed client that lingers (in
        an exception's traceback, say) would keep reconnecting to a broker that may be gone, a
        line on stderr each time. Closing twice is harmless."""
        if self.producer is None:
            return
        self.producer.flush(10)
        self.producer = None
        self.consumer.close()

    def encode(self, kind: str, body: dict[str, Any], command_id: str | None = None) -> tuple[str, bytes]:
        cid = command_id or uuid.uuid4().hex
        value = self.cmd_codec.encode({"command_id": cid, "issued_at_ms": int(time.time() * 1000), "body": tagged(kind, body)})
        return cid, bytes(value)

    def send_raw(self, value: bytes) -> None:
        errors: list[Any] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        self.producer.produce(self.commands_topic, value=value, on_delivery=on_delivery)
        if self.producer.flush(30) > 0 or errors:
            raise KafkaTimeoutError(f"expected the command delivered, found {errors or 'it pending'}")

    def send(self, kind: str, body: dict[str, Any], command_id: str | None = None) -> str:
        cid, value = self.encode(kind, body, command_id)
        self.send_raw(value)
        return cid

    def poll(self, timeout_s: float = 0.05) -> list[dict[str, Any]]:
        out = []
        for m in consume_available(self.consumer, 500, timeout_s):
            if m.error() is not None:
                continue
            try:
                r = self.resp_codec.decode(m.value() or b"")
            except DecodeError:
                continue
            r["_offset"] = m.offset()
            self.seen.append(r)
            if r.get("command_id") is not None:
                self._by_id.setdefault(r["command_id"], []).append(r)
            out.append(r)
        return out

    def responses(self, command_id: str) -> list[dict[str, Any]]:
        return list(self._by_id.get(command_id, []))

    def wait(self, command_id: str, timeout_s: float = 60.0, *, count: int = 1) -> dict[str, Any]:
        """The first response to ``command_id`` (waits until ``count`` have been seen)."""
        deadline = time.monotonic() + timeout_s
        while len(self._by_id.get(command_id, [])) < count:
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(f"expected a response to {command_id!r} within {timeout_s}s, found none")
            self.poll(0.05)
        return self._by_id[command_id][0]

    def call(self, kind: str, body: dict[str, Any], command_id: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.wait(self.send(kind, body, command_id), timeout_s)

    def frontier_uppers(self, collection_id: str) -> Iterator[int | None]:
        for r in self.seen:
            if r.get("command_id") is None and kind_of(r["body"]) == "FrontierUpper":
                if r["body"][1]["collection_id"] == collection_id:
                    yield r["body"][1]["upper"]


def body_kind(response: dict[str, Any]) -> str:
    return kind_of(response["body"])
