"""Serving case N5, "Clean endings" (../shared/cases/serving-cases.md), in the gateway: a stream that
reached its end is logged as completed whatever the client does after it. (A client leaving before the end
stays a disconnect: tests/gateway/test_ratelimit_settlement.py; leaving mid-body is a 499:
tests/gateway/test_client_faults.py; the read timeouts: tests/gateway/test_edge_processes.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvscope.gateway.proxy.call
from kvscope.testing.harness import LoopThread, records_by_id
from tests.gateway.conftest import Stack, build_stack

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def drained(loop: LoopThread, tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """A stack whose drain window after ``[DONE]`` is 2 s instead of 50 ms (DRAIN_BEFORE_END_S): the client's
    close surely lands inside it, so the test does not depend on a 50 ms race."""
    monkeypatch.setattr(kvscope.gateway.proxy.call, "DRAIN_BEFORE_END_S", 2.0)
    gw, fakes, exporter = build_stack(loop, tmp_path)
    with gw:
        yield Stack(gw, fakes, exporter, tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_n5_a_client_closing_right_after_done_is_logged_as_completed(drained: Stack) -> None:
    """Serving case N5: the upstream's body ends 5 s after its ``[DONE]`` (``end_delay_s``), so the gateway is
    still draining it when the client, having read ``data: [DONE]``, closes the connection. The stream reached
    its end: the record says 200, success, no disconnect, no error. Before, the close cancelled the drain and
    the record said ``client_disconnected`` (14 of 68 completed streams in the probe)."""
    body = {
        "model": "fake-model",
        "messages": HI,
        "max_tokens": 3,
        "stream": True,
        "fake": {"end_delay_s": 5},
    }
    with (
        drained.client() as c,
        c.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-request-id": "n5-done-close"}
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            if line == "data: [DONE]":
                break  # leaving the block closes the connection: the body has not ended yet
    assert lines[-1] == "data: [DONE]"
    record = records_by_id(drained.log, ["n5-done-close"])["n5-done-close"][0]
    assert record["http"]["response"]["status_code"] == 200
    assert record["event"]["outcome"] == "success"
    assert (record["kvscope"]["client_disconnected"], record["kvscope"]["disconnect_phase"]) == (False, None)
    assert record["error"] == {"type": None, "message": None}
    assert record["gen_ai"]["response"]["finish_reasons"] == ["length"]
    assert record["gen_ai"]["usage"]["output_tokens"] == 3
