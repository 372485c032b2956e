"""``kvscope serve`` end to end: the supervisor starts a real engine and a real gateway, one chat request goes
through it with the official ``openai`` SDK, and stopping the supervisor leaves no child process behind —
after a SIGTERM (orderly stop, exit status 0) and after a SIGKILL (the children's PR_SET_PDEATHSIG).

Children are found through /proc (parent pid of each process) while the stack runs; a pid counts as gone when
/proc has no such process, a zombie, or a process with another start time (pid reuse).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvscope.gateway.logs.jsonl import read_records
from kvscope.testing.harness import free_port, read_log
from tests.conftest import cpu_instruction_skip
from tests.engine.server.e2e_support import CHAT, wait_for

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
ENGINE_ARGS = "--max-model-len 512 --kv-cache-memory 32M --num-threads 1"
BANNER = "kvscope is serving"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of ``pid``, None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1]), int(fields[19])


def children_of(pid: int) -> dict[int, int]:
    """Child pid → start time of every live child of ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) and stat[1] == pid and stat[0] != "Z":
            out[int(entry.name)] = stat[2]
    return out


def gone(pid: int, start_time: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] == "Z" or stat[2] != start_time


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@dataclass
class Serve:
    proc: subprocess.Popen
    port: int
    output: Path
    log_file: Path
    children: dict[int, int]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _command(port: int, log_file: Path) -> list[str]:
    script = Path(sys.executable).with_name("kvscope")  # the console script of this venv
    head = [str(script)] if script.is_file() else [sys.executable, "-P", "-m", "kvscope.cli"]
    return [*head, "serve", "--port", str(port), "--log-file", str(log_file), "--engine-args", ENGINE_ARGS]


@pytest.fixture
def serve(tmp_path) -> Iterator[Serve]:
    """``kvscope serve`` in its own process group, returned once its banner is printed."""
    port, output, log_file = free_port(), tmp_path / "serve.out", tmp_path / "requests.jsonl"
    with output.open("wb") as out:
        proc = subprocess.Popen(
            _command(port, log_file), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    running = Serve(proc, port, output, log_file, {})
    try:
        deadline = time.monotonic() + 240
        while BANNER not in output.read_text(errors="replace"):
            assert proc.poll() is None, (
                f"kvscope serve exited with {proc.returncode}:\n{output.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no banner after 240 s:\n{output.read_text()[-3000:]}"
            time.sleep(0.2)
        running.children = children_of(proc.pid)
        yield running
    finally:
        for pid, start in {**running.children, **children_of(proc.pid)}.items():  # never leave one behind
            if not gone(pid, start):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _check_children(running: Serve) -> None:
    commands = sorted(
        " ".join(cmdline(pid)[1:5]) for pid in running.children
    )  # [python] -P -m kvscope.cli <cmd>
    assert len(commands) == 2 and "engine" in commands[0] and "gateway" in commands[1], commands


def _check_default_format(running: Serve) -> None:
    """No --dtype/--quantization: the engine picks the fastest verified format (smollm2-135m: float32,
    bfloat16, int8 or gguf by its start-up probe; gguf where kvscope's CPU kernels run its decode step),
    logs why, and serve prints the same format from the engine's card."""
    import re

    text = running.output.read_text(errors="replace")
    engine_line = re.search(
        r"weights format: dtype (\w+), quantization (\w+) \((?:fastest verified format by |kvscope's "
        r"CPU kernels run gguf's decode step .*?)the start-up probe .*verified: float32, bfloat16, "
        r"int8, gguf \(kvscope eval ppl, 13,613 tokens",
        text,
    )
    serve_line = re.search(r"engine weight format: dtype (\w+), quantization (\w+), weights \d+ MiB", text)
    assert engine_line is not None and serve_line is not None, text[-3000:]
    assert engine_line.groups() == serve_line.groups()
    # each fact once (issue 45): the reason in the engine's line only (not the serve line, not a ModelInfo
    # repr), the probe's choice without its timings dict, the probe's choice not repeated by the quantizer
    assert text.count("int8, gguf (kvscope eval ppl, 13,613 tokens") == 1, text[-3000:]
    assert "ModelInfo(" not in text and "'float32@1'" not in text
    probe = re.findall(r"CPU kernel probe \(.*?\): (.*)", text)
    assert len(probe) == 1 and text.count(probe[0]) == 1, text[-3000:]
    # the choice is the one the logged scores make (format_choice.choose_format): gguf where kvscope's CPU
    # kernels run its decode step, otherwise a lowest score (the line rounds them to 2 decimals, so any of
    # those tied there); on an AVX2-only CPU int8 and gguf score within noise and either may win a start
    dtype, quantization = engine_line.groups()
    assert dtype in ("float32", "bfloat16"), engine_line.group(0)
    listed = re.search(r"geometric mean over \d+ batch sizes: ([^)]*)\)", engine_line.group(0))
    assert listed is not None, engine_line.group(0)
    scores = {name: float(score) for name, score in re.findall(r"(\w+) (\d+\.\d+)", listed.group(1))}
    assert set(scores) <= {"float32", "bfloat16", "int8", "gguf"} and "float32" in scores, scores
    chosen = quantization if quantization != "none" else dtype
    if "kvscope's CPU kernels run gguf's decode step" in engine_line.group(0):
        assert chosen == "gguf"
    else:
        assert scores.get(chosen) == min(scores.values()), (chosen, scores)
    if cpu_instruction_skip("cpu_kernels") is None:  # kvscope's CPU kernels run here: never int8, whose
        assert chosen != "int8", engine_line.group(0)  # decode steps were several times gguf's (d14cc91)


def _check_why(log_file: Path, prompt_tokens: int, record: dict) -> None:
    """``kvscope logs why`` on the gateway's log line of the one request (issue 18): one step of prefill, 3 of
    decode, nothing ahead, and the causes add up to the gateway's e2e."""
    import contextlib
    import io
    import json

    from kvscope.gateway.analytics.cli import logs_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert logs_main(["why", "why-me", "--source", str(log_file), "--format", "json"], env={}) == 0
    answer = json.loads(out.getvalue())
    engine = answer["engine"]
    assert (answer["request_id"], engine["queue_ahead"], engine["running_on_arrival"]) == ("why-me", 0, 0)
    assert (engine["prefill_steps"], engine["prefill_tokens"], engine["prompt_tokens"]) == (
        1,
        prompt_tokens,
        prompt_tokens,
    )
    assert (engine["decode_steps"], engine["decode_tokens"], engine["num_preemptions"]) == (3, 3, 0)
    assert sum(c["seconds"] for c in answer["causes"]) == pytest.approx(record["kvscope"]["e2e_s"], rel=0.05)
    # not streamed: the gateway saw no first token; its TTFT is the last byte less the engine's decode_s
    ttft = record["kvscope"]["ttft_s"]
    assert record["kvscope"]["upstream"]["sources"]["ttft_s"] == "per_request"
    assert engine["ttft_s"] <= ttft <= record["kvscope"]["e2e_s"] - engine["decode_s"]
    assert answer["text"].startswith(
        f"TTFT {ttft:.3f} s: {engine['queue_s']:.3f} s queued (0 requests ahead, 0 running); prefill "
    )


def test_serve_answers_through_the_openai_sdk_and_stops_cleanly_on_sigterm(serve):
    import openai

    _check_children(serve)
    _check_default_format(serve)
    sdk = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
    answer = sdk.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        extra_headers={"x-request-id": "why-me"},
    )
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 4)
    assert [m.id for m in sdk.models.list()] == ["smollm2-135m"]
    chats = wait_for(lambda: [r for r in read_log(serve.log_file, 0, 0) if r["url"]["path"] == CHAT], 5)
    assert [(r["http"]["response"]["status_code"], r["gen_ai"]["usage"]["output_tokens"]) for r in chats] == [
        (200, 4)
    ]
    _check_why(serve.log_file, answer.usage.prompt_tokens, chats[0])
    # the engine's own request log goes beside it, not onto the terminal
    engine_log = serve.log_file.with_name("engine.ndjson")
    engine_chats = wait_for(lambda: [r for r in read_records(engine_log) if r["url"]["path"] == CHAT], 30)
    assert [r["gen_ai"]["usage"]["output_tokens"] for r in engine_chats] == [4]
    assert '"url":{"path":"/v1/chat/completions"}' not in serve.output.read_text(errors="replace")
    started = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(20) == 0
    assert time.monotonic() - started < 20
    assert all(gone(pid, start) for pid, start in serve.children.items()), serve.output.read_text()[-3000:]


def test_children_die_with_a_sigkilled_supervisor(serve):
    _check_children(serve)
    serve.proc.send_signal(signal.SIGKILL)
    assert serve.proc.wait(5) == -signal.SIGKILL
    wait_for(lambda: all(gone(pid, start) for pid, start in serve.children.items()), 20, 0.2)
