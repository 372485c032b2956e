"""Launchers reject bad arguments before launching, with TypeError (dtype) or ValueError and a clear
message."""

from __future__ import annotations

import re

import pytest
import torch

from kvscope.kernels._checks import check_launchable
from kvscope.kernels.merge_attn_states import merge_attn_states
from kvscope.kernels.paged_attention import paged_attention
from kvscope.kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.devices import DEVICE


def _attention_args(**overrides) -> dict:
    """A valid 2-request call (3 + 1 tokens, 6 heads over 2 KV heads, head_dim 64) with ``overrides``."""
    i32 = {"dtype": torch.int32, "device": DEVICE}
    args = {
        "query": torch.zeros(4, 6, 64, device=DEVICE),
        "kv_cache": torch.zeros(2, 4, 16, 2, 64, device=DEVICE),
        "query_start_loc": torch.tensor([0, 3, 4], **i32),
        "seq_lens": torch.tensor([3, 9], **i32),
        "block_tables": torch.tensor([[1], [2]], **i32),
        "scale": 0.125,
    }
    return args | overrides


ATTENTION_ERRORS = [
    (
        {"query": torch.zeros(4, 6, 64, dtype=torch.int32, device=DEVICE)},
        TypeError,
        "query must be float16, bfloat16 or float32",
    ),
    (
        {"kv_cache": torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16, device=DEVICE)},
        TypeError,
        "dtypes must all be equal",
    ),
    (
        {"seq_lens": torch.tensor([3, 9], device=DEVICE)},
        TypeError,
        "seq_lens must be torch.int32, got torch.int64",
    ),
    (
        {"query_start_loc": torch.tensor([0.0, 3.0, 4.0], device=DEVICE)},
        TypeError,
        "query_start_loc must be torch.int32",
    ),
    (
        {"block_tables": torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)},
        ValueError,
        "block_tables must have 2 dimension",
    ),
    (
        {"query": torch.zeros(4, 5, 64, device=DEVICE)},
        ValueError,
        r"num_heads \(5\) must be a multiple of num_kv_heads \(2\)",
    ),
    (
        {
            "query": torch.zeros(4, 6, 48, device=DEVICE),
            "kv_cache": torch.zeros(2, 4, 16, 2, 48, device=DEVICE),
        },
        ValueError,
        "power of two",
    ),
    (
        {
            "query": torch.zeros(4, 6, 8, device=DEVICE),
            "kv_cache": torch.zeros(2, 4, 16, 2, 8, device=DEVICE),
        },
        ValueError,
        "head_dim must be",
    ),
    ({"kv_cache": torch.zeros(4, 16, 2, 64, device=DEVICE)}, ValueError, "kv_cache must be"),
    ({"kv_cache": torch.zeros(2, 4, 16, 2, 128, device=DEVICE)}, ValueError, "kv_cache must be"),
    (
        {"query": torch.zeros(4, 64, 6, device=DEVICE).transpose(1, 2)},
        ValueError,
        "query must be contiguous in its last dim",
    ),
    ({"seq_lens": torch.tensor([3, 9, 1], dtype=torch.int32, device=DEVICE)}, ValueError, "for 3 requests"),
    ({"seq_lens": torch.tensor([3, 9], dtype=torch.int32, device="meta")}, ValueError, "one device"),
    (
        {"seq_lens": torch.tensor([3, 0, 9, 0], dtype=torch.int32, device=DEVICE)[::2]},
        ValueError,
        "seq_lens must be contiguous",
    ),
    ({"scale": float("nan")}, ValueError, "scale must be finite and positive"),
    ({"scale": torch.tensor(0.125, device=DEVICE)}, TypeError, "scale must be a Python float"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), ATTENTION_ERRORS)
def test_paged_attention_rejects(overrides: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        paged_attention(**_attention_args(**overrides))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_segments": 3}, "num_segments must be a power of two in"),
    ({"num_segments": 32}, "num_segments must be a power of two in"),
    ({"out": torch.zeros(4, 6, 32, device=DEVICE)}, "out must have the query's shape"),
])  # fmt: skip
def test_paged_attention_rejects_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention(**_attention_args(), **kwargs)


def _cache_args(**overrides) -> dict:
    args = {
        "key": torch.zeros(3, 2, 64, device=DEVICE),
        "value": torch.zeros(3, 2, 64, device=DEVICE),
        "kv_cache": torch.zeros(2, 4, 16, 2, 64, device=DEVICE),
        "slot_mapping": torch.tensor([0, 1, 2], device=DEVICE),
    }
    return args | overrides


@pytest.mark.parametrize(("overrides", "error", "message"), [
    ({"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)}, TypeError,
     "slot_mapping must be torch.int64"),
    ({"value": torch.zeros(3, 2, 64, dtype=torch.bfloat16, device=DEVICE)}, TypeError,
     "dtypes must all be equal"),
    ({"slot_mapping": torch.tensor([0, 1], device=DEVICE)}, ValueError,
     "slot_mapping has 2 entries for 3 tokens"),
    ({"value": torch.zeros(3, 2, 32, device=DEVICE)}, ValueError, "key and value must both be"),
    ({"kv_cache": torch.zeros(2, 4, 16, 3, 64, device=DEVICE)}, ValueError, "kv_cache must be"),
    ({"key": torch.zeros(3, 64, 2, device=DEVICE).transpose(1, 2)}, ValueError,
     "key must be contiguous in its last dim"),
    ({"slot_mapping": torch.tensor([0, 1, 2], device="meta")}, ValueError, "one device"),
])  # fmt: skip
def test_reshape_and_cache_rejects(overrides: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        reshape_and_cache(**_cache_args(**overrides))


def test_merge_attn_states_rejects() -> None:
    out = torch.zeros(2, 3, 64, device=DEVICE)
    acc, m = torch.zeros(2, 3, 4, 64, device=DEVICE), torch.zeros(2, 3, 4, device=DEVICE)
    with pytest.raises(TypeError, match="part_m must be float32"):
        merge_attn_states(out, acc, m.half(), m)
    with pytest.raises(ValueError, match="num_segments must be a power of two"):
        merge_attn_states(out, acc[:, :, :3].contiguous(), m[:, :, :3].contiguous(), m[:, :, :3].contiguous())
    with pytest.raises(ValueError, match="part_m and part_l must be"):
        merge_attn_states(out, acc, m[:, :, :2].contiguous(), m)


def test_compiled_kernels_refuse_cpu_tensors() -> None:
    """Without the interpreter a kernel only takes CUDA tensors; the message says how to run on CPU."""
    not_interpreted = object()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_launchable(not_interpreted, torch.device("cpu"))
    check_launchable(not_interpreted, torch.device("cuda"))  # accepted: compiled kernels run on CUDA
