"""``kvscope plan --weights-format``: the bytes the kvscope engine holds per CPU weight format (the
counts ``kvscope.engine.platform.compact.model_weight_bytes`` reported for SmolLM2-135M on 2026-12-01, dense
copies in bfloat16), bytes per parameter, and the recommended flags naming the format."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest

from kvscope.cli import plan as cli
from kvscope.plan.devices import Device
from kvscope.plan.engine_formats import bytes_per_linear_weight, engine_weight_bytes
from kvscope.plan.model_files import read_model

# model_weight_bytes of the loaded engine, SmolLM2-135M (tied embeddings), probe keeping dense bf16 copies
MEASURED = {
    "float32": 1_075_979_520,
    "bfloat16": 537_989_760,
    "int8": 460_542_336,
    "gguf": 423_858_816,
    "int4": 423_858_816,
}
"""int4/gguf with kvscope's CPU kernels: 392,008,320 B + the Q8 LM-head copy (49,152 x 576 x 36/32 B)."""


@pytest.mark.parametrize("fmt", list(MEASURED))
def test_engine_bytes_match_what_the_engine_holds(model_dir, fmt) -> None:
    assert engine_weight_bytes(read_model(str(model_dir)).shape, fmt, "bfloat16") == MEASURED[fmt]


def test_bytes_per_parameter_per_format() -> None:
    assert [bytes_per_linear_weight(f) for f in ("float32", "bfloat16", "int8", "int4")] == [8, 4, 3, 2.625]
    assert bytes_per_linear_weight("int4", "float32") == 4.625  # a CPU without fast bf16: float32 dense copy
    assert [bytes_per_linear_weight(f, dense_copy=False) for f in ("int8", "int4")] == [1, 0.625]


def test_compact_formats_without_a_dense_copy(model_dir) -> None:
    shape = read_model(str(model_dir)).shape
    linear = 106_168_320  # 30 layers x (qkv 576x960 + o 576x576 + gate_up/down 3x576x1536)
    assert engine_weight_bytes(shape, "int4", dense_copy=False) == MEASURED["int4"] - 2 * linear
    assert (
        engine_weight_bytes(shape, "gguf", q8_head=False) == 392_008_320
    )  # torch's kernels: no Q8 head copy
    assert engine_weight_bytes(shape, "int8", dense_copy=False) == MEASURED["int8"] - 2 * (
        linear + 49152 * 576
    )
    # the 4-bit tile copy of kvscope's AMX matmul: 0.625 B a decoder weight (4 bits + a float16 d and m per
    # 32)
    assert engine_weight_bytes(shape, "gguf", amx_copy=True) == MEASURED["gguf"] + 66_355_200 == 490_214_016


def test_cpu_plan_for_an_engine_format_names_its_flags(capsys, model_dir, monkeypatch) -> None:
    fake_cpu = Device("cpu", 16 << 30, 10e9, MappingProxyType({"fp32": 100e9, "bf16": 200e9}), "test")
    monkeypatch.setattr(cli, "resolve_device", lambda name, args: fake_cpu)
    argv = [
        "--model",
        str(model_dir),
        "--max-model-len",
        "1024",
        "--concurrency",
        "4",
        "--weights-format",
        "int4",
        "--dtype",
        "bfloat16",
        "--format",
        "json",
    ]
    assert cli.plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["weights"]["bytes"], out["weights"]["weights_format"]) == (MEASURED["int4"], "int4")
    assert out["weights"]["engine_by_format"] == MEASURED
    assert out["memory"]["weights_bytes"] == MEASURED["int4"]
    assert out["kv_cache"]["bytes_per_token"] == 23_040  # the KV cache is in the dense dtype
    assert out["flags"]["command"] == (
        "kvscope engine --model " + str(model_dir) + " --max-model-len 1024 "
        "--max-num-seqs 4 --block-size 16 --dtype bfloat16 --quantization int4 "
        "--kv-cache-memory 90MiB"
    )
    assert out["speed"]["streamed_weight_bytes"] == 66_355_200 + (134_515_008 - 106_168_320) * 2  # Q4_1 bytes


def test_compact_engine_formats_are_cpu_only(capsys, model_dir) -> None:
    assert (
        cli.plan_main(["--model", str(model_dir), "--device", "h100-80gb", "--weights-format", "gguf"]) == 2
    )
    assert "is a CPU format of the kvscope engine" in capsys.readouterr().err
