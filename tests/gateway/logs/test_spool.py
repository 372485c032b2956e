"""The on-disk spool: order, segments, cursor, damaged lines, cap, dead letters."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvscope.gateway.logs.spool import REJECTED_FILE, Spool, SpoolConfig
from tests.gateway.logs.helpers import segment_files


def rec(i: int) -> dict:
    return {"i": i, "pad": "x" * 40}


LINE = len(msgspec.json.encode(rec(0))) + 1  # every rec(i) with i < 10 encodes to the same length


def drain(spool: Spool, batch: int) -> list[list[int]]:
    batches = []
    while spool.pending_records:
        b = spool.read_batch(batch)
        batches.append([r["i"] for r in b.records])
        spool.ack(b)
    return batches


def test_replays_in_order_batch_by_batch_and_deletes_consumed_segments(tmp_path):
    spool = Spool(SpoolConfig(tmp_path, segment_bytes=3 * LINE))
    assert spool.append([rec(i) for i in range(8)]).appended == 8
    assert segment_files(tmp_path) == [
        "seg-000000000001.jsonl",
        "seg-000000000002.jsonl",
        "seg-000000000003.jsonl",
    ]
    assert spool.pending_records == 8 and spool.pending_bytes == 8 * LINE
    first = spool.read_batch(2)
    assert [r["i"] for r in first.records] == [
        0,
        1,
    ] and spool.pending_records == 8  # reading consumes nothing
    spool.ack(first)
    assert spool.pending_bytes == 6 * LINE
    # batches stop at segment ends: [2] closes segment 1, then 3..5, then 6..7
    assert drain(spool, 4) == [[2], [3, 4, 5], [6, 7]]
    assert segment_files(tmp_path) == [] and spool.pending_bytes == 0
    spool.append([rec(9)])
    assert segment_files(tmp_path) == ["seg-000000000004.jsonl"]
    assert drain(spool, 10) == [[9]]


def test_reopen_resumes_at_the_cursor_and_appends_behind_old_segments(tmp_path):
    spool = Spool(SpoolConfig(tmp_path))
    spool.append([rec(i) for i in range(6)])
    spool.ack(spool.read_batch(2))
    spool.close()
    again = Spool(SpoolConfig(tmp_path))
    assert again.pending_records == 4 and again.pending_bytes == 4 * LINE
    again.append([rec(6)])  # a new segment: old ones are never appended to after a restart
    assert segment_files(tmp_path) == ["seg-000000000001.jsonl", "seg-000000000002.jsonl"]
    assert drain(again, 100) == [[2, 3, 4, 5], [6]]
    assert json.loads((tmp_path / "cursor.json").read_text()) == {"segment": 3, "offset": 0}


def test_a_line_cut_short_by_a_crash_is_skipped_and_counted(tmp_path, caplog):
    good = b"".join(msgspec.json.encode(rec(i)) + b"\n" for i in range(2))
    (tmp_path / "seg-000000000001.jsonl").write_bytes(good + b'{"i": 2, "pa')
    spool = Spool(SpoolConfig(tmp_path))
    assert spool.pending_records == 2
    batch = spool.read_batch(10)
    assert [r["i"] for r in batch.records] == [0, 1] and batch.corrupt == 1 and batch.lines == 2
    assert "skipping a damaged line" in caplog.text
    spool.ack(batch)
    assert spool.pending_bytes == 0 and segment_files(tmp_path) == []


def test_unreadable_cursor_replays_everything(tmp_path, caplog):
    spool = Spool(SpoolConfig(tmp_path))
    spool.append([rec(i) for i in range(3)])
    spool.ack(spool.read_batch(1))
    spool.close()
    (tmp_path / "cursor.json").write_text("{garbage")
    assert Spool(SpoolConfig(tmp_path)).pending_records == 3
    assert "cursor" in caplog.text and "unreadable" in caplog.text


def test_cap_refuses_records_past_max_bytes_and_room_returns_after_ack(tmp_path):
    spool = Spool(SpoolConfig(tmp_path, max_bytes=3 * LINE))
    result = spool.append([rec(i) for i in range(5)])
    assert (result.appended, result.dropped, result.invalid) == (3, 2, 0)
    assert spool.pending_bytes == 3 * LINE
    spool.ack(spool.read_batch(2))
    assert spool.append([rec(7), rec(8), rec(9)]).appended == 2
    assert drain(spool, 10) == [[2, 7, 8]]


def test_unencodable_record_is_counted_invalid_and_the_rest_is_written(tmp_path, caplog):
    spool = Spool(SpoolConfig(tmp_path))
    result = spool.append([rec(0), {"i": 1, "bad": object()}, rec(2)])
    assert (result.appended, result.dropped, result.invalid) == (2, 0, 1)
    assert drain(spool, 10) == [[0, 2]]
    assert "cannot be encoded" in caplog.text


def test_rejected_records_are_kept_with_their_reason(tmp_path):
    spool = Spool(SpoolConfig(tmp_path))
    spool.reject([rec(1)], ["400 document_parsing_exception: bad"])
    line = json.loads((tmp_path / REJECTED_FILE).read_text())
    assert line == {"reason": "400 document_parsing_exception: bad", "record": rec(1)}
    assert spool.pending_records == 0


def test_fsync_always_and_sync_due(tmp_path):
    spool = Spool(SpoolConfig(tmp_path, fsync="always"))
    spool.append([rec(0)])
    assert spool.sync_due() is False  # fsynced inside append
    lazy = Spool(SpoolConfig(tmp_path / "b", fsync="interval", fsync_interval_s=0.0))
    lazy.append([rec(0)], sync=False)
    assert lazy.sync_due() is True
    lazy.maybe_sync()
    assert lazy.sync_due() is False


@pytest.mark.parametrize(
    "kwargs", [{"fsync": "sometimes"}, {"max_bytes": 0}, {"segment_bytes": 0}, {"fsync_interval_s": -1}]
)
def test_invalid_config_is_refused(tmp_path, kwargs):
    with pytest.raises(ValueError):
        SpoolConfig(tmp_path, **kwargs)
