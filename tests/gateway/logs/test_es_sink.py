"""The Elasticsearch sink through the real client against the double: outages, 429/5xx, timeouts, caps."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from kvscope.gateway.logs.elasticsearch import SPOOLED_HANDOFF_S, ElasticsearchSink
from kvscope.gateway.logs.es_shipper import ShipperConfig
from kvscope.gateway.logs.sink import LogSink
from kvscope.gateway.logs.spool import REJECTED_FILE
from kvscope.testing.records import make_record
from kvscope.testing.wait import async_wait_until
from tests.gateway.logs.helpers import RecordingMetrics, fast_config, segment_files


def ids(n: int, start: int = 0) -> set[str]:
    """Document ``_id``s (``event.id``) of records ``start … start+n-1``."""
    return {f"evt-{i:06d}" for i in range(start, start + n)}


async def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``condition()`` held within ``timeout_s`` (the loop runs meanwhile)."""
    try:
        await async_wait_until(condition, timeout_s, "the sink's condition")
    except AssertionError:
        return False
    return True


async def emit_paced(sink: ElasticsearchSink, start: int, stop: int, chunk: int = 100) -> None:
    """Emit records ``start..stop-1`` in chunks, yielding to the loop between chunks like a busy gateway."""
    for first in range(start, stop, chunk):
        for i in range(first, min(first + chunk, stop)):
            sink.emit(make_record(i))
        await asyncio.sleep(0.001)


async def test_sink_implements_the_logsink_protocol(tmp_path, es):
    sink = ElasticsearchSink(fast_config(tmp_path, es.url))
    assert isinstance(sink, LogSink) and sink.name == "elasticsearch"


async def test_10k_records_outage_in_the_middle_third_then_5pct_429s(tmp_path, es):
    metrics = RecordingMetrics()
    sink = ElasticsearchSink(fast_config(tmp_path, es.url), metrics)
    await sink.start()
    await emit_paced(sink, 0, 3334)
    await es.go_down()
    await emit_paced(sink, 3334, 6667)
    assert await until(lambda: sink.queued == 0, 10)  # while down, memory drains into the spool
    outage_spooled = sink.stats.spooled
    await es.come_up()
    es.faults.item_429_rate = 0.05
    await emit_paced(sink, 6667, 10_000)
    assert await sink.wait_idle(40)
    await sink.aclose()

    assert set(es.docs()) == ids(10_000)
    assert set(es.created.values()) == {1}  # every id created exactly once
    assert es.item_statuses[429] > 100  # ~5% of ≥ 6,666 items after recovery were refused at least once
    assert outage_spooled >= 3333  # everything emitted while the cluster was down went to disk
    s = sink.stats
    assert (s.emitted, s.shipped, s.failed, s.dropped) == (10_000, 10_000, 0, 0)
    assert s.replayed == s.spooled  # every spooled record came back out of the spool into Elasticsearch
    assert metrics.outcomes == Counter({"shipped": 10_000, "spooled": s.spooled})
    assert metrics.spool_bytes[-1] == 0 and max(metrics.spool_bytes) > 0
    assert segment_files(tmp_path) == [] and sink.spool.pending_records == 0


async def test_whole_request_429_503_and_per_item_503_are_retried(tmp_path, es):
    es.faults.bulk_statuses = [429, 503, 503]
    es.faults.item_503_rate = 0.1
    sink = ElasticsearchSink(fast_config(tmp_path, es.url, batch_size=100))
    await sink.start()
    await emit_paced(sink, 0, 1000)
    assert await sink.wait_idle(20)
    await sink.aclose()
    assert set(es.docs()) == ids(1000) and set(es.created.values()) == {1}
    assert es.faults.bulk_statuses == [] and es.item_statuses[503] > 20
    assert (sink.stats.shipped, sink.stats.failed, sink.stats.dropped) == (1000, 0, 0)


async def test_timed_out_bulk_that_landed_is_not_indexed_twice(tmp_path, es):
    es.faults.delay_s = 0.4  # the double applies the bulk, then answers too late for the 0.15 s timeout
    sink = ElasticsearchSink(fast_config(tmp_path, es.url, timeout_s=0.15))
    es.faults.delay_s = 0.0
    await sink.start()
    sink.emit(make_record(0))
    assert await sink.wait_idle(5)  # setup + first record with a fast cluster
    bulks = len([r for r in es.requests if "_bulk" in r.path])
    es.faults.delay_s = 0.4
    await emit_paced(sink, 1, 201)
    # a bulk that arrives now is applied, then answered after 0.4 s: past the sink's 0.15 s timeout
    assert await until(lambda: len([r for r in es.requests if "_bulk" in r.path]) > bulks, 30)
    es.faults.delay_s = 0.0
    assert await sink.wait_idle(20)
    await sink.aclose()
    assert set(es.docs()) == ids(201) and set(es.created.values()) == {1}
    assert sink.stats.duplicates >= 1  # the retry met 409 version_conflict_engine_exception
    assert (sink.stats.shipped, sink.stats.failed) == (201, 0)


async def test_a_record_refused_for_good_is_counted_failed_and_kept(tmp_path, es, caplog):
    metrics = RecordingMetrics()
    sink = ElasticsearchSink(fast_config(tmp_path, es.url), metrics)
    await sink.start()
    bad = make_record(5)
    bad["surprise"] = {"field": 1}  # not in the strict mapping → 400 strict_dynamic_mapping_exception
    for i in range(10):
        sink.emit(bad if i == 5 else make_record(i))
    assert await sink.wait_idle(5)
    await sink.aclose()
    assert set(es.docs()) == ids(10) - {"evt-000005"}
    assert metrics.outcomes == Counter({"shipped": 9, "failed": 1})
    kept = json.loads((tmp_path / REJECTED_FILE).read_text())
    assert kept["record"]["http"]["request"]["id"] == "req-000005"
    assert kept["reason"].startswith("400 strict_dynamic_mapping_exception")
    assert "refused 1 log records for good" in caplog.text


async def test_past_the_spool_cap_records_are_dropped_counted_and_logged(tmp_path, es, caplog):
    line = len(json.dumps(make_record(0), separators=(",", ":")).encode())
    await es.go_down()
    metrics = RecordingMetrics()
    sink = ElasticsearchSink(fast_config(tmp_path, es.url, spool_max_bytes=20 * (line + 10)), metrics)
    await sink.start()
    with caplog.at_level(logging.ERROR, logger="kvscope.gateway.logs.elasticsearch"):
        await emit_paced(sink, 0, 50, chunk=10)
        assert await until(lambda: sink.queued == 0, 10)
    s = sink.stats
    assert 15 <= s.spooled <= 20 and s.spooled + s.dropped == 50
    assert metrics.outcomes["dropped"] == s.dropped
    assert any(r.levelno == logging.ERROR and "log spool full" in r.getMessage() for r in caplog.records)
    await es.come_up()
    assert await sink.wait_idle(10)
    await sink.aclose()
    assert len(es.docs()) == s.spooled and s.shipped == s.spooled


async def test_a_full_memory_queue_overflows_into_the_spool(tmp_path, es):
    sink = ElasticsearchSink(fast_config(tmp_path, es.url, queue_size=10))
    await sink.start()
    for i in range(100):  # no await: the shipper cannot drain, emit itself must spool
        sink.emit(make_record(i))
    assert sink.stats.spooled == 90 and sink.spool.pending_records == 90
    assert await sink.wait_idle(10)
    await sink.aclose()
    assert set(es.docs()) == ids(100) and sink.stats.shipped == 100


async def test_close_during_an_outage_spools_the_queue_and_the_next_start_replays(tmp_path, es):
    await es.go_down()
    first = ElasticsearchSink(fast_config(tmp_path, es.url))
    await first.start()
    for i in range(300):
        first.emit(make_record(i))
    await first.aclose()
    assert first.stats.spooled == 300 and first.spool.pending_records == 300
    first.emit(make_record(999))  # after close: counted, never raises
    assert first.stats.dropped == 1
    await es.come_up()
    second = ElasticsearchSink(fast_config(tmp_path, es.url))
    await second.start()
    assert await second.wait_idle(10)
    await second.aclose()
    assert set(es.docs()) == ids(300) and second.stats.replayed == 300


async def test_cluster_down_at_start_gets_its_templates_when_it_comes_back(tmp_path, es):
    await es.go_down()
    sink = ElasticsearchSink(fast_config(tmp_path, es.url))
    await sink.start()
    await emit_paced(sink, 0, 100)
    assert await until(lambda: sink.stats.spooled == 100, 10)
    await es.come_up()
    assert await sink.wait_idle(10)
    await sink.aclose()
    assert list(es.index_templates) == ["kvscope-requests"]
    assert set(es.docs()) == ids(100)
    assert es.data_streams["kvscope-requests"].mappings["dynamic"] == "strict"


async def test_an_unencodable_record_costs_only_itself(tmp_path, es):
    sink = ElasticsearchSink(fast_config(tmp_path, es.url))
    await sink.start()
    for i in range(10):
        record = make_record(i)
        if i == 3:
            record["kvscope"]["engine"] = {"queue_s": object()}
        sink.emit(record)  # never raises
    assert await sink.wait_idle(10)
    await sink.aclose()
    assert set(es.docs()) == ids(10) - {"evt-000003"}
    assert (sink.stats.shipped, sink.stats.failed) == (9, 1)


async def test_records_without_an_event_id_get_a_stable_content_id(tmp_path, es):
    sink = ElasticsearchSink(fast_config(tmp_path, es.url))
    await sink.start()
    record = make_record(1)
    record["event"]["id"] = None
    sink.emit(record)
    sink.emit(json.loads(json.dumps(record)))  # the same record again: one document
    assert await sink.wait_idle(5)
    await sink.aclose()
    (doc_id,) = es.docs()
    assert doc_id.startswith("sha1-") and len(doc_id) == 45
    assert (sink.stats.shipped, sink.stats.duplicates) == (2, 1)


async def test_in_spooled_mode_each_wait_follows_a_whole_hand_off_and_is_short(tmp_path, es, monkeypatch):
    """docs/logs.md: once the sink has noticed an outage, queued records reach the spool every
    ``SPOOLED_HANDOFF_S``, so a SIGKILL loses only that memory queue (the gateway-level kill test asserts the
    loss; bench/spool_loss_window.py measures it). Checked on the sink's own schedule, not a clock: with the
    production timers (1 s flush, 0.5 s first backoff), every wait the sink starts once records are spooled
    asks for at most ``SPOOLED_HANDOFF_S`` and begins with nothing in memory."""
    config = fast_config(tmp_path, es.url)
    config = replace(config, shipper=ShipperConfig(), setup_on_start=False)  # production timers
    sink = ElasticsearchSink(config)
    waits: list[tuple[float, int, int]] = []
    """(seconds asked, records in memory, records spooled so far) of each wait."""
    real_sleep = sink._sleep

    async def recording_sleep(seconds: float) -> None:
        waits.append((seconds, sink.queued, sink.stats.spooled))
        await real_sleep(seconds)

    monkeypatch.setattr(sink, "_sleep", recording_sleep)
    await sink.start()
    await es.go_down()
    try:
        emitted = config.shipper.batch_size  # a full batch wakes the shipper: it finds the cluster down
        for i in range(emitted):
            sink.emit(make_record(i))
        assert await until(lambda: sink.stats.spooled == emitted, 30)
        for _ in range(5):  # then a few records at a time, each lot handed over before the next
            for _ in range(10):
                sink.emit(make_record(emitted))
                emitted += 1
            assert await until(lambda n=emitted: sink.stats.spooled == n, 5)
    finally:
        await sink.aclose()
    spooled_mode = [(seconds, queued) for seconds, queued, spooled in waits if spooled > 0]
    assert len(spooled_mode) >= 5
    assert all(seconds <= SPOOLED_HANDOFF_S and queued == 0 for seconds, queued in spooled_mode), spooled_mode
