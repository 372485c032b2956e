"""What a request asks the grammar engine for: :class:`StructuredOutputsParams` (vLLM's names).

Plain Python, no llguidance: SamplingParams carries one, the server builds it from ``response_format``,
``structured_outputs``/``guided_*`` or ``tool_choice``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
"""Every constraint kind (the ``kind`` label of ``kvscope_engine_structured_output_requests_total``)."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint for one request (vLLM ``StructuredOutputsParams``, one field set at a time).

    ``spec`` is the JSON schema as a JSON string (``json``), a regular expression (``regex``), a JSON list of
    strings (``choice``), a Lark or GBNF grammar (``grammar``), or ``""`` for ``json_object`` (any JSON object).
    ``param`` is the request field it came from, named in 400 errors.
    """

    kind: StructuredKind
    spec: str = ""
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}")

    @property
    def key(self) -> str:
        """sha256 of (kind, spec): the grammar-cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str = "response_format") -> StructuredOutputsParams:
        """A JSON-schema constraint (property order kept: it is the order the model writes them in)."""
        return cls("json", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, options: list[str], param: str = "structured_outputs") -> StructuredOutputsParams:
        return cls("choice", json.dumps(list(options)), param)
