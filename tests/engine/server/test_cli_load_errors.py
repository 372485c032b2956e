"""A configuration only loading the model can judge ends ``kvscope engine`` with one line and exit status
2, not a start-up traceback (engine/server/cli.py ``load_engine``; found by a break-it run: exit 3 and an
80-line exception group from the app's lifespan)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvscope.engine.engine_core import resolve_device


def _engine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvscope.engine.server", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--model", "/nonexistent/model"),
            "kvscope engine: model '/nonexistent/model' is not a registered name",
        ),
        (("--device", "cuda:999"), "kvscope engine: device 'cuda:999': torch"),
        (
            ("--max-model-len", "1024", "--num-blocks", "1"),
            "kvscope engine: max_model_len 1024 needs more KV cache than the budget holds (16 tokens)",
        ),
    ],
    ids=["no-such-model", "no-such-device", "too-few-blocks"],
)
def test_a_load_time_configuration_error_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    done = _engine(*args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(message)


def test_gguf_quantization_of_a_hf_folder_is_refused_with_exit_2(model_dir: Path) -> None:
    done = _engine("--model", str(model_dir), "--quantization", "gguf")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "kvscope engine: quantization 'gguf' needs a GGUF model (a registry name or a .gguf file)"
    )


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("mps", "gpu", "meta"):
        with pytest.raises(ValueError, match=f"device must be cpu, cuda or cuda:N, got '{name}'"):
            resolve_device(name)
    missing = "cuda:999" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=f"device '{missing}': torch"):
        resolve_device(missing)
