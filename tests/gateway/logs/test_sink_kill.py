"""A process running the sink is SIGKILLed mid-outage; a second process replays the spool: nothing is lost.

The full-gateway version is tests/gateway/logs/test_gateway_kill_replay.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from kvscope.testing.es_double import EsDouble
from tests.gateway.logs.helpers import segment_files

REPO = Path(__file__).resolve().parents[3]


async def start_driver(mode: str, url: str, spool: Path) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.gateway.logs.sink_driver",
        mode,
        url,
        str(spool),
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def read_durable_until(proc: asyncio.subprocess.Process, at_least: int) -> int:
    """Read ``durable N`` lines until N ≥ ``at_least``; return the last N."""
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)  # type: ignore[union-attr]
        assert line, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        durable = int(line.split()[1])
        if durable >= at_least:
            return durable


async def test_sigkill_mid_outage_then_restart_replays_everything(tmp_path):
    spool = tmp_path / "spool"
    async with EsDouble() as es:
        first = await start_driver("emit", es.url, spool)
        shipped_before_outage = await read_durable_until(first, 500)
        await es.go_down()
        durable = await read_durable_until(first, shipped_before_outage + 2000)
        first.send_signal(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        assert segment_files(spool)  # the outage left records on disk

        await es.come_up()
        second = await start_driver("replay", es.url, spool)
        out, err = await asyncio.wait_for(second.communicate(), 60)
        assert second.returncode == 0, err.decode()
        stats = json.loads(out.decode().splitlines()[-1])

    indexed = set(es.docs())
    emitted_prefix = {f"evt-{i:06d}" for i in range(durable)}
    assert emitted_prefix <= indexed  # every record that was durable when the process died is indexed
    assert all(doc_id.startswith("evt-") for doc_id in indexed)
    assert set(es.created.values()) == {1}  # and none twice
    assert stats["replayed"] == stats["shipped"] >= 1500  # the second process shipped only from the spool
    assert stats["failed"] == stats["dropped"] == 0
    assert segment_files(spool) == []
