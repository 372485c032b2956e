"""What admission (gateway/admission.py) hands the proxy: a leaf module, so admission never imports the
call."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.gateway.routing.prefix import PromptPrefix


@dataclass(frozen=True, slots=True)
class ProxyPlan:
    """What admission decided: where and what to send, and how to read the answer."""

    path: str
    body: bytes
    model: str
    stream: bool
    include_usage: bool
    """The client asked for the usage chunk (the upstream is always asked)."""
    expected_choices: int
    operation: str
    prefix: PromptPrefix | None = None
    """The prompt's blocks for cache-aware routing (None unless the model's policy is cache_aware)."""
    timeout_s: float | None = None
    """The client's own ``x-kvscope-timeout`` (s from arrival, gateway/admission.py client_timeout): the
    request's deadline where shorter than ``timeouts.total_s``; None: the gateway's own."""
