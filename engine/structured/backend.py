"""The llguidance grammar backend: one LLTokenizer per engine, compiled grammars cached by constraint hash.

Why llguidance (docs/benchmarks.md "Structured outputs: the grammar backend" has the measurements against
xgrammar and outlines-core): compiles several times faster than xgrammar and two orders of magnitude faster
than outlines-core, and compile time is on the request path of every new schema; its per-step mask is a
negligible share of a CPU decode step; a small wheel with no dependencies (xgrammar pulls torch,
transformers, triton and apache-tvm-ffi; outlines-core needs the vocabulary rebuilt from byte-level tokens).

No request waits for another's compile (serving case N2): the cache is looked up first, under a lock that is
never held during a compile; a grammar not in the cache compiles on the manager's own thread (one worker, at
most ``CompileLimits.max_pending`` distinct grammars queued or running, beyond that
:class:`CompileBusyError`), and concurrent requests for one grammar share that compile (single flight).
llguidance's ``max_grammar_size`` refuses oversized grammars in milliseconds. The compiled grammar is pinned
to the request (:class:`~kvscope.engine.structured.params.GrammarPin`), so the engine step never compiles
(:meth:`matcher_for`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import llguidance
import torch

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.structured.bitmask import allocate_bitmask, allowed_tokens
from kvscope.engine.structured.matcher import RequestMatcher, one_line
from kvscope.engine.structured.params import CompileLimits, StructuredOutputsParams
from kvscope.engine.structured.schema_bounds import bounded_schema

JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (``,`` and ``:`` without spaces): a small model cannot pad the answer with endless
whitespace, and the output is what ``json.dumps(separators=(",", ":"))`` writes."""
ANY_JSON_OBJECT = '{"type":"object"}'
FORCED_ROUNDS = 4
"""Admission follows the grammar's forced tokens (``compute_ff_tokens``) at most this many times: a schema
whose only possible start already breaks the matcher (a required self-reference, an ``anyOf`` wider than
llguidance's row limit) is a 400 instead of an error after the first token."""
BRANCH_TOKENS = 16
"""At the first position that is not forced, admission tries up to this many allowed tokens (each on its
own copy of the matcher) and computes the mask after it: a grammar whose next row already breaks
llguidance's limits (an object of 500 optional properties: ``{`` is not forced, since ``{}`` and ``{"`` are
tokens too, and the row after ``{`` holds 2,007 items, above ``max_items_in_row`` 2,000) is a 400 at
admission, not a failure while generating. Tokens that open a string or a key (``"``…) go first, then those
with ``{`` or ``[``, then the rest by id. Paid once per grammar (cached); ranking the vocabulary once per
engine, on the compile thread (costs: docs/benchmarks.md "Structured outputs: the grammar backend")."""
_GRAMMAR_SIZE = "grammar size (number of symbols) too big"


class CompileBusyError(RuntimeError):
    """More distinct grammars than ``CompileLimits.max_pending`` are queued or compiling; retry later (the
    server answers 429 with ``Retry-After``)."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A validated grammar: the template matcher at the start state (never advanced: each request gets a
    ``deep_copy``) and the seconds its compile took on the compile thread."""

    matcher: llguidance.LLMatcher
    seconds: float


class GrammarWait(NamedTuple):
    """What getting one request's grammar cost (StructuredOutputManager.acquire)."""

    compile_s: float
    """Seconds of the compile this call queued (0.0: pinned, cached, or compiled by a concurrent request):
    the compile-time histogram's observation."""
    wait_s: float
    """Seconds the caller waited for the grammar: 0.0 when it was pinned or cached, else the wait on the
    compile thread (its own compile, or one of the same grammar in flight, compiles queued ahead, the first
    compile's grammar-tokenizer build): the request's ``structured_compile_s`` (engine/core/stats.py)."""


class _Refused(Exception):
    """A compile refusal (the one-line message), shared by every request of its key; each caller re-raises it
    as InvalidParameterError naming its own field."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet validated). A JSON schema is compiled with closed
    objects and bounded numbers (kvscope.engine.structured.schema_bounds), so every answer can end.
    Raises InvalidParameterError naming ``params.param`` for text llguidance cannot even parse (malformed
    JSON, a GBNF grammar it cannot convert) and for a schema nested beyond Python's recursion limit."""
    try:
        if params.kind == "json":
            schema = bounded_schema(json.loads(params.spec))
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        if params.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
        if params.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.spec)
        if params.kind == "choice":
            return llguidance.grammar_from("choice", params.spec)
        return llguidance.grammar_from("grammar", params.spec)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise InvalidParameterError(
            params.param, f"Invalid {params.kind} constraint: {one_line(str(exc))}"
        ) from exc
    except RecursionError as exc:
        raise InvalidParameterError(
            params.param, f"Invalid {params.kind} constraint: nested too deeply to compile."
        ) from exc


class StructuredOutputManager:
    """Compiles constraints on its own thread (cached, LRU of ``cache_size``), pins them to their requests and
    hands each request its own matcher.

    Thread-safe: the server compiles while the engine thread creates matchers. The LLTokenizer (about a second
    to build for a 49k vocabulary) is built on the compile thread at the first compile, so unconstrained
    deployments never pay for it.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_id: int | None,
        cache_size: int = 256,
        limits: CompileLimits | None = None,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self.limits = limits or CompileLimits()
        self._lock = threading.Lock()
        """Guards ``_cache`` and ``_inflight``; held for dictionary operations only, never during a
        compile."""
        self._tokenizer_lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar | str] = OrderedDict()
        """key → the compiled grammar, or the one-line message of its refusal (a repeated bad schema costs
        nothing)."""
        self._inflight: dict[str, Future[CompiledGrammar]] = {}
        """key → the compile queued or running for it (single flight)."""
        self._executor: ThreadPoolExecutor | None = None
        self.num_compiles = 0
        """Compiles run so far (cache hits and shared compiles not counted)."""
        self._branch_rank: torch.Tensor | None = None
        """int64 ``[vocab_size]``: each token's rank for the admission probe (:meth:`_try_branches`), built
        on the compile thread at the first probe."""
        self.mask_observer: Callable[[float], None] | None = None
        """Called with the seconds one step spent filling masks (the server points it at a histogram)."""

    def set_limits(self, limits: CompileLimits) -> None:
        """Use ``limits`` for the compiles from now on (the server's settings, at start-up); forgets the
        cached grammars and refusals, which were judged under the old limits."""
        with self._lock:
            self.limits = limits
            self._cache.clear()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                eos = [self.eos_token_id] if self.eos_token_id is not None else None
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._tokenizer

    # --- admission ------------------------------------------------------------------------------------------

    def lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The grammar pinned to ``params`` or cached for its key (pinning it), else None; never compiles or
        waits for a compile. Raises InvalidParameterError (naming ``params.param``) for a cached refusal."""
        pinned = params.pin.grammar
        if isinstance(pinned, CompiledGrammar):
            return pinned
        with self._lock:
            entry = self._cache.get(params.key)
            if entry is not None:
                self._cache.move_to_end(params.key)
        if isinstance(entry, str):
            raise InvalidParameterError(params.param, entry)
        if entry is not None:
            params.pin.grammar = entry
        return entry

    def compile(self, params: StructuredOutputsParams) -> float:
        """Compile ``params`` (blocking the caller, on the compile thread), cache it and pin it to ``params``;
        return the seconds the compile took (0.0 when pinned, cached, or compiled by a concurrent request).

        Raises InvalidParameterError naming ``params.param`` with llguidance's message in one line (an
        unsupported JSON-schema keyword ``Unimplemented keys: ["if"]``, a grammar/regex error, a grammar above
        ``max_grammar_size``, a constraint the matcher cannot serve), CompileBusyError when the compile queue
        is full."""
        return self.acquire(params).compile_s

    def wait_for(self, params: StructuredOutputsParams) -> float:
        """:meth:`compile`, returning instead the seconds the caller waited (:attr:`GrammarWait.wait_s`)."""
        return self.acquire(params).wait_s

    def acquire(self, params: StructuredOutputsParams) -> GrammarWait:
        """:meth:`compile` with both figures of :class:`GrammarWait`. Same errors as :meth:`compile`."""
        if self.lookup(params) is not None:
            return GrammarWait(0.0, 0.0)
        started = time.perf_counter()
        future, mine = self._submit(params)
        try:
            compiled = future.result()
        except _Refused as exc:
            raise InvalidParameterError(params.param, str(exc)) from None
        params.pin.grammar = compiled
        return GrammarWait(compiled.seconds if mine else 0.0, time.perf_counter() - started)

    async def acquire_async(self, params: StructuredOutputsParams) -> GrammarWait:
        """:meth:`acquire` for an event loop: waits for the compile thread without occupying any other thread
        (asyncio's default executor stays free for everything else). Cancelling the wait leaves the compile
        running for the other requests of the same grammar. Same result and errors as :meth:`acquire`."""
        if self.lookup(params) is not None:
            return GrammarWait(0.0, 0.0)
        started = time.perf_counter()
        future, mine = self._submit(params)
        try:
            compiled = await asyncio.shield(
                asyncio.wrap_future(future)
            )  # a cancelled wait leaves the shared compile
        except _Refused as exc:
            raise InvalidParameterError(params.param, str(exc)) from None
        params.pin.grammar = compiled
        return GrammarWait(compiled.seconds if mine else 0.0, time.perf_counter() - started)

    def _submit(self, params: StructuredOutputsParams) -> tuple[Future[CompiledGrammar], bool]:
        """(the compile of ``params``' key, whether this call queued it): a finished future for a grammar that
        got cached meanwhile, the running one for a key already compiling. Raises CompileBusyError."""
        key = params.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                done: Future[CompiledGrammar] = Future()
                if isinstance(entry, str):
                    done.set_exception(_Refused(entry))
                else:
                    done.set_result(entry)
                return done, False
            running = self._inflight.get(key)
            if running is not None:
                return running, False
            if len(self._inflight) >= self.limits.max_pending:
                raise CompileBusyError(
                    f"{len(self._inflight)} new grammars are already waiting to compile "
                    f"(limit {self.limits.max_pending}); retry later."
                )
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            future = self._executor.submit(self._compile_job, params, self.limits)
            self._inflight[key] = future
            return future, True

    def _compile_job(self, params: StructuredOutputsParams, limits: CompileLimits) -> CompiledGrammar:
        """Runs on the compile thread: compile, then cache the grammar or the refusal and retire the in-flight
        entry in one step (a lookup sees one or the other)."""
        entry: CompiledGrammar | str | None = None
        try:
            self.num_compiles += 1
            entry = self._build(params, limits)
        except InvalidParameterError as exc:
            entry = str(exc)
        finally:
            with self._lock:
                self._inflight.pop(params.key, None)
                if entry is not None:
                    self._cache[params.key] = entry
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise _Refused(entry)
        return entry

    def _build(self, params: StructuredOutputsParams, limits: CompileLimits) -> CompiledGrammar:
        tokenizer = self.tokenizer
        start = time.perf_counter()
        grammar = grammar_text(params)
        parser_limits = llguidance.LLParserLimits(
            max_grammar_size=limits.max_grammar_size, verbose_errors=False
        )
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits)
        if template.is_error():
            error = one_line(template.get_error())
            if error.startswith(_GRAMMAR_SIZE):
                raise InvalidParameterError(
                    params.param,
                    f"The {params.kind} constraint is too large to compile: "
                    f"its grammar has more than {limits.max_grammar_size} symbols (the "
                    f"engine's --structured-output-max-grammar-size).",
                )
            raise InvalidParameterError(
                params.param, f"Unsupported or invalid {params.kind} constraint: {error}"
            )
        self._check_servable(template.deep_copy(), params)
        return CompiledGrammar(template, time.perf_counter() - start)

    def _check_servable(self, probe: llguidance.LLMatcher, params: StructuredOutputsParams) -> None:
        """Raise InvalidParameterError for a grammar the matcher cannot serve: one that no output satisfies
        (a schema that only refers to itself, a regex that matches nothing: llguidance compiles these and
        only fails at the first mask), one that only allows the empty answer, one whose forced start (the
        tokens every answer begins with) already breaks the matcher's limits, and one whose row right after
        the forced start breaks them (:meth:`_try_branches`). Each would otherwise answer an empty or
        truncated 200, or fail while generating."""
        row = allocate_bitmask(1, self.vocab_size)[0]
        start: list[int] = []
        for round_ in range(FORCED_ROUNDS):
            probe.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if probe.is_error():
                raise InvalidParameterError(
                    params.param,
                    f"The {params.kind} constraint can never be satisfied: "
                    f"no output matches it ({one_line(probe.get_error())})",
                )
            if round_ == 0 and self._only_eos(row):
                raise InvalidParameterError(
                    params.param, f"The {params.kind} constraint only allows an empty answer."
                )
            forced = probe.compute_ff_tokens()
            if probe.is_error():
                return
            if not forced:
                break
            if not probe.consume_tokens(forced):
                text = self.tokenizer.decode_str(forced[:8])
                raise InvalidParameterError(
                    params.param,
                    f"The {params.kind} constraint cannot be served: the "
                    f"grammar matcher fails after the forced start {text!r} "
                    f"({one_line(probe.get_error())})",
                )
            if probe.is_stopped():
                return
            start += forced
        else:
            probe.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if probe.is_error():
                return
        self._try_branches(probe, row, start, params)

    def _try_branches(
        self,
        probe: llguidance.LLMatcher,
        row: torch.Tensor,
        start: list[int],
        params: StructuredOutputsParams,
    ) -> None:
        """Consume each of up to BRANCH_TOKENS tokens ``row`` (the mask at ``probe``'s state, after the forced
        ``start``) allows, each on a deep copy of ``probe``, and compute the mask after it. Raises
        InvalidParameterError naming ``params.param`` when the matcher fails there (a row above llguidance's
        ``max_items_in_row``, too many items): every answer through that token would fail while generating."""
        allowed = allowed_tokens(row.unsqueeze(0), self.vocab_size)[0].nonzero().flatten()
        if self.eos_token_id is not None:
            allowed = allowed[allowed != self.eos_token_id]
        rank = self._token_rank()
        tried = allowed[torch.argsort(rank[allowed], stable=True)[:BRANCH_TOKENS]].tolist()
        after = allocate_bitmask(1, self.vocab_size)[0]
        for token in tried:
            branch = probe.deep_copy()
            if branch.consume_token(token):
                branch.unsafe_compute_mask_ptr(after.data_ptr(), after.numel() * after.element_size())
            if branch.is_error():
                prefix = self.tokenizer.decode_str([*start[-8:], token])
                raise InvalidParameterError(
                    params.param,
                    f"The {params.kind} constraint cannot be served: the "
                    f"grammar matcher exceeds its limits after {prefix!r} "
                    f"({one_line(branch.get_error())})",
                )

    def _token_rank(self) -> torch.Tensor:
        """int64 ``[vocab_size]``: 0 for tokens that begin with ``"`` (they open a string or a key), 1 for
        those holding ``"``, ``{`` or ``[``, 2 for the rest (:meth:`_try_branches` tries the lowest first)."""
        if self._branch_rank is None:
            rank = torch.full((self.vocab_size,), 2, dtype=torch.int64)
            tokenizer = self.tokenizer
            for token in range(min(self.vocab_size, tokenizer.vocab_size)):
                text = tokenizer.decode_bytes([token])
                if text.startswith(b'"'):
                    rank[token] = 0
                elif b'"' in text or b"{" in text or b"[" in text:
                    rank[token] = 1
            self._branch_rank = rank
        return self._branch_rank

    def _only_eos(self, row) -> bool:
        allowed = allowed_tokens(row.unsqueeze(0), self.vocab_size)[0].nonzero().flatten().tolist()
        return allowed == [self.eos_token_id]

    # --- the engine step ------------------------------------------------------------------------------------

    def matcher_for(self, params: StructuredOutputsParams) -> RequestMatcher | None:
        """A fresh matcher at the grammar's start from the grammar pinned at admission (or, for a request made
        without admission, the cached one); None when neither exists. Never compiles: this runs inside the
        engine step. Raises InvalidParameterError for a cached refusal."""
        compiled = self.lookup(params)
        if compiled is None:
            return None
        return RequestMatcher(compiled.matcher.deep_copy(), self.eos_token_id)

    def new_matcher(self, params: StructuredOutputsParams) -> RequestMatcher:
        """A fresh matcher at the grammar's start, compiling first on a cache miss (tests, benchmarks: never
        inside a step)."""
        self.compile(params)
        matcher = self.matcher_for(params)
        assert matcher is not None
        return matcher

    @property
    def num_cached(self) -> int:
        """Grammars and refusals in the cache now."""
        with self._lock:
            return len(self._cache)

    @property
    def num_pending(self) -> int:
        """Distinct grammars queued or compiling now. Read under the lock: :meth:`_submit` hands a job to the
        compile thread before it records it in flight (it needs the job's future), so an unlocked read could
        see 0 while that compile already runs."""
        with self._lock:
            return len(self._inflight)
