"""A model's replicas behind the gateway: freeze, kill, mixed load and prefix affinity.

    python -m bench.replicas [--clients 32] [--freeze-seconds 10] [--mixed-seconds 30] [--turns 6]

Three builtin inference replicas of the tiny model as processes (batch room 8 each), the
tokenizer, and gateways over them: the default (least predicted wait, prefix affinity), one
with LLMESH_ROUTING_PICK=round_robin (the load-blind arm, in the same run) and one routed to each
replica alone (the affinity phase's yardstick). In one run:

* freeze    32 closed-loop streaming clients (32-token answers); one replica SIGSTOPped for
            --freeze-seconds, then SIGCONT: `freeze_failed_before_first_token` (target 0: only
            streams already past their first token there may fail), `freeze_eject_s` (SIGSTOP to
            its ejection, from the gateway's llmesh_gateway_replica_ejected; target <= 1) and
            `freeze_return_s` (SIGCONT to its return; target <= 2).
* kill      the same clients; one replica SIGKILLed, then started again on its port:
            `kill_failed_before_first_token` (target 0), `kill_rejoined` (it serves requests
            again) and `kill_rejoin_s` (its restart to its first request; the restart itself,
            loading the model, is not counted).
* mixed     as many closed-loop clients as the replicas have rows (24; --mixed-clients), a
            quarter wanting 512-token answers and the rest 16, on the default gateway and then
            on the round-robin one: `short_ttft_p95_s` against `short_ttft_p95_round_robin_s`
            (target <= 0.5 x). With every row taken but one, the load-aware pick finds the row
            that just freed; round robin sends the next request to a replica whose rows may all
            be taken, often by long answers.
* affinity  24 conversations of --turns turns each (a system prompt of their own, every turn
            the whole conversation so far), on the default gateway, then the round-robin one;
            then each replica serving a third of them alone, the three at once (on shared cores
            a lone replica would have the machine to itself): `affinity_hit_rate` (turns sent
            to the replica holding their prefix, from llmesh_gateway_prefix_affinity; target
            >= 0.8) against `round_robin_hit_rate` (about 1/3), `affinity_ttft_p50_s` within
            1.2 x `single_replica_ttft_p50_s`, and `max_load_over_mean` (the busiest replica's
            requests over the mean; target <= 1.3). Beside them, the share of prompt tokens the
            engines' own prefix caches served (`affinity_engine_prefix_hit_rate`,
            `round_robin_engine_prefix_hit_rate`).

The openai arm (--arms openai; --arms builtin skips it): two vLLM CPU servers of SmolLM2-135M
(eager, VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib), each fronted by its own inference service on
LLMESH_INFERENCE_BACKEND=openai, both targets of one gateway. The same freeze and kill, with the
victim's vLLM process group SIGSTOPped / SIGKILLed (its inference service keeps running) and, for
the kill, a new vLLM started on its port: `openai_freeze_*`, `openai_kill_*` (plus
`openai_kill_restart_s`, the vLLM restart, not counted in the rejoin) and `openai_vllm_rss_gib`.
One arm alone merges its figures into the existing JSON, the other arm's kept (with their date).

Writes bench/results/replicas.json (with "passes") and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc

from bench.common import machine, print_table, write_result
from bench.common import percentile as _percentile
from llmesh.supervisor import Mesh
from llmesh.testing import build_tiny_model, free_port, real_models_dir
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

REPLICAS = ("a", "b", "c")
BATCH = 8
DEADLINE_S = 30.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
WORDS = "sea lamp tide rock gull storm ship rope salt fog night keeper light wave stone wind".split()


@dataclass
class Outcome:
    started: float
    ttft: float | None = None  # seconds to the first delta
    ended: float = 0.0
    error: str = ""  # the status code's name
    tokens: int = 0


def percentile(values: Sequence[float], q: float) -> float | None:
    found = _percentile(values, q)
    return None if math.isnan(found) else found


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return []
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def by_label(port: int, name: str, label: str) -> dict[str, float]:
    return {labels.get(label, ""): value for n, labels, value in scrape(port) if n == name}


def request(prompt: str, tokens: int, messages: Sequence[common_pb2.ChatMessage] = ()) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=0)
    if messages:
        return gateway_pb2.GenerateRequest(messages=messages, use_cache=False, use_retrieval=False, sampling=sampling)
    return gateway_pb2.GenerateRequest(prompt=prompt, use_cache=False, use_retrieval=False, sampling=sampling)


async def stream(stub: gateway_pb2_grpc.GatewayStub, req: gateway_pb2.GenerateRequest) -> tuple[Outcome, str]:
    out = Outcome(time.monotonic())
    text = ""
    try:
        async for message in stub.GenerateStream(req, timeout=DEADLINE_S):
            if message.HasField("final"):
                text = message.final.text
                out.tokens = message.final.usage.output_tokens
            elif out.ttft is None:
                out.ttft = time.monotonic() - out.started
    except grpc.aio.AioRpcError as err:
        out.error = err.code().name
    out.ended = time.monotonic()
    return out, text


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="llmesh-replicas-"))
        models_dir = real_models_dir()
        build_tiny_model(models_dir)
        env = {
            "LLMESH_DATA_DIR": str(self.tmp / "data"),
            "LLMESH_MODELS_DIR": str(models_dir),
            "LLMESH_LOG_LEVEL": os.environ.get("LLMESH_LOG_LEVEL", "WARNING"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": "",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
            "LLMESH_TOKENIZER_MODEL": "tiny",
        }
        self.mesh = Mesh(env=env, services=("tokenizer",))
        self.ports = {r: free_port() for r in REPLICAS}
        self.stopped: set[str] = set()
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.victim = REPLICAS[-1]

    def target(self, r: str) -> str:
        return f"127.0.0.1:{self.ports[r]}"

    def start_replica(self, r: str) -> None:
        name = f"inference-{r}"
        self.mesh.ports[name] = self.ports[r]
        self.mesh.start_one(
            name,
            module="inference",
            extra_env={
                "LLMESH_INFERENCE_MODEL": "tiny",
                "LLMESH_MAX_BATCH_SIZE": str(BATCH),
                "LLMESH_METRICS_PORT": "0",
            },
        )

    def start(self) -> None:
        self.mesh.start()
        for r in REPLICAS:
            self.start_replica(r)
        common = {"LLMESH_CACHE_TARGET": "127.0.0.1:1", "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1"}
        everyone = "|".join(self.target(r) for r in REPLICAS)
        for name, extra in (
            ("gateway", {"LLMESH_INFERENCE_TARGET": everyone}),
            ("gateway-rr", {"LLMESH_INFERENCE_TARGET": everyone, "LLMESH_ROUTING_PICK": "round_robin"}),
            *((f"gateway-{r}", {"LLMESH_INFERENCE_TARGET": self.target(r)}) for r in REPLICAS),
        ):
            self.mesh.start_one(name, module="gateway", extra_env={**common, **extra})

    def stub(self, gateway: str) -> gateway_pb2_grpc.GatewayStub:
        if gateway not in self.channels:
            self.channels[gateway] = grpc.aio.insecure_channel(self.mesh.target(gateway))
        return gateway_pb2_grpc.GatewayStub(self.channels[gateway])

    def metrics_port(self, gateway: str) -> int:
        return self.mesh.procs[gateway].metrics_port

    def ejected(self, gateway: str, r: str) -> bool:
        return (
            by_label(self.metrics_port(gateway), "llmesh_gateway_replica_ejected", "replica").get(self.target(r)) == 1
        )

    def replica_requests(self, gateway: str) -> dict[str, float]:
        return by_label(self.metrics_port(gateway), "llmesh_gateway_replica_requests_total", "replica")

    def engine_prefix_tokens(self) -> tuple[float, float]:
        """(prompt tokens the replicas' prefix caches served, tokens looked up), summed."""
        hit = query = 0.0
        for r in REPLICAS:
            for name, _, value in scrape(self.mesh.procs[f"inference-{r}"].metrics_port):
                if name == "llmesh_inference_prefix_hit_tokens_total":
                    hit += value
                elif name == "llmesh_inference_prefix_query_tokens_total":
                    query += value
        return hit, query

    def signal(self, r: str, sig: int) -> None:
        self.mesh.procs[f"inference-{r}"].proc.send_signal(sig)

    def kill_victim(self, r: str) -> None:
        self.signal(r, signal.SIGKILL)
        self.mesh.stop_one(f"inference-{r}")

    def restart_victim(self, r: str) -> None:
        self.start_replica(r)

    def gateways(self) -> tuple[str, ...]:
        return ("gateway", "gateway-rr", *(f"gateway-{r}" for r in REPLICAS))

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    def cleanup(self) -> None:
        for r in self.stopped:
            with_proc = self.mesh.procs.get(f"inference-{r}")
            if with_proc is not None:
                with_proc.proc.send_signal(signal.SIGCONT)
        self.mesh.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- load

    async def closed_loop(
        self, gateway: str, clients: int, stop: asyncio.Event, tokens: Sequence[int], sink: list[tuple[int, Outcome]]
    ) -> None:
        stub = self.stub(gateway)

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                want = tokens[i % len(tokens)]
                out, _ = await stream(
                    stub, request(f"Tell me about the {WORDS[(i + n) % len(WORDS)]} ({i}.{n}).", want)
                )
                sink.append((want, out))
                n += 1

        await asyncio.gather(*(client(i) for i in range(clients)))

    async def wait_until(self, check: Any, timeout: float, every: float = 0.05) -> float | None:
        """Seconds until `check()` held (polled: the gateway's /metrics), None if it never did."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if await asyncio.to_thread(check):
                return time.monotonic() - started
            await asyncio.sleep(every)
        return None

    async def warm(self) -> None:
        for gateway in self.gateways():
            stub = self.stub(gateway)
            await asyncio.gather(*(stream(stub, request(f"warm up {i}", 8)) for i in range(6)))

    async def freeze(self) -> dict[str, Any]:
        sink: list[tuple[int, Outcome]] = []
        stop = asyncio.Event()
        load = asyncio.create_task(self.closed_loop("gateway", self.args.clients, stop, [32], sink))
        await asyncio.sleep(3)
        victim = self.victim
        frozen_at = time.monotonic()
        self.signal(victim, signal.SIGSTOP)
        self.stopped.add(victim)
        eject_s = await self.wait_until(lambda: self.ejected("gateway", victim), self.args.freeze_seconds)
        await asyncio.sleep(max(0.0, self.args.freeze_seconds - (time.monotonic() - frozen_at)))
        self.signal(victim, signal.SIGCONT)
        self.stopped.discard(victim)
        return_s = await self.wait_until(lambda: not self.ejected("gateway", victim), 15)
        await asyncio.sleep(3)
        stop.set()
        await load
        window = [o for _, o in sink if o.ended >= frozen_at and o.started <= frozen_at + self.args.freeze_seconds + 2]
        return {
            "freeze_failed_before_first_token": sum(1 for o in window if o.error and o.ttft is None),
            "freeze_failed_after_first_token": sum(1 for o in window if o.error and o.ttft is not None),
            "freeze_errors": _codes(o for _, o in sink),
            "freeze_requests": len(sink),
            "freeze_eject_s": eject_s,
            "freeze_return_s": return_s,
            "freeze_ttft_p99_s": percentile([o.ttft for o in window if o.ttft is not None], 0.99),
        }

    async def kill(self) -> dict[str, Any]:
        sink: list[tuple[int, Outcome]] = []
        stop = asyncio.Event()
        load = asyncio.create_task(self.closed_loop("gateway", self.args.clients, stop, [32], sink))
        await asyncio.sleep(3)
        victim = self.victim
        killed_at = time.monotonic()
        self.kill_victim(victim)
        eject_s = await self.wait_until(lambda: self.ejected("gateway", victim), 10)
        await asyncio.sleep(3)
        before = self.replica_requests("gateway").get(self.target(victim), 0.0)
        await asyncio.to_thread(self.restart_victim, victim)
        restarted = time.monotonic()
        rejoin_s = await self.wait_until(
            lambda: self.replica_requests("gateway").get(self.target(victim), 0.0) > before, 30
        )
        await asyncio.sleep(2)
        stop.set()
        await load
        window = [o for _, o in sink if o.ended >= killed_at and o.started <= restarted]
        return {
            "kill_failed_before_first_token": sum(1 for o in window if o.error and o.ttft is None),
            "kill_failed_after_first_token": sum(1 for o in window if o.error and o.ttft is not None),
            "kill_errors": _codes(o for _, o in sink),
            "kill_requests": len(sink),
            "kill_eject_s": eject_s,
            "kill_rejoined": rejoin_s is not None,
            "kill_rejoin_s": rejoin_s,
        }

    async def mixed(self, gateway: str) -> dict[str, Any]:
        sink: list[tuple[int, Outcome]] = []
        stop = asyncio.Event()
        tokens = [512, 16, 16, 16]
        clients = self.args.mixed_clients or len(REPLICAS) * BATCH
        load = asyncio.create_task(self.closed_loop(gateway, clients, stop, tokens, sink))
        await asyncio.sleep(self.args.mixed_seconds)
        stop.set()
        await load
        settled = sink[len(sink) // 10 :]  # past the first tenth: the long answers have spread
        short = [o.ttft for t, o in settled if t == 16 and o.ttft is not None]
        return {
            "short_ttft_p95_s": percentile(short, 0.95),
            "short_ttft_p50_s": percentile(short, 0.5),
            "short_answers": len(short),
            "long_answers": sum(1 for t, o in settled if t == 512 and not o.error),
            "errors": _codes(o for _, o in sink),
        }

    async def conversations(self, gateway: str, count: int, turns: int, seed: int) -> list[Outcome]:
        stub = self.stub(gateway)
        outcomes: list[Outcome] = []

        async def conversation(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            persona = " ".join(rng.choice(WORDS) for _ in range(24))
            history = [common_pb2.ChatMessage(role="system", content=f"You are keeper {i} of the {persona}.")]
            for turn in range(turns):
                question = " ".join(rng.choice(WORDS) for _ in range(12))
                history.append(common_pb2.ChatMessage(role="user", content=f"Turn {turn}: {question}?"))
                out, text = await stream(stub, request("", 16, history))
                if turn:
                    outcomes.append(out)  # a turn after the first: its prefix is somewhere
                history.append(common_pb2.ChatMessage(role="assistant", content=text or "..."))

        await asyncio.gather(*(conversation(i) for i in range(count)))
        return outcomes

    async def affinity(self) -> dict[str, Any]:
        count, turns = self.args.conversations, self.args.turns
        result: dict[str, Any] = {}
        for gateway, key in (("gateway", "affinity"), ("gateway-rr", "round_robin")):
            port = self.metrics_port(gateway)
            before = by_label(port, "llmesh_gateway_prefix_affinity_total", "outcome")
            requests_before = self.replica_requests(gateway)
            hit_before, query_before = self.engine_prefix_tokens()
            outcomes = await self.conversations(gateway, count, turns, seed=1 if key == "affinity" else 2)
            hit_after, query_after = self.engine_prefix_tokens()
            looked_up = query_after - query_before
            # What the engines' own prefix caches served of the prompts (all turns, the first included).
            result[f"{key}_engine_prefix_hit_rate"] = (hit_after - hit_before) / looked_up if looked_up else None
            after = by_label(port, "llmesh_gateway_prefix_affinity_total", "outcome")
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            judged = delta.get("hit", 0) + delta.get("miss", 0) + delta.get("overloaded", 0)
            result[f"{key}_hit_rate"] = delta.get("hit", 0) / judged if judged else None
            result[f"{key}_outcomes"] = delta
            result[f"{key}_ttft_p50_s"] = percentile([o.ttft for o in outcomes if o.ttft is not None], 0.5)
            result[f"{key}_errors"] = _codes(outcomes)
            served = self.replica_requests(gateway)
            per = [served.get(t, 0.0) - requests_before.get(t, 0.0) for t in map(self.target, REPLICAS)]
            result[f"{key}_requests_per_replica"] = per
            if key == "affinity":
                mean = sum(per) / len(per)
                result["max_load_over_mean"] = max(per) / mean if mean else None
        # The yardstick: each replica serving a third of the conversations on its own (a gateway
        # routed to it alone), all three at once, so the replicas share the machine's cores as
        # they do above.
        share = max(1, count // len(REPLICAS))
        groups = await asyncio.gather(
            *(self.conversations(f"gateway-{r}", share, turns, seed=3 + i) for i, r in enumerate(REPLICAS))
        )
        single = [o for group in groups for o in group]
        result["single_replica_ttft_p50_s"] = percentile([o.ttft for o in single if o.ttft is not None], 0.5)
        return result


def _codes(outcomes: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            counts[o.error] = counts.get(o.error, 0) + 1
    return counts


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    try:
        await asyncio.to_thread(bench.start)
        await bench.warm()
        result: dict[str, Any] = {}
        phases = set(args.phases.split(","))
        if "freeze" in phases:
            print("freeze", flush=True)
            result["freeze"] = await bench.freeze()
        if "kill" in phases:
            print("kill", flush=True)
            result["kill"] = await bench.kill()
        if "mixed" in phases:
            print("mixed load", flush=True)
            result["mixed"] = await bench.mixed("gateway")
            result["mixed_round_robin"] = await bench.mixed("gateway-rr")
        if "affinity" in phases:
            print("affinity", flush=True)
            result["affinity"] = await bench.affinity()
        return result
    finally:
        await bench.close()
        bench.cleanup()


OPENAI_REPLICAS = ("a", "b")


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in a process group (a vLLM server: its API server, its
    engine core and their helpers), from /proc."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid:  # the fifth field of stat: the process group
                total += int((entry / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


class OpenaiBench(Bench):
    """The openai arm: two vLLM CPU servers (SmolLM2-135M), each fronted by its own inference
    service on LLMESH_INFERENCE_BACKEND=openai, both targets of one gateway (gateway-level
    replicas). The victim's vLLM is the one frozen or killed (its whole process group); the
    inference service in front of it keeps running, as it would in a pod beside the engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="llmesh-replicas-openai-"))
        self.models_dir = real_models_dir()
        env = {
            "LLMESH_DATA_DIR": str(self.tmp / "data"),
            "LLMESH_MODELS_DIR": str(self.models_dir),
            "LLMESH_LOG_LEVEL": os.environ.get("LLMESH_LOG_LEVEL", "WARNING"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": "",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
            "LLMESH_NICE": "0",
        }
        self.mesh = Mesh(env=env, services=("tokenizer",))
        self.ports = {r: free_port() for r in OPENAI_REPLICAS}
        self.stopped: set[str] = set()
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.victim = OPENAI_REPLICAS[-1]
        self.vllm = {r: self._server(r) for r in OPENAI_REPLICAS}
        self.vllm_ports = {r: v.port for r, v in self.vllm.items()}
        self.rss: dict[str, int] = {}
        self.vllm_start_s: dict[str, float] = {}
        self.restart_s: float | None = None

    def _server(self, r: str, core: int | None = None) -> Any:
        from llmesh.testing import VllmServer

        # eager: no torch.compile (minutes on 2 cores, at every start): the restart in the kill
        # phase stays short, and the scenarios measure routing, not decode speed. `core`: its
        # OpenMP threads there (default: vLLM's `auto`, which puts both servers on core 0 and
        # leaves the other core to the mesh, as engines on hosts or GPUs of their own would).
        return VllmServer(
            (self.models_dir / "smollm2" / "current").resolve(),
            self.tmp / f"vllm-{r}.log",
            kv_cache_gib=self.args.vllm_kv_gib,
            max_model_len=2048,
            eager=True,
            env=None if core is None else {"VLLM_CPU_OMP_THREADS_BIND": str(core)},
        )

    def gateways(self) -> tuple[str, ...]:
        return ("gateway",)

    def start_replica(self, r: str) -> None:
        name = f"inference-{r}"
        self.mesh.ports[name] = self.ports[r]
        self.mesh.start_one(
            name,
            module="inference",
            extra_env={
                "LLMESH_INFERENCE_BACKEND": "openai",
                "LLMESH_BACKEND_URLS": self.vllm[r].base_url,
                "LLMESH_BACKEND_MODEL": "smollm2",
                "LLMESH_METRICS_PORT": "0",
            },
        )

    def start(self) -> None:
        for r in OPENAI_REPLICAS:
            self.vllm[r].start()
        for r in OPENAI_REPLICAS:
            started = time.monotonic()
            self.vllm[r].wait_ready()
            self.vllm_start_s[r] = time.monotonic() - started
            self.rss[r] = group_rss_bytes(self.vllm[r].process.pid)
        print(f"vLLM ready: RSS {', '.join(f'{r} {v / 2**30:.2f} GiB' for r, v in self.rss.items())}", flush=True)
        self.mesh.start()
        for r in OPENAI_REPLICAS:
            self.start_replica(r)
        common = {"LLMESH_CACHE_TARGET": "127.0.0.1:1", "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1"}
        everyone = "|".join(self.target(r) for r in OPENAI_REPLICAS)
        self.mesh.start_one("gateway", module="gateway", extra_env={**common, "LLMESH_INFERENCE_TARGET": everyone})

    def signal(self, r: str, sig: int) -> None:
        os.killpg(self.vllm[r].process.pid, sig)

    def kill_victim(self, r: str) -> None:
        self.vllm[r].kill()

    def restart_victim(self, r: str) -> None:
        """A new vLLM on the victim's port (the inference service in front polls it back), its
        threads on the last core: started on core 0 beside the survivor's worker, vLLM's start-up
        took 200 to more than 900 s here; on a core of its own, about a minute."""
        cores = os.cpu_count() or 1
        server = self._server(r, cores - 1 if cores > 1 else None)
        server.port = self.vllm_ports[r]
        self.vllm[r] = server
        started = time.monotonic()
        server.start()
        server.wait_ready()
        self.restart_s = time.monotonic() - started

    def cleanup(self) -> None:
        for r in OPENAI_REPLICAS:
            server = self.vllm.get(r)
            if server is not None and server.process is not None and server.process.poll() is None:
                try:
                    os.killpg(server.process.pid, signal.SIGCONT)  # a frozen one must be able to stop
                except OSError:
                    pass
        self.mesh.stop()
        for server in self.vllm.values():
            server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def run_openai(args: argparse.Namespace) -> dict[str, Any]:
    bench = OpenaiBench(args)
    try:
        await asyncio.to_thread(bench.start)
        await bench.warm()
        phases = set(args.phases.split(","))
        freeze: dict[str, Any] = {}
        kill: dict[str, Any] = {}
        if "freeze" in phases:
            freeze = await bench.freeze()
            print_table({k: v for k, v in freeze.items() if not isinstance(v, dict)}, "openai freeze")
        if "kill" in phases:  # its vLLM restart alone takes minutes here
            kill = await bench.kill()
            kill["kill_restart_s"] = bench.restart_s
            print_table({k: v for k, v in kill.items() if not isinstance(v, dict)}, "openai kill")
        return {
            "openai_vllm_rss_gib": {r: round(v / 2**30, 3) for r, v in bench.rss.items()},
            "openai_vllm_start_s": bench.vllm_start_s,
            **{f"openai_{k}": v for k, v in freeze.items()},
            **{f"openai_{k}": v for k, v in kill.items()},
        }
    finally:
        await bench.close()
        bench.cleanup()


def passes(r: dict[str, Any]) -> dict[str, bool]:
    def le(a: Any, b: Any) -> bool:
        return a is not None and b is not None and a <= b

    return {
        "freeze_failed_before_first_token_zero": r["freeze_failed_before_first_token"] == 0,
        "freeze_eject_le_1s": le(r["freeze_eject_s"], 1.0),
        "freeze_return_le_2s": le(r["freeze_return_s"], 2.0),
        "kill_failed_before_first_token_zero": r["kill_failed_before_first_token"] == 0,
        "kill_rejoined": bool(r["kill_rejoined"]),
        "short_ttft_p95_le_half_round_robin": r["short_ttft_p95_s"] is not None
        and r["short_ttft_p95_round_robin_s"] is not None
        and r["short_ttft_p95_s"] <= 0.5 * r["short_ttft_p95_round_robin_s"],
        "affinity_hit_rate_ge_0_8": (r["affinity_hit_rate"] or 0) >= 0.8,
        "affinity_ttft_p50_le_1_2_single": r["affinity_ttft_p50_s"] is not None
        and r["single_replica_ttft_p50_s"] is not None
        and r["affinity_ttft_p50_s"] <= 1.2 * r["single_replica_ttft_p50_s"],
        "max_load_over_mean_le_1_3": le(r["max_load_over_mean"], 1.3),
    }


def openai_passes(r: dict[str, Any]) -> dict[str, bool]:
    def le(a: Any, b: Any) -> bool:
        return a is not None and b is not None and a <= b

    return {
        "openai_freeze_failed_before_first_token_zero": r["openai_freeze_failed_before_first_token"] == 0,
        "openai_freeze_eject_le_1s": le(r["openai_freeze_eject_s"], 1.0),
        "openai_freeze_return_le_2s": le(r["openai_freeze_return_s"], 2.0),
        "openai_kill_failed_before_first_token_zero": r["openai_kill_failed_before_first_token"] == 0,
        "openai_kill_rejoined": bool(r["openai_kill_rejoined"]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--freeze-seconds", type=float, default=10.0)
    parser.add_argument("--mixed-seconds", type=float, default=30.0, help="each arm of the mixed load")
    parser.add_argument(
        "--mixed-clients", type=int, default=0, help="clients of the mixed load (default: the replicas' rows, 24)"
    )
    parser.add_argument("--phases", default="freeze,kill,mixed,affinity", help="a subset, to try one (comma-separated)")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--arms",
        default="builtin,openai",
        help="builtin (the tiny model's replicas, every phase), openai (two vLLM CPU servers: freeze and kill); "
        "one arm alone keeps the other's figures from the existing JSON",
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of each vLLM")
    args = parser.parse_args(argv)
    arms = set(args.arms.split(","))
    random.seed(0)
    result: dict[str, Any] = {}
    if "builtin" in arms:
        phases = asyncio.run(run(args))
        if args.phases != parser.get_default("phases"):
            for name, figures in phases.items():
                print_table({k: v for k, v in figures.items() if not isinstance(v, dict)}, name)
            return  # a partial run writes nothing
        result = builtin_result(phases)
        result["passes"] = passes(result)
        result["config"] = {**vars(args), "replicas": len(REPLICAS), "batch": BATCH, "model": "tiny"}
    else:
        previous = Path(__file__).parent / "results" / "replicas.json"
        if previous.is_file():
            result = json.loads(previous.read_text())
            # The builtin figures keep the date of their own run (write_result stamps this one).
            result["builtin_generated_at"] = result.pop("generated_at", result.get("builtin_generated_at"))
            result["passes"] = {k: v for k, v in result.get("passes", {}).items() if not k.startswith("openai_")}
    if "openai" in arms:
        from llmesh.testing import VllmServer, vllm_cpu_dtype

        if not VllmServer.available():
            raise SystemExit("the openai arm needs the vLLM CPU build (.venv-vllm: make vllm)")
        openai = asyncio.run(run_openai(args))
        if not {"freeze", "kill"} <= set(args.phases.split(",")):
            return  # a partial run writes nothing (its tables are printed)
        openai["openai_generated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        openai["openai_config"] = {
            "replicas": len(OPENAI_REPLICAS),
            "model": f"smollm2 (vLLM CPU, eager, {vllm_cpu_dtype()})",
            "vllm_kv_gib": args.vllm_kv_gib,
            "clients": args.clients,
            "freeze_seconds": args.freeze_seconds,
        }
        result = {k: v for k, v in result.items() if not k.startswith("openai_")}
        result.update(openai)
        result["passes"] = {**result.get("passes", {}), **openai_passes(openai)}
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "replicas")
    print_table(result["passes"], "passes")
    print(f"wrote {write_result('replicas', result)}")


def builtin_result(phases: dict[str, Any]) -> dict[str, Any]:
    f, k, a = phases["freeze"], phases["kill"], phases["affinity"]
    return {
        "freeze_failed_before_first_token": f["freeze_failed_before_first_token"],
        "freeze_eject_s": f["freeze_eject_s"],
        "freeze_return_s": f["freeze_return_s"],
        "kill_failed_before_first_token": k["kill_failed_before_first_token"],
        "kill_rejoined": k["kill_rejoined"],
        "short_ttft_p95_s": phases["mixed"]["short_ttft_p95_s"],
        "short_ttft_p95_round_robin_s": phases["mixed_round_robin"]["short_ttft_p95_s"],
        "affinity_hit_rate": a["affinity_hit_rate"],
        "round_robin_hit_rate": a["round_robin_hit_rate"],
        "affinity_ttft_p50_s": a["affinity_ttft_p50_s"],
        "single_replica_ttft_p50_s": a["single_replica_ttft_p50_s"],
        "max_load_over_mean": a["max_load_over_mean"],
        "affinity_engine_prefix_hit_rate": a["affinity_engine_prefix_hit_rate"],
        "round_robin_engine_prefix_hit_rate": a["round_robin_engine_prefix_hit_rate"],
        "phases": phases,
    }


if __name__ == "__main__":
    main()
