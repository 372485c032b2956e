"""Issue 42 through the real AsyncEngine on a tiny random model (one running slot): a disconnected client's
queued request and a request past its deadline never reach a prefill, and admission refuses by the
prediction before anything is queued. The step-time model is scripted (one second a step), so every decision
is exact; the engine steps as fast as it can."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.engine.async_engine import AsyncEngine, DeadlineExceededError
from kvscope.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvscope.engine.core.admission import AdmissionConfig, Refusal
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.errors import AdmissionRefusedError
from kvscope.engine.sampling_params import SamplingParams
from kvscope.testing.wait import async_wait_until
from tests.engine.spec_distribution import build_tiny_model

LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
"""The request holding the one running slot: 120 steps (the tiny model's context is 128)."""
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class SecondPerStep:
    """A scripted step-time model: every step takes one second, whatever its shape."""

    def observe(self, prefill_tokens: int, decode_rows: int, context_tokens: int, seconds: float) -> None:
        pass

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
        return 1.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("admission") / "tiny", tokenizer_dir).path


@pytest.fixture
def scheduled(monkeypatch) -> list[str]:
    """Every request id any step scheduled (a prefill chunk or a decode), in order."""
    seen: list[str] = []
    schedule = Scheduler.schedule

    def recording(self):
        out = schedule(self)
        seen.extend(item.request_id for item in out.scheduled)
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return seen


def _engine(path: Path, admission: AdmissionConfig | None = None) -> AsyncEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=1),
        admission=admission or AdmissionConfig(),
    )
    engine = AsyncEngine(config)
    engine.core.scheduler.step_time = SecondPerStep()  # before start(): the engine thread is idle
    engine.start()
    return engine


async def _queued(
    engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams, tier: str = "default"
):
    """Start ``request_id`` in ``tier`` and wait until the engine queued it; (its output stream's task, its
    prediction)."""
    queued: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
    request = replace(engine.process_inputs(prompt, params), service_tier=tier)
    stream = engine.generate(request_id, request, queued=queued)
    task = asyncio.ensure_future(_drain(stream))
    try:
        return task, await queued
    except AdmissionRefusedError:
        await asyncio.gather(task, return_exceptions=True)  # the stream ends with the same refusal
        raise


async def _drain(stream) -> int:
    tokens = 0
    async for output in stream:
        tokens += len(output.outputs[0].token_ids)
    return tokens


def test_a_disconnected_clients_queued_request_never_reaches_prefill(tiny_dir: Path, scheduled) -> None:
    engine = _engine(tiny_dir)

    async def main() -> None:
        holder, _ = await _queued(engine, "holder", [1, 2, 3], LONG)
        gone, _ = await _queued(engine, "gone", [4, 5, 6], SHORT)
        gone.cancel()  # the client left: closing its stream aborts it before the next step
        await asyncio.gather(gone, return_exceptions=True)
        assert await holder == 120

    try:
        asyncio.run(main())
        assert engine.get_request("gone") is None
    finally:
        engine.stop()
    assert "gone" not in scheduled and scheduled.count("holder") == 120


def test_a_request_past_its_deadline_is_dropped_before_its_prefill(tiny_dir: Path, scheduled) -> None:
    engine = _engine(tiny_dir)

    async def main() -> None:
        holder, _ = await _queued(engine, "holder", [1, 2, 3], LONG)
        late = replace(engine.process_inputs([4, 5, 6], SHORT), deadline=time.monotonic())  # already passed
        with pytest.raises(DeadlineExceededError, match="deadline exceeded before the first admission"):
            await _drain(engine.generate("late", late))
        assert await holder == 120

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert "late" not in scheduled


def test_admission_refuses_by_the_prediction_before_queueing(tiny_dir: Path, scheduled) -> None:
    engine = _engine(tiny_dir, AdmissionConfig({"default": 0.5, "priority": 200.0}))

    async def main() -> None:
        holder, first = await _queued(engine, "holder", [1, 2, 3], LONG, "flex")  # flex: no objective
        await async_wait_until(lambda: "holder" in scheduled, 60, "the holder running")  # not just queued
        assert first is not None and first >= 1.0  # its own prefill step: one (scripted) second
        with pytest.raises(AdmissionRefusedError) as refused:
            await _queued(engine, "refused", [4, 5, 6], SHORT)
        refusal: Refusal = refused.value.refusal
        assert (refusal.tier, refusal.slo_s, refusal.requests_ahead) == ("default", 0.5, 0)
        assert refusal.predicted_ttft_s >= 1.0
        assert engine.get_request("refused") is None
        # priority: an objective it meets; flex: none at all. Both queued, with their predictions
        urgent, predicted_urgent = await _queued(engine, "urgent", [7, 8, 9], SHORT, "priority")
        batch, predicted_batch = await _queued(engine, "batch", [10, 11, 12], SHORT, "flex")
        assert predicted_urgent is not None and predicted_batch is not None
        assert await asyncio.gather(holder, urgent, batch) == [120, 4, 4]

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert "refused" not in scheduled


def test_an_idle_engine_admits_a_request_whatever_its_prediction(tiny_dir: Path, scheduled) -> None:
    """Nothing running, nothing ahead: the prediction (one scripted second, over the 0.5 s objective) is the
    request's own prefill, which no retry would shorten; it is served, not refused forever."""
    engine = _engine(tiny_dir, AdmissionConfig({"default": 0.5}))

    async def main() -> None:
        task, predicted = await _queued(engine, "alone", [4, 5, 6], SHORT)
        assert predicted is not None and predicted >= 1.0 and await task == 4

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert "alone" in scheduled


def test_admission_scales_the_prediction_by_the_tiers_recent_errors(tiny_dir: Path, scheduled) -> None:
    # the flex holder keeps the engine busy and is preempted for a default request: its own prefill, one
    # scripted second, is within 2.5 s; at 3x, not
    engine = _engine(tiny_dir, AdmissionConfig({"default": 2.5}, quantile=0.9))
    calibration = engine.core.scheduler.ttft_calibration
    for _ in range(calibration.min_samples):  # tier default (rank 1) ran 3x its predictions lately
        calibration.observe(1, predicted_s=1.0, actual_s=3.0)

    async def main() -> None:
        holder, _ = await _queued(engine, "holder", [1, 2, 3], LONG, "flex")  # no objective
        await async_wait_until(lambda: "holder" in scheduled, 60, "the holder running")  # not just queued
        with pytest.raises(AdmissionRefusedError) as refused:
            await _queued(engine, "refused", [4, 5, 6], SHORT)
        refusal: Refusal = refused.value.refusal
        assert refusal.bound_s == pytest.approx(3.0 * refusal.predicted_ttft_s)
        assert refusal.quantile == 0.9 and refusal.predicted_ttft_s >= 1.0  # one scripted step
        assert "at the 90th percentile of recent errors" in refusal.message
        # priority has no ratios yet (and no objective): queued on its bare prediction
        urgent, predicted = await _queued(engine, "urgent", [7, 8, 9], SHORT, "priority")
        assert predicted is not None and await asyncio.gather(holder, urgent) == [120, 4]

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert "refused" not in scheduled and calibration.samples(0) == 1


def test_a_tier_refused_by_old_errors_is_admitted_once_they_age_out(tiny_dir: Path, scheduled) -> None:
    """Refused requests add no ratio, so a tier whose recent ratios refuse its requests would be refused
    until the engine is idle again, whatever its load then; a tier without a first token for ``max_age_s``
    starts afresh. (The flex holder keeps the engine busy; a default request's own prefill, one scripted
    second, is within 2.5 s, not at 3x.)"""
    engine = _engine(tiny_dir, AdmissionConfig({"default": 2.5}, quantile=0.9))
    calibration = engine.core.scheduler.ttft_calibration
    long_ago = time.monotonic() - calibration.max_age_s - 1.0
    for _ in range(calibration.min_samples):  # a burst, a while ago: 3x its predictions
        calibration.observe(1, predicted_s=1.0, actual_s=3.0, now=long_ago)

    async def main() -> None:
        holder, _ = await _queued(engine, "holder", [1, 2, 3], LONG, "flex")  # no objective
        await async_wait_until(lambda: "holder" in scheduled, 60, "the holder running")  # not just queued
        task, predicted = await _queued(engine, "admitted", [4, 5, 6], SHORT)
        assert predicted is not None and await asyncio.gather(holder, task) == [120, 4]

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert "admitted" in scheduled and calibration.samples(1) == 1


class MillisecondPerStep(SecondPerStep):
    """A scripted step-time model far more optimistic than the slowed steps below: 1 ms a step."""

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
        return 0.001


def test_an_admitted_request_that_can_no_longer_be_on_time_is_dropped_with_a_refusal(
    tiny_dir: Path, scheduled
) -> None:
    """Predicted at ~0.12 s (120 scripted 1 ms steps ahead), the flex request is admitted under its 1 s
    objective; each real step takes 20 ms, so the holder's 120 steps outlast the objective and the request
    is dropped from the queue before any prefill, with a refusal that says how long it waited."""
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir), dtype="float32"),
        num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=1),
        admission=AdmissionConfig({"flex": 1.0}),
    )
    engine = AsyncEngine(config)
    engine.core.scheduler.step_time = MillisecondPerStep()
    execute = engine.core.runner.execute

    def slow_execute(scheduler_output):
        time.sleep(0.02)
        return execute(scheduler_output)

    engine.core.runner.execute = slow_execute
    engine.start()

    async def main() -> None:
        holder, _ = await _queued(engine, "holder", [1, 2, 3], LONG)  # tier default: no objective
        await async_wait_until(lambda: "holder" in scheduled, 60, "the holder running")
        late, predicted = await _queued(engine, "late", [4, 5, 6], SHORT, "flex")
        assert predicted is not None and predicted < 1.0  # admitted
        with pytest.raises(AdmissionRefusedError) as dropped:
            await late
        refusal: Refusal = dropped.value.refusal
        assert (refusal.tier, refusal.slo_s, refusal.requests_ahead, refusal.reason) == (
            "flex",
            1.0,
            0,
            "ttft_slo_queued",
        )
        assert refusal.waited_s is not None and 0.99 <= refusal.waited_s <= refusal.predicted_ttft_s
        assert refusal.predicted_ttft_s > 1.0
        assert refusal.retry_after_s == 1  # a request like it arriving now: ~0.1 s predicted
        assert refusal.message.startswith(f"waited {refusal.waited_s:.1f} s in the queue; predicted")
        assert await holder == 120

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert "late" not in scheduled
