"""engine/structured: the bitmask hook in the sampler, the compile cache, matcher sync, tool-call parsing."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.tools import ParsedCall, ToolMode, parse_tool_calls
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.structured.bitmask import allocate_bitmask, allowed_tokens
from kvscope.engine.structured.params import StructuredOutputsParams
from kvscope.engine.text.tokenizer import Tokenizer
from kvscope.engine.worker.sampler import Sampler, SamplingMetadata


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.hf.to_str, 49152, tokenizer.eos_token_id)


def test_sampler_masks_only_the_constrained_row() -> None:
    vocab = 40
    logits = torch.zeros(2, vocab)
    logits[:, 7] = 5.0  # the unconstrained favourite
    mask = allocate_bitmask(1, vocab)
    mask.zero_()
    mask[0, 1] = 1 << (33 - 32)  # only token 33 allowed
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=0)] * 2, [[1], [1]], [[], []], [None, None], [None, None], vocab
    )
    meta = type(meta)(
        **{
            **{f: getattr(meta, f) for f in meta.__slots__},
            "bitmask_rows": torch.tensor([1]),
            "token_bitmask": mask,
        }
    )
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [7, 33]
    assert allowed_tokens(mask, vocab)[0].nonzero().flatten().tolist() == [33]
    assert logits[1, 7] == 5.0  # the caller's logits are not modified


def test_compile_cache_and_unsupported_keyword(manager) -> None:
    schema = StructuredOutputsParams.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert manager.compile(schema) > 0
    assert manager.compile(schema) == 0.0
    with pytest.raises(InvalidParameterError) as caught:
        manager.compile(StructuredOutputsParams.json_schema({"type": "object", "if": {}}, "response_format"))
    assert caught.value.param == "response_format" and 'Unimplemented keys: ["if"]' in str(caught.value)


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
        ("json", json.dumps({"$ref": "#"})),
        (
            "json",
            json.dumps(
                {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
            ),
        ),
        ("regex", "[^\\s\\S]"),
        ("grammar", "start: a\na: a"),
    ],
)
def test_a_constraint_no_output_can_satisfy_is_a_400(manager, kind, spec) -> None:
    """llguidance compiles these and only fails at the first mask: answering would be an empty 200."""
    with pytest.raises(InvalidParameterError) as caught:
        manager.compile(StructuredOutputsParams(kind, spec, "structured_outputs"))
    assert caught.value.param == "structured_outputs"
    assert str(caught.value).startswith(f"The {kind} constraint can never be satisfied: no output matches it")
    assert (
        manager.compile(StructuredOutputsParams("regex", "a*", "structured_outputs")) >= 0.0
    )  # may match ""


def test_matcher_follows_the_output_tokens_and_ends_with_eos(manager, tokenizer) -> None:
    choice = StructuredOutputsParams.choice(["yes", "no"])
    matcher = manager.new_matcher(choice)
    ids = tokenizer.encode("yes", add_special_tokens=False)
    row = allocate_bitmask(1, 49152)[0]
    matcher.fill_bitmask(row)
    allowed = allowed_tokens(row.unsqueeze(0), 49152)[0]
    assert allowed[ids[0]] and not allowed[tokenizer.encode("maybe", add_special_tokens=False)[0]]
    matcher.sync(ids)  # e.g. after a preemption by recompute the kept tokens are replayed
    assert (matcher.num_consumed, matcher.is_terminated) == (len(ids), True)
    matcher.fill_bitmask(row)
    assert allowed_tokens(row.unsqueeze(0), 49152)[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    matcher.sync([])  # rollback to the start
    assert (matcher.num_consumed, matcher.is_terminated) == (0, False)


def test_parse_tool_calls_per_mode() -> None:
    hermes = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert parse_tool_calls(ToolMode("auto"), hermes) == ([ParsedCall("f", '{"x": 1}')], "Sure.")
    assert parse_tool_calls(ToolMode("auto"), "no call here") is None
    assert parse_tool_calls(ToolMode("named", "g"), '{"y":2}') == ([ParsedCall("g", '{"y":2}')], None)
    items = json.dumps([{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}])
    assert parse_tool_calls(ToolMode("required"), items) == (
        [ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")],
        None,
    )  # the model's own text
    assert parse_tool_calls(ToolMode("required"), '[{"name": "f"') is None


@pytest.mark.parametrize(("parallel", "most"), [(None, 1), (False, 1), (True, 8)])
def test_required_makes_one_call_unless_parallel_calls_are_asked_for(parallel, most) -> None:
    """The array's ``maxItems``: one call when ``parallel_tool_calls`` is absent (llama.cpp's default, not
    OpenAI's) or false; with ``true`` up to MAX_PARALLEL_TOOL_CALLS, so a model repeating calls ends."""
    from kvscope.engine.server.protocol import ChatCompletionRequest, decode_body
    from kvscope.engine.server.tools import MAX_PARALLEL_TOOL_CALLS, tool_constraint, tool_mode

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    body |= {"tool_choice": "required"} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    req = decode_body(json.dumps(body).encode(), ChatCompletionRequest)
    constraint = tool_constraint(req, tool_mode(req))
    assert constraint is not None and MAX_PARALLEL_TOOL_CALLS == 8
    schema = json.loads(constraint.spec)
    assert (schema["minItems"], schema["maxItems"], constraint.param) == (1, most, "tools")


def test_a_tool_choice_constraint_and_a_guided_field_together_are_a_400() -> None:
    from kvscope.engine.server.errors import OpenAIError
    from kvscope.engine.server.protocol import ChatCompletionRequest, decode_body
    from kvscope.engine.server.sampling import chat_sampling_params

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_regex": "a+"}
    req = decode_body(json.dumps(body).encode(), ChatCompletionRequest)
    tool = StructuredOutputsParams.json_schema({"type": "object"}, "tools")
    with pytest.raises(OpenAIError) as caught:
        chat_sampling_params(req, tool)
    assert (caught.value.status, caught.value.param, caught.value.message) == (
        400,
        "guided_regex",
        "tool_choice required or a named function cannot be combined with guided_regex.",
    )
    assert chat_sampling_params(req).structured_outputs == StructuredOutputsParams(
        "regex", "a+", "guided_regex"
    )
    del body["guided_regex"]
    assert (
        chat_sampling_params(
            decode_body(json.dumps(body).encode(), ChatCompletionRequest), tool
        ).structured_outputs
        is tool
    )


def _optional(count: int, kind: str, closed: bool = True) -> dict:
    """An object of ``count`` optional properties; ``closed=False`` sets ``additionalProperties: true``
    (kvscope closes an object that does not say: engine/structured/schema_bounds.py)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": kind} for i in range(count)}}
    return schema if closed else {**schema, "additionalProperties": True}


@pytest.mark.parametrize(("schema", "prefix", "items"), [
    (_optional(500, "string", closed=False), "'{'", 2007),
    ({"type": "array", "items": _optional(500, "integer", closed=False)}, "'[{'", 2007),
    (_optional(501, "string"), "'{'", 2003),
    ({"type": "array", "items": _optional(501, "integer")}, "'[{'", 2003),
])  # fmt: skip
def test_a_row_past_the_matchers_limit_after_the_start_is_a_400_at_admission(
    manager, schema, prefix, items
) -> None:
    """Many optional properties: ``{`` is not forced (``{}`` and ``{"`` are tokens too), and the row after
    it holds ~4 items per optional property (2,007 for 500 open ones, 2,003 for 501 closed ones), above
    llguidance's 2,000. The probe tries the tokens after the forced start, so this is a 400 at admission;
    before, it compiled and every request failed at its second token (a 500)."""
    with pytest.raises(InvalidParameterError) as caught:
        manager.compile(StructuredOutputsParams.json_schema(schema, "response_format"))
    assert caught.value.param == "response_format"
    assert str(caught.value) == (
        f"The json constraint cannot be served: the grammar matcher exceeds its limits "
        f"after {prefix} (Parser Error: Current row has {items} items; max is 2000; consider "
        "making your grammar left-recursive if it's right-recursive)"
    )


@pytest.mark.parametrize(("closed", "most"), [(True, 500), (False, 498)])
def test_the_most_optional_string_properties_served(manager, closed, most) -> None:
    """docs/engine-server.md's boundary: 500 optional string properties of a closed object (kvscope's
    default) are served, 501 are a 400; 498 and 499 with ``additionalProperties: true``."""
    schema = _optional(most, "string", closed)
    assert manager.compile(StructuredOutputsParams.json_schema(schema, "response_format")) > 0
    with pytest.raises(InvalidParameterError):
        manager.compile(
            StructuredOutputsParams.json_schema(_optional(most + 1, "string", closed), "response_format")
        )
