"""Model resolution and loading: fast tests on fakes and tiny HF folders; one slow test on real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvscope.common.models import UnknownModelError
from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.forward_context import set_forward_context
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.config import ModelConfig
from kvscope.engine.platform.loader import load_model
from kvscope.engine.weights import files
from kvscope.engine.weights.files import resolve_model_dir
from tests.engine.test_models_tiny import ATOL, Pair, hf_logits, make_pair, new_caches, paged_step, prompt


def fake_convert(calls: list[tuple[Path, Path]]):
    def convert(gguf_path: Path, out_dir: Path) -> Path:
        calls.append((gguf_path, out_dir))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")
        return out_dir

    return convert


def test_registry_name_pulls_then_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    pulls: list[str] = []
    converts: list[tuple[Path, Path]] = []
    monkeypatch.setattr(files, "pull", lambda name, root=None: pulls.append(name) or gguf)
    monkeypatch.setattr(files, "convert_gguf_to_hf", fake_convert(converts))
    expected = tmp_path / "models" / "smollm2-135m" / "hf"
    assert resolve_model_dir("smollm2-135m", root=tmp_path) == expected
    assert resolve_model_dir("smollm2-135m", root=tmp_path) == expected
    assert pulls == ["smollm2-135m", "smollm2-135m"]
    assert converts == [(gguf, expected)]


def test_gguf_path_converts_into_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    converts: list[tuple[Path, Path]] = []
    monkeypatch.setattr(files, "convert_gguf_to_hf", fake_convert(converts))
    src = tmp_path / "src"
    src.mkdir()
    (src / "m.gguf").write_bytes(b"GGUF")
    out = resolve_model_dir(str(src / "m.gguf"), root=tmp_path / "cache")
    assert out.parent.parent == tmp_path / "cache" / "models" and out.name == "hf"
    assert out.parent.name.startswith("m-") and len(out.parent.name) == len("m-") + 12
    assert resolve_model_dir(str(src), root=tmp_path / "cache") == out  # folder with one .gguf: same
    assert converts == [(src / "m.gguf", out)]


def test_processes_starting_at_once_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines starting together on a fresh cache: the first converts under ``hf.lock``, the second waits
    and then finds the folder (a conversion that takes 0.5 s, so both are inside it together without the
    lock)."""
    import concurrent.futures
    import time

    converts: list[tuple[Path, Path]] = []
    convert = fake_convert(converts)
    monkeypatch.setattr(files, "convert_gguf_to_hf", lambda g, o: time.sleep(0.5) or convert(g, o))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        found = list(
            pool.map(
                lambda _: files.resolve_model_files(str(tmp_path / "m.gguf"), tmp_path / "cache"), range(2)
            )
        )
    assert len(converts) == 1 and found[0][0] == found[1][0] == converts[0][1]
    assert sorted(converted for _, converted, _ in found) == [False, True]


def test_hf_folder_is_used_as_is_and_unknown_names_raise(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(UnknownModelError, match="'nope-7b' is not a registered name \\(smollm2-135m\\)"):
        resolve_model_dir("nope-7b", root=tmp_path)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pair, Path]:
    pair = make_pair("qwen3")
    out = tmp_path_factory.mktemp("tiny-qwen3")
    pair.hf.save_pretrained(out)
    return pair, out


def test_load_hf_folder(tiny_folder: tuple[Pair, Path]) -> None:
    pair, folder = tiny_folder
    model, hf_config, model_dir, model_report = load_model(ModelConfig(model=str(folder)), "cpu")
    assert (model_dir, hf_config["head_dim"], type(model).__name__) == (folder, 32, "Qwen3ForCausalLM")
    assert model_report.converted is False and model_report.weights_s > 0
    tokens = prompt(9, 9)
    (logits,) = paged_step(Pair(pair.hf, model, 2, 32), new_caches(pair), [(tokens, 0, [2, 0, 1])])
    torch.testing.assert_close(logits, hf_logits(pair, tokens), atol=ATOL, rtol=0)


def test_load_bfloat16(tiny_folder: tuple[Pair, Path]) -> None:
    _, folder = tiny_folder
    model, _, _, model_report = load_model(ModelConfig(model=str(folder), dtype="bfloat16"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sliding_window_longer_than_context_is_refused(tmp_path: Path) -> None:
    config = transformers.MistralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=32,
        max_position_embeddings=128,
    )
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="set max_model_len <= 32 \\(the window\\), got 128"):
        load_model(ModelConfig(model=str(tmp_path)), "cpu")
    model, _, _, model_report = load_model(ModelConfig(model=str(tmp_path), max_model_len=32), "cpu")
    assert model.config.sliding_window == 32


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf(tmp_path: Path, hf_model) -> None:
    """Convert the real Q4_1 GGUF (first load) then load the safetensors cache (second load); logits of a
    chat-templated prompt match transformers' own GGUF loader (the session's ``hf_model``) within 1e-3, same
    argmax everywhere."""
    from kvscope.common.models.pull import pull

    gguf = pull("smollm2-135m", progress=False)  # no-op when the verified file is cached
    first, _, model_dir, first_report = load_model(ModelConfig(model=str(gguf)), "cpu", root=tmp_path)
    second, _, _, second_report = load_model(ModelConfig(model=str(gguf)), "cpu", root=tmp_path)
    assert (first_report.converted, second_report.converted) == (True, False)
    print(
        f"\nfirst load (convert) {first_report.total_s:.2f}s, "
        f"second load (safetensors) {second_report.total_s:.2f}s"
    )
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    gguf_tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert ids == list(
        gguf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>system\n … assistant\n
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    caches = [torch.zeros(2, 8, 16, 3, 64) for _ in range(30)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[4, 1, 6, 0, 2, 7][: -(-len(ids) // 16)]], 16)
    with torch.inference_mode(), set_forward_context(meta, caches, TorchAttentionBackend()):
        logits = second.compute_logits(second(torch.tensor(ids), torch.arange(len(ids))))
    print(f"max |Δlogit| {(logits - expected).abs().max().item():.2e} over {len(ids)} positions")
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    greedy = greedy_decode(second, caches, ids, logits[-1], steps=8)
    with torch.inference_mode():
        reference = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[
            0, len(ids) :
        ].tolist()
    print(f"greedy: {tok.decode(greedy)!r}")
    assert greedy == reference


def greedy_decode(
    model, caches: list[torch.Tensor], ids: list[int], last_logits: torch.Tensor, steps: int
) -> list[int]:
    """Paged single-token decode steps feeding the argmax (blocks as in the prefill above)."""
    tokens, out = list(ids), []
    blocks = [4, 1, 6, 0, 2, 7]
    for _ in range(steps):
        out.append(int(last_logits.argmax()))
        tokens.append(out[-1])
        meta = AttentionMetadata.build([1], [len(tokens)], [blocks[: -(-len(tokens) // 16)]], 16)
        with torch.inference_mode(), set_forward_context(meta, caches, TorchAttentionBackend()):
            last_logits = model.compute_logits(
                model(torch.tensor(out[-1:]), torch.tensor([len(tokens) - 1]))
            )[0]
    return out
