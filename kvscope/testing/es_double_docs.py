"""Data streams and document validation for the Elasticsearch double (mapping semantics as documented)."""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass, field
from typing import Any

_MALFORMED_OK = {"long", "integer", "double", "float", "date", "ip"}
"""Field types that honour ``ignore_malformed`` (boolean and keyword do not)."""


@dataclass(slots=True)
class BackingIndex:
    name: str
    uuid: str = field(default_factory=lambda: uuid.uuid4().hex[:22])
    docs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DataStream:
    name: str
    template: str
    mappings: dict[str, Any]
    settings: dict[str, Any]
    indices: list[BackingIndex] = field(default_factory=list)

    @classmethod
    def create(cls, name: str, template: str, parts: list[dict[str, Any]]) -> DataStream:
        """Compose ``template`` parts in order (later wins), as an index template with ``composed_of``
        does."""
        mappings: dict[str, Any] = {"properties": {}}
        settings: dict[str, Any] = {}
        for part in parts:
            _merge(mappings, part.get("mappings", {}))
            settings.update(_flatten(part.get("settings", {})))
        ds = cls(name, template, mappings, settings)
        ds.roll_over()
        return ds

    @property
    def write_index(self) -> BackingIndex:
        return self.indices[-1]

    def roll_over(self) -> None:
        self.indices.append(BackingIndex(f".ds-{self.name}-2025.01.01-{len(self.indices) + 1:06d}"))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "timestamp_field": {"name": "@timestamp"},
            "indices": [{"index_name": i.name, "index_uuid": i.uuid} for i in self.indices],
            "generation": len(self.indices),
            "status": "GREEN",
            "template": self.template,
            "ilm_policy": self.settings.get("index.lifecycle.name"),
            "hidden": False,
            "system": False,
        }


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name if name.startswith("index.") else f"index.{name}"] = value
    return flat


def validate_doc(doc: Any, mappings: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any] | None:
    """The per-item error Elasticsearch would answer for ``doc`` in a data stream, or None if it indexes."""
    if not isinstance(doc, dict) or "@timestamp" not in doc:
        return {
            "type": "document_parsing_exception",
            "reason": "[1:2] failed to parse: data stream timestamp field [@timestamp] is missing",
        }
    ignore_malformed = bool(settings.get("index.mapping.ignore_malformed", False))
    return _walk(
        doc, mappings.get("properties", {}), "", str(mappings.get("dynamic", "true")), ignore_malformed
    )


def _walk(
    obj: dict[str, Any], props: dict[str, Any], path: str, dynamic: str, lenient: bool
) -> dict[str, Any] | None:
    for key, value in obj.items():
        mapping = props.get(key)
        if mapping is None:
            if dynamic == "strict":
                return {
                    "type": "strict_dynamic_mapping_exception",
                    "reason": f"[1:2] mapping set to strict, dynamic introduction of [{key}] within "
                    f"[{path.rstrip('.') or '_doc'}] is not allowed",
                }
            continue
        if value is None or mapping.get("enabled") is False:
            continue
        sub = mapping.get("properties")
        if sub is not None or mapping.get("type") == "object":
            if not isinstance(value, dict):
                return {
                    "type": "document_parsing_exception",
                    "reason": f"[1:2] object mapping for [{path}{key}] tried to parse field [{key}] as "
                    "object, but found a concrete value",
                }
            problem = _walk(value, sub or {}, f"{path}{key}.", str(mapping.get("dynamic", dynamic)), lenient)
        else:
            problem = _check_leaf(value, mapping["type"], path + key, lenient)
        if problem is not None:
            return problem
    return None


def _check_leaf(value: Any, ftype: str, path: str, lenient: bool) -> dict[str, Any] | None:
    for item in value if isinstance(value, list) else (value,):
        if item is not None and not _fits(item, ftype) and not (lenient and ftype in _MALFORMED_OK):
            return {
                "type": "document_parsing_exception",
                "reason": f"[1:2] failed to parse field [{path}] of type [{ftype}]",
            }
    return None


def _fits(value: Any, ftype: str) -> bool:
    if isinstance(value, dict):
        return False
    if ftype in ("keyword", "match_only_text", "text"):
        return True
    if ftype in ("long", "integer", "double", "float"):
        return _is_number(value)
    if ftype == "boolean":
        return isinstance(value, bool) or value in ("true", "false", "")
    if ftype == "ip":
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return False
        return True
    if ftype == "date":
        return isinstance(value, (str, int)) and not isinstance(value, bool)
    return True  # keyword / text / match_only_text accept strings, numbers and booleans


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
