"""A stand-in gateway process for the kill test: runs the Elasticsearch sink in its own interpreter.

``emit URL SPOOL``: emits records ``req-000000``, ``req-000001`` … forever (100 every 5 ms) and prints
``durable N`` after each chunk: the first N records are in Elasticsearch or in the spool (written to the
page cache, so they survive SIGKILL). Records are spooled in emission order, so durable records form a
prefix. ``replay URL SPOOL``: starts the sink on the same spool, waits until it is empty, prints the stats
as JSON and exits.

Run as ``python -m tests.gateway.logs.sink_driver MODE URL SPOOL`` from the repository root.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from kvscope.gateway.logs.elasticsearch import ElasticsearchSink
from kvscope.testing.records import make_record
from tests.gateway.logs.helpers import fast_config


async def emit_forever(sink: ElasticsearchSink) -> None:
    i = 0
    while True:
        for _ in range(100):
            sink.emit(make_record(i))
            i += 1
        await asyncio.sleep(0.005)
        durable = sink.stats.shipped + sink.stats.spooled
        print(f"durable {durable} emitted {i} shipped {sink.stats.shipped}", flush=True)


async def main(mode: str, url: str, spool_dir: Path) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("elastic_transport").setLevel(logging.ERROR)
    sink = ElasticsearchSink(fast_config(spool_dir, url))
    await sink.start()
    if mode == "emit":
        await emit_forever(sink)
    idle = await sink.wait_idle(30)
    await sink.aclose()
    print(json.dumps({"idle": idle, **asdict(sink.stats)}), flush=True)
    return 0 if idle else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))))
