"""Shared pytest wiring: GPU tests skip without CUDA; tests of kvscope's CPU kernels skip on a CPU without
their instructions, naming the missing ones (pytest_runtest_setup below); tests needing a system tool skip on
a laptop but fail under CI=true (see require_tool); under CI=true any skip whose reason is not in
ALLOWED_SKIP_REASONS fails the run (pytest_sessionfinish below)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def _drop_the_repository_root_from_sys_path() -> None:
    """Remove the repository root from sys.path (``python -m pytest`` run there puts it first, as ``''`` or
    its path). Its layer folders would shadow top-level packages that are not ours: ``kernels/`` shadows
    Hugging Face's ``kernels``, which transformers imports. The tests need no root on sys.path: the project
    is imported as ``kvscope.*`` (installed) and ``tests.*`` is registered by pytest's importlib import
    mode."""
    root = Path(__file__).resolve().parents[1]
    sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != root]


_drop_the_repository_root_from_sys_path()

ALLOWED_SKIP_REASONS = (
    "needs a CUDA device",  # tests marked `gpu` on a machine without CUDA (pytest_collection_modifyitems)
    "set ELASTICSEARCH_URL",  # tests/gateway/logs/test_es_live.py without a live Elasticsearch
    # tests marked `cpu_kernels`/`amx`/`bf16` (kvscope's CPU kernels) on a CPU without those instructions,
    # e.g. "needs AMX (amx_tile, amx_bf16): this CPU has avx512f ... avx512_bf16" (cpu_instruction_skip)
    "needs kvscope's CPU kernels: AVX-512 VNNI or AVX2 (",
    "needs AMX (",
    "needs AVX-512 BF16 (",
    # tests marked `onednn_bf16` (dense bfloat16 matmuls) where oneDNN packs no bfloat16: an AVX2-only CPU
    "needs oneDNN's bfloat16 matmul (",
)
"""The only reasons a test may be skipped under CI=true (matched as prefixes). Anything else — a missing tool,
a "not written yet" guard, an OSError — fails the run: a skipped test protects nothing."""
_DISALLOWED_SKIPS = pytest.StashKey[list[str]]()
# pytester: tests/test_ci_policy.py runs inner pytest sessions under these hooks; tests/xdist_groups.py: the
# files sharing an expensive session fixture run on one xdist worker
pytest_plugins = ["pytester", "tests.xdist_groups"]


def require_tool(name: str) -> str:
    """Return the path of executable ``name``; skip the test on a laptop, fail it when CI=true."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install it, or run .ci/run)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason=ALLOWED_SKIP_REASONS[0])
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


CPU_INSTRUCTION_MARKS = {
    "cpu_kernels": "kvscope's CPU kernels: AVX-512 VNNI or AVX2",
    "amx": "AMX",
    "bf16": "AVX-512 BF16",
}
"""The markers of tests that need kvscope's CPU kernels, and what each names in its skip: ``cpu_kernels`` the
library itself (either of its builds, kvscope.kernels.cpu_decode ``kernel_isa``), ``amx`` and ``bf16`` the
AVX-512 extensions of its AMX matmul and bfloat16 tiles."""


def cpu_instruction_skip(marker: str) -> str | None:
    """The skip reason of a test marked ``marker`` (``cpu_kernels``, ``amx`` or ``bf16``) on this CPU, None
    where /proc/cpuinfo lists every flag it needs (kvscope.kernels.cpu_decode: VNNI_FLAGS or AVX2_FLAGS for
    ``cpu_kernels``; VNNI_FLAGS + AMX_FLAGS for ``amx``; VNNI_FLAGS + ``avx512_bf16`` for ``bf16``: the
    small-batch matmul's bfloat16 tiles, built where it is). The reason names the missing flags and those of
    the kernels' flags this CPU has, e.g. ``needs AMX (amx_tile, amx_bf16): this CPU has avx512f avx512bw
    avx512dq avx512_vnni f16c avx512_bf16``. The import is not guarded: a kvscope.kernels.cpu_decode that
    fails to import fails the test, it never skips it."""
    from kvscope.kernels.cpu_decode import AMX_FLAGS, AVX2_FLAGS, VNNI_FLAGS, kernel_isa, missing_cpu_flags

    if marker == "cpu_kernels":
        if kernel_isa() is not None:
            return None
        missing = missing_cpu_flags(AVX2_FLAGS)  # the smaller build's
        known = tuple(dict.fromkeys(AVX2_FLAGS + VNNI_FLAGS))
    else:
        missing = missing_cpu_flags(VNNI_FLAGS + {"amx": AMX_FLAGS, "bf16": ("avx512_bf16",)}[marker])
        if not missing:
            return None
        known = VNNI_FLAGS + AMX_FLAGS
    absent = set(missing_cpu_flags(known))
    present = [flag for flag in known if flag not in absent]
    has = " ".join(present) if present else "none of them"
    return f"needs {CPU_INSTRUCTION_MARKS[marker]} ({', '.join(missing)}): this CPU has {has}"


def onednn_bf16_skip() -> str | None:
    """The skip reason of a test marked ``onednn_bf16`` (it runs dense bfloat16 matmuls on oneDNN's packed
    weights, kvscope.engine.models.layers ``packed_linear_kernel``) where this torch's oneDNN refuses to pack
    bfloat16 (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU such as AMD Zen 3); None where it
    packs. Asked of oneDNN itself, not of /proc/cpuinfo: its own rule decides."""
    import torch

    from kvscope.engine.models.layers import packed_linear_kernel

    if packed_linear_kernel(torch.zeros(16, 16, dtype=torch.bfloat16), None) is not None:
        return None
    return (
        "needs oneDNN's bfloat16 matmul (avx512bw, avx512vl, avx512dq or avx_ne_convert): this CPU's oneDNN "
        "packs no bfloat16 weight"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``cpu_kernels``/``amx``/``bf16`` on a CPU without those instructions, before its
    fixtures build the kernels (cpu_instruction_skip), and one marked ``onednn_bf16`` where oneDNN packs no
    bfloat16 (onednn_bf16_skip)."""
    for marker in CPU_INSTRUCTION_MARKS:
        if item.get_closest_marker(marker) is not None:
            reason = cpu_instruction_skip(marker)
            if reason is not None:
                pytest.skip(reason)
    if item.get_closest_marker("onednn_bf16") is not None and (reason := onednn_bf16_skip()) is not None:
        pytest.skip(reason)


def disallowed_skips(reports: list[pytest.TestReport]) -> list[str]:
    """``nodeid: reason`` for each skipped (not xfailed) report whose reason is not allow-listed."""
    found = []
    for report in reports:
        if not report.skipped or hasattr(report, "wasxfail"):
            continue
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith(ALLOWED_SKIP_REASONS):
            found.append(f"{report.nodeid}: {reason}")
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI=true, turn a green run with a disallowed skip into a failed one (exit code 1)."""
    if os.environ.get("CI") != "true":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    found = disallowed_skips(reporter.stats.get("skipped", []) if reporter else [])
    session.config.stash[_DISALLOWED_SKIPS] = found
    if found and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    found = config.stash.get(_DISALLOWED_SKIPS, [])
    if found:
        terminalreporter.section("skips not allowed under CI=true", sep="=", red=True, bold=True)
        terminalreporter.line(
            f"allowed: {', '.join(ALLOWED_SKIP_REASONS)} (tests/conftest.py ALLOWED_SKIP_REASONS)"
        )
        for line in found:
            terminalreporter.line(f"SKIPPED {line}", red=True)


OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
"""The OpenTelemetry environment variables that decide what is exported and sampled."""


@pytest.fixture
def no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of :data:`OTEL_VARS` set for the test (a module applies it with ``pytest.mark.usefixtures``)."""
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def model_dir():
    """The default model converted to an HF folder (pulled and converted on first use)."""
    from kvscope.engine.weights.files import resolve_model_dir

    return resolve_model_dir("smollm2-135m")


@pytest.fixture(scope="session")
def llm():
    """One shared offline engine on SmolLM2 (fp32, prefix caching on, 256 MiB of KV cache)."""
    from kvscope.engine.llm import LLM

    return LLM("smollm2-135m", kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own load of the SmolLM2 GGUF (fp32): the reference for token-level parity.

    transformers parses the GGUF twice (config, then weights: ~6-8 s each on a slow 2-vCPU host, most of it
    the tokenizer's 49k strings) and builds gguf-py's tensor-name map once per tensor (~400 times). Both are
    pure functions of their arguments, so during this load the two parses share one ``GGUFReader`` and the map
    is built once per (architecture, layers): 28.6 → 15.0 s, the same 273 tensors bit for bit (checked
    2026-12-03). Were transformers to bind those names at import, the patch would not apply and the load would
    only be slower."""
    import functools

    import gguf as gguf_py
    import torch
    from transformers import AutoModelForCausalLM

    from kvscope.engine.weights.files import resolve_model_dir

    path = next(resolve_model_dir("smollm2-135m").parent.glob("*.gguf"))
    readers: dict = {}
    read = gguf_py.GGUFReader

    def shared_reader(*args, **kwargs):
        key = (tuple(str(a) for a in args), tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = read(*args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_py, "GGUFReader", shared_reader)
        patch.setattr(
            gguf_py, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf_py.get_tensor_name_map)
        )
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()
