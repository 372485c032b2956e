"""``kvscope plan`` end to end in-process: JSON and table output, flags, errors (exit 2, naming what is
known)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvscope.cli.main import main as kvscope_main
from kvscope.cli.plan import plan_main
from kvscope.plan.devices import known_device_names

KNOWN_DEVICES = (
    "a10-24gb, a100-sxm-40gb, a100-sxm-80gb, cpu, h100-pcie-80gb, h100-sxm-80gb, h200-sxm-141gb, "
    "l4-24gb, l40s-48gb, mi300x-192gb, t4-16gb"
)


def run_json(capsys, *argv: str) -> dict:
    assert plan_main([*argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_plan_for_smollm2_on_an_a100_40gb(capsys, model_dir):
    out = run_json(
        capsys,
        "--model",
        str(model_dir),
        "--device",
        "a100-40gb",
        "--max-model-len",
        "4096",
        "--concurrency",
        "32",
        "--dtype",
        "bfloat16",
    )
    assert out["kv_cache"]["bytes_per_token"] == 23_040
    assert out["kv_cache"]["bytes_per_sequence"] == 256 * 16 * 23_040
    weights = 2 * 134_515_008
    assert out["weights"]["bytes"] == weights
    budget = int(40 * (1 << 30) * 0.9) - weights - (512 << 20)
    assert out["memory"]["kv_budget_bytes"] == budget
    assert out["memory"]["num_blocks"] == budget // (16 * 23_040)
    assert out["memory"]["max_concurrent_sequences"] == budget // (16 * 23_040) // 256
    assert out["memory"]["fits"] is True
    assert out["flags"]["engine"] == {
        "--max-model-len": 4096,
        "--max-num-seqs": 32,
        "--block-size": 16,
        "--dtype": "bfloat16",
        "--device": "cuda",
        "--gpu-memory-utilization": 0.9,
    }
    assert out["speed"]["compute_format"] == "bf16"
    assert out["speed"]["peak_flops"] == 312e12
    assert [r["concurrency"] for r in out["speed"]["decode"]] == [1, 8, 32]
    one = out["speed"]["decode"][0]
    streamed = weights  # tied embeddings: the lm_head read is the embedding table
    assert one["memory_ms"] == pytest.approx(1e3 * (streamed + 192 * 23_040) / 1555e9)
    assert one["output_tokens_per_s"] == pytest.approx(1e3 / one["step_ms"])
    assert [r["prompt_tokens"] for r in out["speed"]["ttft"]] == [128, 512, 2048, 4096]
    assert out["warnings"] == []


def test_cpu_plan_recommends_the_kv_cache_memory_it_needs(capsys, model_dir, monkeypatch):
    from types import MappingProxyType

    from kvscope.cli import plan as cli
    from kvscope.plan.devices import Device

    fake_cpu = Device("cpu", 16 << 30, 10e9, MappingProxyType({"fp32": 100e9, "bf16": 200e9}), "test")
    monkeypatch.setattr(cli, "resolve_device", lambda name, args: fake_cpu)
    out = run_json(capsys, "--model", str(model_dir), "--max-model-len", "1024", "--concurrency", "4")
    assert out["flags"]["engine"]["--kv-cache-memory"] == f"{4 * 64 * 737_280 // (1 << 20)}MiB" == "180MiB"
    assert out["memory"]["num_blocks"] == 4 * 64
    assert out["memory"]["max_concurrent_sequences"] == 4
    assert out["memory"]["max_concurrent_sequences_at_workload"] == 4 * 64 // 16  # 256 tokens = 16 blocks
    assert out["flags"]["command"] == (
        "kvscope engine --model " + str(model_dir) + " --max-model-len 1024 "
        "--max-num-seqs 4 --block-size 16 --dtype float32 --kv-cache-memory 180MiB"
    )
    batch1 = out["speed"]["decode"][0]
    assert batch1["memory_ms"] == pytest.approx(1e3 * (538_060_032 + 192 * 46_080) / 10e9)
    assert batch1["bound"] == "memory"
    assert out["warnings"] == []


def test_cpu_plan_warns_when_the_cache_does_not_fit_the_ram(capsys, model_dir, monkeypatch):
    from types import MappingProxyType

    from kvscope.cli import plan as cli
    from kvscope.plan.devices import Device

    small = Device("cpu", 1 << 30, 10e9, MappingProxyType({"fp32": 100e9}), "test")
    monkeypatch.setattr(cli, "resolve_device", lambda name, args: small)
    out = run_json(capsys, "--model", str(model_dir), "--max-model-len", "1024", "--concurrency", "16")
    assert out["warnings"] == [
        f"weights (538060032 B) + KV cache ({16 * 64 * 737_280} B) exceed this machine's {1 << 30} B of RAM"
    ]


def test_too_small_a_budget_lowers_max_model_len_and_warns(capsys, model_dir):
    out = run_json(
        capsys,
        "--model",
        str(model_dir),
        "--device",
        "l4",
        "--concurrency",
        "100",
        "--gpu-memory-utilization",
        "0.05",
    )
    budget = int(24 * (1 << 30) * 0.05) - 538_060_032 - (512 << 20)
    blocks = budget // 737_280
    assert out["memory"]["num_blocks"] == blocks
    assert out["flags"]["engine"]["--max-model-len"] == blocks * 16
    assert (
        out["warnings"][0]
        == f"one sequence of 8192 tokens does not fit the KV budget: max_model_len lowered to {blocks * 16}"
    )
    assert out["memory"]["fits"] is False


@pytest.mark.parametrize("how", ["folder", "registered"])
def test_table_output_shows_the_kv_bytes_and_the_command(capsys, model_dir, how):
    model = str(model_dir) if how == "folder" else "smollm2-135m"
    assert plan_main(["--model", model, "--device", "h100", "--max-model-len", "2048"]) == 0
    text = capsys.readouterr().out
    assert "46,080 B" in text
    assert "recommended: kvscope engine --model " + model + " --max-model-len 2048 --max-num-seqs 256" in text
    assert ("on disk: gguf file" in text) is (how == "registered")
    assert "None" not in text  # a missing value reads as words ("never breaks"), not Python's None


def test_unknown_device_names_the_known_ones(capsys, model_dir):
    assert plan_main(["--model", str(model_dir), "--device", "b9000"]) == 2
    assert (
        capsys.readouterr().err
        == f"kvscope plan: error: unknown device 'b9000'; known devices: {KNOWN_DEVICES}\n"
    )
    assert ", ".join(known_device_names()) == KNOWN_DEVICES


def test_unknown_model_names_the_registered_ones(capsys):
    assert kvscope_main(["plan", "--model", "no-such-model", "--device", "h100"]) == 2
    assert capsys.readouterr().err == (
        "kvscope plan: error: unknown model 'no-such-model': not a registered name "
        "(known: smollm2-135m), a HF folder or config.json, or a .gguf file\n"
    )


def test_a_format_the_device_lacks_is_exit_2(capsys, model_dir):
    assert plan_main(["--model", str(model_dir), "--device", "t4", "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err == (
        "kvscope plan: error: device t4-16gb has no bf16 peak in the table; it has fp32, fp16, int8\n"
    )


def test_max_model_len_beyond_the_model_is_exit_2(capsys, model_dir):
    assert plan_main(["--model", str(model_dir), "--device", "h100", "--max-model-len", "9000"]) == 2
    assert capsys.readouterr().err == (
        "kvscope plan: error: max_model_len 9000 exceeds the model's max_position_embeddings 8192\n"
    )


def test_list_devices_json_has_every_entry_with_its_source(capsys):
    assert plan_main(["--list-devices", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert sorted([*table, "cpu"]) == KNOWN_DEVICES.split(", ")
    assert table["h100-sxm-80gb"] == {
        "aliases": ["h100", "h100-80gb", "h100-sxm"],
        "vendor": "NVIDIA",
        "memory_bytes": 80 << 30,
        "bandwidth_bytes_per_s": 3350e9,
        "peak_flops": {
            "fp32": 67e12,
            "tf32": 494.5e12,
            "bf16": 989.5e12,
            "fp16": 989.5e12,
            "fp8": 1979e12,
            "int8": 1979e12,
        },
        "source": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
        "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)",
    }
    assert [name for name, d in table.items() if "https://" not in d["source"]] == []


def test_the_planner_imports_no_torch():
    code = (
        "import sys, kvscope.cli.plan, kvscope.plan.replay, kvscope.plan.log_section, kvscope.plan.render; "
        "print(sorted(m for m in ('torch', 'transformers', 'kvscope.engine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


def test_the_planner_assumes_the_engines_default_token_budget() -> None:
    from kvscope.engine.config import SchedulerConfig
    from kvscope.plan.planner import PlanRequest

    assert (
        PlanRequest(model="smollm2-135m").max_num_batched_tokens
        == SchedulerConfig().max_num_batched_tokens
        == 1024
    )
