"""The openai backend's load, read from the engine's own Prometheus `/metrics` (vLLM names):
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, the KV
geometry in `vllm:cache_config_info` and the step time from the `vllm:inter_token_latency_seconds`
histogram. Polled by the backend at a short interval, never per request (see OpenAIBackend).
Servers that expose none of these (llama.cpp, a proxy) report nothing: the gateway then falls
back to its own guesses."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from services.inference.engine.load import EngineLoad

#: A sample line: name, optional {labels}, value (timestamps, if any, are ignored).
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # older vLLM
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
#: What a scrape asks for (WANTED and the KV geometry).
SCRAPED = (*WANTED, "vllm:cache_config_info")
#: Step time smoothing (as the builtin engine's EWMA).
STEP_WEIGHT = 0.3
#: Blocks reported for a server that tells its KV usage but not its block count.
USAGE_BLOCKS = 1000


@dataclass
class MetricsSample:
    """What one /metrics scrape said (values summed over label sets: engines, models)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    num_blocks: int = 0
    block_size: int = 0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    found: bool = False


def parse_metrics(text: str) -> MetricsSample:
    sample = MetricsSample()
    usages: list[float] = []
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels or ""))
            try:
                sample.num_blocks += int(float(found.get("num_gpu_blocks") or 0))
                sample.block_size = int(float(found.get("block_size") or 0)) or sample.block_size
            except ValueError:
                pass
            continue
        if name not in WANTED:
            continue
        sample.found = True
        if name == "vllm:num_requests_running":
            sample.running += value
        elif name == "vllm:num_requests_waiting":
            sample.waiting += value
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usages.append(value)
        elif name == "vllm:inter_token_latency_seconds_sum":
            sample.itl_sum += value
        elif name == "vllm:inter_token_latency_seconds_count":
            sample.itl_count += value
        elif name == "vllm:prefix_cache_queries_total":
            sample.prefix_queries += value
        elif name == "vllm:prefix_cache_hits_total":
            sample.prefix_hits += value
    if usages:
        sample.kv_usage = min(1.0, max(0.0, sum(usages) / len(usages)))
    return sample


class ReplicaLoad:
    """One backend replica's load as its scrapes tell it; step time and prefix hit rate from
    the counters' growth between scrapes."""

    def __init__(self) -> None:
        self.last: MetricsSample | None = None
        self.step_seconds: float | None = None
        self.prefix_hit_rate = 0.0
        self.scraped_at = -math.inf

    def update(self, sample: MetricsSample, now: float) -> None:
        previous = self.last
        if previous is not None:
            tokens = sample.itl_count - previous.itl_count
            if tokens > 0:
                step = (sample.itl_sum - previous.itl_sum) / tokens
                self.step_seconds = (
                    step if self.step_seconds is None else ((1 - STEP_WEIGHT) * self.step_seconds + STEP_WEIGHT * step)
                )
            queries = sample.prefix_queries - previous.prefix_queries
            if queries > 0:
                self.prefix_hit_rate = max(0.0, min(1.0, (sample.prefix_hits - previous.prefix_hits) / queries))
        self.last = sample
        self.scraped_at = now

    def forget(self) -> None:
        self.last = None
        self.scraped_at = -math.inf

    def load(self, max_running: int = 0) -> EngineLoad | None:
        sample = self.last
        if sample is None or not sample.found:
            return None
        if sample.num_blocks:
            total, block = sample.num_blocks, sample.block_size or 16
        elif sample.kv_usage is not None:
            total, block = USAGE_BLOCKS, 0
        else:
            total, block = 0, 0
        free = round(total * (1.0 - sample.kv_usage)) if sample.kv_usage is not None else total
        return EngineLoad(
            running=int(sample.running),
            max_running=max_running,
            waiting=int(sample.waiting),
            kv_blocks_free=free,
            kv_blocks_total=total,
            block_tokens=block,
            step_seconds=self.step_seconds,
            prefix_hit_rate=self.prefix_hit_rate,
        )


def combine(loads: list[EngineLoad]) -> EngineLoad | None:
    """The load of several replicas behind one backend (sums; the slowest step)."""
    if not loads:
        return None
    if len(loads) == 1:
        return loads[0]
    steps = [x.step_seconds for x in loads if x.step_seconds is not None]
    unknown_rows = any(x.max_running == 0 for x in loads)
    return EngineLoad(
        running=sum(x.running for x in loads),
        max_running=0 if unknown_rows else sum(x.max_running for x in loads),
        waiting=sum(x.waiting for x in loads),
        kv_blocks_free=sum(x.kv_blocks_free for x in loads),
        kv_blocks_total=sum(x.kv_blocks_total for x in loads),
        block_tokens=max(x.block_tokens for x in loads),
        step_seconds=max(steps) if steps else None,
        prefix_hit_rate=sum(x.prefix_hit_rate for x in loads) / len(loads),
    )
