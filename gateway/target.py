"""The one canonical form of a request target, checked before routing, and the generation-route names.

OpenAI clients send an origin-form target (RFC 9112 §3.2.1): ``/v1/chat/completions``, ``/v1/models/{id}``
with the id percent-encoded as an RFC 3986 path segment (the ``openai`` SDK's ``path_template``: ``/`` in a
model id becomes ``%2F``), an optional query. They never send a fragment, a dot segment, an empty segment, a
trailing slash or a percent-encoded unreserved character. The gateway accepts exactly that form and answers
anything else with a 400 ``invalid_request_target`` before any route runs, so each route has one spelling
(``/v1/chat/completions#x``, ``/v1/chat/%63ompletions``, ``/v1//completions``, ``/v1/completions/`` … never
reach the pass-through).

The pass-through additionally refuses every path that names a generation API in any letter case
(:func:`names_generation_api`), so no spelling an upstream might map to a generation route (a case-folding or
``;param``-stripping server) is forwarded without admission.
"""

from __future__ import annotations

import re
import string
from urllib.parse import unquote

from kvscope.gateway.errors import InvalidRequest

UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
"""RFC 3986 §2.3: percent-encoding these is never needed (§6.2.2.2: equivalent to the plain character)."""
_PCT = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\#?]")
_ENCODED_SLASH = re.compile(rb"%2[Ff]")
GENERATION_SEGMENTS = frozenset(
    {
        "completions",
        "completion",
        "chat",
        "responses",
        "messages",
        "generate",
        "generations",
        "engines",
        "infill",
        "realtime",
        "audio",
    }
)
"""Path segments (case-folded) that name a generation API of the OpenAI, vLLM, llama.cpp or TGI servers:
the pass-through never forwards a ``/v1/*`` path containing one (only the admitted routes serve them)."""


class InvalidTarget(InvalidRequest):
    """400 for a request target outside the canonical form (module docstring)."""

    code = "invalid_request_target"


def target_problem(raw_path: bytes, query: bytes, path: str) -> str | None:
    """Why the target is not canonical, or None when it is.

    Args:
        raw_path: the target's path bytes as sent (ASGI ``raw_path``, no query).
        query: the query bytes (ASGI ``query_string``).
        path: the percent-decoded path (ASGI ``path``).
    """
    if b"#" in raw_path or b"#" in query:
        return "a fragment ('#') is not allowed in a request target"
    if not raw_path.startswith(b"/"):
        return "the request target must be an absolute path starting with '/'"
    if _PCT.search(raw_path) or _PCT.search(query):
        return "'%' must start a percent-encoded byte (%XX)"
    for match in re.finditer(rb"%([0-9A-Fa-f]{2})", raw_path):
        if int(match.group(1), 16) in UNRESERVED:
            return f"{match.group(0).decode()} encodes an unreserved character; send it unencoded"
    if _CONTROL.search(path):
        return "control characters, '\\' and encoded '#' or '?' are not allowed in the path"
    if path != "/" and path.endswith("/"):
        return "the path must not end with '/'"
    segments = path.split("/")[1:]
    if any(s == "" for s in segments) and path != "/":
        return "the path must not contain empty segments ('//')"
    if any(s in (".", "..") for s in segments):
        return "the path must not contain '.' or '..' segments"
    if _ENCODED_SLASH.search(raw_path) and not path.startswith("/v1/models/") and names_generation_api(path):
        return "an encoded '/' (%2F) is allowed only in a model id (/v1/models/{id})"
    return None


def check_target(raw_path: bytes, query: bytes, path: str) -> None:
    """Raises :class:`InvalidTarget` (400) when the target is not in the canonical form."""
    problem = target_problem(raw_path, query, path)
    if problem is not None:
        shown = raw_path.decode("latin-1")[:200]
        raise InvalidTarget(f"Invalid request target {shown!r}: {problem}.")


def _leading_letters(segment: str) -> str:
    """The ASCII lowercase letters ``segment`` starts with (empty when it starts with anything else)."""
    return segment[: len(segment) - len(segment.lstrip(string.ascii_lowercase))]


def names_generation_api(path: str) -> bool:
    """True when a path (percent-decoded here) has a segment whose leading letters, case-folded, are one of
    :data:`GENERATION_SEGMENTS`: whatever a server might strip after them (``;params``, ``#…``, ``.json``)
    and any letter case count (``/v1/Chat/Completions``, ``/v1/completions;x``, ``/v1/completions%23x``)."""
    decoded = unquote(path)
    return any(_leading_letters(segment.casefold()) in GENERATION_SEGMENTS for segment in decoded.split("/"))
