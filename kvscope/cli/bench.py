"""``kvscope bench``: ``--offline`` runs the engine benchmark in-process; otherwise the serving benchmark."""

from __future__ import annotations


def bench_main(argv: list[str]) -> int:
    """Dispatch to kvscope.engine.bench (offline) or kvscope.bench.serve (against an OpenAI-compatible
    URL)."""
    if "--offline" in argv:
        from kvscope.engine.bench import main

        return main([a for a in argv if a != "--offline"])
    from kvscope.bench.serve import main as serve_main

    return serve_main(argv)
