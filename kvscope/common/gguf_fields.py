"""Reading GGUF metadata fields, for the engine's GGUF loader and the capacity planner (a leaf: it takes the
``gguf`` package's ``GGUFReader`` as an argument and imports neither it nor the project).

Keys are llama.cpp's (``general.architecture``, ``{arch}.block_count``, ``{arch}.attention.head_count_kv``
…, gguf-py/gguf/constants.py ``Keys``); ``ReaderField.contents()`` decodes a field to a Python value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class _Field(Protocol):
    def contents(self) -> Any: ...


class GgufMetadata(Protocol):
    """What is read of a ``gguf.GGUFReader``: its metadata fields by key."""

    @property
    def fields(self) -> Mapping[str, Any]: ...


_MISSING: Any = object()


def gguf_field(reader: GgufMetadata, key: str, default: Any = _MISSING) -> Any:
    """The decoded value of metadata field ``key`` (a str, number, or list for array fields), or
    ``default`` when the file has no such field. Raises ValueError for a missing field without a default."""
    field: _Field | None = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def gguf_scalar(reader: GgufMetadata, key: str, default: Any = _MISSING) -> Any:
    """:func:`gguf_field`, where a per-layer array (``head_count_kv``, ``feed_forward_length`` … of models
    whose layers differ) counts as its one value when every layer has the same. Raises ValueError for a
    missing field without a default, or a per-layer array whose values differ."""
    value = gguf_field(reader, key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer {key} {value} is not supported")
        return value[0]
    return value
