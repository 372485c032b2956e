"""`kvscope plan`'s verdict (issue 45): dtype from the config and the engine's defaults per device, a plain
"does not fit" with the bytes it is short and exit 3, what would fit (a quantization, a tensor-parallel
degree, a bigger device), and recommended commands that carry every flag the plan assumed."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest

from kvscope.cli import plan as cli
from kvscope.cli.plan import plan_main
from kvscope.plan.devices import Device
from kvscope.plan.engine_formats import engine_weight_bytes
from kvscope.plan.model_files import read_model

GIB = 1 << 30
H100_USABLE = int(80 * GIB * 0.9)
CUDA_CONTEXT = 512 << 20
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA2_7B_PARAMS = 6_738_415_616
"""32 × (4 × 4096² + 3 × 4096 × 11008 + 2 × 4096) + 2 × 32000 × 4096 + 4096."""
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
LLAMA3_70B_PARAMS = 70_553_706_496
LLAMA3_70B_LINEAR = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
"""q, o, k, v and gate/up/down of 80 layers (the rest: embeddings, lm_head, norms)."""
KV_70B_BLOCK = 16 * 2 * 80 * 8 * 128 * 2
"""A 16-token block of the 70B's float16 KV cache: 5,242,880 B."""


@pytest.fixture
def model(tmp_path):
    def write(config: dict) -> str:
        folder = tmp_path / str(config["num_hidden_layers"])
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    return write


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = plan_main([*argv, "--format", "json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_7b_bfloat16_config_fits_one_h100_in_bfloat16(capsys, model) -> None:
    path = model(LLAMA2_7B)
    code, out = run(capsys, "--model", path, "--device", "h100")
    weights = 2 * LLAMA2_7B_PARAMS
    budget = H100_USABLE - weights - CUDA_CONTEXT
    block = 16 * 2 * 32 * 32 * 128 * 2
    assert code == 0
    assert (out["weights"]["dtype"], out["weights"]["bytes"]) == ("bfloat16", weights)
    assert out["assumed"] == {
        "--dtype": "the config's torch_dtype bfloat16",
        "--quantization": "the engine's --quantization auto on CUDA",
    }
    assert out["memory"]["num_blocks"] == budget // block
    capacity = budget // block // 256  # 4096-token sequences of 256 blocks
    assert out["verdict"]["fits"] is True and out["verdict"]["short_bytes"] == 0
    assert out["verdict"]["text"] == (
        f"fits on h100-sxm-80gb: weights {weights / GIB:,.2f} GiB + CUDA context 0.50 GiB leave "
        f"{budget / GIB:,.2f} GiB of the {H100_USABLE / GIB:,.2f} GiB usable (80.0 GiB × 0.9) for the KV "
        f"cache: room for {capacity} sequences of 4096 tokens"
    )
    assert out["flags"]["command"] == (
        f"kvscope engine --model {path} --max-model-len 4096 --max-num-seqs {capacity} --block-size 16 "
        "--dtype bfloat16 --quantization none --device cuda --gpu-memory-utilization 0.9"
    )


def test_a_bfloat16_checkpoint_on_a_t4_is_planned_in_float16(capsys, model) -> None:
    code, out = run(capsys, "--model", model(LLAMA2_7B), "--device", "t4", "--max-model-len", "1024")
    assert code == 0
    assert out["assumed"]["--dtype"] == (
        "the config's torch_dtype bfloat16; t4-16gb has no bfloat16, so float16 (as vLLM)"
    )
    assert out["flags"]["engine"]["--dtype"] == "float16"


def test_a_70b_float16_model_does_not_fit_one_h100_and_says_what_would(capsys, model) -> None:
    path = model(LLAMA3_70B)
    code, out = run(capsys, "--model", path, "--device", "h100")
    weights = 2 * LLAMA3_70B_PARAMS
    needed = weights + CUDA_CONTEXT + 16 * KV_70B_BLOCK  # one sequence of the workload's 256 tokens
    assert code == 3
    verdict = out["verdict"]
    assert (verdict["fits"], verdict["needed_bytes"], verdict["usable_bytes"]) == (False, needed, H100_USABLE)
    assert verdict["short_bytes"] == needed - H100_USABLE
    assert verdict["text"] == (
        f"does not fit on h100-sxm-80gb: weights {weights / GIB:,.2f} GiB + CUDA context 0.50 GiB need "
        f"{(weights + CUDA_CONTEXT) / GIB:,.2f} GiB, more than the 72.00 GiB usable (80.0 GiB × 0.9); with "
        f"the KV cache of 1 sequence of 256 tokens it is {(needed - H100_USABLE) / GIB:,.2f} GiB short"
    )
    assert out["flags"]["command"] is None  # no --max-model-len 1 --max-num-seqs 1
    assert out["kv_cache"]["max_model_len"] == 256
    fp8 = LLAMA3_70B_LINEAR + 2 * (LLAMA3_70B_PARAMS - LLAMA3_70B_LINEAR)
    fp8_tokens = (H100_USABLE - fp8 - CUDA_CONTEXT) // KV_70B_BLOCK * 16
    tp2_tokens = (H100_USABLE - weights // 2 - CUDA_CONTEXT) // (KV_70B_BLOCK // 2) * 16
    assert [(a["change"], a["max_model_len"], a["command"]) for a in verdict["alternatives"]] == [
        (
            "--quantization fp8",
            fp8_tokens,
            f"vllm serve {path} --max-model-len {fp8_tokens} --max-num-seqs 1 --max-num-batched-tokens 1024 "
            "--block-size 16 --dtype float16 --quantization fp8 --gpu-memory-utilization 0.9",
        ),
        (
            "--tensor-parallel-size 2",
            tp2_tokens,
            f"vllm serve {path} --tensor-parallel-size 2 --max-model-len {tp2_tokens} --max-num-seqs 1 "
            "--max-num-batched-tokens 1024 --block-size 16 --dtype float16 --gpu-memory-utilization 0.9",
        ),
        (
            "--device mi300x-192gb",  # the h200's 141 GB is not enough either
            131072,
            f"kvscope engine --model {path} --max-model-len 131072 --max-num-seqs 1 --block-size 16 "
            "--dtype float16 --quantization none --device cuda --gpu-memory-utilization 0.9",
        ),
    ]
    assert (fp8_tokens, tp2_tokens) == (12560, 37952)


def test_what_does_not_fit_one_h100_fits_two(capsys, model) -> None:
    path = model(LLAMA3_70B)
    argv = ["--model", path, "--device", "h100", "--max-model-len", "8192", "--concurrency", "4"]
    code, one = run(capsys, *argv)
    assert code == 3 and one["flags"]["command"] is None
    assert "--tensor-parallel-size 2" in [a["change"] for a in one["verdict"]["alternatives"]]
    code, two = run(capsys, *argv, "--tensor-parallel-size", "2")
    assert code == 0
    per_gpu = LLAMA3_70B_PARAMS  # half of the float16 weights
    assert two["memory"]["weights_bytes_per_device"] == per_gpu
    assert two["kv_cache"]["bytes_per_token"] == 2 * 80 * 4 * 128 * 2  # 4 of the 8 KV heads per GPU
    assert two["memory"]["num_blocks"] == (H100_USABLE - per_gpu - CUDA_CONTEXT) // (KV_70B_BLOCK // 2)
    assert two["flags"]["command"] == (
        f"vllm serve {path} --tensor-parallel-size 2 --max-model-len 8192 --max-num-seqs 4 "
        "--max-num-batched-tokens 1024 --block-size 16 --dtype float16 --gpu-memory-utilization 0.9"
    )
    assert two["verdict"]["text"].startswith("fits on 2 × h100-sxm-80gb: weights 65.71 GiB per GPU")


@pytest.mark.parametrize(
    ("quantization", "flag", "note"),
    [
        ("fp8", "--quantization fp8", None),
        ("int4", "--quantization bitsandbytes", None),
        ("int8", "--quantization compressed-tensors", "serve a W8A8 int8 checkpoint of the model "
         "(llm-compressor's compressed-tensors)"),
    ],
)  # fmt: skip
def test_quantized_70b_fits_one_h100_and_the_command_names_the_quantization(
    capsys, model, quantization, flag, note
) -> None:
    path = model(LLAMA3_70B)
    code, out = run(capsys, "--model", path, "--device", "h100", "--quantization", quantization)
    assert code == 0 and out["verdict"]["fits"] is True
    assert out["flags"]["server"] == "vllm serve"
    assert f" --dtype float16 {flag} --gpu-memory-utilization 0.9" in out["flags"]["command"]
    assert out["flags"]["note"] == note
    assert out["weights"]["quantization"] == quantization


def test_fp8_on_a_device_without_fp8_is_exit_2(capsys, model) -> None:
    assert plan_main(["--model", model(LLAMA3_70B), "--device", "a100", "--quantization", "fp8"]) == 2
    assert capsys.readouterr().err == (
        "kvscope plan: error: device a100-sxm-80gb has no fp8 peak in the table; it has fp32, tf32, bf16, "
        "fp16, int8\n"
    )


def test_a_ggml_type_gets_no_command(capsys, model) -> None:
    code, out = run(capsys, "--model", model(LLAMA2_7B), "--device", "h100", "--quantization", "q4_k")
    assert code == 0 and out["flags"]["command"] is None
    assert (
        out["flags"]["note"] == "q4_k is a GGUF block type: llama.cpp's llama-server serves that .gguf file"
    )


def fake_cpu(monkeypatch, memory: int, peaks: dict[str, float]) -> None:
    device = Device("cpu", memory, 10e9, MappingProxyType(peaks), "test")
    monkeypatch.setattr(cli, "resolve_device", lambda name, args: device)


@pytest.mark.parametrize(
    ("peaks", "dtype"), [({"fp32": 1e11, "bf16": 4e11}, "bfloat16"), ({"fp32": 1e11}, "float32")]
)
def test_smollm2_on_the_cpu_is_planned_as_make_run_serves_it(
    capsys, model_dir, monkeypatch, peaks, dtype
) -> None:
    fake_cpu(monkeypatch, 16 * GIB, peaks)
    code, out = run(capsys, "--model", "smollm2-135m", "--max-model-len", "1024", "--concurrency", "4")
    assert code == 0
    shape = read_model("smollm2-135m").shape
    assert (out["weights"]["weights_format"], out["weights"]["dtype"]) == ("gguf", dtype)
    assert out["weights"]["bytes"] == engine_weight_bytes(shape, "gguf", dtype)
    assert out["assumed"]["--quantization"] == (
        "what kvscope serve's --quantization auto runs where kvscope's CPU kernels build "
        "(verified formats of smollm2-135m: float32, bfloat16, int8, gguf)"
    )
    kv_mib = 4 * 64 * 16 * 2 * 30 * 3 * 64 * (2 if dtype == "bfloat16" else 4) // (1 << 20)
    assert out["flags"]["command"] == (
        "kvscope engine --model smollm2-135m --max-model-len 1024 --max-num-seqs 4 --block-size 16 "
        f"--dtype {dtype} --quantization gguf --kv-cache-memory {kv_mib}MiB"
    )


def test_a_cpu_too_small_for_dense_weights_is_told_the_compact_format_that_fits(
    capsys, model_dir, monkeypatch
) -> None:
    fake_cpu(monkeypatch, GIB, {"fp32": 1e11})
    code, out = run(capsys, "--model", str(model_dir), "--dtype", "float32", "--quantization", "none")
    assert code == 3
    shape = read_model(str(model_dir)).shape
    assert out["verdict"]["needed_bytes"] == engine_weight_bytes(shape, "float32") + 16 * 737_280
    first = out["verdict"]["alternatives"][0]
    assert first["change"] == "--quantization int8"
    assert first["command"].startswith(f"kvscope engine --model {model_dir} --max-model-len ")
    assert " --dtype float32 --quantization int8 --kv-cache-memory " in first["command"]
    assert out["verdict"]["alternatives"][-1]["change"] == "a machine with more RAM"


def test_a_config_json_model_is_recommended_as_its_folder(capsys, model) -> None:
    """`--model …/config.json` was passed on as is: `vllm serve …/config.json` and `kvscope engine --model
    …/config.json` both fail (each takes the folder)."""
    folder = model(LLAMA3_70B)
    code, out = run(capsys, "--model", f"{folder}/config.json", "--device", "h100")
    assert code == 3
    assert [a["command"].split(" --max-model-len")[0] for a in out["verdict"]["alternatives"]] == [
        f"vllm serve {folder}",
        f"vllm serve {folder} --tensor-parallel-size 2",
        f"kvscope engine --model {folder}",
    ]
    code, out = run(capsys, "--model", f"{model(LLAMA2_7B)}/config.json", "--device", "h100")
    assert code == 0 and out["flags"]["command"].startswith(f"kvscope engine --model {model(LLAMA2_7B)} --")


def test_the_table_of_a_model_that_does_not_fit_promises_no_ttft(capsys, model, monkeypatch) -> None:
    """The table said "TTFT SLO 1.0 s …: never breaks (met up to max_num_seqs=1 …)" for a model that cannot
    load; it now says the SLO is not judged, then the verdict and what would fit, and exits 3."""
    monkeypatch.setenv("COLUMNS", "100")
    assert plan_main(["--model", model(LLAMA3_70B), "--device", "h100"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("TTFT SLO")] == [
        "TTFT SLO 1.0 s: not judged, the model does not fit (the verdict below)"
    ]
    assert [
        line.split(":")[0] for line in lines if line.startswith(("verdict", "would fit", "recommended"))
    ] == [
        "verdict",
        "would fit with --quantization fp8",
        "would fit with --tensor-parallel-size 2",
        "would fit with --device mi300x-192gb",
    ]


def test_a_step_budget_the_plan_assumed_is_in_the_command(capsys, model) -> None:
    """The TTFT rows and the activation estimate assume ``--max-num-batched-tokens`` (the kvscope engine's
    1024 unless given): vLLM's default is another, so ``vllm serve`` always gets it; ``kvscope engine`` gets
    it when the request set another value than the engine's default."""
    path = model(LLAMA2_7B)
    argv = ["--model", path, "--device", "h100", "--max-model-len", "4096", "--concurrency", "8"]
    code, default = run(capsys, *argv)
    assert code == 0 and "--max-num-batched-tokens" not in default["flags"]["engine"]
    code, given = run(capsys, *argv, "--max-num-batched-tokens", "4096")
    assert code == 0 and given["flags"]["engine"]["--max-num-batched-tokens"] == 4096
    assert " --max-num-seqs " in given["flags"]["command"]
    assert (
        given["flags"]["command"].split(" --max-num-batched-tokens ")[1].startswith("4096 --block-size 16 ")
    )
    code, vllm = run(capsys, *argv, "--quantization", "fp8", "--max-num-batched-tokens", "2048")
    assert code == 0 and vllm["flags"]["command"].startswith(
        f"vllm serve {path} --max-model-len 4096 --max-num-seqs "
    )
    assert (
        " --max-num-batched-tokens 2048 --block-size 16 --dtype bfloat16 --quantization fp8 "
        in (vllm["flags"]["command"])
    )
