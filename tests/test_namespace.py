"""kvscope's layers are imported as ``kvscope.engine``, ``kvscope.gateway``, ``kvscope.kernels`` and
``kvscope.dashboards`` (symlinks in kvscope/, installed through src/kvscope): no generic top-level import
name is ours. Top-level ``kernels`` is Hugging Face's package, which transformers >= 5.25 imports; the
repository's ``kernels/`` folder must never be what ``import kernels`` finds — neither in the test process
nor in a ``python -P`` process started from the repository root (what the Makefile and the supervisor run)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "gateway", "kernels", "dashboards")

PROBE = """
import importlib.util, json
spec = importlib.util.find_spec("kernels")
print(json.dumps(None if spec is None else spec.origin))
"""


def _hugging_face_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _check_kernels_origin(origin: str | None) -> None:
    """``import kernels`` finds Hugging Face's package when it is installed, and nothing when it is not."""
    if _hugging_face_kernels_installed():
        assert origin is not None and Path(origin).resolve().parent != (REPO / "kernels").resolve(), origin
        assert Path(origin).parent.name == "kernels" and "site-packages" in Path(origin).parts, origin
    else:
        assert origin is None, f"`import kernels` finds {origin}, not Hugging Face's package (not installed)"


def test_top_level_kernels_is_not_ours_under_pytest() -> None:
    spec = importlib.util.find_spec("kernels")
    _check_kernels_origin(None if spec is None else spec.origin)


def test_top_level_kernels_is_not_ours_in_a_safe_path_process_at_the_root() -> None:
    out = subprocess.run(
        [sys.executable, "-P", "-c", PROBE], cwd=REPO, capture_output=True, text=True, check=True
    )
    _check_kernels_origin(json.loads(out.stdout))


def test_no_layer_is_importable_by_its_bare_name_outside_the_root(tmp_path: Path) -> None:
    code = (
        "import importlib.util, json; "
        f"print(json.dumps([n for n in {LAYERS!r} if importlib.util.find_spec(n)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    found = json.loads(out.stdout)
    expected = ["kernels"] if _hugging_face_kernels_installed() else []
    assert found == expected


def test_the_layers_are_kvscope_subpackages_from_the_repository_folders() -> None:
    for name in LAYERS:
        spec = importlib.util.find_spec(f"kvscope.{name}")
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve() == (REPO / name / "__init__.py").resolve(), spec.origin


def test_transformers_model_code_imports_beside_hugging_faces_kernels() -> None:
    """What broke with transformers 5.25 while our folder was top-level ``kernels``: LlamaConfig's module
    imports transformers' activations, which import ``kernels`` when its distribution is present."""
    from transformers import LlamaConfig

    assert LlamaConfig().model_type == "llama"
