"""Which replica serves a request: the routing policies (``cache_aware``, ``least_outstanding``,
``round_robin``), the prompt-prefix hashes ``cache_aware`` scores replicas by, and the per-replica index of
the prefixes each replica most likely still holds in its KV cache.

Imports nothing of the rest of the gateway but its settings, tokenizer constants and the request context's
RoutingRecord (what a decision leaves in the log line): the replica pool (gateway/proxy/upstreams.py) owns
the replicas and asks the router for a decision.
"""
