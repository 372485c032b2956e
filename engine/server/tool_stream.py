"""An incremental tool-call scanner: fed the text deltas of a chat answer, it yields content and tool calls
as they appear, so ``tool_choice`` ``required`` and ``auto`` stream like OpenAI's (a header delta per call,
then ``function.arguments`` fragments as the model writes them).

Shapes (engine/server/tools.py): ``required`` output is a JSON array of ``{"name", "arguments"}`` objects;
``auto`` output is free text with Hermes ``<tool_call>{"name", "arguments"}</tool_call>`` blocks.

Events: :class:`Content` (answer text outside call blocks; ``auto`` only), :class:`CallStart` (once the
item's ``name`` string is complete), :class:`Arguments` (the raw JSON text of the item's ``arguments``
value — or ``parameters``, the Hermes alias — as it grows, ending exactly at its closing brace; a string value
is sent decoded, in one fragment when it closes; an item without one gets ``{}``), :class:`CallEnd`.

The scanner is the one parser of both paths: tools.parse_tool_calls runs it over the finished text, so a
stream's fragments concatenate to exactly the non-streamed ``arguments`` (the model's raw text, not a
re-serialization). In ``auto`` the text before a block streams as it arrives; only a possible prefix of
``<tool_call>`` and the whitespace before it are held back. A block that fails before its name is complete
(not ``{`` after the tag, an item closing without a string ``name``, the answer ending) is flushed as content;
once a call has started it stays a call. Whitespace around a started call's block is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_ARG_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


@dataclass(frozen=True, slots=True)
class Content:
    """Answer text outside tool-call blocks (``auto``)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Call ``index`` (0-based, in order) begins; its name is complete."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class Arguments:
    """The next piece of call ``index``'s arguments text."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """Call ``index`` is complete (its arguments ended)."""

    index: int


Event = Content | CallStart | Arguments | CallEnd


class _Item:
    """One ``{"name": ..., "arguments": ...}`` object, fed after its opening brace, one character at a
    time."""

    def __init__(self) -> None:
        self.depth = 1
        self.in_str = self.esc = False
        self.phase = "key"  # key | keystr | colon | value | valstr | scalar | nested
        self.key = ""
        self.raw = ""
        self.name: str | None = None
        self.capturing = False
        self.args_seen = False  # an arguments/parameters value began (the first one is the arguments)
        self.args_out = ""  # argument text produced by the last characters, not yet taken
        self.has_args = False
        self.done = False

    def feed(self, c: str) -> None:
        """Advance by one character; sets ``done`` at the item's closing brace."""
        if self.phase in ("keystr", "valstr") or self.in_str:
            self._string_char(c)
        elif self.phase == "nested":
            self._take(c)
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_end()
        elif self.phase == "scalar" and not (c in _WS or c in ",}"):
            self._take(c)
        else:
            if self.phase == "scalar":
                self._value_end()
            if c not in _WS:
                self._structural(c)

    def _structural(self, c: str) -> None:
        if self.phase == "value":
            self.raw = ""
            self.capturing = self.key in _ARG_KEYS and not self.args_seen
            self.args_seen = self.args_seen or self.capturing
            if c == '"':
                self.phase, self.raw = "valstr", c
            else:
                self.phase = "nested" if c in "{[" else "scalar"
                self.depth += c in "{["
                self._take(c)
        elif self.phase == "colon":
            if c == ":":
                self.phase = "value"
        elif c == "}":
            self.done = True
        elif c == '"':
            self.phase, self.raw = "keystr", c

    def _string_char(self, c: str) -> None:
        if self.phase == "nested":
            self._take(c)
        else:
            self.raw += c
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False
            if self.phase == "keystr":
                text = _decode(self.raw)
                self.key, self.phase = (text if text is not None else "\0"), "colon"
            elif self.phase == "valstr":
                self._string_value(_decode(self.raw))

    def _string_value(self, text: str | None) -> None:
        if self.key == "name" and self.name is None and text is not None:
            self.name = text
        if self.capturing and text is not None:
            self.args_out += text
            self.has_args = True
        self._value_end()

    def _take(self, c: str) -> None:
        self.raw += c
        if self.capturing:
            self.args_out += c
            self.has_args = True

    def _value_end(self) -> None:
        self.phase, self.key, self.capturing = "key", "", False


def _decode(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


class ToolCallScanner:
    """Feed text deltas with :meth:`feed`, then call :meth:`finish` once; each returns the new events
    (adjacent content and same-call argument pieces merged). ``mode`` is ``required`` or ``auto``."""

    def __init__(self, mode: str) -> None:
        if mode not in ("required", "auto"):
            raise ValueError(f"mode must be required or auto, not {mode!r}")
        self.mode = mode
        self.calls = 0
        """Calls started so far."""
        self._events: list[Event] = []
        self._item: _Item | None = None
        self._started = False
        self._hold = ""  # auto text mode: a possible tag prefix and the whitespace before it
        self._block = ""  # auto: the block's raw text before its call started (flushed if it fails)
        self._state = "text"  # text | open (after the tag, before "{") | item | close
        self._skip_ws = False

    def feed(self, text: str) -> list[Event]:
        """Events for one more piece of the answer."""
        for c in text:
            self._char(c)
        self._flush_args()
        return self._take()

    def finish(self) -> list[Event]:
        """Events at the end of the answer: held text as content, an open call ended."""
        self._flush_args()
        if self._item is not None and self._started:
            self._end_call()
        elif self.mode == "auto" and self._state in ("open", "item"):
            self._content(self._block)
        self._item = None
        if self.mode == "auto":
            self._content(self._hold)
            self._hold = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _char(self, c: str) -> None:
        if self.mode == "required":
            if self._item is None:
                if c == "{":
                    self._item, self._started = _Item(), False
                return
            self._item_char(c)
            return
        if self._state == "text":
            self._text_char(c)
        elif self._state == "open":
            self._block += c
            if c == "{":
                self._item, self._started, self._state = _Item(), False, "item"
            elif c not in _WS:
                self._fail_block()
        elif self._state == "item":
            if not self._started:
                self._block += c
            self._item_char(c)
        else:
            self._close_char(c)

    def _text_char(self, c: str) -> None:
        if self._skip_ws and c in _WS:
            return
        self._skip_ws = False
        self._hold += c
        at = self._hold.find(OPEN_TAG)
        if at >= 0:
            before = self._hold[:at]
            kept = before.rstrip(_WS)
            self._content(kept)
            self._block, self._hold, self._state = self._hold[len(kept) :], "", "open"
            return
        body = self._hold.rstrip(_WS)
        cut = len(body)
        for k in range(min(len(OPEN_TAG) - 1, len(self._hold)), 0, -1):
            if OPEN_TAG.startswith(self._hold[-k:]):
                body = self._hold[:-k].rstrip(_WS)
                cut = len(body)
                break
        self._content(self._hold[:cut])
        self._hold = self._hold[cut:]

    def _item_char(self, c: str) -> None:
        item = self._item
        assert item is not None
        item.feed(c)
        if not self._started and item.name is not None:
            self._start(item.name)
        if item.done:
            self._flush_args()
            if self._started:
                self._end_call()
                if self.mode == "auto":
                    self._state, self._close = "close", ""
            else:
                self._item = None
                if self.mode == "auto":
                    self._fail_block()

    def _close_char(self, c: str) -> None:
        if c in _WS and not self._close:
            return
        self._close += c
        if self._close == CLOSE_TAG:
            self._state, self._skip_ws = "text", True
        elif not CLOSE_TAG.startswith(self._close):
            pending, self._state = self._close, "text"
            for ch in pending:
                self._text_char(ch)

    def _start(self, name: str) -> None:
        self._started = True
        self._block = ""
        self._hold = ""
        self._events.append(CallStart(self.calls, name))
        self.calls += 1

    def _flush_args(self) -> None:
        item = self._item
        if item is None or not self._started or not item.args_out:
            return
        text, item.args_out = item.args_out, ""
        last = self._events[-1] if self._events else None
        if isinstance(last, Arguments) and last.index == self.calls - 1:
            self._events[-1] = Arguments(last.index, last.text + text)
        else:
            self._events.append(Arguments(self.calls - 1, text))

    def _end_call(self) -> None:
        item = self._item
        assert item is not None
        if not item.has_args:
            item.args_out = "{}"
            item.has_args = True
            self._flush_args()
        self._events.append(CallEnd(self.calls - 1))
        self._item = None

    def _fail_block(self) -> None:
        text, self._block, self._state, self._item = self._block, "", "text", None
        # the failed block is plain text; re-scan its tail for another tag (e.g. "<tool_call><tool_call>{")
        head, tag, tail = text.partition(OPEN_TAG)
        self._content(head + tag)
        for ch in tail:
            self._text_char(ch)

    def _content(self, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, Content):
            self._events[-1] = Content(last.text + text)
        else:
            self._events.append(Content(text))


def scan(mode: str, text: str) -> tuple[list[tuple[str, str]], str]:
    """(calls as (name, arguments text), content) of a finished answer: the scanner run over it in one
    piece."""
    scanner = ToolCallScanner(mode)
    names: list[str] = []
    args: list[str] = []
    content = []
    for event in [*scanner.feed(text), *scanner.finish()]:
        if isinstance(event, CallStart):
            names.append(event.name)
            args.append("")
        elif isinstance(event, Arguments):
            args[event.index] += event.text
        elif isinstance(event, Content):
            content.append(event.text)
    return list(zip(names, args, strict=True)), "".join(content)
