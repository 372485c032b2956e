"""The subset of the ``query_string`` syntax the Elasticsearch double reads, translated to the query DSL
(Elasticsearch reference, "Query string query", "Query string syntax").

Read: ``field:value`` (a term; ``*``/``?`` in it make a wildcard, ``field:*`` is ``exists``),
``field:"quoted value"`` (one exact term on a keyword, as its analyzer keeps the whole string),
``field:>v``, ``>=``, ``<``, ``<=`` and ``field:[a TO b]`` / ``{a TO b}`` (``*`` an open end),
``_exists_:field``, ``AND``/``&&``, ``OR``/``||``, ``NOT``/``!``, parentheses, and ``\\`` escapes.

Refused (400 ``es_double_unsupported``) rather than guessed, because Lucene's classic parser does not give
them the meaning one expects: ``AND`` and ``OR`` mixed in one group without parentheses (the reference: the
operators "do not honor the usual precedence rules, so parentheses should be used"), ``NOT`` inside an
``OR`` group (Lucene reads ``a OR NOT b`` as ``a AND NOT b``), terms side by side without an operator
(``default_operator``), a term without a field (``default_field`` ``*``), ``+``/``-`` prefixes, boosts,
fuzziness, regular expressions, proximity and field groups. A group of only negated clauses matches every
document without them, as Elasticsearch's parser adds a ``match_all`` to a purely negative group.
"""

from __future__ import annotations

from typing import Any

from kvscope.testing.es_double_fields import SearchError, Unsupported

_STOP = set(' \t\r\n()[]{}"')
_NO_START = set('+-!():^[]"{}~/')


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def error(self, reason: str) -> SearchError:
        return SearchError(
            400, "query_shard_exception", f"Failed to parse query [{self.text}]: {reason} at {self.pos}"
        )

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self, word: str) -> bool:
        end = self.pos + len(word)
        if self.text[self.pos : end] != word:
            return False
        if word.isalpha():  # AND/OR/NOT/TO are words: not a prefix of a longer term
            return end >= len(self.text) or self.text[end].isspace() or self.text[end] in "()"
        return True

    def take(self, *words: str) -> str | None:
        self.skip()
        for word in words:
            if self.peek(word):
                self.pos += len(word)
                return word
        return None

    # ---- grammar ---------------------------------------------------------------------------------------
    def expression(self) -> dict[str, Any]:
        operands = [self.unary()]
        ops: set[str] = set()
        while True:
            self.skip()
            if self.pos >= len(self.text) or self.text[self.pos] == ")":
                break
            op = self.take("AND", "&&", "OR", "||")
            if op is None:
                raise Unsupported("query_string terms without AND/OR between them (default_operator)")
            ops.add("AND" if op in ("AND", "&&") else "OR")
            operands.append(self.unary())
        if len(ops) > 1:
            raise Unsupported("AND and OR in one query_string group without parentheses")
        positive = [q for negated, q in operands if not negated]
        negative = [q for negated, q in operands if negated]
        if ops == {"OR"}:
            if negative:
                raise Unsupported("NOT inside an OR group (Lucene reads `a OR NOT b` as `a AND NOT b`)")
            return {"bool": {"should": positive, "minimum_should_match": 1}}
        if not negative and len(positive) == 1:
            return positive[0]
        return {"bool": {"must": positive or [{"match_all": {}}], "must_not": negative}}

    def unary(self) -> tuple[bool, dict[str, Any]]:
        if self.take("NOT", "!"):
            if self.take("NOT", "!"):
                raise Unsupported("a double NOT in query_string")
            return True, self.primary()
        self.skip()
        if self.pos < len(self.text) and self.text[self.pos] in "+-":
            raise Unsupported("+/- prefixes in query_string")
        return False, self.primary()

    def primary(self) -> dict[str, Any]:
        if self.take("("):
            inner = self.expression()
            if not self.take(")"):
                raise self.error("missing )")
            return inner
        return self.clause()

    def clause(self) -> dict[str, Any]:
        self.skip()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _STOP and self.text[self.pos] != ":":
            self.pos += 1
        field = self.text[start : self.pos]
        if self.pos >= len(self.text) or self.text[self.pos] != ":" or not field:
            raise Unsupported("a query_string term without a field (default_field)")
        if "*" in field or "?" in field or "\\" in field:
            raise Unsupported(f"field patterns in query_string [{field}]")
        self.pos += 1
        self.skip()
        if field == "_exists_":
            name, _ = self.term()
            return {"exists": {"field": name}}
        for op, key in ((">=", "gte"), ("<=", "lte"), (">", "gt"), ("<", "lt")):
            if self.take(op):
                value, _ = self.term()
                return {"range": {field: {key: value}}}
        if self.take("[", "{") is not None:
            return self.bracket_range(field, self.text[self.pos - 1] == "[")
        if self.pos < len(self.text) and self.text[self.pos] == "(":
            raise Unsupported("field groups in query_string (field:(a b))")
        value, wild = self.term()
        if value == "*" and wild:
            return {"exists": {"field": field}}
        if wild:
            return {"wildcard": {field: {"value": self.last_raw}}}
        return {"term": {field: value}}

    def bracket_range(self, field: str, include_lower: bool) -> dict[str, Any]:
        lower, lower_wild = self.term()
        if not self.take("TO"):
            raise self.error("expected TO")
        upper, upper_wild = self.term()
        self.skip()
        close = self.text[self.pos : self.pos + 1]
        if close not in ("]", "}"):
            raise self.error("expected ] or }")
        self.pos += 1
        spec: dict[str, Any] = {}
        if not (lower == "*" and lower_wild):
            spec["gte" if include_lower else "gt"] = lower
        if not (upper == "*" and upper_wild):
            spec["lte" if close == "]" else "lt"] = upper
        return {"range": {field: spec}} if spec else {"exists": {"field": field}}

    def term(self) -> tuple[str, bool]:
        """(the unescaped value, whether it holds an unescaped wildcard); ``self.last_raw`` keeps the escapes
        for a wildcard pattern."""
        self.skip()
        if self.pos < len(self.text) and self.text[self.pos] == '"':
            self.pos += 1
            out = []
            while self.pos < len(self.text) and self.text[self.pos] != '"':
                if self.text[self.pos] == "\\" and self.pos + 1 < len(self.text):
                    self.pos += 1
                out.append(self.text[self.pos])
                self.pos += 1
            if self.pos >= len(self.text):
                raise self.error("unterminated quote")
            self.pos += 1
            self.last_raw = "".join(out)
            return self.last_raw, False
        if self.pos >= len(self.text) or self.text[self.pos] in _NO_START and self.text[self.pos] != "\\":
            raise self.error("expected a term")
        start, out, wild = self.pos, [], False
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == "\\" and self.pos + 1 < len(self.text):
                out.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if c in _STOP:
                break
            if c in "^~/":
                raise Unsupported(f"boosts, fuzziness and regular expressions in query_string [{c}]")
            if c == ":":
                raise self.error("unescaped :")
            wild = wild or c in "*?"
            out.append(c)
            self.pos += 1
        self.last_raw = self.text[start : self.pos]
        return "".join(out), wild

    last_raw: str = ""


def parse_query_string(text: str) -> dict[str, Any]:
    """The query DSL equivalent of ``text`` (module doc for the subset). Raises SearchError
    (``query_shard_exception``, as Elasticsearch for a syntax error) or Unsupported."""
    parser = _Parser(text)
    parser.skip()
    if parser.pos >= len(text):
        raise Unsupported("an empty query_string")
    query = parser.expression()
    parser.skip()
    if parser.pos != len(text):
        raise parser.error("unexpected )")
    return query
