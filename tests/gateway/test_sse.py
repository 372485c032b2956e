"""SSE framing and stream bookkeeping (gateway/sse.py)."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvscope.gateway.sse import Action, SSESplitter, StreamState, event_data, without_usage

EVENTS = [
    b'data: {"a": 1}\n\n',
    b": keep-alive\n\n",
    b"event: x\ndata: line1\ndata: line2\n\n",
    b"data: [DONE]\n\n",
]


def _split_randomly(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, min(12, len(data) - 1))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def test_splitter_returns_each_event_exactly_under_random_rechunking() -> None:
    stream = b"".join(EVENTS)
    rng = random.Random(7)
    for _ in range(300):
        splitter = SSESplitter()
        out = [e for piece in _split_randomly(stream, rng) for e in splitter.feed(piece)]
        assert out == EVENTS
        assert splitter.tail() == b""


def test_splitter_handles_crlf_cr_and_cr_at_a_chunk_boundary() -> None:
    crlf = [b"data: 1\r\n\r\n", b"data: 2\r\ndata: 3\r\n\r\n"]
    cr = [b"data: 4\r\r", b"data: 5\n\r\n"]
    splitter = SSESplitter()
    assert splitter.feed(b"data: 1\r\n\r") == []  # the trailing CR may start a CRLF
    assert splitter.feed(b"\ndata: 2\r\ndata: 3\r\n\r\n") == crlf
    assert splitter.feed(b"".join(cr)) == cr
    assert splitter.feed(b"data: partial") == []
    assert splitter.tail() == b"data: partial"


@pytest.mark.parametrize(
    "data",
    [
        b'data: {"a": 1}\n\n',  # one whole event per read: the shortcut
        b": keep-alive\n\n",
        b"\ndata: 1\n\n",  # a blank line first is an event of its own
        b"data: 1\n\ndata: 2\n\n",  # two events
        b"data: 1\r\n\r\n",
        b"data: 1\rx\n\n",
        b"data: 1\n\r\n",  # CR anywhere: the scan
        b"\n\n",
        b"data: 1\n\n\n",
    ],
)
def test_splitter_reads_whole_events_as_the_byte_scan_does(data: bytes) -> None:
    """A read holding exactly one LF-framed event takes a shortcut (gateway/sse.py); every read gives the
    events (and the tail) that feeding the same bytes one at a time gives."""
    whole, byte_by_byte = SSESplitter(), SSESplitter()
    assert whole.feed(data) == [e for i in range(len(data)) for e in byte_by_byte.feed(data[i : i + 1])]
    assert whole.tail() == byte_by_byte.tail()
    after_partial = SSESplitter()
    assert after_partial.feed(b"data: x") == []
    assert after_partial.feed(data)[0].startswith(b"data: x")  # a buffered line joins the next read's


def test_event_data_joins_data_lines_and_ignores_comments() -> None:
    assert event_data(b"data:  two spaces\n\n") == b" two spaces"  # one space after the colon is dropped
    assert event_data(b"data: \n\n") == b""
    assert event_data(b"data: a\rb\n\n") == b"a"  # CR ends a line: "b" is no field
    assert event_data(b"data: a\ndata: b\n\n") == b"a\nb"
    assert event_data(b"data: a\r\n\r\n") == b"a"
    assert event_data(b'data: {"a":1}\n\n') == b'{"a":1}'
    assert event_data(b"data:x\ndata\ndata:  y\n\n") == b"x\n\n y"
    assert event_data(b": keep-alive\n\n") is None
    assert event_data(b"\n") is None


def _chunk(choices: list, **extra: object) -> dict:
    return {"id": "c", "model": "m", "choices": choices, **extra}


def test_stream_state_tracks_tokens_finish_usage_and_actions() -> None:
    state = StreamState(expected_choices=2, keep_text=True)
    role = _chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    assert state.observe(role, client_wants_usage=False) == (Action.FORWARD, False)
    tok = _chunk(
        [
            {"index": 0, "delta": {"content": "Hi"}, "finish_reason": None},
            {"index": 1, "delta": {"content": "Yo"}, "finish_reason": None},
        ]
    )
    assert state.observe(tok, False) == (Action.FORWARD, True)
    fin = _chunk([{"index": 0, "delta": {}, "finish_reason": "length"}])
    assert state.observe(fin, False) == (Action.FORWARD, False)
    assert not state.complete
    assert (
        state.observe(_chunk([{"index": 1, "text": "", "finish_reason": "stop"}]), False)[0] is Action.FORWARD
    )
    assert state.complete and state.finish_reasons == {0: "length", 1: "stop"}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    engine = {"ttft_s": 0.5}
    assert state.observe(_chunk([], usage=usage, kvscope=engine), False) == (Action.DROP, False)
    assert state.observe(_chunk([], usage=usage), True) == (Action.FORWARD, False)
    assert state.usage == usage and state.engine == engine and state.token_events == 1
    assert state.output_text() == ["Hi", "Yo"]


def test_stream_state_reads_odd_choices_as_before() -> None:
    """Choices that are not a list of objects carry no token and are forwarded (the one-choice shortcut of
    observe takes lists only: a one-key object there once raised KeyError)."""
    for choices in ({"a": 1}, {"0": {"delta": {"content": "x"}}}, ["x"], [], None):
        state = StreamState()
        assert state.observe({"id": "c", "choices": choices}, True) == (Action.FORWARD, False)
        assert state.token_events == 0
    state = StreamState()
    assert state.observe({"choices": [{"index": 0, "text": "a"}, "junk"]}, True) == (Action.FORWARD, True)


def test_stream_state_errors_and_bad_finish_reasons() -> None:
    state = StreamState()
    assert state.observe({"error": {"message": "boom", "code": "x"}}, False) == (Action.ERROR, False)
    assert state.error == {"message": "boom", "code": "x"}
    state = StreamState()
    assert (
        state.observe(_chunk([{"index": 0, "delta": {}, "finish_reason": "abort"}]), False)[0]
        is Action.BAD_FINISH
    )
    assert state.bad_finish_reason == "abort" and not state.complete


def test_usage_on_a_choice_chunk_is_rewritten_away_when_not_requested() -> None:
    obj = _chunk(
        [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
        usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        kvscope={"x": 1},
    )
    assert StreamState().observe(obj, False)[0] is Action.REWRITE
    assert msgspec.json.decode(event_data(without_usage(obj))) == _chunk(obj["choices"])
