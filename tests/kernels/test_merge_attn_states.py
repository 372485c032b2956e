"""merge_attn_states combines split-KV partial states exactly like one softmax over all keys."""

from __future__ import annotations

import torch

from kvscope.kernels.merge_attn_states import merge_attn_states, merge_attn_states_ref
from tests.kernels.devices import DEVICE

LOG2E = 1.4426950408889634


def _partials(scores: torch.Tensor, values: torch.Tensor, num_segments: int):
    """Split keys into ``num_segments`` runs (the last ones empty) and build (acc, m, l) in log2 units."""
    tokens, heads, keys = scores.shape
    bounds = torch.linspace(0, keys, num_segments // 2 + 1).long().tolist() + [keys] * (num_segments // 2)
    acc = torch.zeros(tokens, heads, num_segments, values.shape[-1])
    m = torch.full((tokens, heads, num_segments), float("-inf"))
    lse = torch.zeros(tokens, heads, num_segments)
    for s in range(num_segments):
        lo, hi = bounds[s], bounds[s + 1]
        if lo == hi:
            continue
        part = scores[..., lo:hi] * LOG2E
        m[..., s] = part.amax(-1)
        p = torch.exp2(part - m[..., s, None])
        lse[..., s] = p.sum(-1)
        acc[..., s, :] = torch.einsum("thk,kd->thd", p, values[lo:hi])
    return acc, m, lse


def test_merge_equals_full_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 50, generator=gen) * 3
    values = torch.randn(50, 64, generator=gen)
    expected = torch.einsum("thk,kd->thd", scores.softmax(-1), values)
    acc, m, lse = _partials(scores, values, num_segments=8)
    assert (m == float("-inf")).any()  # some segments are empty and must weigh 0

    torch.testing.assert_close(merge_attn_states_ref(acc, m, lse), expected, atol=1e-5, rtol=1e-5)
    out = torch.empty(3, 4, 64, device=DEVICE)
    merged = merge_attn_states(out, acc.to(DEVICE), m.to(DEVICE), lse.to(DEVICE))
    assert merged is out
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
