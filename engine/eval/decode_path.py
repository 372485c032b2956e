"""Teacher-forced perplexity through the engine's decode path: the quality guard of the fused CPU decode step.

``kvscope eval ppl`` scores text through ``prompt_logprobs``, i.e. prefill: many rows per matmul, so the
compact layers run their dense copies and the decode kernels (kernels/cpu_decode.py,
engine/platform/fused_decode.py: int4 GEMVs with int8 activations, a Q8_0 LM head, attention read from the
paged cache) are never exercised. Here each token of the text is fed as a one-token decode step over the paged
KV cache of the tokens before it, and the log-probability of the next token is read from that step's logits:
the numbers a served request's tokens are sampled from. The NLL is summed in float64; perplexity = exp(mean
NLL) over ``len(tokens) - 1`` tokens, comparable with the prefill perplexity of the same tokens in one window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.forward_context import set_forward_context
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.worker.kv_cache import allocate_kv_caches
from kvscope.engine.worker.model_runner import DecodeStep

BLOCK_SIZE = 16


@torch.inference_mode()
def decode_path_nll(
    model: torch.nn.Module, tokens: Sequence[int], dtype: torch.dtype, fused: DecodeStep | None = None
) -> list[float]:
    """NLL (nats) of ``tokens[i + 1]`` after decode steps over ``tokens[: i + 1]``, for i = 0 … n − 2.

    ``model``: a loaded CPU model (``kvscope.engine.platform.cpu.prepare_for_cpu`` done); ``dtype``: its
    KV-cache dtype; ``fused``: the fused decode step to use (None: the eager decoder with the torch attention
    backend). Raises ValueError for fewer than 2 tokens."""
    if len(tokens) < 2:
        raise ValueError("need at least 2 tokens to score")
    c = model.config
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    caches = allocate_kv_caches(
        c.num_hidden_layers,
        num_blocks,
        BLOCK_SIZE,
        c.num_key_value_heads,
        c.head_dim,
        dtype,
        torch.device("cpu"),
    )
    backend = TorchAttentionBackend()
    table = list(range(num_blocks))
    nll = []
    for t in range(len(tokens) - 1):
        metadata = AttentionMetadata.build([1], [t + 1], [table], BLOCK_SIZE)
        ids, positions = torch.tensor([tokens[t]]), torch.tensor([t])
        if fused is not None and fused.applies(metadata, caches):
            logits = fused(ids, positions, metadata, caches)
        else:
            with set_forward_context(metadata, caches, backend):
                logits = model.compute_logits(model(ids, positions))
        nll.append(-torch.log_softmax(logits[0].double(), dim=-1)[tokens[t + 1]].item())
    return nll


def perplexity(nll: Sequence[float]) -> float:
    """exp(mean NLL)."""
    return math.exp(math.fsum(nll) / len(nll))
