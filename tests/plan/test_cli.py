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
        "--quantization": "none",
        "--device": "cuda",
        "--gpu-memory-utilization": 0.9,
    }
    assert out["verdict"]["fits"] is True and out["verdict"]["short_bytes"] == 0
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
    out = run_json(
        capsys,
        "--model",
        str(model_dir),
        "--max-model-len",
        "1024",
        "--concurrency",
        "4",
        "--dtype",
        "float32",
    )
    assert out["flags"]["engine"]["--kv-cache-memory"] == f"{4 * 64 * 737_280 // (1 << 20)}MiB" == "180MiB"
    assert out["memory"]["num_blocks"] == 4 * 64
    assert out["memory"]["max_concurrent_sequences"] == 4
    assert out["memory"]["max_concurrent_sequences_at_workload"] == 4 * 64 // 16  # 256 tokens = 16 blocks
    assert out["flags"]["command"] == (
        "kvscope engine --model " + str(model_dir) + " --max-model-len 1024 "
        "--max-num-seqs 4 --block-size 16 --dtype float32 --quantization none --kv-cache-memory 180MiB"
    )
    # an explicit --dtype with --quantization auto: dense weights as the kvscope engine holds them
    assert out["assumed"] == {"--quantization": "dense weights in float32 (the --dtype given)"}
    assert (out["weights"]["weights_format"], out["weights"]["bytes"]) == ("float32", 1_075_979_520)
    batch1 = out["speed"]["decode"][0]
    assert batch1["memory_ms"] == pytest.approx(1e3 * (538_060_032 + 192 * 46_080) / 10e9)
    assert batch1["bound"] == "memory"
    assert out["warnings"] == []


def test_cpu_plan_that_does_not_fit_the_ram_exits_3_and_names_the_ram_it_needs(
    capsys, model_dir, monkeypatch
):
    from types import MappingProxyType

    from kvscope.cli import plan as cli
    from kvscope.plan.devices import Device

    small = Device("cpu", 1 << 30, 10e9, MappingProxyType({"fp32": 100e9}), "test")
    monkeypatch.setattr(cli, "resolve_device", lambda name, args: small)
    argv = ["--model", str(model_dir), "--max-model-len", "1024", "--concurrency", "16", "--format", "json"]
    assert plan_main(argv) == 3
    out = json.loads(capsys.readouterr().out)
    usable = int((1 << 30) * 0.9)
    needed = 1_075_979_520 + 16 * 64 * 737_280  # float32 weights as the engine holds them + 16 × 1024 tokens
    assert out["verdict"]["fits"] is False
    assert (out["verdict"]["needed_bytes"], out["verdict"]["usable_bytes"]) == (needed, usable)
    assert out["verdict"]["short_bytes"] == needed - usable
    assert out["verdict"]["text"] == (
        "does not fit on cpu: weights 1.00 GiB need 1.00 GiB, more than the 0.90 GiB usable (1.0 GiB × 0.9); "
        "with the KV cache of 16 sequences of 1024 tokens it is "
        f"{(needed - usable) / (1 << 30):,.2f} GiB short"
    )
    assert out["flags"]["command"] is None
    assert [a["change"] for a in out["verdict"]["alternatives"]] == ["a machine with more RAM"]
    assert out["verdict"]["alternatives"][0]["verdict"] == (
        f"needs at least {needed / 0.9 / (1 << 30):,.1f} GiB of RAM at utilization 0.9 (this one has 1.0 GiB)"
    )


def test_too_small_a_budget_lowers_max_model_len_and_warns(capsys, model_dir):
    argv = [
        "--model",
        str(model_dir),
        "--device",
        "l4",
        "--gpu-memory-utilization",
        "0.05",
        "--dtype",
        "float32",
    ]
    out = run_json(capsys, *argv)
    budget = int(24 * (1 << 30) * 0.05) - 538_060_032 - (512 << 20)
    blocks = budget // 737_280
    assert out["memory"]["num_blocks"] == blocks
    assert out["flags"]["engine"]["--max-model-len"] == blocks * 16
    assert (
        out["warnings"][0]
        == f"one sequence of 8192 tokens does not fit the KV budget: max_model_len lowered to {blocks * 16}"
    )
    assert out["memory"]["fits"] is True
    assert out["verdict"]["text"].endswith(
        f"room for 1 sequence of {blocks * 16} tokens (the model's 8192 lowered to fit)"
    )
    # 100 sequences would leave each fewer tokens than the workload's 256: it does not fit, exit 3
    assert plan_main([*argv, "--concurrency", "100", "--format", "json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["fits"] is False and out["flags"]["command"] is None
    assert out["kv_cache"]["max_model_len"] == 256  # the requirement, not a context that fits nothing
    assert out["verdict"]["needed_bytes"] == 538_060_032 + (512 << 20) + 100 * 16 * 737_280


@pytest.mark.parametrize("how", ["folder", "registered"])
def test_table_output_shows_the_kv_bytes_and_the_command(capsys, model_dir, how):
    model = str(model_dir) if how == "folder" else "smollm2-135m"
    assert plan_main(["--model", model, "--device", "h100", "--max-model-len", "2048"]) == 0
    text = capsys.readouterr().out
    assert "23,040 B" in text  # bfloat16: the engine's --dtype auto on CUDA for a float32 checkpoint
    assert (
        "recommended: kvscope engine --model "
        + model
        + " --max-model-len 2048 --max-num-seqs 256 --block-size 16 "
        "--dtype bfloat16 --quantization none --device cuda --gpu-memory-utilization 0.9\n"
    ) in text
    assert (
        "assumed: --dtype bfloat16: the engine's --dtype auto on CUDA (the config's torch_dtype is float32)\n"
        in text
    )
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
