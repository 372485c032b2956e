"""The result of ``kvscope eval ppl``: rows per format, the machine, the markdown table, the JSON file."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvscope.engine.eval.agreement import Agreement, agreement
from kvscope.engine.eval.formats import REFERENCE
from kvscope.engine.eval.perplexity import relative_change_pct
from kvscope.engine.eval.runner import FormatRun
from kvscope.engine.platform.kernel_probe import cpu_bf16_flags

TABLE_COLUMNS = (
    "format",
    "dtype / quantization",
    "weights bytes",
    "ppl",
    "Δ vs fp32 %",
    "bound",
    "pass",
    "greedy agreement",
    "seconds",
)


@dataclass(frozen=True, slots=True)
class Machine:
    """Where the numbers were measured."""

    cpu_model: str
    cpu_flags: tuple[str, ...]
    """The bfloat16/AMX flags of /proc/cpuinfo (``kvscope.engine.platform.kernel_probe.BF16_FLAGS``) it
    has."""
    torch_cpu_capability: str
    threads: int
    logical_cpus: int
    load_average: tuple[float, float, float]
    torch_version: str

    def describe(self) -> str:
        flags = " ".join(self.cpu_flags) or "no avx512_bf16/amx"
        load = ", ".join(f"{x:.2f}" for x in self.load_average)
        return (
            f"{self.cpu_model} ({self.logical_cpus} logical CPUs; {flags}; torch {self.torch_version} "
            f"capability {self.torch_cpu_capability}), {self.threads} torch thread(s), load average {load}"
        )


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``model name`` of the first CPU in /proc/cpuinfo, else ``platform.processor()``."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def this_machine(load_average: tuple[float, float, float] | None = None) -> Machine:
    """The current machine and torch's current thread count; ``load_average`` defaults to the one now."""
    return Machine(
        cpu_model=cpu_model_name(),
        cpu_flags=cpu_bf16_flags(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
        logical_cpus=os.cpu_count() or 1,
        load_average=load_average or os.getloadavg(),
        torch_version=torch.__version__,
    )


@dataclass(frozen=True, slots=True)
class FormatRow:
    """One row of the table."""

    format: str
    dtype: str
    quantization: str
    dense_dtype: str | None
    kernels: str
    weights_bytes: int
    perplexity: float
    mean_nll: float
    tokens_scored: int
    delta_pct: float
    bound_pct: float
    passed: bool
    agreement_tokens: tuple[int, ...]
    agreement_total: int
    agreement_possible: int
    identical_prompts: int
    seconds: float


@dataclass(frozen=True, slots=True)
class EvalReport:
    """Everything one ``kvscope eval ppl`` run measured."""

    model: str
    text: str
    text_sha256: str
    num_tokens: int
    context: int
    stride: int
    num_windows: int
    kernels: str
    """``compact`` or ``served`` (engine/eval/runner.py)."""
    machine: Machine
    rows: tuple[FormatRow, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def to_dict(self) -> dict:
        return asdict(self)


def build_rows(runs: Sequence[FormatRun]) -> tuple[FormatRow, ...]:
    """Rows of ``runs`` (the first is float32, the reference): Δ = ppl / ppl(float32) − 1, pass = Δ ≤
    bound."""
    reference = runs[0]
    if reference.spec.name != REFERENCE:
        raise ValueError(f"the first run must be {REFERENCE}, got {reference.spec.name}")
    rows = []
    for run in runs:
        delta = relative_change_pct(run.perplexity.perplexity, reference.perplexity.perplexity)
        quantization = run.quantization or run.spec.quantization
        bound = run.spec.bound_pct(run.dtype, quantization)
        agree: Agreement = agreement(
            reference.greedy, run.greedy, max((len(g) for g in reference.greedy), default=0)
        )
        rows.append(
            FormatRow(
                format=run.spec.name,
                dtype=run.dtype,
                quantization=quantization,
                dense_dtype=run.dense_dtype,
                kernels=run.kernels,
                weights_bytes=run.weights_bytes,
                perplexity=run.perplexity.perplexity,
                mean_nll=run.perplexity.mean_nll,
                tokens_scored=run.perplexity.num_scored,
                delta_pct=delta,
                bound_pct=bound,
                passed=delta <= bound,
                agreement_tokens=agree.matched,
                agreement_total=agree.total,
                agreement_possible=agree.possible,
                identical_prompts=agree.identical_prompts,
                seconds=run.seconds,
            )
        )
    return tuple(rows)


def _format_cell(row: FormatRow) -> str:
    if not row.dense_dtype:
        dense = ""
    elif row.kernels == "compact":
        dense = " (compact kernel at all rows)"
    else:
        dense = f" (dense {row.dense_dtype} above the crossover)"
    return f"{row.dtype} / {row.quantization}{dense}"


def markdown_table(report: EvalReport) -> str:
    """The table (columns :data:`TABLE_COLUMNS`), one line per format, then the run's parameters."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---|---|---:|---:|---:|---:|---|---|---:|"]
    for r in report.rows:
        bound = "reference" if r.format == REFERENCE else f"≤ +{r.bound_pct:g} %"
        agree = (
            (
                f"{r.identical_prompts}/{len(r.agreement_tokens)} prompts, "
                f"{r.agreement_total}/{r.agreement_possible} tokens"
            )
            if r.agreement_possible
            else "—"
        )
        lines.append(
            f"| {r.format} | {_format_cell(r)} | {r.weights_bytes:,} | {r.perplexity:.4f} | "
            f"{r.delta_pct:+.3f} | {bound} | {'PASS' if r.passed else 'FAIL'} | {agree} | {r.seconds:.1f} |"
        )
    lines.append("")
    lines.append(
        f"model {report.model}; text {report.text} (sha256 {report.text_sha256[:12]}…), "
        f"{report.num_tokens} tokens in {report.num_windows} windows of ≤ {report.context} "
        f"(stride {report.stride}), kernels {report.kernels}; greedy agreement: "
        + (
            "8 prompts × 64 tokens vs float32"
            if any(r.agreement_possible for r in report.rows)
            else "not run (--no-agreement)"
        )
    )
    lines.append(f"machine: {report.machine.describe()}")
    return "\n".join(lines)
