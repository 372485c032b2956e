"""kernels/csrc/cpu_simd_avx2.h, the AVX2 build's stand-in for the AVX-512 intrinsics the CPU kernels use,
checked lane by lane against scalar models of the instructions, and cpu_pair_vnni_avx2.h's block sums against
the vpdpbusd chain they replace (tests/kernels/simd_avx2_check.cpp: 2,000 random rounds with NaN and ±0, the
dot products' extremes, reduce_max's order). Runs on any x86-64 CPU with AVX2, FMA and F16C, AVX-512 ones
included (the check is built with ``-mno-avx512f``); needs the system g++ that builds the kernels."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvscope.kernels import cpu_decode
from tests.conftest import require_tool

CHECK = Path(__file__).with_name("simd_avx2_check.cpp")


@pytest.mark.cpu_kernels  # every CPU either build runs on has AVX2, FMA and F16C
def test_every_stand_in_computes_what_its_avx512_instruction_does(tmp_path: Path) -> None:
    compiler = require_tool("g++")
    binary = tmp_path / "simd_avx2_check"
    build = subprocess.run(
        [
            compiler,
            "-O2",
            "-std=c++20",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mno-avx512f",
            f"-I{cpu_decode.CSRC}",
            str(CHECK),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout[-4000:]
    assert run.stdout.strip().startswith("checked ")
    assert int(run.stdout.split()[-1]) > 100_000
