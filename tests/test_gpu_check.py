"""scripts/gpu_check.sh on a machine without a GPU: its dry run passes (what would travel fits 64 MiB, what
would run fits 8 minutes, every step's tests collect, every gpu-marked test is in a step, every import is in
the device image or carried); a run runs every step whatever the others did and leaves a log and a junit file
per step; a step past its timeout is killed with its children; a pytest step that skipped a test fails.
Stub interpreters stand for the device's python3, so no case depends on this machine having CUDA."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvscope.testing.wait import wait_until

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    """scripts/gpu_check.py as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow
def test_the_dry_run_passes_and_lists_what_travels_and_runs(gpu_check: ModuleType) -> None:
    done = subprocess.run(
        [str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out.splitlines()[-1] == "gpu_check --dry-run: ok"
    carried = re.findall(r"^  carry (\S+) +([\d,]+) B$", out, re.M)
    names = [Path(p).name for p, _ in carried]
    assert names[:2] == ["tokenizer.json", "tokenizer_config.json"]
    assert [n.split("-")[0] for n in names[2:]] == sorted(gpu_check.WHEEL_DISTRIBUTIONS)
    [total] = [int(n.replace(",", "")) for n in re.findall(r"^  total ([\d,]+) B = ", out, re.M)]
    [tree] = [
        int(n.replace(",", "")) for n in re.findall(r"^  working tree: \d+ files, ([\d,]+) B$", out, re.M)
    ]
    assert total == tree + sum(int(size.replace(",", "")) for _, size in carried) < 64 << 20
    steps = re.findall(r"^  (setup|kernels|engine|bench) +(\d+) s  (.+)$", out, re.M)
    assert [(name, int(t)) for name, t, _ in steps] == [(s.name, s.timeout_s) for s in gpu_check.STEPS]
    assert (
        f"timeouts + kill grace: {20 + sum(s.timeout_s for s in gpu_check.STEPS) + 3 * 5} s of 480 s" in out
    )
    assert 20 + sum(s.timeout_s for s in gpu_check.STEPS) + 3 * 5 < 480
    collected = dict(re.findall(r"^  (kernels|engine) +pytest exit 0, (\d+) tests$", out, re.M))
    assert collected.keys() == {"kernels", "engine"} and all(int(n) > 0 for n in collected.values())
    assert "outside every step: none" in out


def stub_python(tmp_path: Path, probe_exit: int) -> Path:
    """An interpreter that answers the CUDA probe with ``probe_exit`` and fails every step with status 3."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *cuda.is_available*) echo "stub: probed"; exit {probe_exit};; esac\n'
        'echo "stub python: $*"; exit 3\n'
    )
    stub.chmod(0o755)
    return stub


def run_script(tmp_path: Path, stub: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"OUT": str(tmp_path / "out"), "GPU_CHECK_PYTHON": str(stub)}
    return subprocess.run([str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_every_step_runs_when_every_step_fails(tmp_path: Path, gpu_check: ModuleType) -> None:
    done = run_script(tmp_path, stub_python(tmp_path, 0))
    assert done.returncode == 1, done.stdout + done.stderr
    names = [s.name for s in gpu_check.STEPS]
    assert re.findall(r"^gpu_check: (\w+) +FAILED rc 3 ", done.stdout, re.M) == names
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{n}.{kind}" for n in names for kind in ("log", "junit.xml")
    )  # 8 files: the most the device tool brings back
    for name in names:
        suite = ET.parse(out / f"{name}.junit.xml").getroot()
        failure = suite.find("testcase/failure")
        assert failure is not None and (
            suite.get("tests"),
            suite.get("failures"),
            failure.get("message"),
        ) == (
            "1",
            "1",
            "exit status 3",
        )
        assert "stub python: " in (out / f"{name}.log").read_text()


def test_no_cuda_device_exits_2_before_any_step(tmp_path: Path) -> None:
    done = run_script(tmp_path, stub_python(tmp_path, 2))
    assert done.returncode == 2
    assert done.stdout.splitlines() == [
        "stub: probed",
        "gpu_check: no CUDA device; nothing to check here (--dry-run checks the plan on CPU)",
    ]
    assert list((tmp_path / "out").iterdir()) == []


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path: Path, gpu_check: ModuleType) -> None:
    pid_file = tmp_path / "child.pid"
    argv = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    returncode, seconds = gpu_check.run_command(argv, 1, tmp_path / "step.log", os.environ.copy())
    assert returncode is None and 1 <= seconds < 30  # killed, not waited out (the sleep is 60 s)
    assert "killed at its 1 s timeout" in (tmp_path / "step.log").read_text()
    child = int(pid_file.read_text())
    # the orphaned sleep is reaped by init once killed
    wait_until(lambda: not Path(f"/proc/{child}").exists(), 5, f"process {child} gone", interval_s=0.05)


def test_a_pytest_step_that_skips_a_test_fails(tmp_path: Path, gpu_check: ModuleType) -> None:
    tests = tmp_path / "test_inner.py"
    tests.write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\ndef test_skips():\n    pytest.skip('not here')\n"
    )
    step = gpu_check.pytest_step("inner", 120, (str(tests),))
    outcome = gpu_check.run_step(step, sys.executable, tmp_path, os.environ.copy())
    assert (outcome.returncode, outcome.counts, outcome.ok) == (
        0,
        {"tests": 2, "failures": 0, "errors": 0, "skipped": 1},
        False,
    )
