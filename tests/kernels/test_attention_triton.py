"""TritonAttentionBackend gives the torch reference backend's results over two scheduler steps."""

from __future__ import annotations

import torch

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.attention.triton_backend import TritonAttentionBackend
from tests.kernels.devices import DEVICE

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M attention
BLOCKS = {"a": [6, 2], "b": [4, 9], "c": [1]}  # shuffled ids; block 0 only as table padding
STEPS = [
    # (request, query_len, seq_len): step 1 prefills a (20) and b's first chunk (10 of 30);
    # step 2 decodes a, finishes b's prompt after its 10 cached tokens, prefills c.
    [("a", 20, 20), ("b", 10, 10)],
    [("a", 1, 21), ("b", 20, 30), ("c", 5, 5)],
]


def _step_inputs(step: list, gen: torch.Generator):
    meta = AttentionMetadata.build(
        [q for _, q, _ in step], [s for _, _, s in step], [BLOCKS[r] for r, _, _ in step], BLOCK_SIZE, DEVICE
    )
    num_tokens = meta.num_tokens
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    key, value = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    return meta, query, key, value


def test_triton_backend_matches_torch_backend_over_steps() -> None:
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert triton_backend.name == "triton"
    caches = [torch.zeros(2, 10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for step in STEPS:
        meta, query, key, value = _step_inputs(step, gen)
        outs = []
        for backend, cache in zip((triton_backend, torch_backend), caches, strict=True):
            backend.write_kv(key, value, cache, meta.slot_mapping)
            outs.append(backend.forward(query, cache, meta, HEAD_DIM**-0.5))
        assert torch.equal(caches[0], caches[1])
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_forced_split_kv_matches_torch_backend() -> None:
    meta, query, key, value = _step_inputs([("a", 1, 21), ("b", 1, 30)], torch.Generator().manual_seed(1))
    cache = torch.randn(2, 10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(DEVICE)
    split = TritonAttentionBackend(num_segments=4)
    split.write_kv(key, value, cache, meta.slot_mapping)
    expected = TorchAttentionBackend().forward(query, cache, meta, 0.125)
    torch.testing.assert_close(split.forward(query, cache, meta, 0.125), expected, atol=1e-5, rtol=1e-5)
