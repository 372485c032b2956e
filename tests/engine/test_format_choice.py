"""``--quantization auto``: the fastest verified weight format by a given probe result, flags overriding it,
and the KV budget of ``--memory-budget`` being the total minus the chosen format's weights."""

from __future__ import annotations

import math

import pytest
import torch

import kvscope.engine.platform.loader as loader
from kvscope.common.models.registry import verified_formats
from kvscope.engine.config import CacheConfig, ModelConfig
from kvscope.engine.engine_core import format_line
from kvscope.engine.memory import cpu_kv_budget, process_memory_bytes
from kvscope.engine.platform.compact import model_weight_bytes
from kvscope.engine.platform.format_choice import choose_format, format_cost_ms, format_score
from kvscope.engine.platform.kernel_probe import NO_DENSE, KernelChoice
from kvscope.engine.server.cli import build_parser, engine_options
from kvscope.plan.engine_formats import engine_weight_bytes
from kvscope.plan.model_files import read_model
from tests.engine.server.fakes import FakeInfo

ROWS = (1, 2, 4, 8, 16, 32, 64)


def probe(dense: torch.dtype, max_rows: dict[str, int], **series: tuple[float, ...]) -> KernelChoice:
    """A KernelChoice with ``series[kernel]`` ms at each of ROWS."""
    timings = {f"{k}@{n}": t for k, ts in series.items() for n, t in zip(ROWS, ts, strict=True)}
    return KernelChoice(dense_dtype=dense, max_rows=max_rows, timings_ms=timings)


# An AMX Xeon (this project's machine, probe of 2026-12-01 rounded): bf16 2x fp32 when batched, int4 2-4x
# faster than bf16 at 1-4 rows and 2-6x slower above.
XEON_AMX = probe(
    torch.bfloat16,
    {"int4": 4, "int8": 2},
    float32=(0.72, 0.66, 0.41, 0.55, 0.69, 1.11, 1.98),
    bfloat16=(0.53, 0.43, 0.31, 0.28, 0.30, 0.52, 0.64),
    int4=(0.19, 0.19, 0.25, 0.51, 0.97, 2.06, 3.81),
    int8=(0.32, 0.29, 0.33, 0.60, 1.17, 1.91, 4.66),
)
# An AMD EPYC with AVX-512 but no AMX/AVX512_BF16: bf16 is emulated (slower than fp32 everywhere), the
# compact kernels win at small batches, fp32 above the crossover.
EPYC_NO_AMX = probe(
    torch.float32,
    {"int4": 8, "int8": 4},
    float32=(0.70, 0.70, 0.72, 0.80, 1.00, 1.60, 3.00),
    bfloat16=(1.40, 1.45, 1.50, 1.70, 2.20, 3.50, 6.50),
    int4=(0.25, 0.26, 0.30, 0.45, 1.50, 3.00, 6.00),
    int8=(0.40, 0.42, 0.45, 0.90, 1.80, 3.40, 7.00),
)
# A CPU where the compact kernels never win: gguf costs exactly what its dense copy costs, so it ties with
# bfloat16 and the tie goes to the earlier (higher-precision) format.
COMPACT_NEVER_WINS = probe(
    torch.bfloat16,
    {"int4": 0, "int8": 0},
    float32=(1.0,) * 7,
    bfloat16=(0.5,) * 7,
    int4=(2.0,) * 7,
    int8=(2.0,) * 7,
)
# An AVX2-only CPU (AMD Zen 3, probe of 2026-12-07 rounded): oneDNN packs no bfloat16, so the probe has no
# bfloat16 timings; the compact kernels (torch's, kvscope's need AVX-512 VNNI) win at 1-4 rows.
AVX2_ONLY = probe(
    torch.float32,
    {"int4": 4, "int8": 4},
    float32=(1.10, 1.00, 0.90, 1.00, 1.30, 2.00, 3.60),
    int4=(0.60, 0.62, 0.80, 1.40, 2.60, 5.00, 9.50),
    int8=(0.55, 0.58, 0.75, 1.30, 2.50, 4.80, 9.20),
)
SMOLLM2 = ("float32", "bfloat16", "int8", "gguf")


@pytest.mark.parametrize(
    ("verified", "choice", "has_gguf", "expected"),
    [
        (SMOLLM2, XEON_AMX, True, ("gguf", "bfloat16", "gguf")),
        (SMOLLM2, EPYC_NO_AMX, True, ("gguf", "float32", "gguf")),
        (("float32", "bfloat16"), EPYC_NO_AMX, True, ("float32", "float32", "none")),  # unregistered model
        (("float32", "bfloat16"), XEON_AMX, True, ("bfloat16", "bfloat16", "none")),
        (
            ("float32", "bfloat16", "gguf"),
            XEON_AMX,
            False,
            ("bfloat16", "bfloat16", "none"),
        ),  # a model with no GGUF
        (SMOLLM2, XEON_AMX, False, ("int8", "bfloat16", "int8")),  # no GGUF: int8 is next
        (("float32", "bfloat16", "int8"), EPYC_NO_AMX, False, ("int8", "float32", "int8")),
        (SMOLLM2, COMPACT_NEVER_WINS, True, ("bfloat16", "bfloat16", "none")),
        (("float32",), XEON_AMX, True, ("float32", "float32", "none")),
        (SMOLLM2, AVX2_ONLY, True, ("int8", "float32", "int8")),  # bfloat16 was never timed: no candidate
        (("float32", "bfloat16"), AVX2_ONLY, True, ("float32", "float32", "none")),
    ],
)
def test_the_chooser_picks_the_fastest_verified_format(verified, choice, has_gguf, expected) -> None:
    picked = choose_format(verified, choice, source="test table", has_gguf=has_gguf)
    assert (picked.format, picked.dtype, picked.quantization) == expected


def test_scores_are_the_geometric_mean_of_the_kernel_each_format_runs() -> None:
    # gguf on the Xeon: int4 at 1, 2, 4 rows, then the bf16 dense copy at 8..64 rows
    ratios = [0.19 / 0.72, 0.19 / 0.66, 0.25 / 0.41, 0.28 / 0.55, 0.30 / 0.69, 0.52 / 1.11, 0.64 / 1.98]
    assert format_score("gguf", XEON_AMX) == pytest.approx(math.prod(ratios) ** (1 / 7))
    assert [format_cost_ms("gguf", XEON_AMX, n) for n in (4, 8)] == [0.25, 0.28]
    assert format_cost_ms("int8", probe(torch.float32, {"int8": NO_DENSE}, int8=(9.0,) * 7), 64) == 9.0
    picked = choose_format(SMOLLM2, XEON_AMX, source="test table")
    assert picked.scores == {
        "float32": 1.0,
        "bfloat16": round(format_score("bfloat16", XEON_AMX), 4),
        "int8": round(format_score("int8", XEON_AMX), 4),
        "gguf": round(format_score("gguf", XEON_AMX), 4),
    }
    assert picked.reason == (
        f"fastest verified format by the start-up probe (cost vs float32, geometric mean over 7 batch sizes: "
        f"float32 1.00, bfloat16 {picked.scores['bfloat16']:.2f}, int8 {picked.scores['int8']:.2f}, "
        f"gguf {picked.scores['gguf']:.2f}); verified: float32, bfloat16, int8, gguf (test table)"
    )


def test_gguf_is_scored_on_the_amx_matmul_where_the_engine_runs_it() -> None:
    # the 2-vCPU Xeon's probe of 2026-12-02 (rounded): the GEMVs hand over at 2 (int4) and 4 (int8) rows, the
    # AMX int4 matmul beats the dense copy up to 32 rows. Without the AMX rows gguf scored 0.40 and int8 0.43,
    # and start-up noise picked int8 on some starts.
    timings = {
        f"{k}@{n}": t
        for k, ts in {
            "float32": (0.46, 0.414, 0.367, 0.459, 0.59, 0.915, 1.652),
            "bfloat16": (0.302, 0.283, 0.267, 0.277, 0.271, 0.285, 0.352),
            "int4": (0.15, 0.166, 0.281, 0.503, 0.959, 1.857, 3.538),
            "int8": (0.27, 0.196, 0.202, 0.415, 0.811, 1.567, 3.187),
            "int4_amx": (0.238, 0.188, 0.152, 0.18, 0.166, 0.206, 0.353),
        }.items()
        for n, t in zip(ROWS, ts, strict=True)
    }
    amx = KernelChoice(
        dense_dtype=torch.bfloat16, max_rows={"int4": 2, "int8": 4}, timings_ms=timings, batched_rows=32
    )
    assert [format_cost_ms("gguf", amx, n) for n in ROWS] == [0.15, 0.166, 0.152, 0.18, 0.166, 0.206, 0.352]
    assert [format_cost_ms("int8", amx, n) for n in ROWS] == [0.27, 0.196, 0.202, 0.277, 0.271, 0.285, 0.352]
    gguf = [
        0.15 / 0.46,
        0.166 / 0.414,
        0.152 / 0.367,
        0.18 / 0.459,
        0.166 / 0.59,
        0.206 / 0.915,
        0.352 / 1.652,
    ]
    assert format_score("gguf", amx) == pytest.approx(math.prod(gguf) ** (1 / 7))
    picked = choose_format(SMOLLM2, amx)
    assert picked.format == "gguf" and picked.scores["gguf"] == 0.3118 and picked.scores["int8"] == 0.4321
    no_amx = KernelChoice(dense_dtype=torch.bfloat16, max_rows={"int4": 2, "int8": 4}, timings_ms=timings)
    assert format_cost_ms("gguf", no_amx, 8) == 0.277  # not built or not faster: the dense copy's cost
    assert choose_format(SMOLLM2, no_amx).scores["gguf"] == 0.4038


# The 2-vCPU AMD EPYC (AVX-512 + AVX512_BF16, no AMX) of 2026-12-02, its start-up probe as logged: int4 and
# int8 beat bfloat16 at 1-2 rows and hand over to the same dense copy above, so the matmul scores tie at 0.49.
EPYC_2026_12_02 = probe(
    torch.bfloat16,
    {"int4": 2, "int8": 2},
    float32=(0.479, 0.301, 0.242, 0.254, 0.351, 0.605, 1.092),
    bfloat16=(0.196, 0.156, 0.13, 0.151, 0.202, 0.343, 0.626),
    int4=(0.152, 0.108, 0.166, 0.324, 0.631, 1.257, 2.556),
    int8=(0.156, 0.103, 0.146, 0.285, 0.559, 1.188, 2.227),
)


def test_gguf_wins_where_the_cpu_kernels_run_its_decode_step() -> None:
    # the tie went to int8, whose decode step is 3x slower there at batch 1 and 2x at batch 32 (module doc)
    by_probe = choose_format(SMOLLM2, EPYC_2026_12_02)
    assert by_probe.format == "int8" and (by_probe.scores["int8"], by_probe.scores["gguf"]) == (
        0.4887,
        0.4902,
    )
    assert by_probe.reason.startswith("fastest verified format by the start-up probe")
    picked = choose_format(SMOLLM2, EPYC_2026_12_02, source="test table", cpu_kernels=True)
    assert (picked.format, picked.dtype, picked.quantization) == ("gguf", "bfloat16", "gguf")
    assert picked.scores == by_probe.scores
    assert picked.reason == (
        "kvscope's CPU kernels run gguf's decode step (the probe's int4 kernel beats the dense one up to 2 "
        "rows; the fused step's own row limit is timed on the model at start-up), which the matmul probe "
        "does not time; the start-up probe (cost vs float32, geometric "
        "mean over 7 batch sizes: float32 1.00, bfloat16 0.54, int8 0.49, gguf 0.49); verified: float32, "
        "bfloat16, int8, gguf (test table)"
    )
    # not where the int4 kernel never wins (no fused rows), the model has no GGUF, or gguf is not verified
    assert choose_format(SMOLLM2, COMPACT_NEVER_WINS, cpu_kernels=True).format == "bfloat16"
    assert choose_format(SMOLLM2, EPYC_2026_12_02, has_gguf=False, cpu_kernels=True).format == "int8"
    assert choose_format(("float32", "bfloat16", "int8"), EPYC_2026_12_02, cpu_kernels=True).format == "int8"


def test_the_loader_passes_the_loaded_kernels_to_the_chooser(monkeypatch) -> None:
    seen = {}

    def fake_choose(verified, kernels, **kwargs):
        seen.update(kwargs)
        return choose_format(verified, kernels, **kwargs)

    monkeypatch.setattr(loader, "choose_format", fake_choose)
    config = ModelConfig(model="smollm2-135m", dtype="auto", quantization="auto")
    cpu = torch.device("cpu")
    fmt = loader.resolve_format(config, cpu, EPYC_2026_12_02, None, cpu_kernels=True)
    assert seen["cpu_kernels"] is True and fmt.format == "int8"  # no GGUF file: has_gguf False
    assert (
        loader.resolve_format(config, cpu, EPYC_2026_12_02, loader.Path("x.gguf"), cpu_kernels=True).format
        == "gguf"
    )
    assert loader.resolve_format(config, cpu, EPYC_2026_12_02, loader.Path("x.gguf")).format == "int8"


def test_off_cpu_and_without_a_probe_and_unknown_names() -> None:
    assert (
        choose_format(SMOLLM2, None, device_type="cuda").dtype,
        choose_format(SMOLLM2, None, device_type="cuda").quantization,
    ) == ("bfloat16", "none")
    assert choose_format(SMOLLM2, None).format == "float32"
    untimed = choose_format(SMOLLM2, KernelChoice(torch.bfloat16, {"int4": 4}))
    assert (untimed.format, untimed.reason) == (
        "float32",
        "no kernel probe timings or no verified format: float32",
    )
    with pytest.raises(ValueError, match=r"unknown weight formats \['fp4'\]"):
        choose_format(("float32", "fp4"), XEON_AMX)


def test_verified_formats_come_from_the_registry() -> None:
    formats, source = verified_formats("smollm2-135m")
    assert formats == SMOLLM2 and source.startswith("kvscope eval ppl, 13,613 tokens vs float32")
    assert verified_formats("/models/some-hf-folder") == (
        ("float32", "bfloat16"),
        "not a registered model: dense formats only",
    )


@pytest.mark.parametrize(
    ("dtype", "quantization", "expected"),
    [
        ("auto", "auto", ("gguf", "bfloat16", "gguf")),
        ("float32", "auto", ("float32", "float32", "none")),  # --dtype alone pins dense weights
        ("bfloat16", "auto", ("bfloat16", "bfloat16", "none")),
        ("auto", "int8", ("int8", "bfloat16", "int8")),  # explicit --quantization: as given
        ("float32", "none", ("float32", "float32", "none")),
        ("float32", "int4", ("int4", "float32", "int4")),
    ],
)
def test_flags_override_the_chooser(dtype, quantization, expected) -> None:
    fmt = loader.resolve_format(
        ModelConfig(model="smollm2-135m", dtype=dtype, quantization=quantization),
        torch.device("cpu"),
        XEON_AMX,
        gguf_path=None if dtype != "auto" else "x.gguf",
    )
    assert (fmt.format, fmt.dtype, fmt.quantization) == expected


def test_servers_default_to_auto_and_the_library_to_float32() -> None:
    options = engine_options(build_parser().parse_args([]))
    assert (options.dtype, options.quantization) == ("auto", "auto")
    assert (options.config_kwargs()["dtype"], options.config_kwargs()["quantization"]) == ("auto", "auto")
    pinned = engine_options(build_parser().parse_args(["--dtype", "float32"]))
    assert (pinned.dtype, pinned.quantization) == ("float32", "auto")
    assert (ModelConfig().dtype, ModelConfig().quantization) == ("float32", "none")
    assert engine_options(build_parser().parse_args(["--memory-budget", "1GiB"])).memory_budget == 1 << 30


def test_kv_budget_is_the_total_minus_the_weights() -> None:
    assert cpu_kv_budget(CacheConfig(kv_cache_memory=5000), 3000) == 5000  # no total: the KV budget as given
    assert cpu_kv_budget(CacheConfig(memory_budget=8000), 3000) == 5000
    with pytest.raises(ValueError, match="not above the weights' 8000 B"):
        cpu_kv_budget(CacheConfig(memory_budget=8000), 8000)
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        CacheConfig(memory_budget=0)


def test_process_memory_reads_vmrss_and_vmhwm(tmp_path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert process_memory_bytes(status) == (1 << 20, 2 << 20)
    assert process_memory_bytes(tmp_path / "missing") == (0, 0)


def test_start_up_line_names_format_reason_and_bytes() -> None:
    info = FakeInfo()
    assert format_line(info) == (
        "weights format: dtype bfloat16, quantization gguf (fake: fastest verified "
        "format), CPU kernels kvscope (fused decode up to 2 rows); weights 2000 B, KV "
        "cache 1000 B (7 blocks), process RSS 5000 B (peak 6000 B)"
    )


@pytest.mark.cpu_kernels
@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_the_amx_copy_is_counted_and_planned(monkeypatch: pytest.MonkeyPatch, model_dir) -> None:
    """A probe that keeps kvscope's AMX int4 matmul up to 32 rows: every int4 layer holds its tile copy,
    counted in the weights bytes as `kvscope plan` counts it with amx_copy, and runs 5-32 rows on it. The
    probe is replaced and the load runs no matmul, so this needs kvscope's pair blocks (its CPU kernels) and
    a bfloat16 dense copy (oneDNN's packing), not AMX."""
    from dataclasses import replace

    from kvscope.engine.llm import LLM
    from kvscope.engine.weights.quant import CompactLinearKernel

    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: replace(XEON_AMX, batched_rows=32))
    engine = LLM("smollm2-135m", dtype="auto", quantization="auto").engine
    kernels = [
        m.cpu_kernel
        for m in engine.model.modules()
        if isinstance(getattr(m, "cpu_kernel", None), CompactLinearKernel)
    ]
    assert len(kernels) == 120 and all(k.batched is not None and k.max_batched_rows == 32 for k in kernels)
    assert (
        engine.info.weights_bytes
        == model_weight_bytes(engine.model)
        == engine_weight_bytes(
            read_model(str(model_dir)).shape, "gguf", "bfloat16", q8_head=True, amx_copy=True
        )
    )


@pytest.mark.onednn_bf16
def test_engine_with_auto_format_and_memory_budget(monkeypatch: pytest.MonkeyPatch, model_dir) -> None:
    from kvscope.engine.llm import LLM

    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: XEON_AMX)
    budget = 600 << 20
    engine = LLM("smollm2-135m", dtype="auto", quantization="auto", memory_budget=budget).engine
    info = engine.info
    assert (info.dtype, info.quantization) == ("bfloat16", "gguf")
    assert (
        info.weights_bytes
        == model_weight_bytes(engine.model)
        == engine_weight_bytes(
            read_model(str(model_dir)).shape,
            "gguf",
            "bfloat16",  # kvscope plan --weights-format gguf counts the same
            q8_head=engine.load_report.cpu_kernels.ok,
        )
    )  # (+ the Q8 LM head of kvscope's CPU kernels where they run)
    per_block = 30 * 2 * 16 * 3 * 64 * 2  # bf16 KV: layers x (K, V) x block x kv_heads x head_dim x 2 B
    assert info.num_blocks == (budget - info.weights_bytes) // per_block
    assert info.kv_cache_bytes == info.num_blocks * per_block
    assert (
        info.format_reason
        == choose_format(
            SMOLLM2,
            XEON_AMX,
            source=verified_formats("smollm2-135m")[1],
            cpu_kernels=engine.load_report.cpu_kernels.ok,
        ).reason
    )
