"""``kvscope pull [NAME]``: fetch a registered model (default smollm2-135m) into the model cache."""

from __future__ import annotations

import argparse

from kvscope.common.cli_help import HelpFormatter
from kvscope.common.models.registry import list_models

DEFAULT_MODEL = "smollm2-135m"


def pull_main(argv: list[str]) -> int:
    """Download and verify the model; prints where it lies. Exit 1 with a message on failure."""
    parser = argparse.ArgumentParser(
        prog="kvscope pull", description="Download a registered model.", formatter_class=HelpFormatter
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list_models())
    args = parser.parse_args(argv)
    from kvscope.common.models.pull import PullError, pull

    try:
        path = pull(args.name)
    except PullError as exc:
        print(f"kvscope pull: {exc}")
        return 1
    print(f"{args.name}: {path}")
    return 0
