"""Tests of kvscope's CPU kernels (markers ``cpu_kernels``, ``amx``, ``bf16``) skip only on a CPU without the
instructions they need, and say which (tests/conftest.py ``cpu_instruction_skip``); CI allows those skips;
a kernels module that fails to import fails the test instead of skipping it. The CPU is faked through
kvscope.kernels.cpu_decode's /proc/cpuinfo reader, so every case runs on every machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvscope.common.models.cache import cache_root
from kvscope.engine.platform.cpu import CPU_KERNELS_DIR
from kvscope.kernels import cpu_decode
from tests.conftest import ALLOWED_SKIP_REASONS, cpu_instruction_skip

CONFTEST = Path(__file__).with_name("conftest.py")
XEON_AMX = "flags\t: fpu avx512f avx512bw avx512dq avx512_vnni f16c avx512_bf16 amx_tile amx_bf16 amx_int8"
EPYC = "flags\t: fpu avx2 avx512f avx512bw avx512dq avx512_vnni f16c avx512_bf16 avx512vbmi"
XEON_VNNI = "flags\t: fpu avx2 avx512f avx512bw avx512dq avx512_vnni f16c"  # Cascade Lake: no BF16, no AMX
AVX2 = "flags\t: fpu avx2 f16c fma"  # Zen 3: the library's AVX2 build, no AMX or BF16
AVX = "flags\t: fpu avx f16c"  # Ivy Bridge: no library


@pytest.mark.parametrize(
    ("flags", "kernels", "amx", "bf16"),
    [
        (XEON_AMX, None, None, None),
        (
            EPYC,
            None,
            "needs AMX (amx_tile, amx_bf16): this CPU has avx512f avx512bw avx512dq avx512_vnni f16c "
            "avx512_bf16",
            None,
        ),
        (
            XEON_VNNI,
            None,
            "needs AMX (avx512_bf16, amx_tile, amx_bf16): this CPU has avx512f avx512bw avx512dq avx512_vnni "
            "f16c",
            "needs AVX-512 BF16 (avx512_bf16): this CPU has avx512f avx512bw avx512dq avx512_vnni f16c",
        ),
        (
            AVX2,
            None,
            "needs AMX (avx512f, avx512bw, avx512dq, avx512_vnni, avx512_bf16, amx_tile, amx_bf16): this CPU "
            "has f16c",
            "needs AVX-512 BF16 (avx512f, avx512bw, avx512dq, avx512_vnni, avx512_bf16): this CPU has f16c",
        ),
        (
            AVX,
            "needs kvscope's CPU kernels: AVX-512 VNNI or AVX2 (avx2, fma): this CPU has f16c",
            "needs AMX (avx512f, avx512bw, avx512dq, avx512_vnni, avx512_bf16, amx_tile, amx_bf16): this CPU "
            "has f16c",
            "needs AVX-512 BF16 (avx512f, avx512bw, avx512dq, avx512_vnni, avx512_bf16): this CPU has f16c",
        ),
        (
            "",  # /proc/cpuinfo unreadable
            "needs kvscope's CPU kernels: AVX-512 VNNI or AVX2 (avx2, fma, f16c): this CPU has none of them",
            "needs AMX (avx512f, avx512bw, avx512dq, avx512_vnni, f16c, avx512_bf16, amx_tile, amx_bf16): "
            "this CPU has none of them",
            "needs AVX-512 BF16 (avx512f, avx512bw, avx512dq, avx512_vnni, f16c, avx512_bf16): this CPU has "
            "none of them",
        ),
    ],
    ids=["xeon-amx", "epyc", "xeon-vnni", "avx2", "avx", "no-cpuinfo"],
)
def test_the_reason_names_the_missing_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: str, kernels: str | None, amx: str | None, bf16: str | None
) -> None:
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: flags)
    assert (
        cpu_instruction_skip("cpu_kernels"),
        cpu_instruction_skip("amx"),
        cpu_instruction_skip("bf16"),
    ) == (kernels, amx, bf16)
    assert cpu_decode.cpu_supports() == (kernels is None) and cpu_decode.cpu_supports_amx() == (amx is None)
    for reason in (kernels, amx, bf16):
        assert reason is None or reason.startswith(ALLOWED_SKIP_REASONS)


@pytest.mark.cpu_kernels
def test_the_bfloat16_tiles_are_built_exactly_where_the_cpu_has_avx512_bf16() -> None:
    """A test marked ``bf16`` runs where /proc/cpuinfo lists avx512_bf16, and there the library must have
    the tiles (``-march=native`` compiles them in): a build without them fails here instead of leaving
    the bfloat16 cases of the tile tests unrun."""
    result = cpu_decode.load(cache_root() / CPU_KERNELS_DIR)
    assert result.ok, result.detail
    assert cpu_decode.bf16_tiles_built() == (cpu_instruction_skip("bf16") is None)


INNER_CONFTEST = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("kvscope_root_conftest", {str(CONFTEST)!r})
root = importlib.util.module_from_spec(spec)
spec.loader.exec_module(root)
pytest_runtest_setup = root.pytest_runtest_setup
pytest_sessionfinish = root.pytest_sessionfinish
pytest_terminal_summary = root.pytest_terminal_summary
"""
INNER_INI = """[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    cpu_kernels: kernels
    amx: AMX kernels
"""
INNER_TESTS = """
import pytest

@pytest.fixture
def built():
    raise AssertionError("the kernels' fixture must not run where the test skips")

@pytest.mark.cpu_kernels
def test_decode(built):
    pass

@pytest.mark.amx
def test_amx(built):
    pass

@pytest.mark.cpu_kernels
def test_decode_without_fixture():
    pass
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    """An inner session with tests/conftest.py's hooks (in this process, so the monkeypatched CPU holds)."""
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makeini(INNER_INI)
    pytester.makepyfile(INNER_TESTS)
    return pytester


def test_a_cpu_without_amx_skips_by_name_and_ci_allows_it(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: EPYC)
    monkeypatch.setenv("CI", "true")
    result = inner.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1, errors=1)  # test_decode's fixture fails: the CPU has VNNI
    result.stdout.fnmatch_lines(["*SKIPPED*needs AMX (amx_tile, amx_bf16): this CPU has avx512f*avx512_bf16"])
    assert "skips not allowed" not in result.stdout.str()


def test_an_import_error_of_the_kernels_fails_instead_of_skipping(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "kvscope.kernels.cpu_decode", None)  # `import` raises ImportError
    result = inner.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=3)
    # ModuleNotFoundError is an ImportError
    result.stdout.fnmatch_lines(["E * ModuleNotFoundError: import of kvscope.kernels.cpu_decode halted*"] * 3)


def test_the_onednn_bfloat16_skip_asks_onednn_and_names_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``onednn_bf16`` skips exactly where oneDNN packs no bfloat16 weight (an AVX2-only CPU),
    with an allowed reason; where it packs, it runs."""
    import torch

    from kvscope.engine.models import layers
    from tests.conftest import onednn_bf16_skip

    packs = layers.packed_linear_kernel(torch.zeros(16, 16, dtype=torch.bfloat16), None) is not None
    assert (onednn_bf16_skip() is None) == packs
    monkeypatch.setattr(layers, "packed_linear_kernel", lambda weight, bias: None)
    reason = onednn_bf16_skip()
    assert reason is not None and reason.startswith(ALLOWED_SKIP_REASONS)
