"""The shared leaf: what the engine, the gateway and the tools all use (the model registry and cache, the
OpenAI error vocabulary, the OTel environment and GenAI metric definitions, HTTP read timeouts, the engine's
default settings, address helpers, the event-loop choice, the chat template, settings-to-CLI flags, the
weight-format table, GGUF metadata reads, the version).

Imports nothing of the project (import-linter contract in pyproject.toml), so every layer may import it.
"""
