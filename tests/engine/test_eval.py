"""``kvscope eval ppl`` without a model forward: window arithmetic, NLL bookkeeping, formats and bounds,
agreement, the shipped text, the table and the CLI's exit codes (engine/eval/)."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kvscope.engine.eval.runner as runner
import kvscope.engine.eval.text as eval_text
from kvscope.engine.eval.agreement import AGREEMENT_PROMPTS, agreement, common_prefix
from kvscope.engine.eval.cli import eval_main, ppl_main
from kvscope.engine.eval.formats import FormatError, FormatSpec, parse_format, parse_formats
from kvscope.engine.eval.perplexity import PerplexityResult, Window, score_windows, sliding_windows
from kvscope.engine.eval.report import TABLE_COLUMNS, EvalReport, Machine, build_rows, markdown_table
from kvscope.engine.eval.runner import FormatRun, force_compact_kernels
from kvscope.engine.eval.text import DEFAULT_TEXT_SHA256, DEFAULT_TEXT_TOKENS, EvalTextError, load_text
from kvscope.engine.platform.kernel_probe import NO_DENSE
from kvscope.engine.weights.quant import CompactLinearKernel, Int8Weight

REPO = Path(__file__).resolve().parents[2]


def test_windows_of_a_hand_made_case() -> None:
    assert sliding_windows(10, context=4, stride=2) == [
        Window(0, 4, 1),
        Window(2, 6, 4),
        Window(4, 8, 6),
        Window(6, 10, 8),
    ]
    assert sliding_windows(5, context=8, stride=4) == [Window(0, 5, 1)]
    assert sliding_windows(11, context=4, stride=3) == [
        Window(0, 4, 1),
        Window(3, 7, 4),
        Window(6, 10, 7),
        Window(9, 11, 10),
    ]


@pytest.mark.parametrize("num_tokens", [2, 3, 17, 100, 1025, 2048])
@pytest.mark.parametrize(("context", "stride"), [(2, 1), (4, 3), (16, 8), (1024, 512), (64, 1)])
def test_every_token_but_the_first_is_scored_once_with_enough_context(
    num_tokens: int, context: int, stride: int
) -> None:
    windows = sliding_windows(num_tokens, context, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    assert scored == list(range(1, num_tokens))
    assert all(w.end - w.begin <= context for w in windows)
    assert all(t - w.begin >= context - stride for w in windows[1:] for t in range(w.score_from, w.end))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 4, 2), "need at least 2 tokens to score, got 1"),
        ((10, 1, 1), "context must be at least 2 tokens, got 1"),
        ((10, 4, 4), r"stride must be in \[1, context - 1\] = \[1, 3\], got 4"),
        ((10, 4, 0), r"stride must be in \[1, context - 1\] = \[1, 3\], got 0"),
    ],
)
def test_window_arguments_out_of_range_raise(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        sliding_windows(*args)


def test_the_nll_sums_each_windows_scored_tokens_at_their_window_offsets() -> None:
    """A fake model whose log-probability of token j of a window is -j (its context length there): the sum
    is that of the scored offsets, 1+2+3 | 2+3 | 2+3 | 2+3 = 21 over 9 tokens."""
    calls = []

    def by_offset(tokens: list[int]) -> list[float]:
        calls.append(tokens)
        return [-float(j) for j in range(1, len(tokens))]

    ids = list(range(100, 110))
    result = score_windows(ids, sliding_windows(10, 4, 2), by_offset)
    assert result == PerplexityResult(num_tokens=10, num_scored=9, nll_sum=21.0, num_windows=4)
    assert result.perplexity == pytest.approx(math.exp(21 / 9), rel=1e-15)
    assert calls == [ids[0:4], ids[2:6], ids[4:8], ids[6:10]]


def test_a_token_only_model_gives_the_same_nll_for_any_windows() -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]

    def by_token(tokens: list[int]) -> list[float]:
        return [-0.5 * t for t in tokens[1:]]

    sums = {
        (c, s): score_windows(ids, sliding_windows(len(ids), c, s), by_token).nll_sum
        for c, s in [(2, 1), (4, 2), (5, 3), (15, 7), (64, 32)]
    }
    assert set(sums.values()) == {0.5 * sum(ids[1:])}


def test_a_wrong_number_of_logprobs_is_refused() -> None:
    with pytest.raises(ValueError, match="^prompt_logprobs returned 2 values for 4 tokens$"):
        score_windows([1, 2, 3, 4], [Window(0, 4, 1)], lambda tokens: [0.0, 0.0])


def test_formats_map_to_engine_options_and_bounds() -> None:
    specs = parse_formats("gguf, bfloat16,gguf,auto,bfloat16/int8")
    assert [(s.name, s.dtype, s.quantization) for s in specs] == [
        ("float32", "float32", "none"),
        ("gguf", "float32", "gguf"),
        ("bfloat16", "bfloat16", "none"),
        ("auto", "auto", "auto"),
        ("bfloat16/int8", "bfloat16", "int8"),
    ]
    resolved = {"float32": "float32", "bfloat16": "bfloat16", "auto": "bfloat16"}
    assert [s.bound_pct(resolved[s.dtype]) for s in specs] == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert parse_format("auto").bound_pct("float32") == 0.0
    assert parse_format("int4").bound_pct("float32") == 0.5
    assert parse_format("auto/gguf").bound_pct("bfloat16") == 0.5
    # the servers' default: the bound of what --quantization auto loaded
    assert [parse_format("auto").bound_pct("bfloat16", q) for q in ("gguf", "int8", "none")] == [
        0.5,
        1.0,
        1.0,
    ]
    assert [s.verified_name for s in specs] == ["float32", "gguf", "bfloat16", None, None]


@pytest.mark.parametrize("text", ["int9", "float16", "bfloat16/int3", " , "])
def test_unknown_formats_raise(text: str) -> None:
    with pytest.raises(FormatError):
        parse_formats(text)


def test_agreement_counts_tokens_until_the_first_divergence() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    result = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 0, 7, 8]], length=4)
    assert (result.matched, result.total, result.possible, result.identical_prompts) == ((4, 1), 5, 8, 1)
    assert result.describe() == "1/2 prompts, 5/8 tokens"
    assert len(AGREEMENT_PROMPTS) == 8


def test_the_shipped_text_is_the_vendored_bytes_and_over_10k_tokens(tokenizer) -> None:
    text = load_text()
    assert (
        text.sha256 == DEFAULT_TEXT_SHA256 == hashlib.sha256(eval_text.DEFAULT_TEXT.read_bytes()).hexdigest()
    )
    assert text.name == "python-3.11.7-reference-prose.txt"
    assert len(tokenizer.encode(text.text)) == DEFAULT_TEXT_TOKENS == 13613


def test_a_changed_shipped_text_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "changed.txt"
    copy.write_bytes(eval_text.DEFAULT_TEXT.read_bytes().replace(b"Python", b"Pithon", 1))
    monkeypatch.setattr(eval_text, "DEFAULT_TEXT", copy)
    with pytest.raises(
        EvalTextError,
        match=f"changed: sha256 {hashlib.sha256(copy.read_bytes()).hexdigest()}, "
        f"expected {DEFAULT_TEXT_SHA256}",
    ):
        load_text()
    assert load_text(copy).text.startswith("A Pithon program")  # an explicit --text is not checked


def _run(spec: str, ppl: float, greedy: tuple[tuple[int, ...], ...], dtype: str = "float32") -> FormatRun:
    nll = math.log(ppl) * 99
    return FormatRun(
        spec=parse_format(spec),
        dtype=dtype,
        dense_dtype="bfloat16" if "/" in spec or spec == "gguf" else None,
        weights_bytes=1000,
        perplexity=PerplexityResult(100, 99, nll, 1),
        greedy=greedy,
        seconds=1.25,
        ppl_seconds=1.0,
        kernels="compact",
    )


REF = ((1, 2, 3, 4),) * 8


def test_compact_mode_drops_the_dense_copies() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen)
    compact = Int8Weight.from_float(weight)
    dense_calls = []

    def dense(x: torch.Tensor) -> torch.Tensor:
        dense_calls.append(x.shape[0])
        return x @ weight.to(x.dtype).T

    layer = torch.nn.Module()
    layer.cpu_kernel = CompactLinearKernel(
        compact=compact, bias=None, dense=dense, dense_dtype=torch.bfloat16, max_compact_rows=2
    )
    model = torch.nn.Module()
    model.layer = layer
    model.logits_kernel = layer.cpu_kernel
    x = torch.randn(8, 64, generator=gen)
    layer.cpu_kernel(x)
    assert dense_calls == [8]
    assert force_compact_kernels(model) == 2
    assert (layer.cpu_kernel.dense, layer.cpu_kernel.max_compact_rows) == (None, NO_DENSE)
    assert (model.logits_kernel.dense, model.logits_kernel.max_compact_rows) == (None, NO_DENSE)
    assert torch.equal(layer.cpu_kernel(x), compact.matmul(x.to(torch.bfloat16)).float())
    assert dense_calls == [8]
    assert force_compact_kernels(torch.nn.Linear(2, 2)) == 0


def test_rows_and_table_columns() -> None:
    runs = [
        _run("float32", 10.0, REF),
        _run("gguf", 10.04, ((1, 2, 3, 9),) + REF[1:]),
        _run("bfloat16", 10.2, REF, "bfloat16"),
    ]
    machine = Machine("Test CPU", ("amx_bf16",), "AVX512", 1, 2, (1.0, 2.0, 3.0), "2.x")
    report = EvalReport(
        model="m",
        text="t.txt",
        text_sha256="ab" * 32,
        num_tokens=100,
        context=64,
        stride=32,
        num_windows=3,
        kernels="compact",
        machine=machine,
        rows=build_rows(runs),
    )
    assert [(r.format, round(r.delta_pct, 6), r.bound_pct, r.passed) for r in report.rows] == [
        ("float32", 0.0, 0.0, True),
        ("gguf", 0.4, 0.5, True),
        ("bfloat16", 2.0, 1.0, False),
    ]
    assert report.passed is False
    lines = markdown_table(report).splitlines()
    assert lines[0] == "| " + " | ".join(TABLE_COLUMNS) + " |"
    assert TABLE_COLUMNS == (
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
    assert (
        lines[2] == "| float32 | float32 / none | 1,000 | 10.0000 | +0.000 | reference | PASS | "
        "8/8 prompts, 32/32 tokens | 1.2 |"
    )
    assert (
        lines[3]
        == "| gguf | float32 / gguf (compact kernel at all rows) | 1,000 | 10.0400 | +0.400 | ≤ +0.5 % | "
        "PASS | 7/8 prompts, 31/32 tokens | 1.2 |"
    )
    assert lines[4].split(" | ")[4:7] == ["+2.000", "≤ +1 %", "FAIL"]
    assert lines[6].endswith(
        "100 tokens in 3 windows of ≤ 64 (stride 32), kernels compact; greedy agreement: "
        "8 prompts × 64 tokens vs float32"
    )
    assert lines[-1] == (
        "machine: Test CPU (2 logical CPUs; amx_bf16; torch 2.x capability AVX512), 1 torch "
        "thread(s), load average 1.00, 2.00, 3.00"
    )
    no_agreement = [_run("float32", 10.0, ()), _run("gguf", 10.04, ())]
    report = replace(report, rows=build_rows(no_agreement))
    lines = markdown_table(report).splitlines()
    assert [line.split(" | ")[7] for line in lines[2:4]] == ["—", "—"]
    assert lines[5].endswith("kernels compact; greedy agreement: not run (--no-agreement)")


@pytest.mark.parametrize(("gguf_ppl", "code"), [(10.04, 0), (10.06, 1)])
def test_the_exit_status_is_1_when_a_format_misses_its_bound(
    gguf_ppl: float,
    code: int,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen = []

    def fake_run(
        model,
        spec: FormatSpec,
        token_ids,
        windows,
        num_threads,
        on_window=None,
        *,
        agreement=True,
        kernels="compact",
    ):
        seen.append((spec.name, len(token_ids), len(windows), num_threads, agreement, kernels))
        return _run(spec.name, 10.0 if spec.name == "float32" else gguf_ppl, REF)

    monkeypatch.setattr(runner, "run_format", fake_run)
    out = tmp_path / "r.json"
    assert (
        ppl_main(
            [
                "--model",
                str(model_dir),
                "--formats",
                "gguf",
                "--max-tokens",
                "300",
                "--context",
                "128",
                "--stride",
                "64",
                "--num-threads",
                "1",
                "--kernels",
                "served",
                "--save-result",
                str(out),
            ]
        )
        == code
    )
    assert seen == [("float32", 300, 4, 1, True, "served"), ("gguf", 300, 4, 1, True, "served")]
    assert "| gguf | float32 / gguf (compact kernel at all rows) |" in capsys.readouterr().out
    assert out.read_text().count('"passed": true') == (2 if code == 0 else 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stride", "0"], "--stride must be in [1, context - 1] = [1, 1023], got 0"),
        (["--context", "1"], "--context must be at least 2, got 1"),
        (["--context", "8", "--stride", "8"], "--stride must be in [1, context - 1] = [1, 7], got 8"),
        (["--max-tokens", "1"], "--max-tokens must be at least 2, got 1"),
        (["--num-threads", "0"], "--num-threads must be at least 1, got 0"),
        (
            ["--formats", "int9"],
            "unknown format 'int9': use one of float32, bfloat16, int8, int4, gguf, auto or "
            "DTYPE/QUANTIZATION with DTYPE in float32, bfloat16, auto and QUANTIZATION in none, int8, "
            "int4, gguf, auto",
        ),
        (
            ["--text", "/nonexistent/t.txt"],
            "cannot read the evaluation text /nonexistent/t.txt: No such file or directory",
        ),
        (["--save-result", "/nonexistent/r.json"], "--save-result: no such directory /nonexistent"),
        (
            ["--model", "/nonexistent/model"],
            "model '/nonexistent/model' is not a registered name (smollm2-135m), a HF "
            "folder with config.json, or a .gguf file",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert eval_main(["ppl", *argv]) == 2
    assert capsys.readouterr().err == f"kvscope eval ppl: error: {message}\n"


def test_a_context_beyond_the_model_exits_2(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ppl_main(["--model", str(model_dir), "--context", "9000"]) == 2
    assert (
        capsys.readouterr().err == "kvscope eval ppl: error: --context 9000 exceeds the model's "
        "max_position_embeddings 8192\n"
    )


@pytest.mark.parametrize(
    ("argv", "stderr_line"),
    [
        (["eval", "ppl", "--bogus"], "kvscope eval ppl: error: unrecognized arguments: --bogus"),
        (
            ["eval", "ppl", "--context", "x"],
            "kvscope eval ppl: error: argument --context: invalid int value: 'x'",
        ),
        (["eval", "perplexity"], "kvscope eval ppl: error: unknown subcommand 'perplexity' (known: ppl)"),
        (["eval"], "  ppl  perplexity + greedy agreement per weight format (kvscope eval ppl --help)"),
    ],
)
def test_the_kvscope_command_exits_2_without_a_traceback(argv: list[str], stderr_line: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kvscope.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines()[-1] == stderr_line
    assert "Traceback" not in proc.stderr
