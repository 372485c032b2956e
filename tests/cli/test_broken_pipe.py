"""`kvscope logs … | head`: when the reader closes the pipe early, kvscope exits quietly with 141 (as a
process killed by SIGPIPE would), with no traceback and no "BrokenPipeError" line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvscope.testing.records import make_record

REPO = Path(__file__).resolve().parents[2]


def test_logs_search_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(make_record(i)) + "\n" for i in range(3000)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "kvscope.cli",
        "logs",
        "search",
        "--source",
        str(log),
        "--limit",
        "3000",
        "--format",
        "json",
        "true",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line, as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert json.loads(first)["http"]["request"]["id"].startswith("req-")
    assert err == ""
