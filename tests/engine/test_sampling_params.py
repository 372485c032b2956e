"""SamplingParams validation: every invalid value raises InvalidParameterError naming its OpenAI param."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["a", ""]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_invalid_values_name_their_param(kwargs, param):
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


@pytest.mark.parametrize("seed", [-(2**63), 0, 2**64 - 1])
def test_seed_range_is_what_torch_accepts(seed):
    assert SamplingParams(seed=seed).seed == seed
    torch.Generator().manual_seed(seed)  # the bounds are exactly torch's


def test_stop_string_and_top_k_minus_one_are_normalised():
    params = SamplingParams(stop="O P Q", top_k=-1)
    assert params.stop == ("O P Q",) and params.top_k == 0
