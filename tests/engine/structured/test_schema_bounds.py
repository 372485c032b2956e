"""engine/structured/schema_bounds.py: open objects closed and numbers bounded before llguidance compiles a
JSON schema, so a sampled answer can always end (issue 45); the rewrite only narrows the schema."""

from __future__ import annotations

import copy
import json

import pytest

from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.structured.params import StructuredOutputsParams
from kvscope.engine.structured.schema_bounds import FRACTION_DIGITS, INTEGER_LIMIT, bounded_schema
from kvscope.engine.text.tokenizer import Tokenizer

INT_REF = {"$ref": "#/$defs/kvscope_bounded_integer"}
NUMBER_REF = {"$ref": "#/$defs/kvscope_bounded_number"}
INT_DEF = {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}
NUMBER_DEF = {**INT_DEF, "type": "number", "multipleOf": 1e-10}


def test_the_defaults_are_llama_cpps_integer_digits_and_llguidances_finest_multiple() -> None:
    assert (INTEGER_LIMIT, len(str(INTEGER_LIMIT)), FRACTION_DIGITS) == (9_999_999_999_999_999, 16, 10)


def test_plain_numbers_point_to_one_shared_definition_and_objects_close() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "description": "count"},
            "x": {"type": "number"},
            "inner": {"type": "object", "properties": {"y": {"type": "number"}}},
            "list": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["n"],
    }
    before = copy.deepcopy(schema)
    assert bounded_schema(schema) == {
        "type": "object",
        "properties": {
            "n": {**INT_REF, "description": "count"},
            "x": NUMBER_REF,
            "inner": {"type": "object", "properties": {"y": NUMBER_REF}, "additionalProperties": False},
            "list": {"type": "array", "items": INT_REF},
        },
        "required": ["n"],
        "additionalProperties": False,
        "$defs": {"kvscope_bounded_integer": INT_DEF, "kvscope_bounded_number": NUMBER_DEF},
    }
    assert schema == before  # the client's schema is never modified


@pytest.mark.parametrize(("node", "bounded"), [
    ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0, "maximum": INTEGER_LIMIT}),
    ({"type": "integer", "exclusiveMaximum": 10}, {"type": "integer", "exclusiveMaximum": 10,
                                                   "minimum": -INTEGER_LIMIT}),
    ({"type": "number", "maximum": 5, "exclusiveMaximum": True},  # draft 4: the boolean qualifies maximum
     {"type": "number", "maximum": 5, "exclusiveMaximum": True, "minimum": -INTEGER_LIMIT,
      "multipleOf": 1e-10}),
    ({"type": "number", "minimum": -1.5, "maximum": 2}, {"type": "number", "minimum": -1.5, "maximum": 2,
                                                          "multipleOf": 1e-10}),
    ({"type": "number", "multipleOf": 0.5}, {"type": "number", "multipleOf": 0.5, "minimum": -INTEGER_LIMIT,
                                              "maximum": INTEGER_LIMIT}),
    ({"type": ["number", "null"]}, {"type": ["number", "null"], "minimum": -INTEGER_LIMIT,
                                    "maximum": INTEGER_LIMIT, "multipleOf": 1e-10}),
    ({"type": "number", "minimum": 0, "maximum": 1e-12}, {"type": "number", "minimum": 0, "maximum": 1e-12}),
    ({"type": "integer", "minimum": 10**20}, {"type": "integer", "minimum": 10**20,
                                              "maximum": 10**20 + INTEGER_LIMIT}),
    ({"type": "integer", "$ref": "#/$defs/a"}, {"type": "integer", "$ref": "#/$defs/a",
                                                "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}),
    ({"type": "integer", "format": "int32"}, {"type": "integer", "format": "int32", "minimum": -INTEGER_LIMIT,
                                              "maximum": INTEGER_LIMIT}),
])  # fmt: skip
def test_numbers_with_keywords_of_their_own_get_the_missing_bounds_inline(node, bounded) -> None:
    """One bound given: the other is added; a range narrower than 1e-10 keeps its fraction open (no
    multiple might lie in it); a bound beyond the default moves the default past it."""
    assert bounded_schema({"type": "array", "items": node}) == {"type": "array", "items": bounded}


@pytest.mark.parametrize("schema", [
    {"type": "integer", "enum": [10**30]},
    {"type": "number", "const": 1.0e-20},
    {"type": "object", "additionalProperties": True, "properties": {"a": {"const": {"type": "number"}}}},
    {"type": "object", "additionalProperties": {"type": "string"}, "properties": {}},
    {"type": "object"},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
               {"type": "object", "properties": {"b": {"type": "string"}}}]},
    {"type": "string", "default": {"type": "integer"}, "examples": [{"type": "number"}]},
    True,
    "not a schema",
])  # fmt: skip
def test_bounded_and_explicit_schemas_and_data_stay_as_they_are(schema) -> None:
    """Enums and consts, an explicit additionalProperties, an object without properties (json_object),
    allOf members (closing each would forbid the other's properties) and values at data positions."""
    assert bounded_schema(schema) == schema


def test_a_nested_id_or_a_taken_name_keeps_the_bounds_inline() -> None:
    """A ``#/$defs`` pointer under a nested ``$id`` would resolve against that ``$id``."""
    nested_id = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"a": {"$id": "https://example.com/a", "type": "integer"}},
    }
    inline = {
        "$id": "https://example.com/a",
        "type": "integer",
        "minimum": -INTEGER_LIMIT,
        "maximum": INTEGER_LIMIT,
    }
    assert bounded_schema(nested_id) == {**nested_id, "properties": {"a": inline}}
    taken = {
        "$defs": {"kvscope_bounded_integer": {"type": "string"}},
        "type": "array",
        "items": {"type": "integer"},
    }
    assert bounded_schema(taken)["items"] == {
        "type": "integer",
        "minimum": -INTEGER_LIMIT,
        "maximum": INTEGER_LIMIT,
    }
    assert bounded_schema(taken)["$defs"] == taken["$defs"]


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.hf.to_str, 49152, tokenizer.eos_token_id)


OPEN = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
    "required": ["n", "x"],
}


@pytest.mark.parametrize(("text", "complete"), [
    ('{"n":1234567890123456,"x":-0.1234567891}', True),  # 16 integer digits, 10 fraction digits
    ('{"n":-9999999999999999,"x":9999999999999999}', True),
    ('{"n":12345678901234567,"x":1}', False),  # 17 digits
    ('{"n":1,"x":0.12345678901}', False),  # 11 fraction digits
    ('{"n":1,"x":1e5}', False),  # no exponent in a bounded range
    ('{"n":1,"x":2,"y":3}', False),  # a closed object
])  # fmt: skip
def test_the_compiled_grammar_ends_numbers_and_objects(manager, tokenizer, text, complete) -> None:
    """The grammar an open schema compiles to, over SmolLM2's tokenizer: a complete answer is accepted and
    leaves only EOS; one digit past the bound (or an invented key) is rejected."""
    matcher = manager.new_matcher(StructuredOutputsParams.json_schema(OPEN))
    accepted = all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert (accepted and matcher.is_terminated) is complete
    assert json.loads(text)  # every case is valid JSON: only the bounds reject
