"""Structured output: grammar-constrained decoding (JSON schema, regex, choice, grammar) with llguidance.

``params`` is plain Python (every layer may import it); ``backend``, ``matcher`` and ``bitmask`` need
llguidance/torch and are imported by the engine core and the worker only. See docs/engine-server.md
("Structured output and tools") for the request surface and why llguidance was chosen.
"""
