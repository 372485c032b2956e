"""``make install`` fits the machine (issue 45): PyTorch's CPU build where no NVIDIA driver is present, pip's
default (CUDA) build where one is (scripts/torch_index.py decides), and ``make run`` installs what serving
needs, not the dev tools (``make test`` adds them). Checked on the decision function with a fake driver file
and a fake ``nvidia-smi``, and on the commands ``make -n`` prints: nothing is installed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU = "https://download.pytorch.org/whl/cpu"


def _script():
    spec = importlib.util.spec_from_file_location("torch_index", REPO / "scripts" / "torch_index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_nvidia_smi(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    return folder


def test_the_decision_reads_the_driver_file_and_nvidia_smi(tmp_path: Path) -> None:
    torch_index = _script()
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "no-driver"
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15\n")
    assert torch_index.CPU_INDEX_URL == CPU
    assert torch_index.DRIVER_FILE == Path("/proc/driver/nvidia/version")
    assert torch_index.torch_index_url("Linux", missing, str(empty)) == CPU
    assert torch_index.torch_index_url("Linux", driver, str(empty)) == ""
    assert torch_index.torch_index_url("Linux", missing, str(_fake_nvidia_smi(tmp_path / "bin"))) == ""
    assert torch_index.torch_index_url("Darwin", missing, str(empty)) == ""  # PyPI's macOS wheel has no CUDA
    assert torch_index.torch_index_url("Windows", missing, str(empty)) == ""


def _dry_run(tmp_path: Path, target: str, driver: Path, path: Path, *extra: str) -> list[str]:
    """The commands ``make -n <target>`` would run for a venv that does not exist yet."""
    make = shutil.which("make")
    assert make is not None
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "TORCH_INDEX_URL", "PORT")}
    done = subprocess.run(
        [make, "-n", "-C", str(REPO), target, f"VENV={tmp_path / 'venv'}", f"PYTHON={sys.executable}",
         f"NVIDIA_DRIVER_FILE={driver}", *extra],
        capture_output=True, text=True, check=True, env={**env, "PATH": str(path)},
    )  # fmt: skip
    return [line.strip() for line in done.stdout.splitlines()]


def _pip_installs(lines: list[str]) -> list[str]:
    return [line.split(" -m pip install ", 1)[1] for line in lines if " -m pip install " in line]


@pytest.mark.parametrize(("driver", "nvidia_smi", "torch"), [
    (False, False, [f"--no-deps torch==2.13.0 --index-url {CPU}", "torch==2.13.0"]),
    (True, False, ["torch==2.13.0"]),
    (False, True, ["torch==2.13.0"]),
])  # fmt: skip
def test_make_install_asks_for_the_cpu_build_without_a_driver(tmp_path, driver, nvidia_smi, torch) -> None:
    driver_file = tmp_path / "version"
    if driver:
        driver_file.write_text("NVRM version: 570.86.15\n")
    bin_dir = _fake_nvidia_smi(tmp_path / "bin") if nvidia_smi else tmp_path
    installs = _pip_installs(_dry_run(tmp_path, "install", driver_file, bin_dir))
    assert installs == ["-q --upgrade pip", *torch, "-e '.[engine,gateway]'"]


def test_make_run_installs_no_dev_tools_and_make_test_does(tmp_path) -> None:
    missing = tmp_path / "no-driver"
    run = _pip_installs(_dry_run(tmp_path, "run", missing, tmp_path))
    assert run == [
        "-q --upgrade pip",
        f"--no-deps torch==2.13.0 --index-url {CPU}",
        "torch==2.13.0",
        "-e '.[engine,gateway]'",
    ]
    lint = _pip_installs(_dry_run(tmp_path, "lint", missing, tmp_path))
    assert lint == [*run, "-e '.[dev]'"]
    override = _pip_installs(_dry_run(tmp_path, "install", missing, tmp_path, "TORCH_INDEX_URL="))
    assert override[1:3] == ["torch==2.13.0", "-e '.[engine,gateway]'"]  # TORCH_INDEX_URL=: the default build


def test_make_install_says_what_it_installs_before_each_step(tmp_path) -> None:
    """The install printed nothing of its own for a minute and a half: each step is now announced first
    (which PyTorch build and why, then what kvscope installs for serving), and pip shows its progress."""
    lines = _dry_run(tmp_path, "install", tmp_path / "no-driver", tmp_path)
    said = [i for i, line in enumerate(lines) if line.startswith('echo "make install: ')]
    steps = [i for i, line in enumerate(lines) if " -m pip install " in line]
    assert [lines[i] for i in said] == [
        f'echo "make install: PyTorch 2.13.0 from {CPU} (the CPU build where no \\',
        'echo "make install: kvscope with what serving needs (engine, gateway); make test adds the dev '
        'tools"',
    ]
    assert steps[0] < said[0] < steps[1] < steps[2] < said[1] < steps[3]  # pip upgrade, torch x2, kvscope
    assert not any(" -q " in lines[i] for i in steps[1:])  # pip's own progress shows for the big downloads
