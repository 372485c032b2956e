"""Tests of kvscope's CPU kernels (markers ``vnni``, ``amx``) skip only on a CPU without the instructions they
need, and say which (tests/conftest.py ``cpu_instruction_skip``); CI allows those skips; a kernels module
that fails to import fails the test instead of skipping it. The CPU is faked through
kvscope.kernels.cpu_decode's /proc/cpuinfo reader, so every case runs on every machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvscope.kernels import cpu_decode
from tests.conftest import ALLOWED_SKIP_REASONS, cpu_instruction_skip

CONFTEST = Path(__file__).with_name("conftest.py")
XEON_AMX = "flags\t: fpu avx512f avx512bw avx512dq avx512_vnni f16c avx512_bf16 amx_tile amx_bf16 amx_int8"
EPYC = "flags\t: fpu avx2 avx512f avx512bw avx512dq avx512_vnni f16c avx512_bf16 avx512vbmi"
AVX2 = "flags\t: fpu avx2 f16c fma"


@pytest.mark.parametrize(
    ("flags", "vnni", "amx"),
    [
        (XEON_AMX, None, None),
        (
            EPYC,
            None,
            "needs AMX (amx_tile, amx_bf16): this CPU has avx512f avx512bw avx512dq avx512_vnni f16c "
            "avx512_bf16",
        ),
        (
            AVX2,
            "needs AVX-512 VNNI (avx512f, avx512bw, avx512dq, avx512_vnni): this CPU has f16c",
            "needs AMX (avx512f, avx512bw, avx512dq, avx512_vnni, avx512_bf16, amx_tile, amx_bf16): this CPU "
            "has f16c",
        ),
        (
            "",  # /proc/cpuinfo unreadable
            "needs AVX-512 VNNI (avx512f, avx512bw, avx512dq, avx512_vnni, f16c): this CPU has none of them",
            "needs AMX (avx512f, avx512bw, avx512dq, avx512_vnni, f16c, avx512_bf16, amx_tile, amx_bf16): "
            "this CPU has none of them",
        ),
    ],
    ids=["xeon-amx", "epyc", "avx2", "no-cpuinfo"],
)
def test_the_reason_names_the_missing_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: str, vnni: str | None, amx: str | None
) -> None:
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: flags)
    assert (cpu_instruction_skip("vnni"), cpu_instruction_skip("amx")) == (vnni, amx)
    assert cpu_decode.cpu_supports() == (vnni is None) and cpu_decode.cpu_supports_amx() == (amx is None)
    for reason in (vnni, amx):
        assert reason is None or reason.startswith(ALLOWED_SKIP_REASONS)


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
    vnni: kernels
    amx: AMX kernels
"""
INNER_TESTS = """
import pytest

@pytest.fixture
def built():
    raise AssertionError("the kernels' fixture must not run where the test skips")

@pytest.mark.vnni
def test_decode(built):
    pass

@pytest.mark.amx
def test_amx(built):
    pass

@pytest.mark.vnni
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
