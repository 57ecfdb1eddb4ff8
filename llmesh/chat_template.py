"""A model's own chat template (its Jinja source, as Hugging Face tokenizers ship it) over the real
turns of a conversation. The tokenizer service renders with it; the gateway renders with the same
code and the same template, learned from the tokenizer, while that service is away.

Turns are given to the template in the shape Hugging Face templates expect: `role`, `content`,
and where set `name`, `tool_call_id` and `tool_calls` (each `{"id", "type": "function",
"function": {"name", "arguments"}}`, the arguments as a mapping when they are a JSON object, as
templates apply `tojson` to them). `tools` (JSON Schema function definitions) are passed for
templates that describe tools to the model. A template that shows no tools (none of its text
reads `tools`) gets them through llmesh's Hermes-format preamble instead, and its turns with tool
calls and tool results written as text (`llmesh.tool_calls.text_turns`), since it would drop them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmesh import tool_calls
from llmesh.v1 import common_pb2

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateRefused(ValueError):
    """The template itself refused the turns (its `raise_exception`, e.g. roles out of order)."""


def _raise(message: str) -> None:
    raise TemplateRefused(message)


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken object."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def load_template(model_dir: Path, tool_format: str = "") -> ChatTemplate:
    """The chat template a model folder ships (chat_template.jinja, else tokenizer_config.json's
    `chat_template`); ValueError when it has none. `tool_format`: see `ChatTemplate`."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template_file = model_dir / "chat_template.jinja"
    source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if not source or not isinstance(source, str):
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    return ChatTemplate(source, {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}, tool_format)


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def turn_dict(message: common_pb2.ChatMessage) -> dict[str, Any]:
    """One turn as a Hugging Face chat template reads it."""
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        turn["name"] = message.name
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in message.tool_calls
        ]
    return turn


class ChatTemplate:
    """One model's chat template, compiled once (a sandboxed Jinja environment: a template is
    data, never code with access to the process)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], tool_format: str = "") -> None:
        """`tool_format`: the call format the model writes ("" or "auto": the one the template's
        own text shows; Hermes, the preamble's, for a template that shows none)."""
        if not source:
            raise ValueError("empty chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.source = source
        self.special = {k: special_tokens.get(k, "") for k in SPECIAL_TOKENS}
        self.template = env.from_string(source)
        # Whether the template itself shows the tools (it reads `tools`); else the preamble does.
        self.renders_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        detected = tool_calls.detect_format(source) if self.renders_tools else ""
        self.tool_format = tool_format if tool_format in tool_calls.FORMATS else detected or "hermes"

    def render(
        self,
        messages: Sequence[common_pb2.ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[common_pb2.Tool] = (),
    ) -> str:
        """The rendered prompt; TemplateRefused when the template rejects the turns. `tools`:
        the functions the model may call, shown by the template or by llmesh's preamble."""
        extra: dict[str, Any] = {}
        if self.renders_tools:
            if tools:
                extra["tools"] = tool_calls.tool_dicts(tools)
        elif tools or any(m.tool_calls or m.role == "tool" for m in messages):
            messages = tool_calls.text_turns(messages, tools)
        try:
            return self.template.render(
                messages=[turn_dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self.special,
            )
        except TemplateError as exc:
            raise TemplateRefused(str(exc)) from exc
