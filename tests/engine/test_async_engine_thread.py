"""AsyncEngine runs all of the engine's torch work on its one engine thread (engine/async_engine.py): building
the EngineCore, the prefill warm-up and every step. A second thread that runs torch's OpenMP parallel regions
leaves a second libgomp worker pool behind, and with more OpenMP threads than CPUs every parallel op of the
step thread pays a futex wake-up (a batch-32 decode step measured 57.6 → 78.4 ms on 2 cores)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from kvscope.engine.async_engine import AsyncEngine
from kvscope.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvscope.engine.engine_core import EngineCore
from kvscope.engine.errors import EngineDeadError
from kvscope.engine.sampling_params import SamplingParams
from tests.engine.spec_distribution import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("async") / "tiny", tokenizer_dir).path


def _config(path: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=64),
    )


async def _generate(engine: AsyncEngine) -> list[int]:
    request = engine.process_inputs([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    async for output in engine.generate("r1", request):
        tokens.extend(output.outputs[0].token_ids)
    return tokens


def test_build_warm_up_and_steps_run_on_the_engine_thread(tiny_dir: Path, monkeypatch) -> None:
    seen: dict[str, set[str]] = {"build": set(), "warm_up": set(), "step": set()}

    def recording(name: str, original):
        def wrapper(self, *args, **kwargs):
            seen[name].add(threading.current_thread().name)
            return original(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(EngineCore, "__init__", recording("build", EngineCore.__init__))
    monkeypatch.setattr(EngineCore, "warm_up_prefill", recording("warm_up", EngineCore.warm_up_prefill))
    monkeypatch.setattr(EngineCore, "step", recording("step", EngineCore.step))
    engine = AsyncEngine(_config(tiny_dir))
    try:
        assert engine.warm_up_prefill() >= 0
        assert not engine.is_running  # built and warmed, not serving before start()
        engine.start()
        assert engine.is_running
        assert len(asyncio.run(_generate(engine))) == 4
    finally:
        engine.stop()
    assert seen == {"build": {"kvscope-engine"}, "warm_up": {"kvscope-engine"}, "step": {"kvscope-engine"}}
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        engine.warm_up_prefill()


def test_a_failed_build_raises_in_the_caller(tmp_path: Path) -> None:
    with pytest.raises(Exception) as caught:
        AsyncEngine(_config(tmp_path / "no-such-model"))
    assert "no-such-model" in str(caught.value)


def test_an_error_in_a_call_is_raised_in_the_caller_and_the_engine_keeps_serving(
    tiny_dir: Path, monkeypatch
) -> None:
    engine = AsyncEngine(_config(tiny_dir))
    try:

        def broken(self):
            raise RuntimeError("warm-up broke")

        monkeypatch.setattr(EngineCore, "warm_up_prefill", broken)
        with pytest.raises(RuntimeError, match="warm-up broke"):
            engine.warm_up_prefill()
        engine.start()
        assert len(asyncio.run(_generate(engine))) == 4
    finally:
        engine.stop()


def test_a_step_delivers_its_outputs_in_one_thread_safe_call(tiny_dir: Path, monkeypatch) -> None:
    """Each call_soon_threadsafe writes the loop's self-pipe from the engine thread: a step's outputs for 6
    concurrent requests go in one call, each request still gets all its tokens in order."""
    engine = AsyncEngine(_config(tiny_dir))
    per_step: list[int] = []
    original = EngineCore.step

    def step(self, *args, **kwargs):
        deadline = time.monotonic() + 10
        while not per_step and len(set(self.request_ids())) < 6 and time.monotonic() < deadline:
            engine._drain_inbox()  # the first step waits (on the engine thread) until all 6 requests are in
            time.sleep(0.005)
        result = original(self, *args, **kwargs)
        per_step.append(len(result.outputs))
        return result

    monkeypatch.setattr(EngineCore, "step", step)
    calls: list[int] = []

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if threading.current_thread().name == "kvscope-engine":
                calls.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

        async def one(i: int) -> list[int]:
            request = engine.process_inputs([1, 2, 3 + i], params)
            return [t async for out in engine.generate(f"r{i}", request) for t in out.outputs[0].token_ids]

        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        engine.start()
        results = asyncio.run(run())
    finally:
        engine.stop()
    assert [len(tokens) for tokens in results] == [5] * 6
    assert per_step[0] == 6 and calls == [n for n in per_step if n]  # one call per step, all its outputs
