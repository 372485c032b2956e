"""One ``--help`` style for every ``kvscope`` command: plain text and each option's default.

:class:`HelpFormatter` is argparse's formatter with three changes:

- the description and epilog keep their line breaks (argparse's ``RawDescriptionHelpFormatter``: module
  docstrings are laid out by hand);
- reStructuredText inline literals (````kvscope serve````) and Markdown code spans (```--port```) lose their
  backticks: help is read in a terminal, not rendered;
- every option with a default other than None, False or "" shows it as ``(default: X)``, like
  ``ArgumentDefaultsHelpFormatter`` but only where the help does not already name it (the word ``default``),
  and also for options that have no help text.
"""

from __future__ import annotations

import argparse
import copy
import re

_LITERAL = re.compile(r"``(.+?)``|`([^`\n]+)`")


def plain(text: str) -> str:
    """``text`` without RST/Markdown inline-literal backticks: ````x```` and ```x``` → ``x``."""
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    if default is None or default is False or default == "" or default == argparse.SUPPRESS:
        return False
    if not action.option_strings:  # a positional argument
        return False
    return not isinstance(action, argparse._HelpAction | argparse._VersionAction)  # noqa: SLF001


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The ``kvscope`` commands' ``--help`` formatter (module doc)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = plain(action.help or "")
        if _shows_default(action) and "default" not in text.lower():
            text = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not (action.help or "").strip() and _shows_default(action):
            action = copy.copy(action)  # argparse prints no help line for an option without help text
            action.help = "default: %(default)s"
        return super()._format_action(action)
