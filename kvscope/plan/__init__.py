"""``kvscope plan``: the capacity planner (docs/plan.md). Imports nothing heavy: torch only inside the CPU probe."""

from __future__ import annotations


def plan_main(argv: list[str]) -> int:
    """Entry point of ``kvscope plan`` (see kvscope/plan/cli.py)."""
    from kvscope.plan.cli import plan_main as main

    return main(argv)
