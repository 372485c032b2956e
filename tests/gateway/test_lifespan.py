"""The gateway's start-up (gateway/lifespan.py) leaves what it built out of the cyclic GC's passes when the
process is the gateway's own."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from kvscope.gateway.lifespan import gateway_lifespan
from kvscope.testing.harness import LoopThread
from tests.gateway.conftest import build_stack


def test_what_start_up_built_is_frozen_out_of_the_gcs_passes(loop: LoopThread, tmp_path: Path) -> None:
    """gc.freeze() once the lifespan has started with its loop in the main thread (``kvscope gateway``, each
    of its workers): the app, its state and the libraries' objects move to the permanent generation, which
    no collection scans (measured: GC time per request 0.7 -> 0.4 ms), until the lifespan ends. A gateway in
    another thread (a test's, an embedding program's) leaves its host's objects alone."""
    gateway, fakes, _ = build_stack(loop, tmp_path)

    async def frozen_while_running() -> int:
        async with gateway_lifespan(gateway.app):
            frozen = gc.get_freeze_count()
        assert gc.get_freeze_count() == 0  # given back at shutdown: a stopped app can be collected
        return frozen

    try:
        gc.unfreeze()
        assert gc.get_freeze_count() == 0
        with gateway:  # the same app's lifespan in a thread: nothing frozen
            assert gc.get_freeze_count() == 0
        frozen = asyncio.run(frozen_while_running())
    finally:
        gc.unfreeze()
        for fake in fakes.values():
            loop.run(fake.close())
    assert frozen > 10_000  # the gateway's state and everything imported so far
