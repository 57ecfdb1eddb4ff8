"""Tool calls as models write them: the call formats of the model families (one parser each), the
format a chat template uses (detected from its source), and for templates that describe no tools
llmesh's own tool preamble and the grammar that keeps a call valid.

Formats (what the model writes; `parse` turns it into text and calls):

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Hermes 2 Pro, Qwen 2.5/3, and llmesh's preamble). Text around the blocks is the answer's text.
* `llama3`: Llama 3.1-3.3's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`.
* `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers), or one
  `name[ARGS]{...}` per call (v11 and later); text before the marker is the answer's text.

A call counts only when it names one of the offered functions and its arguments are a JSON
object; anything else stays text, as the model wrote it (never an error).

Templates without a tool format (SmolLM2's ChatML today) get the Hermes format through a preamble
appended to the system turn (`preamble`), and earlier calls written into assistant turns as Hermes
blocks (`text_turns`); tool results stay tool turns. Their answers are decoded
under `auto_grammar`: plain text (never containing `<tool_call>`), or one or more Hermes blocks
whose JSON is valid for one of the functions' parameter schemas. Whether to call stays the
model's choice; a call it makes is always well formed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmesh.v1 import common_pb2

FORMATS = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def detect_format(template_source: str) -> str:
    """The call format a chat template's own tool instructions use ("" when it shows none)."""
    if HERMES_OPEN in template_source:
        return "hermes"
    if MISTRAL_MARK in template_source:
        return "mistral"
    if PYTHON_TAG in template_source or "ipython" in template_source:
        return "llama3"
    return ""


def parameters_of(tool: common_pb2.Tool) -> Any:
    return json.loads(tool.parameters) if tool.parameters else dict(EMPTY_PARAMETERS)


def tool_dicts(tools: Iterable[common_pb2.Tool]) -> list[dict[str, Any]]:
    """The tools as Hugging Face chat templates take them (OpenAI's `tools` entries)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": parameters_of(t)},
        }
        for t in tools
    ]


def preamble(tools: Sequence[common_pb2.Tool]) -> str:
    """llmesh's tool instructions, in the Hermes format, for a template that shows no tools."""
    signatures = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": parameters_of(t)}, ensure_ascii=False)
        for t in tools
    )
    return (
        "# Tools\n\nYou may call one or more functions to answer the user. The functions, as JSON "
        f"signatures within <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, reply with nothing but a JSON object with its name and arguments within "
        f'{HERMES_OPEN}{HERMES_CLOSE} tags:\n{HERMES_OPEN}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{HERMES_CLOSE}\nThe result comes back in a tool turn; then answer the user "
        "in plain text."
    )


def hermes_block(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{HERMES_CLOSE}"


def text_turns(
    messages: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.Tool]
) -> list[common_pb2.ChatMessage]:
    """The turns for a template that shows no tools: the preamble after the system turn's text
    (a system turn is added when there is none) and each assistant turn's calls written after its
    text as Hermes blocks, so nothing of the conversation is lost to the template. Tool results
    stay `tool` turns, as the template shows them (ChatML: a turn of its own)."""
    out: list[common_pb2.ChatMessage] = []
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            blocks = [hermes_block(c.name, c.arguments) for c in message.tool_calls]
            content = "\n".join(([message.content] if message.content else []) + blocks)
            out.append(common_pb2.ChatMessage(role="assistant", content=content))
        else:
            copied = common_pb2.ChatMessage()
            copied.CopyFrom(message)
            copied.ClearField("tool_calls")
            copied.ClearField("tool_call_id")
            out.append(copied)
    if tools:
        if out and out[0].role == "system":
            out[0].content = f"{out[0].content}\n\n{preamble(tools)}" if out[0].content else preamble(tools)
        else:
            out.insert(0, common_pb2.ChatMessage(role="system", content=preamble(tools)))
    return out


def auto_grammar(tools: Sequence[common_pb2.Tool]) -> str:
    """The Lark grammar (llguidance's dialect) of an answer that is plain text (never holding
    `<tool_call>`, possibly empty) or one or more Hermes blocks, each a JSON object
    {"name": <a tool>, "arguments": <valid for its parameters>}."""
    union = {
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": parameters_of(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ],
    }
    return "\n".join(
        [
            "start: TEXT | calls |",
            'calls: call ("\\n" call)*',
            f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"',
            f"body: %json {json.dumps(union)}",
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){HERMES_OPEN}(?s:.*)/",
        ]
    )


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Segment:
    """A piece of the answer in order: text, or a call."""

    text: str = ""
    call: Call | None = None


def _call_of(value: Any, names: frozenset[str], arguments_key: str = "arguments") -> Call | None:
    """A call from a parsed JSON value: {"name": <offered>, arguments_key: <object or its JSON>}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    args = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(value["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back while streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _hermes(text: str, names: frozenset[str], final: bool) -> tuple[list[Segment], int]:
    found, end = _hermes_blocks(text, names, final)
    if any(s.call is not None for s in found):  # blank lines between and around calls are no text
        found = [s for s in found if s.call is not None or s.text.strip()]
    return found, end


def _hermes_blocks(text: str, names: frozenset[str], final: bool) -> tuple[list[Segment], int]:
    segments: list[Segment] = []
    at = 0
    while True:
        start = text.find(HERMES_OPEN, at)
        if start < 0:
            end = len(text) if final else len(text) - _partial_suffix(text[at:], HERMES_OPEN)
            if not final:  # a blank end may still turn out to lie before a call
                end = at + len(text[at:end].rstrip())
            if end > at:
                segments.append(Segment(text=text[at:end]))
            return segments, end
        if start > at:
            segments.append(Segment(text=text[at:start]))
        close = text.find(HERMES_CLOSE, start)
        if close < 0 and not final:
            return segments, start
        body_end = close if close >= 0 else len(text)
        end = close + len(HERMES_CLOSE) if close >= 0 else len(text)
        call = _call_of(_loads(text[start + len(HERMES_OPEN) : body_end]), names)
        segments.append(Segment(call=call) if call is not None else Segment(text=text[start:end]))
        at = end


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Consecutive JSON values separated by whitespace and `separators`; None when any is not JSON."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _llama3(text: str, names: frozenset[str], final: bool) -> tuple[list[Segment], int]:
    stripped = text.lstrip()
    body = stripped.removeprefix(PYTHON_TAG).lstrip()
    candidate = body.startswith("{") or (not body and (not stripped or PYTHON_TAG.startswith(stripped)))
    if not candidate:
        return [Segment(text=text)] if text else [], len(text)
    if not final:
        return [], 0
    values = _json_values(body, ";")
    calls = [_call_of(v, names, "parameters") for v in values or ()]
    if not values or any(c is None for c in calls):
        return [Segment(text=text)] if text else [], len(text)
    return [Segment(call=c) for c in calls], len(text)


def _mistral(text: str, names: frozenset[str], final: bool) -> tuple[list[Segment], int]:
    start = text.find(MISTRAL_MARK)
    if start < 0:
        end = len(text) if final else len(text) - _partial_suffix(text, MISTRAL_MARK)
        return ([Segment(text=text[:end])] if end else []), end
    head = [Segment(text=text[:start])] if start else []
    if not final:
        return head, start
    tail = text[start:]
    calls: list[Call | None] = []
    if MISTRAL_ARGS in tail:  # v11+: [TOOL_CALLS]name[ARGS]{...} per call
        for part in tail.split(MISTRAL_MARK)[1:]:
            name, _, args = part.partition(MISTRAL_ARGS)
            calls.append(_call_of({"name": name.strip(), "arguments": _loads(args.strip())}, names))
    else:
        values = _json_values(tail[len(MISTRAL_MARK) :], "")
        items = [item for v in values or () for item in (v if isinstance(v, list) else [v])]
        calls = [_call_of(item, names) for item in items] if values else [None]
    if not calls or any(c is None for c in calls):
        return [*head, Segment(text=tail)], len(text)
    return head + [Segment(call=c) for c in calls if c is not None], len(text)


PARSERS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}


def segments(text: str, tool_format: str, names: Iterable[str], final: bool = True) -> list[Segment]:
    """The answer as text and calls, in order. `final` False (while streaming): only what more
    text cannot change (a call is held back until it is complete)."""
    return PARSERS[tool_format](text, frozenset(names), final)[0]


def parse(text: str, tool_format: str, names: Iterable[str]) -> tuple[str, list[Call]]:
    """The answer's text (outside its calls) and its calls; no call: the text as it is."""
    found = segments(text, tool_format, names)
    return "".join(s.text for s in found), [s.call for s in found if s.call is not None]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    """A whole call as streamed: its position among the answer's calls, id, name and arguments."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class CallStream:
    """One answer's text as it streams, split into text to show and calls: `feed` takes each
    piece and returns (text, calls) that are now certain; `finish` returns the rest. The text
    and calls returned over the whole stream are the answer's (`text`, `calls`)."""

    tool_format: str
    names: frozenset[str]
    raw: list[str] = field(default_factory=list)
    shown: int = 0  # characters of text returned
    calls: list[CallDelta] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        if piece:
            self.raw.append(piece)
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[CallDelta]]:
        found = segments("".join(self.raw), self.tool_format, self.names, final)
        text = "".join(s.text for s in found)
        calls = [s.call for s in found if s.call is not None]
        new_text = text[self.shown :]
        self.shown = len(text)
        new_calls = [CallDelta(i, call_id(), c.name, c.arguments) for i, c in enumerate(calls) if i >= len(self.calls)]
        self.calls.extend(new_calls)
        if new_text:
            self.text_parts.append(new_text)
        return new_text, new_calls


def tool_calls_of(calls: Sequence[CallDelta]) -> list[common_pb2.ToolCall]:
    return [common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def names_of(tools: Iterable[common_pb2.Tool | Mapping[str, Any]]) -> frozenset[str]:
    return frozenset(t.name if isinstance(t, common_pb2.Tool) else str(t["function"]["name"]) for t in tools)
