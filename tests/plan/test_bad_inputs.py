"""`kvscope plan` answers bad input with exit 2 and one line naming the problem, never a traceback or a plan
built from nonsense (the break-it cases of this round)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvscope.cli.plan import plan_main

GOOD = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


def _config(tmp_path: Path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([1, 2], "must be a JSON object, got list"),
        (None, "must be a JSON object, got NoneType"),
        ({**GOOD, "max_position_embeddings": -1}, "max_position_embeddings must be between 1 and"),
        ({**GOOD, "vocab_size": None}, "has no 'vocab_size'"),
        ({**GOOD, "num_key_value_heads": True}, "num_key_value_heads must be a whole number, got True"),
        (
            {**GOOD, "num_key_value_heads": 3},
            "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
        ),
        ({**GOOD, "num_hidden_layers": 1e30}, "num_hidden_layers must be between 1 and"),
        ({**GOOD, "hidden_size": 1.5}, "hidden_size must be a whole number, got 1.5"),
        ({**GOOD, "head_dim": 0}, "head_dim must be between 1 and"),
        (
            {
                "architectures": ["MambaForCausalLM"],
                "hidden_size": 768,
                "num_hidden_layers": 24,
                "vocab_size": 50280,
            },
            "has no 'num_attention_heads'",
        ),
    ],
)
def test_bad_configs_exit_2_with_the_field(tmp_path, capsys, config, message) -> None:
    assert plan_main(["--model", _config(tmp_path, config), "--device", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope plan: error: config ") and message in err and err.count("\n") == 1


def test_a_damaged_gguf_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    assert plan_main(["--model", str(path), "--device", "h100"]) == 2
    assert capsys.readouterr().err.startswith(f"kvscope plan: error: {path} is not a readable GGUF file (")


def test_a_damaged_gz_log_exits_2(tmp_path, capsys) -> None:
    log = tmp_path / "requests.jsonl"
    log.write_text("")
    (tmp_path / "requests.jsonl.1.gz").write_bytes(gzip.compress(b'{"a": 1}\n')[:-8])
    assert plan_main(["--model", _config(tmp_path, GOOD), "--device", "h100", "--from-log", str(log)]) == 2
    assert capsys.readouterr().err.startswith(f"kvscope plan: error: cannot read the request log {log}: ")


def test_non_positive_probe_threads_exit_2(tmp_path, capsys) -> None:
    assert plan_main(["--model", _config(tmp_path, GOOD), "--device", "cpu", "--probe-threads", "-2"]) == 2
    assert capsys.readouterr().err == "kvscope plan: error: probe threads must be at least 1, got -2\n"


@pytest.mark.parametrize("text", [b"{", b"\xff\xfe{}"], ids=["truncated", "not-utf8"])
def test_a_config_that_is_not_json_names_the_file(tmp_path, capsys, text: bytes) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(text)
    assert plan_main(["--model", str(path), "--device", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope plan: error: config {path} is not JSON: ") and err.count("\n") == 1
