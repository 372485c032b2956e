"""OpenAI tool calling: tools rendered into the prompt, tool_choice → a constraint, output → tool_calls.

Rendering: a model whose chat template mentions ``tools`` gets them as the ``tools`` template variable (the
transformers convention). Otherwise (SmolLM2's template has no tool support) kvscope writes the Hermes format
(NousResearch Hermes-2-Pro function calling, also what Qwen2.5 templates use) into the system message: the
signatures as JSON lines inside ``<tools></tools>``, calls as ``<tool_call>{"name",
"arguments"}</tool_call>``, results as ``<tool_response>`` in ``role: tool`` turns.

tool_choice: ``none`` (tools not rendered, plain answer), ``auto`` (rendered; ``<tool_call>`` blocks in the
answer are parsed), ``required`` (output constrained to a JSON array of ``{"name", "arguments"}`` whose
arguments follow each function's parameters schema), a named function (output constrained to that function's
arguments object). The constraint shapes follow vLLM's; the schemas are closed and their numbers bounded
before they compile (kvscope.engine.structured.schema_bounds), so an answer can always end.

How many calls ``required`` makes: exactly one unless the request sends ``parallel_tool_calls: true``, then
one to :data:`MAX_PARALLEL_TOOL_CALLS`, ending where the model closes the array. OpenAI's default is parallel
calls on; kvscope's is llama.cpp's (tools/server: ``parallel_tool_calls`` defaults to false, in newer
versions to what the chat template supports; SmolLM2's template supports no tools at all). Left open, a small
model at temperature 0.8 repeats calls until ``max_tokens`` (SmolLM2-135M, seed 0: 14 calls and a cut 15th
in 400 tokens), and the client gets ``finish_reason: "length"`` and no ``tool_calls``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from kvscope.engine.server.tool_stream import scan
from kvscope.engine.structured.params import StructuredOutputsParams

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_PARALLEL_TOOL_CALLS = 8
"""The most calls a ``required`` answer with ``parallel_tool_calls: true`` may make (the array's
``maxItems``): a model that keeps calling ends after this many (~25 tokens each for a small call)."""


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat request uses tools: ``kind`` none | auto | required | named."""

    kind: str
    function: str | None = None
    """The named function (kind ``named``)."""
    parallel: bool = False
    """Several calls allowed: the request sent ``parallel_tool_calls: true``."""

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def named_function(self) -> str:
        """The function of a ``named`` mode. Raises ValueError for a mode that names none."""
        if self.function is None:
            raise ValueError(f"tool mode {self.kind!r} names no function")
        return self.function


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text of the arguments object."""


def tool_mode(req: ChatCompletionRequest) -> ToolMode:
    """The request's tool mode. Raises OpenAIError 400 (``tool_choice``) for a choice without tools, an
    unknown function name, or tools combined with a constraining response_format."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return ToolMode("none")
    parallel = req.parallel_tool_calls is True
    if choice is None or choice == "auto":
        return ToolMode("auto", parallel=parallel)
    if choice == "none":
        return ToolMode("none")
    if choice == "required":
        mode = ToolMode("required", parallel=parallel)
    else:
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not in tools ({names}).",
                param="tool_choice",
            )
        mode = ToolMode("named", choice.function.name, parallel)
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(
            "tool_choice required or a named function cannot be combined with response_format.",
            param="response_format",
        )
    return mode


def tool_constraint(req: ChatCompletionRequest, mode: ToolMode) -> StructuredOutputsParams | None:
    """The grammar constraint of ``required``/named tool choices (None otherwise): ``required`` is an array of
    1 to ``MAX_PARALLEL_TOOL_CALLS`` calls with ``parallel_tool_calls: true``, else of exactly one."""
    if mode.kind == "named":
        tool = next(t for t in req.tools or () if t.function.name == mode.function)
        return StructuredOutputsParams.json_schema(_parameters(tool), "tools")
    if mode.kind != "required":
        return None
    items = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
        }
        for t in req.tools or ()
    ]
    most = MAX_PARALLEL_TOOL_CALLS if mode.parallel else 1
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": items}}
    return StructuredOutputsParams.json_schema(schema, "tools")


def conversation(req: ChatCompletionRequest, mode: ToolMode, template: str | None) -> tuple[list[dict], dict]:
    """(messages, template variables) for the chat template: tool calls and tool results of the history in
    the Hermes format, plus the tool signatures (system message, or the template's ``tools`` variable)."""
    native = bool(template) and "tools" in template
    messages = [_message(m, native) for m in req.messages]
    if not mode.active or not req.tools:
        return messages, {}
    tools = [msgspec.to_builtins(t) for t in req.tools]
    if native:
        return messages, {"tools": tools}
    block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages, {}


def _message(message: ChatMessage, native: bool) -> dict:
    content = msgspec.to_builtins(message.content) if message.content is not None else ""
    role = "system" if message.role == "developer" else message.role
    item: dict[str, Any] = {"role": role, "content": content}
    if message.name:
        item["name"] = message.name
    if native:
        if message.tool_calls:
            item["tool_calls"] = msgspec.to_builtins(message.tool_calls)
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        return item
    if message.tool_calls:
        calls = "\n".join(
            f'<tool_call>\n{{"name": {json.dumps(c.function.name)}, "arguments": '
            f"{c.function.arguments}}}\n</tool_call>"
            for c in message.tool_calls
        )
        item["content"] = f"{_text(content)}\n{calls}" if _text(content) else calls
    if message.role == "tool":
        item["content"] = f"<tool_response>\n{_text(content)}\n</tool_response>"
    return item


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content)
    return content or ""


def parse_tool_calls(mode: ToolMode, text: str) -> tuple[list[ParsedCall], str | None] | None:
    """(calls, remaining content) from a finished answer, or None when it holds no (valid) call.

    ``required``/``auto`` take the calls from kvscope.engine.server.tool_stream's scanner (the streaming
    path's parser), so ``arguments`` is the model's own text of the arguments object, byte for byte what a
    stream of the same answer sends; ``required`` must also be a JSON array of objects with
    ``name``/``arguments``.
    """
    try:
        if mode.kind == "named":
            return (
                ([ParsedCall(mode.named_function, text)], None)
                if isinstance(json.loads(text), dict)
                else None
            )
        if mode.kind == "required":
            items = json.loads(text)
            if not isinstance(items, list) or not all(
                isinstance(i["name"], str) and "arguments" in i for i in items
            ):
                return None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if mode.kind not in ("required", "auto"):
        return None
    calls, content = scan(mode.kind, text)
    if not calls:
        return None
    return [ParsedCall(name, arguments) for name, arguments in calls], content or None


def _parameters(tool: ToolDefinition) -> dict:
    return tool.function.parameters or _EMPTY_PARAMETERS


def new_call_id() -> str:
    """OpenAI-style tool call id ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"
