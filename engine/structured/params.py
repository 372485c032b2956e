"""What a request asks the grammar engine for: :class:`StructuredOutputsParams` (vLLM's names).

Plain Python, no llguidance: SamplingParams carries one, the server builds it from ``response_format``,
``structured_outputs``/``guided_*`` or ``tool_choice``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
"""Every constraint kind (the ``kind`` label of ``kvscope_engine_structured_output_requests_total``)."""


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """What the grammar compiler accepts (engine/structured/backend.py; the server's
    ``--structured-output-max-grammar-size`` and ``--structured-output-max-pending-compiles``).

    ``max_grammar_size`` is llguidance's own ``LLParserLimits.max_grammar_size`` (symbols in the grammar's
    productions), checked before the expensive part of a compile, so a grammar above it is refused in
    milliseconds with a 400. 20,000 symbols bounds a compile to well under a second in the worst shape
    measured (many optional string properties: llguidance's compile time grows with the square of an object's
    optional properties) and admits about 5,000 required properties (OpenAI's own cap); the compile times
    behind it: docs/benchmarks.md "What the per-request limits cost and buy".
    ``max_pending`` bounds the distinct grammars queued or compiling on the one compile thread; a request that
    would be one more is refused with a 429 (worst wait behind the queue: ``max_pending`` x the longest
    compile)."""

    max_grammar_size: int = 20_000
    max_pending: int = 16

    def __post_init__(self) -> None:
        if self.max_grammar_size < 1 or self.max_pending < 1:
            raise ValueError(
                f"grammar compile limits must be >= 1, got max_grammar_size={self.max_grammar_size}, "
                f"max_pending={self.max_pending}"
            )


@dataclass(slots=True, eq=False)
class GrammarPin:
    """The compiled grammar a request was admitted with, set once by the compiler
    (:meth:`kvscope.engine.structured.backend.StructuredOutputManager.compile`). The request holds it, so
    the grammar cache may evict the grammar while the request waits: the engine step never compiles."""

    grammar: object | None = None
    """kvscope.engine.structured.backend.CompiledGrammar (opaque here: this module stays free of
    llguidance)."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint for one request (vLLM ``StructuredOutputsParams``, one field set at a time).

    ``spec`` is the JSON schema as a JSON string (``json``), a regular expression (``regex``), a JSON list of
    strings (``choice``), a Lark or GBNF grammar (``grammar``), or ``""`` for ``json_object`` (any JSON
    object). ``param`` is the request field it came from, named in 400 errors.
    """

    kind: StructuredKind
    spec: str = ""
    param: str = "structured_outputs"
    pin: GrammarPin = field(default_factory=GrammarPin, compare=False, repr=False)
    """Filled at admission with the compiled grammar; ``n > 1`` children share it (their SamplingParams are
    copies that keep this object)."""

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
