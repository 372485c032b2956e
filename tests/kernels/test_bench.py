"""kvscope.kernels.bench: its byte/FLOP accounting, its PyTorch baselines, and its refusal without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.bench import SHAPES, attention_runner, gather_dense, main, make_workload
from kvscope.kernels.paged_attention import paged_attention_ref
from tests.kernels.devices import DEVICE


def test_bytes_and_flops_of_a_workload() -> None:
    w = make_workload(SHAPES["smollm2-135m"], num_reqs=2, q_len=3, seq_len=5, device=DEVICE)
    # Q read + O write (2 * 6 tokens * 9 heads * 64) + K and V of 2 * 5 tokens * 3 kv heads * 64, bf16
    assert w.bytes_moved == 2 * (2 * 6 * 9 * 64) + 2 * (2 * 2 * 5 * 3 * 64)
    # queries at positions 2, 3, 4 see 3 + 4 + 5 keys, per request; 4 FLOPs per (query, key, head, dim)
    assert w.flops == 4 * 9 * 64 * 2 * (3 + 4 + 5)


def test_gather_dense_reads_the_block_table_in_order() -> None:
    w = make_workload(SHAPES["smollm2-135m"], num_reqs=2, q_len=1, seq_len=20, device=DEVICE)
    k, v = gather_dense(w)
    assert k.shape == (2, 3, 20, 64)
    block = int(w.block_tables[1, 1])
    assert torch.equal(k[1, :, 16 + 3], w.kv_cache[0, block, 3]) and torch.equal(
        v[1, :, 5], w.kv_cache[1, w.block_tables[1, 0], 5]
    )


@pytest.mark.parametrize("provider", ["triton", "sdpa", "gather+sdpa"])
def test_providers_compute_the_same_attention(provider: str) -> None:
    w = make_workload(SHAPES["smollm2-135m"], num_reqs=1, q_len=12, seq_len=40, device=DEVICE)
    expected = paged_attention_ref(w.query, w.kv_cache, w.query_start_loc, w.seq_lens, w.block_tables, 0.125)
    out = attention_runner(w, provider)()
    if provider != "triton":  # SDPA layout [num_reqs, heads, q_len, head_dim] -> packed tokens
        out = out.transpose(1, 2).flatten(0, 1)
    torch.testing.assert_close(out.float(), expected.float(), atol=1.6e-2, rtol=1.6e-2)


def test_refuses_without_cuda(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    assert main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
