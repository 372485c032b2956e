"""The fused CPU decode step (engine/platform/fused_decode.py on kernels/cpu_decode.py): when the model runner
uses it, that its tokens are the served model's (teacher-forced decode perplexity within the int4 bound of
float32), that the K/V it writes is what the eager decoder writes, and the fallbacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvscope.engine.platform.loader as loader
from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.forward_context import set_forward_context
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.config import ModelConfig
from kvscope.engine.eval.decode_path import decode_path_nll, perplexity
from kvscope.engine.eval.text import load_text
from kvscope.engine.llm import LLM
from kvscope.engine.platform import fused_decode
from kvscope.engine.platform.fused_decode import FusedDecoder, fused_row_limit
from kvscope.engine.platform.kernel_probe import KernelChoice
from kvscope.engine.platform.loader import load_model
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.text.tokenizer import Tokenizer
from kvscope.engine.worker.kv_cache import allocate_kv_caches
from kvscope.kernels.cpu_decode import PairBlocks, VnniBlocks

pytestmark = pytest.mark.cpu_kernels

FOUR_ROWS = KernelChoice(dense_dtype=torch.bfloat16, max_rows={"int4": 4, "int8": 2})
"""A probe result with the compact crossover at 4 rows (the probe's own varies with the machine's load)."""
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _fixed_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: FOUR_ROWS)


@pytest.fixture(scope="module")
def compact_llm():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "probe_cpu_kernels", lambda: FOUR_ROWS)
        return LLM(
            "smollm2-135m", dtype="bfloat16", quantization="gguf", kv_cache_memory=64 << 20, num_threads=2
        )


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every fused step call (patched on the class: the runner's instance is frozen)."""
    calls: list[int] = []
    inner = FusedDecoder.__call__

    def counted(self, input_ids, *args):
        calls.append(input_ids.shape[0])
        return inner(self, input_ids, *args)

    monkeypatch.setattr(FusedDecoder, "__call__", counted)
    return calls


def three_row_step(model: torch.nn.Module, prompts: list[list[int]]):
    """Three 5-token prompts: their first 4 tokens prefilled by the eager model into a fresh bfloat16 cache,
    then a function that runs one decode step of their 5th tokens through a fused decoder on its own copy of
    that cache and returns its logits."""
    c = model.config
    kv = allocate_kv_caches(
        c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.bfloat16, torch.device("cpu")
    )
    tables = [[0], [1], [2]]
    with torch.inference_mode():
        prefill = AttentionMetadata.build([4, 4, 4], [4, 4, 4], tables, 16)
        with set_forward_context(prefill, kv, TorchAttentionBackend()):
            model(torch.tensor([t for p in prompts for t in p[:4]]), torch.arange(4).repeat(3))
    step = AttentionMetadata.build([1, 1, 1], [5, 5, 5], tables, 16)
    last, pos = torch.tensor([p[4] for p in prompts]), torch.tensor([4, 4, 4])

    def run(decoder: FusedDecoder) -> torch.Tensor:
        with torch.inference_mode():
            return decoder(last, pos, step, [t.clone() for t in kv])

    return run


@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_the_fused_step_runs_the_tiles_the_probe_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe choice with tiles from 2 rows reaches every layer and the fused step; its logits at 3 rows are
    the GEMV's within the activation codes' rounding."""
    tiles = KernelChoice(
        dense_dtype=torch.bfloat16, max_rows={"int4": 8, "int8": 2}, tile_rows=2, tile="float32"
    )
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: tiles)
    monkeypatch.setattr(fused_decode, "FUSED_PROBE_ROWS", ())  # the probe's limit, untimed
    llm = LLM("smollm2-135m", dtype="bfloat16", quantization="gguf", kv_cache_memory=32 << 20, num_threads=2)
    fused = llm.engine.runner.fused
    assert (fused.max_rows, fused.tile_rows, fused.tile) == (8, 2, "float32")
    assert llm.engine.info.cpu_kernels == (
        "kvscope (fused decode up to 8 rows; decode rows: gemv 1, tiles_float32 2-8, dense_bfloat16 9+)"
    )
    layer = llm.engine.model.model.layers[0]
    assert (layer.mlp.down_proj.cpu_kernel.tile_rows, layer.mlp.down_proj.cpu_kernel.tile) == (2, "float32")
    calls = count_calls(monkeypatch)
    assert [len(o.outputs[0].token_ids) for o in llm.generate(["The capital of France is"] * 3, GREEDY)] == [
        12
    ] * 3
    assert calls == [3] * 11
    model = llm.engine.model
    prompts = [
        Tokenizer.from_dir(llm.engine.info.model_dir).hf.encode(text).ids[:5]
        for text in ("The quick brown fox jumps", "Once upon a time there", "In a hole in the ground")
    ]
    step = three_row_step(model, prompts)
    on_tiles, on_gemv = step(fused), step(dataclasses.replace(fused, tile_rows=0))
    # the tiles multiply float32 activations, the GEMV their 16-bit codes (~1e-5): the logits agree closely
    assert ((on_tiles - on_gemv).norm() / on_gemv.norm()).item() < 1e-3
    assert torch.equal(on_tiles.argmax(-1), on_gemv.argmax(-1))


@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_the_int16_tiles_run_on_vnni_blocks_in_the_step_and_in_eager_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe choice of int16 tiles from 2 rows: every layer and the Q8 head get their VNNI blocks (counted
    in the weights' bytes), the fused step runs them from 2 rows with logits the GEMV's up to float32 rounding
    (the same 16-bit codes, exact integer sums), the layers run them from 2 rows up to the probe's crossover
    (not the fused step's raised limit: a short prompt's prefill takes the same kernel alone and in a batch),
    and the C++ step refuses int16 tiles without them."""
    tiles = KernelChoice(
        dense_dtype=torch.bfloat16, max_rows={"int4": 4, "int8": 2}, tile_rows=2, tile="int16"
    )
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: tiles)
    monkeypatch.setattr(fused_decode, "fused_row_limit", lambda model, fused, rows: 16)
    llm = LLM("smollm2-135m", dtype="bfloat16", quantization="gguf", kv_cache_memory=32 << 20, num_threads=2)
    model, fused = llm.engine.model, llm.engine.runner.fused
    assert (fused.max_rows, fused.tile_rows, fused.tile, len(fused.vnni)) == (16, 2, "int16", 121)
    assert fused.vnni[-1] is model.decode_head_vnni and model.decode_head_vnni.bits == 8
    assert llm.engine.info.cpu_kernels == (
        "kvscope (fused decode up to 16 rows; decode rows: gemv 1, tiles_int16 2-16, dense_bfloat16 17+)"
    )
    down = model.model.layers[0].mlp.down_proj.cpu_kernel
    assert down.vnni is not None and down.max_compact_rows == 4
    assert down.nbytes == down.compact.nbytes + down.dense.nbytes + down.vnni.nbytes
    x = torch.randn(5, down.compact.scales.shape[1] * 64)
    assert torch.equal(down(x[:4]), down.vnni.matmul(x[:4]))
    assert torch.equal(down(x[:1]), down.compact.matmul(x[:1]))
    assert torch.equal(down(x), down.dense(x.bfloat16()).float())  # above the crossover: the dense copy
    calls = count_calls(monkeypatch)
    outs = llm.generate(["The capital of France is"] * 3, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 3 and calls == [3] * 11
    step = three_row_step(model, [[11, 12, 13, 14, last] for last in (100, 200, 300)])
    on_tiles, on_gemv = step(fused), step(dataclasses.replace(fused, tile_rows=0))
    # ~3e-7 per matmul (the order of float32 sums over blocks), grown through 30 layers
    assert ((on_tiles - on_gemv).norm() / on_gemv.norm()).item() < 5e-4
    assert torch.equal(on_tiles.argmax(-1), on_gemv.argmax(-1))
    with pytest.raises(RuntimeError, match="int16 tiles need 4 VNNI blocks per layer"):
        step(dataclasses.replace(fused, vnni=fused.vnni[:-1]))


@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_int16_tiles_from_more_rows_than_the_fused_probe_starts_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU where the int16 tiles win only from 16 rows: the fused limit's timing at 8 rows runs the GEMV
    (qgemv has no int16 tiles), and the engine starts with the tiles from 16 rows in its step (break-it pass:
    it failed to start)."""
    tiles = KernelChoice(
        dense_dtype=torch.bfloat16, max_rows={"int4": 4, "int8": 2}, tile_rows=16, tile="int16"
    )
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: tiles)
    monkeypatch.setattr(fused_decode, "FUSED_PROBE_ROWS", (8, 16))
    llm = LLM("smollm2-135m", dtype="float32", quantization="gguf", kv_cache_memory=32 << 20, num_threads=2)
    fused = llm.engine.runner.fused
    assert fused.tile_rows == 16 and fused.tile == "int16" and fused.max_rows in (4, 8, 16)
    assert len(llm.generate(["The capital of France is"], GREEDY)[0].outputs[0].token_ids) == 12


def test_a_short_prompt_gets_the_same_tokens_alone_and_in_a_batch_on_int16_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serving case K2 on the int16 tiles: prompts of ~11 tokens (above the probe's crossover) prefilled alone
    and 8 at once take the same kernel, so float32 greedy tokens match (break-it pass: with the layers' limit
    raised to the fused step's, request 3's first token flipped)."""
    tiles = KernelChoice(
        dense_dtype=torch.bfloat16, max_rows={"int4": 4, "int8": 2}, tile_rows=1, tile="int16"
    )
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: tiles)
    monkeypatch.setattr(fused_decode, "fused_row_limit", lambda model, fused, rows: 64)
    llm = LLM("smollm2-135m", dtype="float32", quantization="gguf", kv_cache_memory=64 << 20, num_threads=2)
    prompts = [f"Request {i}: list the numbers from 1 upward:" for i in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_decode_steps_up_to_the_crossover_run_fused(compact_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = compact_llm.engine.runner.fused
    assert fused is not None and fused.max_rows == 4 and len(fused.codes) == 120 and fused.head.bits == 8
    calls = count_calls(monkeypatch)
    outs = compact_llm.generate(["The capital of France is"] * 3, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 3
    # one prefill step of the 3 prompts (eager), then 11 decode steps of 3 rows each (fused)
    assert calls == [3] * 11
    calls.clear()
    compact_llm.generate(["Once upon a time"] * 5, GREEDY)  # 5 rows > the crossover: every step eager
    assert calls == []


def test_prompt_logprobs_keep_the_eager_decoder(compact_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch)
    out = compact_llm.generate(
        ["def add(a, b):"], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    )
    assert len(out[0].outputs[0].token_ids) == 4 and calls == []


@pytest.mark.parametrize("tile", ["", "int16"])
def test_speculative_verification_runs_fused_with_the_tokens_of_plain_decoding(
    monkeypatch: pytest.MonkeyPatch, tile: str
) -> None:
    """A verification step (each request its token and its drafts, 1 + k rows) runs the fused step, one row
    per token attending to the context up to its own position; in float32 the greedy tokens are those of
    plain decoding (a row's logits do not depend on the rows beside it: the GEMV's and the int16 tiles' sums
    are per row), for two requests at once and on the GEMV or the int16 tiles at every row."""
    choice = dataclasses.replace(FOUR_ROWS, max_rows={"int4": 8, "int8": 2})  # 2 requests x (1 + 3 drafts)
    if tile:
        choice = dataclasses.replace(choice, tile_rows=1, tile=tile)
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: choice)
    monkeypatch.setattr(fused_decode, "FUSED_PROBE_ROWS", ())  # the probe's limit, untimed
    common = dict(model="smollm2-135m", dtype="float32", quantization="gguf", kv_cache_memory=32 << 20)
    prompts = ["a b c d e f a b c d e f a b c d e f", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, params)]
    spec = LLM(**common, speculative="ngram", num_speculative_tokens=3)
    assert spec.engine.runner.fused is not None and spec.engine.runner.fused.tile == (tile or "float32")
    calls = count_calls(monkeypatch)
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert max(calls) > 2 and max(calls) <= spec.engine.runner.fused.max_rows  # drafts verified fused
    assert sum(o.outputs[0].stats.spec_accepted_tokens or 0 for o in outs) > 0


@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_one_row_logits_come_from_the_decode_head(compact_llm) -> None:
    """One row's logits (a lone prompt's first token) are the Q8_0 ``decode_head``'s, as in the fused step;
    two or more rows (batched prefills, prompt logprobs) keep the dense head."""
    model = compact_llm.engine.model
    hidden = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(
        torch.bfloat16
    )
    with torch.inference_mode():
        one = model.compute_logits(hidden[1:])
        two = model.compute_logits(hidden)
        assert torch.equal(one, model.decode_head.matmul(hidden[1:]))
        assert torch.equal(two, model.logits_kernel(hidden).float())
    assert not torch.equal(one[0], two[1])  # two different heads (8-bit vs bfloat16 weights)
    torch.testing.assert_close(one[0], two[1], rtol=0, atol=0.1)


def test_torch_kernels_and_other_formats_have_no_fused_step() -> None:
    torch_kernels = LLM(
        "smollm2-135m", dtype="bfloat16", quantization="gguf", kv_cache_memory=16 << 20, cpu_kernels="torch"
    )
    assert torch_kernels.engine.runner.fused is None
    assert torch_kernels.engine.load_report.cpu_kernels is None
    int8 = LLM("smollm2-135m", dtype="bfloat16", quantization="int8", kv_cache_memory=16 << 20)
    assert int8.engine.runner.fused is None  # torch's int8 layers: not the pair-block layout
    # which kernel serves which rows: none named for torch's compact kernels, the dtype for dense weights
    assert torch_kernels.engine.info.row_kernels == int8.engine.info.row_kernels == ()
    dense = LLM("smollm2-135m", dtype="bfloat16", quantization="none", kv_cache_memory=16 << 20)
    assert dense.engine.info.row_kernels == (("dense_bfloat16", 1, 1 << 62),)


def test_fused_step_writes_the_kv_the_eager_decoder_writes(compact_llm) -> None:
    model = compact_llm.engine.model
    fused = compact_llm.engine.runner.fused
    c = model.config
    tokens = Tokenizer.from_dir(compact_llm.engine.info.model_dir).hf.encode("The quick brown fox jumps").ids
    caches = [
        allocate_kv_caches(
            c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.bfloat16, torch.device("cpu")
        )
        for _ in range(2)
    ]
    backend = TorchAttentionBackend()
    table = [3, 1, 2, 0]  # blocks out of order: attention must follow the table
    with torch.inference_mode():
        prefill = AttentionMetadata.build([len(tokens) - 1], [len(tokens) - 1], [table], 16)
        for kv in caches:
            with set_forward_context(prefill, kv, backend):
                model(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1))
        step = AttentionMetadata.build([1], [len(tokens)], [table], 16)
        last, pos = torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1])
        with set_forward_context(step, caches[0], backend):
            eager = model.compute_logits(model(last, pos))
        logits = fused(last, pos, step, caches[1])
    slot = step.slot_mapping.item()
    for eager_kv, fused_kv in zip(caches[0], caches[1], strict=True):
        a, b = (
            eager_kv.view(2, -1, c.num_key_value_heads, c.head_dim)[:, slot].float(),
            fused_kv.view(2, -1, c.num_key_value_heads, c.head_dim)[:, slot].float(),
        )
        # eager rounds q/k/v to bfloat16 after every op, fused keeps float32 and int8 activations in the GEMV
        assert (a - b).abs().max() <= 0.05 * a.abs().max()  # measured 2.6-3.2 % at the worst layer
        assert torch.equal(
            eager_kv.view(2, -1, c.num_key_value_heads, c.head_dim)[:, :slot],
            fused_kv.view(2, -1, c.num_key_value_heads, c.head_dim)[:, :slot],
        )  # nothing else moved
    assert logits.shape == (1, c.vocab_size) and logits.dtype == torch.float32
    # both are a few % (relative L2) from float32 logits of the same weights, in different directions
    # (measured on three prompts with the int8 codes: fused 0.8-6.7 %, eager 1.1-5.8 %, 5-11 % from each
    # other); a wrong kernel is ~100 % off
    assert ((logits - eager).norm() / eager.norm()).item() < 0.2
    assert len(set(logits[0].topk(5).indices.tolist()) & set(eager[0].topk(5).indices.tolist())) >= 3


@pytest.mark.parametrize("tile", ["", "float32", pytest.param("bfloat16", marks=pytest.mark.bf16), "int16"])
def test_decode_path_perplexity_stays_near_float32(compact_llm, model_dir, tile: str) -> None:
    """Three 256-token windows of the shipped eval text, teacher-forced through the fused step, against
    float32's prefill perplexity of the same tokens (the same GGUF weights, dequantized): on the GEMV, and on
    the small-batch matmul's tiles at every row (``tile``; int16: the GEMV's codes on the VNNI blocks).
    Measured with the 16-bit activation codes: +0.04 / −0.03 / +0.11 % (int8 codes were +0.78 / +0.55 / +0.69
    %: the bound catches them); a broken kernel is tens of percent off."""
    text = Tokenizer.from_dir(model_dir).hf.encode(load_text().text).ids
    reference, _, _, _ = load_model(ModelConfig(), "cpu")
    model, fused = compact_llm.engine.model, compact_llm.engine.runner.fused
    if tile:
        vnni = ()
        if tile == "int16":  # the transposed copies the loader makes where the probe picks them
            weights = [PairBlocks(c, s) for c, s in zip(fused.codes, fused.scales, strict=True)]
            vnni = tuple(VnniBlocks.from_pair_blocks(w) for w in [*weights, fused.head])
        fused = dataclasses.replace(fused, tile_rows=1, tile=tile, vnni=vnni)
    ratios = []
    for start in (0, 2000, 5000):
        tokens = text[start : start + 256]
        with torch.inference_mode():
            everything = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(16))], 16)
            c = reference.config
            kv = allocate_kv_caches(
                c.num_hidden_layers,
                16,
                16,
                c.num_key_value_heads,
                c.head_dim,
                torch.float32,
                torch.device("cpu"),
            )
            with set_forward_context(everything, kv, TorchAttentionBackend()):
                logits = reference.compute_logits(reference(torch.tensor(tokens), torch.arange(len(tokens))))
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        exact = [-logprobs[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)]
        if start == 0:  # the scorer itself: float32 decode steps = float32 prefill
            float32_decode = perplexity(decode_path_nll(reference, tokens[:40], torch.float32))
            assert abs(float32_decode - perplexity(exact[:39])) < 1e-3
        ratios.append(perplexity(decode_path_nll(model, tokens, torch.bfloat16, fused)) / perplexity(exact))
    assert 0.995 < sum(ratios) / len(ratios) < 1.005, ratios


def test_a_float32_tied_embedding_runs_fused_from_its_column_major_view() -> None:
    """float32 activations with gguf weights (the start-up probe's pick on AVX-512 CPUs without AMX): the tied
    embedding is the LM head's column-major copy (prepare_for_cpu), and the fused step gathers its rows
    through the strides, bit for bit as from a contiguous copy."""
    import dataclasses

    llm = LLM("smollm2-135m", dtype="float32", quantization="gguf", kv_cache_memory=16 << 20, num_threads=2)
    fused = llm.engine.runner.fused
    assert fused is not None and fused.embed.dtype == torch.float32
    assert fused.embed.stride() == (1, fused.embed.shape[0])  # column-major: no row-major copy kept
    c = llm.engine.model.config
    kv_dtype = llm.engine.runner.kv_caches[0].dtype
    caches = [
        allocate_kv_caches(
            c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, kv_dtype, torch.device("cpu")
        )
        for _ in range(2)
    ]
    ids, pos = torch.tensor([17, 40000]), torch.tensor([0, 0])
    step = AttentionMetadata.build([1, 1], [1, 1], [[0], [1]], 16)
    with torch.inference_mode():
        strided = fused(ids, pos, step, caches[0])
        contiguous = dataclasses.replace(fused, embed=fused.embed.contiguous())(ids, pos, step, caches[1])
    assert torch.equal(strided, contiguous)
    assert llm.engine.info.cpu_kernels.startswith("kvscope (fused decode up to")


@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_the_fused_limit_rises_to_where_its_matmuls_stay_faster(compact_llm) -> None:
    """fused_row_limit times each size above the probe's crossover on the model's weights, fused then eager,
    and stops at the first size where the fused matmuls are slower (a scripted clock: seconds per call)."""
    fused = dataclasses.replace(compact_llm.engine.runner.fused, tile_rows=2)
    model = compact_llm.engine.model

    def clock_of(durations: list[float]):
        ticks = iter(t for d in durations for t in (0.0, d))
        return lambda: next(ticks)

    # per size: fused warm-up untimed, 2 timed fused calls, eager warm-up, 2 timed eager calls
    assert fused_row_limit(model, fused, (4, 8, 16, 32), clock=clock_of([1, 1, 2, 2, 3, 3, 2, 2])) == 8
    assert fused_row_limit(model, fused, (8,), clock=clock_of([2, 2, 1, 1])) == 4  # slower at once: unchanged
    assert fused_row_limit(model, fused, (2, 4)) == 4  # nothing above the probe's limit: nothing timed
