"""``kvscope bench``: a serving benchmark for any OpenAI-compatible server (pure HTTP client, no torch).

Modules: ``dataset`` (random / JSONL prompts as text), ``arrival`` (Poisson / gamma request arrivals),
``client`` (one streamed request, timed on the client side), ``metrics`` (vLLM ``bench serve`` statistics),
``runner`` (one benchmark run: arrivals, concurrency limit, progress bar), ``compare`` (A B A B … runs and
ratios), ``report`` (console tables and the JSON result), ``serve`` (the CLI).
"""
