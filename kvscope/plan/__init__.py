"""``kvscope plan``: the capacity planner (docs/plan.md). Imports nothing heavy: torch only inside the CPU
probe.

Its command line is kvscope/cli/plan.py (the top layer, which also reads request logs for ``--from-log``).
"""
