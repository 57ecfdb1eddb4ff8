"""Client libraries benchmark: do the tools teams already use work against llmesh, as they do
against vLLM? Pass or fail per client feature, for each server, in one run.

Servers, side by side: the mesh (all five services, auth off, the prepared SmolLM2 and
all-MiniLM) and vLLM's CPU build (`make vllm`, .venv-vllm) on the same SmolLM2, started with
its Hermes tool parser so that automatic tool choice is accepted.

Features, each used as the library's docs show:

* openai SDK: chat, chat stream, `parse` (a pydantic model), a named tool, tools with the
  default (automatic) choice, embeddings, raw completions (the prompt's own token count),
  completions with echo + logprobs + max_tokens 0 (what evaluation harnesses send),
  `responses.create` with `previous_response_id`, the Responses stream
* anthropic SDK: `messages.create`, its stream, a forced tool (`tool_choice` type tool)
* LangChain: `with_structured_output` (json_schema), `bind_tools` with the default choice,
  an agent loop (`create_agent`, two tools)
* instructor: tools and JSON-schema modes (from .venv-lmeval: its jiter pin conflicts with the
  dev venv's openai)
* lm-evaluation-harness `local-completions` on a small multiple-choice task read from
  bench/data/clients_lmeval.jsonl (no dataset download), its log-likelihoods compared item by
  item with vLLM's: `lm_eval_max_abs_diff_nats`
* `vllm bench serve --ignore-eos` (vLLM's own benchmark module, random prompts) against each:
  `vllm_bench_failed` counts the mesh's failed requests

Result: bench/results/clients.json: `features` (name -> {"llmesh": "pass" | why it failed,
"vllm": ...}), llmesh_passed / llmesh_total, vllm_passed, lm_eval_max_abs_diff_nats,
vllm_bench_failed.

Run: `.venv/bin/python -m bench.clients` (`make vllm lmeval` first; about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
from pydantic import BaseModel, Field

from bench.common import machine, print_table, write_result
from bench.mesh import bench_mesh
from llmesh.testing import REPO_ROOT, VLLM_PYTHON, VllmServer, real_models_dir

LMEVAL_PYTHON = REPO_ROOT / ".venv-lmeval" / "bin" / "python"
LMEVAL_DATA = Path(__file__).resolve().parent / "data" / "clients_lmeval.jsonl"
KEY = "bench-clients-key"  # auth is off on the mesh; clients need some key to send
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@dataclass
class Server:
    name: str
    origin: str  # http://127.0.0.1:PORT
    model: str
    embedding_model: str

    @property
    def v1(self) -> str:
        return f"{self.origin}/v1"


def _openai(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=300)


def _anthropic(server: Server) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=server.origin, api_key=KEY, max_retries=0, timeout=300)


def _chat_model(server: Server) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.v1, api_key=KEY, model=server.model, max_tokens=48, temperature=0, max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    }
]


def openai_chat(s: Server) -> None:
    answer = _openai(s).chat.completions.create(model=s.model, messages=ASK, max_tokens=16)
    assert answer.choices[0].message.content, answer


def openai_chat_stream(s: Server) -> None:
    # Its own question: the same one as openai_chat would be a cached answer, sent in one piece.
    ask = [{"role": "user", "content": "Tell me a story about a fox."}]
    stream = _openai(s).chat.completions.create(model=s.model, messages=ask, max_tokens=16, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2, pieces


def openai_parse(s: Server) -> None:
    ask = [{"role": "user", "content": "Name a city in France and its country."}]
    answer = _openai(s).chat.completions.parse(model=s.model, messages=ask, response_format=City, max_tokens=48)
    assert isinstance(answer.choices[0].message.parsed, City), answer


def _check_calls(calls: Any, offered: set[str]) -> None:
    for call in calls or ():
        assert call.function.name in offered, call
        assert isinstance(json.loads(call.function.arguments), dict), call


def openai_tool_named(s: Server) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = _openai(s).chat.completions.create(
        model=s.model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=48
    )
    calls = answer.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather", answer
    _check_calls(calls, {"get_weather"})


def openai_tools_auto(s: Server) -> None:
    answer = _openai(s).chat.completions.create(model=s.model, messages=ASK, tools=TOOLS, max_tokens=48)
    message = answer.choices[0].message
    assert message.tool_calls or message.content, answer
    _check_calls(message.tool_calls, {"get_weather"})


def openai_embeddings(s: Server) -> None:
    found = _openai(s).embeddings.create(model=s.embedding_model, input=["a cat", "a dog"])
    assert len(found.data) == 2 and len(found.data[0].embedding) > 16, found


def openai_completions_raw(s: Server) -> None:
    """The prompt as it is: "Describe Paris in many sentences." is 7 tokens, not a chat turn."""
    answer = _openai(s).completions.create(model=s.model, prompt="Describe Paris in many sentences.", max_tokens=8)
    assert answer.choices[0].text and answer.usage is not None, answer
    assert answer.usage.prompt_tokens <= 8, f"prompt_tokens {answer.usage.prompt_tokens}: a template was added"


def openai_completions_echo_logprobs(s: Server) -> None:
    answer = _openai(s).completions.create(
        model=s.model, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=1
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and len(logprobs.token_logprobs) >= 5, answer
    assert all(v is not None for v in logprobs.token_logprobs[1:]), logprobs


def openai_responses(s: Server) -> None:
    client = _openai(s)
    first = client.responses.create(model=s.model, input="Name a colour.", max_output_tokens=16)
    assert first.output_text, first
    second = client.responses.create(
        model=s.model, input="Another one?", previous_response_id=first.id, max_output_tokens=8
    )
    alone = client.responses.create(model=s.model, input="Another one?", max_output_tokens=8)
    assert second.usage and alone.usage and first.usage
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens, (second, alone)


def openai_responses_stream(s: Server) -> None:
    events = list(
        _openai(s).responses.create(model=s.model, input="Tell me a story.", max_output_tokens=16, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds


def anthropic_messages(s: Server) -> None:
    message = _anthropic(s).messages.create(model=s.model, max_tokens=16, system="Be brief.", messages=ASK)
    assert message.content[0].type == "text" and message.content[0].text, message


def anthropic_stream(s: Server) -> None:
    ask = [{"role": "user", "content": "Tell me a story about an owl."}]
    with _anthropic(s).messages.stream(model=s.model, max_tokens=16, messages=ask) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 2 and final.stop_reason in ("end_turn", "max_tokens"), final


def anthropic_tool(s: Server) -> None:
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
    message = _anthropic(s).messages.create(
        model=s.model, max_tokens=48, messages=ASK, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}
    )
    use = next(b for b in message.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str), message


def langchain_structured(s: Server) -> None:
    city = _chat_model(s).with_structured_output(City, method="json_schema").invoke("Name a city in France.")
    assert isinstance(city, City), city


def _weather_tools() -> list[Any]:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return f"Sunny, 21 C in {city}"

    @tool
    def add(a: int, b: int) -> int:
        """The sum of two numbers."""
        return a + b

    return [get_weather, add]


def langchain_tools_default(s: Server) -> None:
    tools = _weather_tools()
    answer = _chat_model(s).bind_tools(tools).invoke("What is the weather in Paris?")
    for call in answer.tool_calls:
        assert call["name"] in {"get_weather", "add"} and isinstance(call["args"], dict), answer
    assert answer.tool_calls or answer.content, answer


# The conversation both servers' agents start from: one earlier exchange that shows the tool in
# use. A 135M model follows an example, not an instruction; without one it answers in text on
# either server, which says nothing about the client's protocol, the thing measured here.
AGENT_EXAMPLE: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather assistant. To answer about the weather, call get_weather."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "Cloudy, 15 C in Rome"},
    {"role": "assistant", "content": "It is cloudy and 15 C in Rome."},
]


def langchain_agent(s: Server) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, ToolMessage

    agent = create_agent(_chat_model(s), tools=_weather_tools())
    state = agent.invoke(
        {"messages": [*AGENT_EXAMPLE, {"role": "user", "content": "What is the weather in Paris?"}]},
        {"recursion_limit": 8},
    )
    messages = state["messages"][len(AGENT_EXAMPLE) + 1 :]  # what the agent did after the question
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls and all(c["name"] in {"get_weather", "add"} for c in calls), messages
    assert any(isinstance(m, ToolMessage) for m in messages), messages
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls, messages


FEATURES: dict[str, Callable[[Server], None]] = {
    "openai.chat": openai_chat,
    "openai.chat_stream": openai_chat_stream,
    "openai.parse": openai_parse,
    "openai.tool_named": openai_tool_named,
    "openai.tools_auto": openai_tools_auto,
    "openai.embeddings": openai_embeddings,
    "openai.completions_raw": openai_completions_raw,
    "openai.completions_echo_logprobs": openai_completions_echo_logprobs,
    "openai.responses": openai_responses,
    "openai.responses_stream": openai_responses_stream,
    "anthropic.messages": anthropic_messages,
    "anthropic.messages_stream": anthropic_stream,
    "anthropic.tool_use": anthropic_tool,
    "langchain.structured_output": langchain_structured,
    "langchain.tools_default_choice": langchain_tools_default,
    "langchain.agent_loop": langchain_agent,
}
INSTRUCTOR = ("instructor.tools", "instructor.json_schema")
HEADLINES = ("llmesh_passed", "llmesh_total", "vllm_passed", "lm_eval_max_abs_diff_nats", "vllm_bench_failed")


def _outcome(run: Callable[[], None]) -> str:
    try:
        run()
        return "pass"
    except Exception as exc:  # every failure is a finding, reported by name
        return f"{type(exc).__name__}: {exc}"[:400]


def instructor_features(server: Server) -> dict[str, str]:
    if not LMEVAL_PYTHON.is_file():
        return dict.fromkeys(INSTRUCTOR, "not run: no .venv-lmeval (`make lmeval`)")
    script = Path(__file__).resolve().parent / "clients_instructor.py"
    done = subprocess.run(
        [str(LMEVAL_PYTHON), str(script), server.v1, KEY, server.model], capture_output=True, text=True, timeout=900
    )
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict.fromkeys(INSTRUCTOR, f"instructor run failed: {done.stderr[-300:]}")
    return {name: found.get(name) or "pass" for name in INSTRUCTOR}


LMEVAL_TASK = """task: llmesh_clients
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def lm_eval(server: Server, tokenizer: Path, work: Path) -> tuple[str, list[float]]:
    """lm-evaluation-harness's local-completions on the custom task: its outcome, and every
    choice's log-likelihood in item order."""
    if not LMEVAL_PYTHON.is_file():
        return "not run: no .venv-lmeval (`make lmeval`)", []
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "llmesh_clients.yaml").write_text(LMEVAL_TASK.format(data=LMEVAL_DATA))
    out = work / f"lm-eval-{server.name}"
    model_args = (
        f"model={server.model},base_url={server.v1}/completions,tokenizer={tokenizer},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    cmd = [
        str(LMEVAL_PYTHON),
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        "llmesh_clients",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": KEY}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    samples = sorted(glob.glob(str(out / "**" / "samples_llmesh_clients_*.jsonl"), recursive=True))
    if done.returncode != 0 or not samples:
        return f"lm_eval exited {done.returncode}: {(done.stderr or done.stdout)[-300:]}", []
    values: list[float] = []
    rows = [json.loads(line) for line in Path(samples[-1]).read_text().splitlines() if line.strip()]
    for row in sorted(rows, key=lambda r: r["doc_id"]):
        values.extend(float(r[0]) for r in row["filtered_resps"])
    return "pass", values


def vllm_bench(server: Server, tokenizer: Path, work: Path) -> tuple[str, int | None]:
    """vLLM's `bench serve` (its module: the console script cannot find its own distribution in
    .venv-vllm) with --ignore-eos on random prompts: its outcome and its failed requests."""
    result = work / f"vllm-bench-{server.name}.json"
    code = (
        "import sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "parser = FlexibleArgumentParser()\n"
        "add_cli_args(parser)\n"
        "main(parser.parse_args(sys.argv[1:]))\n"
    )
    args = [
        "--backend",
        "openai",
        "--base-url",
        server.origin,
        "--endpoint",
        "/v1/completions",
        "--model",
        server.model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        "32",
        "--random-output-len",
        "16",
        "--num-prompts",
        "16",
        "--max-concurrency",
        "4",
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(work),
        "--result-filename",
        result.name,
        "--disable-tqdm",
    ]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(VLLM_PYTHON), "-c", code, *args], capture_output=True, text=True, timeout=900, env=env)
    if not result.is_file():
        return f"vllm bench exited {done.returncode}: {(done.stderr or done.stdout)[-300:]}", None
    found = json.loads(result.read_text())
    failed = int(found.get("failed", 16 - int(found.get("completed", 0))))
    return ("pass" if failed == 0 and found.get("completed") == 16 else f"{failed} of 16 failed"), failed


def run_all(server: Server, tokenizer: Path, work: Path) -> tuple[dict[str, str], list[float], int | None]:
    outcomes = {}
    for name, feature in FEATURES.items():
        started = time.monotonic()
        outcomes[name] = _outcome(lambda feature=feature: feature(server))  # type: ignore[misc]
        print(f"  {server.name:7s} {name:36s} {outcomes[name][:90]} ({time.monotonic() - started:.0f} s)", flush=True)
    outcomes.update(instructor_features(server))
    outcomes["lm_eval.local_completions"], loglikelihoods = lm_eval(server, tokenizer, work)
    outcomes["vllm_bench.serve_ignore_eos"], failed = vllm_bench(server, tokenizer, work)
    for name in (*INSTRUCTOR, "lm_eval.local_completions", "vllm_bench.serve_ignore_eos"):
        print(f"  {server.name:7s} {name:36s} {outcomes[name][:90]}", flush=True)
    return outcomes, loglikelihoods, failed


def served(origin: str) -> list[str]:
    answer = httpx.get(f"{origin}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    return [m["id"] for m in answer.json()["data"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--no-vllm", action="store_true", help="only the mesh (vLLM's column stays empty)")
    args = parser.parse_args(argv)
    models = real_models_dir()
    tokenizer = (models / "smollm2" / "current").resolve()
    result: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-clients-") as tmp:
        work = Path(tmp)
        vllm = None
        if not args.no_vllm and VllmServer.available():
            vllm = VllmServer(
                tokenizer,
                work / "vllm.log",
                eager=True,
                extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
            )
            vllm.start()  # starts while the mesh does
        try:
            with bench_mesh({"LLMESH_MAX_PROMPT_TOKENS": "1536"}) as mesh:
                origin = mesh.procs["gateway"].http_base_url(120).removesuffix("/v1")
                names = served(origin)
                mesh_server = Server("llmesh", origin, names[0], names[-1])
                print(f"llmesh at {origin}: {names}", flush=True)
                mesh_outcomes, mesh_ll, mesh_failed = run_all(mesh_server, tokenizer, work)
            vllm_outcomes: dict[str, str] = {}
            vllm_ll: list[float] = []
            if vllm is not None:
                vllm.wait_ready()
                vllm_server = Server("vllm", vllm.origin, "smollm2", "smollm2")
                vllm_outcomes, vllm_ll, _ = run_all(vllm_server, tokenizer, work)
        finally:
            if vllm is not None:
                vllm.stop()
    features = {
        name: {"llmesh": outcome, "vllm": vllm_outcomes.get(name, "not run")} for name, outcome in mesh_outcomes.items()
    }
    diff = (
        max(abs(a - b) for a, b in zip(mesh_ll, vllm_ll, strict=True))
        if mesh_ll and vllm_ll and len(mesh_ll) == len(vllm_ll)
        else None
    )
    result.update(
        {
            "features": features,
            "llmesh_passed": sum(v == "pass" for v in mesh_outcomes.values()),
            "llmesh_total": len(mesh_outcomes),
            "vllm_passed": sum(v == "pass" for v in vllm_outcomes.values()),
            "lm_eval_max_abs_diff_nats": diff,
            "vllm_bench_failed": mesh_failed,
            "backend": "vLLM CPU build, --enable-auto-tool-choice --tool-call-parser hermes, SmolLM2-135M-Instruct",
        }
    )
    result["passes"] = {
        "every_feature_on_llmesh": result["llmesh_passed"] == result["llmesh_total"] >= 12,
        "lm_eval_within_0.01_nats": diff is not None and diff <= 0.01,
        "vllm_bench_no_failures": mesh_failed == 0,
    }
    path = write_result("clients", result)
    print_table(
        {
            k: result[k]
            for k in ("llmesh_passed", "llmesh_total", "vllm_passed", "lm_eval_max_abs_diff_nats", "vllm_bench_failed")
        },
        "clients",
    )
    print(f"\nwrote {path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
