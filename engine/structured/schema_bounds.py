"""Bounds kvscope adds to a JSON schema before llguidance compiles it, so a sampled answer always has an end.

A grammar from an open schema lets a model write without end while staying valid: an object without
``additionalProperties`` takes any number of invented keys (a 135M model at temperature 0.8 writes
``"type":"string"`` again and again), and a number without a range takes any number of digits. Either runs
until ``max_tokens`` and the client gets ``finish_reason: "length"`` and JSON that does not parse. Two
rewrites, both narrowing (every answer still validates against the client's own schema):

- **Closed objects.** An object schema with ``properties`` or ``patternProperties`` and no
  ``additionalProperties`` gets ``additionalProperties: false``: vLLM's ``disable_additional_properties``
  walk for its llguidance backend (vllm/v1/structured_output/backend_guidance.py,
  ``process_for_additional_properties``), the behaviour of vLLM's default backend xgrammar (its JSON-schema
  converter's strict mode) and what OpenAI's strict mode demands of every object. A schema that sets
  ``additionalProperties`` (``true`` or a schema) keeps it; members of an ``allOf`` are left open (closing
  each branch would forbid the other branches' properties).
- **Bounded numbers.** llguidance has no digit-limit option, but it bounds digits from the schema: an
  ``integer`` or ``number`` with both a lower bound (``minimum``/``exclusiveMinimum``) and an upper one
  (``maximum``/``exclusiveMaximum``) compiles to a range whose integer part has at most the bound's
  digits (and no exponent), and a decimal ``multipleOf`` ``1e-k`` to at most ``k`` fraction digits. A
  missing bound becomes ±:data:`INTEGER_LIMIT` = 10^16 − 1, the 16 integer digits of llama.cpp's
  JSON-schema-to-grammar (common/json-schema-to-grammar.cpp: ``integral-part ::= [0] | [1-9] [0-9]{0,15}``);
  a ``number`` without ``multipleOf`` gets ``multipleOf`` 1e-:data:`FRACTION_DIGITS`. llama.cpp's
  ``decimal-part`` allows 16 digits; llguidance refuses a ``multipleOf`` below 1e-10 ("too many digits"),
  so kvscope allows 10. Enums and consts are bounded already and left alone.

Only schema positions are walked (``properties``, ``items``, ``anyOf``, ``$defs`` …), never data positions
(``const``, ``enum``, ``default``, ``examples``), and the client's schema is never modified (a copy is).
"""

from __future__ import annotations

from typing import Any

INTEGER_LIMIT = 10**16 - 1
"""Default bound of an integer or number without one: ±(10^16 − 1), 16 digits (llama.cpp's integral part)."""
FRACTION_DIGITS = 10
"""Default fraction digits of a number without ``multipleOf`` (llguidance's smallest ``multipleOf`` is
1e-10)."""
_NUMERIC = frozenset({"integer", "number"})
_SHARED_PREFIX = "kvscope_bounded_"
_PLAIN_NUMBER_KEYS = frozenset(
    {"type", "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
)
"""The keys of a plain number: its type and annotations. Such a node becomes a bare ``$ref`` (with its
annotations) to the shared definition; any other keyword beside the ``$ref`` would make llguidance build
the intersection, one new range per use."""
_SCHEMA_KEYS = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
"""Keywords whose value is one subschema (``items`` may also be a list: draft 4-7 tuples)."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_schema(schema: Any) -> Any:
    """A copy of the JSON schema ``schema`` (a dict, a bool, or anything a JSON parse gives) with closed
    objects and bounded numbers (the module docstring says which and why). Never raises: a value that is not a
    schema object is returned as it is, and llguidance judges it.

    A plain ``{"type": "integer"}`` or ``{"type": "number"}`` (annotations aside) becomes a ``$ref`` to one
    shared bounded definition added to the root's ``$defs`` (:func:`shared_definition`): llguidance compiles a
    definition once, while each inline range costs ~0.3 ms of compile (200 unbounded integers: 94 ms inline,
    3 ms shared; 1,000 inline ranges overflow its lexer). Numbers with a bound or another keyword of their
    own, or a type list, get the missing bounds inline; so does every number of a schema with a nested
    ``$id`` (a ``#/$defs`` pointer would resolve against that ``$id``) or whose ``$defs`` already use our
    names."""
    if not isinstance(schema, dict):
        return schema
    defs = schema.get("$defs")
    shared = not any("$id" in node for node in _subschemas(schema)) and not (
        isinstance(defs, dict) and any(name.startswith(_SHARED_PREFIX) for name in defs)
    )
    used: set[str] = set()
    out = _walk(schema, in_all_of=False, shared=shared, used=used)
    if used:
        defs = dict(out["$defs"]) if isinstance(out.get("$defs"), dict) else {}
        out["$defs"] = {**defs, **{name: shared_definition(name) for name in sorted(used)}}
    return out


def shared_definition(name: str) -> dict[str, Any]:
    """A fresh copy of the shared bounded definition ``name`` (``kvscope_bounded_integer`` or
    ``kvscope_bounded_number``) that plain numbers point to. Raises KeyError for another name."""
    kind = {"kvscope_bounded_integer": "integer", "kvscope_bounded_number": "number"}[name]
    definition: dict[str, Any] = {"type": kind, "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}
    if kind == "number":
        definition["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")
    return definition


def _subschemas(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every subschema below ``node`` (not ``node`` itself), at schema positions only."""
    found: list[dict[str, Any]] = []
    pending = _children(node)
    while pending:
        child = pending.pop()
        found.append(child)
        pending += _children(child)
    return found


def _children(node: dict[str, Any]) -> list[dict[str, Any]]:
    children: list[Any] = []
    for key in (*_SCHEMA_KEYS, *_SCHEMA_LISTS, "allOf"):
        value = node.get(key)
        children += value if isinstance(value, list) else [value]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            children += node[key].values()
    return [c for c in children if isinstance(c, dict)]


def _walk(node: Any, in_all_of: bool, shared: bool, used: set[str]) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_KEYS:
        if key in out:
            value = out[key]
            if isinstance(value, list):
                out[key] = [_walk(v, False, shared, used) for v in value]
            else:
                out[key] = _walk(value, False, shared, used)
    for key in (*_SCHEMA_LISTS, "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_walk(v, key == "allOf", shared, used) for v in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(v, False, shared, used) for name, v in out[key].items()}
    if (
        not in_all_of
        and "additionalProperties" not in out
        and ("properties" in out or "patternProperties" in out)
    ):
        out["additionalProperties"] = False
    types = out.get("type")
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if not kinds & _NUMERIC or "enum" in out or "const" in out:
        return out
    low = _bound(out, "minimum", "exclusiveMinimum")
    high = _bound(out, "maximum", "exclusiveMaximum")
    if shared and isinstance(types, str) and set(out) <= _PLAIN_NUMBER_KEYS:
        name = f"{_SHARED_PREFIX}{types}"
        used.add(name)
        return {"$ref": f"#/$defs/{name}", **{k: v for k, v in out.items() if k != "type"}}
    _bound_numbers(out, low, high, fractional="number" in kinds)
    return out


def _bound_numbers(node: dict[str, Any], low: float | None, high: float | None, fractional: bool) -> None:
    """Add the missing range (``low``/``high``: the node's own bounds) and, for a ``number``, the fraction
    digits to a numeric schema in place. A ``number`` whose own range is narrower than one step of
    1e-FRACTION_DIGITS keeps its fraction digits open (no multiple of the step might lie inside)."""
    if low is None:
        node["minimum"] = -INTEGER_LIMIT if high is None or high >= -INTEGER_LIMIT else high - INTEGER_LIMIT
    if high is None:
        node["maximum"] = INTEGER_LIMIT if low is None or low <= INTEGER_LIMIT else low + INTEGER_LIMIT
    step = float(f"1e-{FRACTION_DIGITS}")
    if fractional and "multipleOf" not in node and (low is None or high is None or high - low >= step):
        node["multipleOf"] = step


def _bound(node: dict[str, Any], inclusive: str, exclusive: str) -> float | None:
    """The schema's bound on one side (the inclusive keyword's or draft 6's numeric exclusive one), None
    without one. Draft 4's boolean ``exclusiveMinimum``/``exclusiveMaximum`` only qualifies its ``minimum``/
    ``maximum``."""
    values = [
        v
        for v in (node.get(inclusive), node.get(exclusive))
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    if not values:
        return None
    return max(values) if inclusive == "minimum" else min(values)
