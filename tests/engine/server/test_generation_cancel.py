"""A GenerationRun whose reader is cancelled (the client left while it waited for the next output) leaves
no pending ``Queue.get`` task behind: asyncio would log "Task was destroyed but it is pending!" at ERROR
later."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvscope.engine.server.generation import KEEPALIVE, GenerationRun


async def _queue_getters() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if not t.done() and "Queue.get" in repr(t.get_coro())]


async def test_a_cancelled_wait_cancels_its_queue_getter() -> None:
    run = SimpleNamespace(_queue=asyncio.Queue())
    waiting = asyncio.create_task(GenerationRun._get(run, None, asyncio.get_running_loop().create_future()))
    for _ in range(3):
        await asyncio.sleep(0)  # let it reach asyncio.wait
    assert len(await _queue_getters()) == 1
    waiting.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    assert waiting.cancelled() and await _queue_getters() == []
    run._queue.put_nowait("next")  # the cancelled getter consumed nothing
    assert run._queue.get_nowait() == "next"


async def test_a_timeout_returns_keepalive_and_cancels_the_getter() -> None:
    run = SimpleNamespace(_queue=asyncio.Queue())
    assert await GenerationRun._get(run, 0.01, None) is KEEPALIVE
    await asyncio.sleep(0)
    assert await _queue_getters() == []
