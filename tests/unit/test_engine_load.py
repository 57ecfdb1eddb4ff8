"""`Engine.load()`: the engine's own load report, and the openai backend's from the
engine's Prometheus text."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from llmesh.models import verify
from services.inference.backend_load import ReplicaLoad, combine, parse_metrics
from services.inference.engine import Engine, EngineConfig, LoadedModel
from services.inference.engine.decoding import SamplingParams


async def test_load_reports_rows_queue_kv_and_step_time(tiny_model: Path) -> None:
    loaded = LoadedModel(verify(tiny_model), "cpu", "float32")
    engine = Engine(loaded, EngineConfig(max_batch_size=2, max_prompt_tokens=64, max_new_tokens=8))
    idle = engine.load()
    assert (idle.running, idle.waiting, idle.max_running) == (0, 0, 2)
    # KV in blocks: the pool holds at least two worst-case sequences (64 + 8 tokens).
    total = idle.kv_blocks_total
    assert idle.kv_blocks_free == total and idle.block_tokens == engine.config.block_tokens
    assert total * idle.block_tokens >= 2 * 72
    assert idle.step_seconds is None and idle.free_rows == 2

    ids = engine.encode("Hello there, how are you?")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    streams = [engine.submit(ids, params) for _ in range(3)]
    queued = engine.load()
    assert (queued.running, queued.waiting) == (0, 3)
    assert queued.waiting_prompt_tokens == 3 * len(ids)

    in_decode, release = threading.Event(), threading.Event()

    def hold_first_decode(kind: str, rows: int) -> None:
        if kind == "decode" and not release.is_set():
            in_decode.set()
            release.wait(10)

    engine.fault_hook = hold_first_decode
    engine.start()
    try:
        assert await asyncio.to_thread(in_decode.wait, 10)
        busy = engine.load()
        assert (busy.running, busy.waiting, busy.free_rows) == (2, 1, 0)
        # Two running rows hold the blocks of their prompt and first tokens, no more.
        held = total - busy.kv_blocks_free
        assert 2 <= held <= 2 * -(-(len(ids) + 1) // idle.block_tokens)
        assert busy.waiting_prompt_tokens == len(ids)
        assert busy.prefill_tokens_per_second is None or busy.prefill_tokens_per_second > 0
        release.set()
        for stream in streams:
            async for _ in stream:
                pass
        await asyncio.to_thread(engine.drain, 10)
        done = engine.load()
        assert (done.running, done.waiting, done.kv_blocks_free) == (0, 0, total)
        assert done.step_seconds is not None and done.step_seconds > 0
    finally:
        release.set()
        engine.close()


VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="400",prefix_caching="True"} 1.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 2.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 10.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 20.0
"""


def test_vllm_metrics_become_an_engine_load() -> None:
    sample = parse_metrics(VLLM_TEXT)
    assert (sample.running, sample.waiting, sample.kv_usage) == (3.0, 2.0, 0.25)
    assert (sample.num_blocks, sample.block_size) == (400, 16)
    replica = ReplicaLoad()
    replica.update(sample, 1.0)
    first = replica.load()
    assert first is not None and first.step_seconds is None  # a rate needs two scrapes
    assert (first.running, first.waiting, first.kv_blocks_total, first.kv_blocks_free) == (3, 2, 400, 300)
    later = VLLM_TEXT.replace(
        'seconds_sum{engine="0",model_name="m"} 2.0', 'seconds_sum{engine="0",model_name="m"} 3.0'
    )
    later = later.replace(
        'seconds_count{engine="0",model_name="m"} 100.0', 'seconds_count{engine="0",model_name="m"} 150.0'
    )
    later = later.replace(
        'queries_total{engine="0",model_name="m"} 100.0', 'queries_total{engine="0",model_name="m"} 200.0'
    )
    later = later.replace('hits_total{engine="0",model_name="m"} 20.0', 'hits_total{engine="0",model_name="m"} 70.0')
    replica.update(parse_metrics(later), 1.1)
    second = replica.load()
    assert second is not None and second.step_seconds is not None
    assert abs(second.step_seconds - 0.02) < 1e-9 and abs(second.prefix_hit_rate - 0.5) < 1e-9
    both = combine([second, second])
    assert both is not None and (both.running, both.waiting, both.kv_blocks_total) == (6, 4, 800)


def test_a_server_without_vllm_metrics_reports_nothing() -> None:
    replica = ReplicaLoad()
    replica.update(parse_metrics("# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 1.0\n"), 1.0)
    assert replica.load() is None
    assert combine([]) is None
