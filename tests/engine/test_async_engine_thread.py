"""AsyncEngine runs all of the engine's torch work on its one engine thread (engine/async_engine.py): building
the EngineCore, the prefill warm-up and every step. A second thread that runs torch's OpenMP parallel regions
leaves a second libgomp worker pool behind, and with more OpenMP threads than CPUs every parallel op of the
step thread pays a futex wake-up (a batch-32 decode step measured 57.6 → 78.4 ms on 2 cores)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine_core import EngineCore
from engine.errors import EngineDeadError
from engine.sampling_params import SamplingParams
from tests.engine.spec_distribution import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("async") / "tiny", tokenizer_dir).path


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(path), dtype="float32"), num_threads=1,
                        cache=CacheConfig(block_size=16, num_blocks=64))


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


def test_an_error_in_a_call_is_raised_in_the_caller_and_the_engine_keeps_serving(tiny_dir: Path,
                                                                                monkeypatch) -> None:
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
