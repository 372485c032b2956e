#!/usr/bin/env python3
"""Which PyTorch build `make install` asks pip for: prints the package index URL of the CPU build, or nothing
for pip's default build. The Makefile installs a printed URL's torch alone (``pip install --no-deps
torch==2.13.0 --index-url URL``), then ``pip install torch==2.13.0``, which keeps that build (``2.13.0+cpu``
satisfies ``==2.13.0``) and takes torch's own dependencies from PyPI: the CPU index is asked for one wheel,
not for every dependency (a machine that reaches only PyPI and a local wheel folder pays one retry, not ten).

Why: on Linux, PyPI's default ``torch`` wheel is the CUDA build, which pulls about 19 NVIDIA wheels (several
GB) that a machine without an NVIDIA GPU never uses; PyTorch publishes CPU-only wheels of the same version on
its own index, https://download.pytorch.org/whl/cpu (the "CPU" row of pytorch.org's install selector). On
macOS and Windows the default wheel has no CUDA libraries, so the default stays.

How it decides that an NVIDIA driver is present (then the default, CUDA build): either

- ``/proc/driver/nvidia/version`` exists: the NVIDIA kernel module writes it when it is loaded, and the CUDA
  build needs exactly that driver (its ``libcuda``) at run time; containers share the host's ``/proc/driver``,
  so a GPU container sees it too; or
- ``nvidia-smi`` is on ``PATH``: it ships with the driver, and it is how WSL2 exposes a GPU, where the Linux
  guest has no NVIDIA kernel module and so no ``/proc/driver/nvidia``.

A GPU without its driver cannot run CUDA anyway, so the PCI bus is not searched. Overrides: ``make install
TORCH_INDEX_URL=`` (empty: pip's default build) or ``TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126``
(a CUDA version of your choice).

Plain Python with no imports from kvscope: it runs with the system interpreter before ``.venv`` exists.
Usage: ``python3 scripts/torch_index.py [--driver-file PATH]`` (the file to look for; default
``/proc/driver/nvidia/version``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
from pathlib import Path

CPU_INDEX_URL = "https://download.pytorch.org/whl/cpu"
DRIVER_FILE = Path("/proc/driver/nvidia/version")


def nvidia_driver_present(driver_file: Path = DRIVER_FILE, path: str | None = None) -> bool:
    """True when ``driver_file`` exists or ``nvidia-smi`` is an executable on ``path`` (default: the
    ``PATH`` environment variable)."""
    return driver_file.exists() or shutil.which("nvidia-smi", path=path) is not None


def torch_index_url(system: str, driver_file: Path = DRIVER_FILE, path: str | None = None) -> str:
    """The ``--index-url`` of PyTorch's wheel on this machine: :data:`CPU_INDEX_URL` on Linux (``system`` as
    ``platform.system()`` names it) without an NVIDIA driver, else ``""`` (pip's default build)."""
    if system != "Linux" or nvidia_driver_present(driver_file, path):
        return ""
    return CPU_INDEX_URL


def main(argv: list[str] | None = None) -> None:
    """Print the index URL (or an empty line) for this machine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--driver-file", type=Path, default=DRIVER_FILE)
    args = parser.parse_args(argv)
    print(torch_index_url(platform.system(), args.driver_file, os.environ.get("PATH")))


if __name__ == "__main__":
    main()
