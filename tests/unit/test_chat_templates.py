"""The model's own chat template over the real turns: in the tokenizer, and in the gateway while the
tokenizer is away (the template it learned from the tokenizer, never ChatML for every model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmesh.chat_template import ChatTemplate
from llmesh.errors import InvalidArgument, Unavailable
from llmesh.v1 import common_pb2, gateway_pb2, tokenizer_pb2
from services.gateway.core import Gateway, GatewayConfig, InputTokenPredictor, validate
from services.gateway.peers import Deadline, PeerCallError
from services.gateway.pipeline import RequestPath
from services.tokenizer.core import TokenizerCore

# A Llama-3-like template: nothing like ChatML, so a ChatML fallback would show.
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CONFIG = GatewayConfig("docs", 4, 0.2, 32 * 1024, 4096, 1024, 128)


def turn(role: str, content: str = "", **kw: object) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=role, content=content, **kw)  # type: ignore[arg-type]


def test_the_tokenizer_renders_every_turn_with_the_models_template(tiny_model: Path) -> None:
    core = TokenizerCore(tiny_model, 1 << 20)
    call = common_pb2.ToolCall(id="call_1", name="weather", arguments='{"city": "Paris"}')
    text = core.chat_template(
        [
            turn("system", "Be brief."),
            turn("user", "My name is Ann."),
            turn("assistant", "Hello Ann."),
            turn("user", "Weather?"),
            turn("assistant", "", tool_calls=[call]),
            turn("tool", "18C", tool_call_id="call_1"),
        ],
        True,
    )
    # SmolLM2's ChatML: one block per turn, in order, nothing folded into another.
    assert text.count("<|im_start|>") == 7
    assert "<|im_start|>user\nMy name is Ann.<|im_end|>" in text
    assert "<|im_start|>assistant\nHello Ann.<|im_end|>" in text
    # ChatML shows no tool calls: the call is written into its assistant turn (else it is lost).
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18C<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role"):
        core.chat_template([turn("robot", "x")], True)


class TokenizerAway:
    """Peers whose tokenizer answers until `away` is set, then is unavailable."""

    def __init__(self) -> None:
        self.away = False

    async def chat_template(self, messages, deadline, model="", tools=()):  # type: ignore[no-untyped-def]
        if self.away:
            raise PeerCallError(Unavailable("tokenizer down"))
        return tokenizer_pb2.ApplyChatTemplateResponse(ids=[1, 2, 3], token_count=3)

    async def get_chat_template(self, deadline, model=""):  # type: ignore[no-untyped-def]
        return tokenizer_pb2.GetChatTemplateResponse(template=LLAMA_LIKE, special_tokens={"bos_token": "<BOS>"})


def bare_gateway(peers: object) -> Gateway:
    gateway = object.__new__(Gateway)
    gateway.peers = peers  # type: ignore[assignment]
    gateway.templates, gateway.local_templates, gateway._learning = {}, {}, {}
    gateway._background = set()
    gateway.predictor = InputTokenPredictor()
    gateway.admission = None  # type: ignore[assignment]  # the render stage alone never asks it
    return gateway


def path_of(gateway: Gateway, request: gateway_pb2.GenerateRequest) -> RequestPath:
    """The request's path through `gateway` (its `_render` stage alone is run here)."""
    return RequestPath(gateway, validate(request, CONFIG), Deadline.after(5))


async def test_while_the_tokenizer_is_away_the_gateway_renders_with_the_template_it_learned() -> None:
    peers = TokenizerAway()
    gateway = bare_gateway(peers)
    request = gateway_pb2.GenerateRequest(messages=[turn("user", "Hi"), turn("assistant", "Yo"), turn("user", "Q?")])
    ids, count = await path_of(gateway, request)._render([], "llama")
    assert ids == [1, 2, 3] and count == 3
    await asyncio.gather(*gateway._background)  # learned in the background
    peers.away = True
    path = path_of(gateway, request)
    text, _ = await path._render([], "llama")
    assert isinstance(text, str) and text.startswith("<BOS><|start_header_id|>system")
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>" in text and "<|im_start|>" not in text
    assert path.state.degradations == ["tokenizer_estimate"]


async def test_a_model_whose_template_is_not_known_here_falls_back_to_chatml_and_says_so() -> None:
    peers = TokenizerAway()
    peers.away = True
    gateway = bare_gateway(peers)
    path = path_of(gateway, gateway_pb2.GenerateRequest(prompt="Q?"))
    text, _ = await path._render([], "other")
    assert isinstance(text, str) and text.startswith("<|im_start|>system")
    assert path.state.degradations == ["tokenizer_estimate", "chat_template_unknown"]


def test_a_template_refusing_the_turns_is_a_bad_request() -> None:
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    gateway = bare_gateway(TokenizerAway())
    gateway.local_templates["strict"] = template
    path = path_of(gateway, gateway_pb2.GenerateRequest(prompt="Q?"))
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        path._render_locally([turn("user", "Q?")], "strict")
