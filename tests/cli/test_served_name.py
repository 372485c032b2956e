"""The name a model is served under without ``--served-model-name``: one rule for the engine's /v1/models
and for ``kvscope serve``'s banner and gateway tokenizer key (kvscope/common/models/registry.py
``default_served_name``; a break-it run found a .gguf path served as ``hf``, the name of the folder it is
converted into)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.cli.supervisor import ServeOptions, _served_name
from kvscope.common.models.registry import default_served_name


def test_default_served_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "My-Model-1B"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert [
        default_served_name(m)
        for m in (
            "smollm2-135m",
            "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "local.Q8_0.gguf",
            str(folder),
            f"{folder}/",
            "My-Model-1B",
            "./My-Model-1B",
        )
    ] == [
        "smollm2-135m",
        "SmolLM2-135M-Instruct.Q4_1",
        "local.Q8_0",
        "My-Model-1B",
        "My-Model-1B",
        "My-Model-1B",
        "My-Model-1B",
    ]


@pytest.mark.parametrize(
    ("model", "engine_args", "served"),
    [
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", (), "SmolLM2-135M-Instruct.Q4_1"),
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", ("--served-model-name", "chat"), "chat"),
        ("smollm2-135m", ("--dtype", "float32"), "smollm2-135m"),
    ],
)
def test_serve_announces_the_name_the_engine_serves(
    model: str, engine_args: tuple[str, ...], served: str, tmp_path: Path
) -> None:
    options = ServeOptions(
        model=model,
        host="127.0.0.1",
        port=1,
        engine_port=2,
        log_file=tmp_path / "r.jsonl",
        engine_args=engine_args,
        gateway_args=(),
    )
    assert _served_name(options) == served


def test_the_engine_serves_a_gguf_file_by_its_name(model_dir: Path) -> None:
    from kvscope.engine.llm import LLM

    gguf = next(model_dir.parent.glob("*.gguf"))
    llm = LLM(str(gguf), kv_cache_memory=32 << 20)
    assert llm.engine.info.name == gguf.name.removesuffix(".gguf") == "SmolLM2-135M-Instruct.Q4_1"
