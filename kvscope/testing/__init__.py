"""Test doubles and process helpers shared by the test suite (tests/) and the gateway benchmarks (bench/):
a stub OpenAI-compatible upstream (fake_upstream.py, also ``python -m kvscope.testing.fake_upstream``), the
gateway/upstream/Redis process harness (harness.py), an Elasticsearch double (es_double.py) and request-log
record factories (records.py).

Sits above the gateway (it starts and reads it) and below the CLI; no serving layer imports it (import-linter
layers contract in pyproject.toml).
"""
