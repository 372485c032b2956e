"""The ``kvscope bench`` CLI end to end over a MockTransport: request bodies, the JSON result file, the
rotated alternation of ``--compare`` (A B C, B C A, …) and its ratios, exit codes."""

from __future__ import annotations

import json

import httpx
import pytest

from kvscope.bench import runner
from kvscope.bench.serve import main
from tests.bench.fakes import write_word_tokenizer

DELAY = {"a": 0, "b": 0}


def stream(n_tokens: int) -> bytes:
    chunks = [{"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]} for i in range(n_tokens)]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n_tokens}})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@pytest.fixture
def served(monkeypatch, tmp_path):
    """Patch the runner's client factory: every POST is recorded and answered with max_tokens tokens."""
    seen: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "down":
            return httpx.Response(503, json={"error": {"message": "engine stopped", "type": "server_error"}})
        return httpx.Response(200, content=stream(body["max_tokens"]))

    monkeypatch.setattr(
        runner, "make_client", lambda load: httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    return seen, ["--tokenizer", str(tokenizer), "--disable-tqdm", "--input-len", "6", "--output-len", "3"]


def test_single_run_writes_every_request(served, tmp_path, capsys):
    seen, common = served
    out_file = tmp_path / "result.json"
    rc = main(
        [
            "--base-url",
            "http://a:1",
            "--model",
            "tiny",
            "--num-prompts",
            "4",
            "--ignore-eos",
            "--max-concurrency",
            "2",
            "--extra-body",
            '{"cache_prompt": false}',
            "--save-result",
            str(out_file),
            *common,
        ]
    )
    assert rc == 0
    warmup, *timed = [body for _, body in seen]
    assert warmup["max_tokens"] == 3 and len(timed) == 4
    assert warmup["prompt"].startswith("This is a warm-up request")  # no dataset prompt gets cached early
    assert warmup["prompt"] not in {b["prompt"] for b in timed}
    assert {
        (b["model"], b["max_tokens"], b["min_tokens"], b["ignore_eos"], b["cache_prompt"], b["temperature"])
        for b in timed
    } == {("tiny", 3, 3, True, False, 0.0)}
    result = json.loads(out_file.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 12)
    assert result["total_input_tokens"] == 24 and result["input_lens"] == [6, 6, 6, 6]
    assert result["output_lens"] == [3, 3, 3, 3]
    assert [len(r["itl"]) for r in result["requests"]] == [2, 2, 2, 2]
    assert result["load"]["max_concurrency"] == 2 and result["load"]["request_rate"] == "inf"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_compare_alternates_endpoints_and_reports_ratios(served, tmp_path, capsys):
    seen, common = served
    out_file = tmp_path / "cmp.json"
    rc = main(
        [
            "--base-url",
            "http://a:1",
            "--compare",
            "http://b:2",
            "--compare",
            "http://c:3",
            "--compare-rounds",
            "4",
            "--num-prompts",
            "2",
            "--label",
            "engine",
            "--label",
            "peer",
            "--label",
            "other",
            "--save-result",
            str(out_file),
            *common,
        ]
    )
    assert rc == 0
    hosts = [host for host, _ in seen]
    runs = [hosts[i : i + 3] for i in range(0, len(hosts), 3)]  # each run: its warm-up and 2 prompts
    assert all(len(set(run)) == 1 for run in runs)
    # the order rotates each round (counterbalanced): A B C, B C A, C A B, A B C
    assert [run[0] for run in runs] == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    out = capsys.readouterr().out
    assert [line.split()[2] for line in out.splitlines() if line.startswith("round ")] == list("ABCBCACABABC")
    result = json.loads(out_file.read_text())
    assert result["labels"] == ["engine", "peer", "other"] and len(result["runs"]) == 4
    assert [[run["label"] for run in row] for row in result["runs"]] == [["engine", "peer", "other"]] * 4
    prompts = [[run["requests"][0]["prompt_len"] for run in row] for row in result["runs"]]
    assert prompts == [[6, 6, 6]] * 4
    assert result["figures"]["output_throughput"][0] > 0
    assert set(result["ratios"]) >= {"output_throughput", "median_ttft_ms", "p99_tpot_ms"}
    assert "peer/engine" in out and "other/engine" in out


def test_failed_warmup_and_bad_arguments_exit_nonzero(served, capsys):
    _, common = served
    assert main(["--base-url", "http://down:1", "--num-prompts", "2", *common]) == 1
    assert "warm-up request to http://down:1/v1/completions failed (http_503): engine stopped" in (
        capsys.readouterr().err
    )
    assert main(["--num-prompts", "0", *common]) == 2
    assert main(["--compare-model", "x", *common]) == 2
