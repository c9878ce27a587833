"""The controller as a subprocess, SIGKILLed mid-command and restarted, repeatedly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.devstack.embedded import EmbeddedStack
from shared.io.controller_client import body_kind
from shared.shard import Shard
from tests.controller_fixture import (
    Model,
    append_body,
    changes_of,
    check_progress_order,
    client_for,
    controller_settings,
    create_body,
    ok,
    peek_rows,
    read_subscribe,
)

ROOT = Path(__file__).resolve().parents[2]


def _spawn(stack: EmbeddedStack, cs: object, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **stack.env(), "SHARDSINK_S3_PREFIX": cs.service.s3.prefix}  # type: ignore[attr-defined]
    argv = [sys.executable, "-m", "services.controller", "--commands-topic", cs.commands_topic,  # type: ignore[attr-defined]
            "--responses-topic", cs.responses_topic, "--peek-timeout-ms", "60000"]  # type: ignore[attr-defined]
    out = open(log, "ab")  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def test_sigkill_mid_command_and_restart_repeatedly_applies_each_command_once(stack: EmbeddedStack, tmp_path: Path) -> None:
    rng = random.Random(7)
    cs = controller_settings(stack)
    client = client_for(cs)
    log = tmp_path / "controller.log"
    model = Model()
    topic = f"subout-{cs.commands_topic}"
    sent: list[tuple[str, str]] = []  # (command id, kind)
    # Commands sent while no controller runs are answered once one does.
    sent.append((client.send("CreateCollection", create_body("kill")), "create"))
    sub_id = client.send("Subscribe", {"collection_id": "kill", "output_topic": topic, "as_of": 0, "up_to": None,
                                       "with_snapshot": True})
    sent.append((sub_id, "subscribe"))
    upper = 0
    proc = None
    try:
        for round_ in range(5):
            proc = _spawn(stack, cs, log)
            for _ in range(8):
                ups = [({"k": rng.randrange(20), "v": "x"}, upper, rng.choice([1, 1, -1])) for _ in range(3)]
                model.add(ups)
                aid = client.send("Append", append_body("kill", ups, upper + 1, expected=upper))
                sent.append((aid, "append"))
                if rng.random() < 0.3:  # a client retry of the same command
                    client.send("Append", append_body("kill", ups, upper + 1, expected=upper), command_id=aid)
                upper += 1
                if rng.random() < 0.3:
                    sent.append((client.send("Peek", {"collection_id": "kill", "as_of": upper - 1}), "peek"))
            time.sleep(rng.uniform(2.5, 4.5))  # start-up takes ~2 s: kill at various points
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc = _spawn(stack, cs, log)
        for cid, _ in sent:
            client.wait(cid, timeout_s=120)
        # Every command answered; all answers to one id are the same; appends applied once.
        for cid, kind in sent:
            rs = client.responses(cid)
            assert all(r["body"] == rs[0]["body"] for r in rs), rs
            if kind != "peek":
                ok(rs[0])
            else:
                assert body_kind(rs[0]) == "PeekResult", rs[0]
        st = Shard(cs.service.store(), "kill").refresh()
        assert st.upper.time == upper
        final_peek = client.call("Peek", {"collection_id": "kill", "as_of": upper - 1})
        assert peek_rows(final_peek) == model.at(upper - 1)
        # Peeks answered after restarts still show the contents at their as_of.
        for cid, kind in sent:
            if kind == "peek":
                r = client.responses(cid)[0]
                assert peek_rows(r) == model.at(r["body"][1]["as_of"])
        # The subscribe resumed without gaps or duplicates.
        ok(client.call("CancelSubscribe", {"subscribe_command_id": sub_id}))
        msgs = read_subscribe(stack, topic, sub_id)
        check_progress_order(msgs)
        last = max(m["time"] for m in msgs if m["progressed"] and m["time"] is not None)
        assert last == upper
        assert changes_of(msgs) == model.subscribe(0, last)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        client.close()
        print(log.read_text()[-3000:] if log.exists() else "")
