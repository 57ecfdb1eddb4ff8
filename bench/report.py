"""`python -m bench.report [--write]`: the latest figures from bench/results as one markdown
table (what `llmesh bench` prints); --write rewrites the table in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, fmt

PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

# Headline figures per benchmark, in reading order.
HEADLINES: dict[str, tuple[str, ...]] = {
    "batching": (
        "sequential_tok_s",
        "offline_batch_tok_s",
        "mesh_tok_s",
        "mesh_tok_s_no_prefix",
        "sequential_mesh_tok_s",
        "mixed_tok_s",
        "ttft_idle_s",
        "ttft_p50_s",
        "ttft_p95_s",
    ),
    "priority": (
        "interactive_ttft_steps_max_alone",
        "interactive_ttft_steps_max_with_batch",
        "interactive_ttft_steps_max_with_batch_no_priority",
        "interactive_ttft_s_median_alone",
        "interactive_ttft_s_median_with_batch",
        "interactive_ttft_s_max_with_batch_no_priority",
        "preemptions_priority",
        "step_ab.tok_per_cpu_s_new_over_old",
    ),
    "engine": (
        "served",
        "read_bandwidth_gb_s",
        "bandwidth_bound_tok_s",
        "tok_s_32",
        "vllm_tok_s_32",
        "grpc_tok_s_32",
        "mixed_tok_s_32",
        "ttft_p50_32",
        "vllm_ttft_p50_32",
        "grpc_ttft_p50_32",
        "mixed_ttft_p50_32",
        "tok_s_1",
        "vllm_tok_s_1",
        "bf16_tok_s_1",
        "int8_tok_s_1",
        "int4_tok_s_1",
        "llamacpp_tok_s_1",
        "llamacpp_decode_tok_s_1",
        "llamacpp_n_batch",
        "openai_mesh_vs_direct_http",
        "openai_mesh_vs_direct_grpc",
        "openai_ttft_p50_http_minus_direct_ms",
        "openai_ttft_p50_grpc_minus_direct_ms",
    ),
    "decode_step": (
        "dtype",
        "step_1.own_ms",
        "step_1.own_int8_ms",
        "step_1.own_int4_ms",
        "step_1.transformers_ms",
        "step_32.own_ms",
        "step_32.transformers_ms",
        "profile_1.own.matmul",
        "profile_1.own.attention",
        "profile_1.own.norms_rotary_elementwise",
        "profile_1.own.python_dispatch_ms",
        "profile_1.own.matmul_gb_s",
        "profile_1.own_int4.matmul_gb_s",
    ),
    "prefix": (
        "system_prompt_tokens",
        "first_ttft_s",
        "repeat_ttft_p50_s",
        "fresh_ttft_p50_s",
        "repeat_ttft_p50_no_prefix_s",
        "vllm_repeat_ttft_p50_s",
        "vllm_fresh_ttft_p50_s",
        "turn1_ttft_s",
        "turn8_ttft_s",
        "max_concurrent_64tok",
        "max_concurrent_64tok_slots",
        "rag_rps",
        "rag_rps_no_prefix",
        "rag_ttft_p50_s",
        "rag_ttft_p50_s_no_prefix",
        "rag_ttft_p95_s",
        "rag_ttft_p95_s_no_prefix",
        "rag_prefix_hit_rate",
    ),
    "cache": (
        "semantic_threshold",
        "semantic_precision",
        "semantic_recall",
        "exact_hit_p50_ms",
        "exact_hit_p99_ms",
        "semantic_hit_p50_ms",
        "miss_p50_ms",
        "exact_hit_rps",
        "http_exact_hit_rps",
        "echo_chain_rps",
        "exact_hit_rps_over_echo_chain",
        "http_over_grpc_exact_hit_rps",
        "grpc_lookups_per_cache_call",
    ),
    "backends": (
        "backend",
        "direct_tok_s",
        "mesh_http_tok_s",
        "mesh_grpc_tok_s",
        "openai_mesh_vs_direct_http",
        "openai_mesh_vs_direct_grpc",
        "ttft_direct_p50_s",
        "ttft_mesh_http_p50_s",
        "ttft_mesh_grpc_p50_s",
        "ttft_p50_mesh_http_minus_direct_ms",
        "ttft_p50_mesh_grpc_minus_direct_ms",
        "builtin_mesh_http_tok_s",
        "builtin_mesh_grpc_tok_s",
        "ttft_builtin_mesh_http_p50_s",
        "ttft_builtin_mesh_grpc_p50_s",
    ),
    "structured": (
        "unconstrained_tok_s",
        "json_schema_tok_s",
        "unconstrained_stream_tok_s",
        "json_schema_stream_tok_s",
        "compile_cold_ms",
        "compile_cached_ms",
        "ttft_unconstrained_p50_s",
        "ttft_json_schema_p50_s",
        "schemas_valid",
        "schemas_refused",
        "schemas_total",
        "vllm_json_schema_tok_s",
        "vllm_json_schema_stream_tok_s",
        "vllm_schemas_valid",
    ),
    "cache_eval": (
        "threshold",
        "semantic_precision",
        "semantic_recall",
        "heldout_precision",
        "heldout_recall",
        "pairs",
    ),
    "retrieval": ("ingest_chunks_s", "raw_embed_chunks_s", "search_p50_ms", "chunks"),
    "retrieval_scale": (
        "store_search_100k.p50_ms",
        "store_search_100k.p99_ms",
        "store_filtered_100k.p50_ms",
        "store_filtered_100k.p99_ms",
        "search_10k.p50_ms",
        "search_100k.p50_ms",
        "search_100k.p99_ms",
        "filtered_100k.p50_ms",
        "fill_100k.index_build_seconds",
    ),
    "cache_scale": (
        "fill.points",
        "fill.store_search.p50_ms",
        "fill.store_filtered.p50_ms",
        "fill.store_filtered.p99_ms",
        "lookup_miss.p50_ms",
        "lookup_miss.p99_ms",
        "lookup_miss_empty_scope.p50_ms",
        "semantic_hit.p50_ms",
        "fill.index_build_seconds",
    ),
    "cache_tenancy": (
        "grpc_off_exact_hit_rps",
        "grpc_on_exact_hit_rps",
        "grpc_on_over_off",
        "http_off_exact_hit_rps",
        "http_on_exact_hit_rps",
        "http_on_over_off",
        "machine.load_average_1m",
    ),
    "tracing": (
        "hit_p50_ms_on",
        "hit_p50_ms_off",
        "hit_p99_ms_on",
        "hit_p99_ms_off",
        "hit_rps_on",
        "hit_rps_off",
        "overhead_ratio",
        "hit_p99_ratio",
        "hit_rps_ratio",
        "generate_overhead_ratio",
    ),
    "hostile": (
        "normal_p99_s_alone",
        "normal_p99_s_with",
        "normal_p99_ratio",
        "normal_cached_p99_s_alone",
        "normal_cached_p99_s_with",
        "normal_errors",
        "gateway_rss_peak_ratio",
        "gateway_loop_lag_p99_s_alone",
        "gateway_loop_lag_p99_s_with",
        "hostile_sent",
        "hostile_per_second",
        "hostile_unexpected",
    ),
    "reliability": (
        "model",
        "load.requests",
        "load.ok",
        "load.shed",
        "load.other_errors",
        "load.lost",
        "load.p50_s",
        "load.p99_s",
        "load.shed_p99_s",
        "bad_input.bad_inputs_tried",
        "bad_input.crashes",
        "bad_input.unexpected_codes",
        "calibration.admission_budget",
        "default_budget.learned_in_flight_limit",
        "default_budget.ok",
        "default_budget.shed",
        "default_budget.deadline_exceeded",
        "default_budget.shed_p99_s",
        "faults.retrieval_freeze.ok_per_second",
        "faults.cache_freeze.ok_per_second",
        "faults.tokenizer_freeze.ok_per_second",
        "faults.redis_freeze.ok_per_second",
    ),
    "bursts": (
        "model",
        "burst_sheds",
        "mixed_generation_sheds",
        "mixed_cached_rps_ratio",
        "overload_shed_p99_ms",
        "overload_deadline_exceeded",
        "openai_burst_sheds",
        "config.mixed_seconds",
    ),
    "replicas": (
        "freeze_failed_before_first_token",
        "freeze_eject_s",
        "freeze_return_s",
        "kill_failed_before_first_token",
        "kill_rejoined",
        "short_ttft_p95_s",
        "short_ttft_p95_round_robin_s",
        "affinity_hit_rate",
        "round_robin_hit_rate",
        "affinity_ttft_p50_s",
        "single_replica_ttft_p50_s",
        "max_load_over_mean",
        "affinity_engine_prefix_hit_rate",
        "round_robin_engine_prefix_hit_rate",
    ),
    "batch": (
        "lines",
        "batch_tok_s_alone",
        "closed_loop_32_tok_s",
        "interactive_ttft_p95_s_alone",
        "interactive_ttft_p95_s_with_batch",
        "lost_lines",
        "duplicate_lines",
    ),
    "reliability_openai": (
        "backend",
        "model",
        "default_budget.ok",
        "default_budget.shed",
        "default_budget.deadline_exceeded",
        "default_budget.shed_p99_s",
        "default_budget.learned_in_flight_limit",
        "faults.backend_freeze.ok_per_second",
        "faults.backend_freeze.seconds_to_first_success",
        "faults.inference_stall.seconds_to_recover",
    ),
    "gateway_redesign_ab": (
        "ratios_head_over_base.mesh_tok_s",
        "ratios_head_over_base.exact_hit_rps_over_echo_chain",
        "head.burst_sheds",
    ),
    "clients": (
        "llmesh_passed",
        "llmesh_total",
        "vllm_passed",
        "lm_eval_max_abs_diff_nats",
        "vllm_bench_failed",
    ),
}


def load() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob("*.json"))}


def _find(result: dict[str, Any], key: str) -> Any:
    """A top-level figure, or a nested one named with dots (`load.requests`)."""
    value: Any = result
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return None if isinstance(value, dict | list) else value


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| Benchmark | Figure | Value |", "| --- | --- | --- |"]
    for name, result in results.items():
        for key in HEADLINES.get(name, ()):
            value = _find(result, key)
            if value is not None:
                rows.append(f"| {name} | `{key}` | {fmt(value)} |")
        for target, ok in (result.get("passes") or {}).items():
            rows.append(f"| {name} | target `{target}` | {'met' if ok else '**not met**'} |")
        if "generated_at" in result:
            rows.append(f"| {name} | measured at | {result['generated_at']} |")
    return "\n".join(rows)


def update_page(text: str) -> None:
    page = PAGE.read_text()
    block = f"{START}\n{text}\n{END}"
    if START in page:
        page = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, page, flags=re.S)
    else:
        page = page.replace("# Benchmarks\n", f"# Benchmarks\n\n{block}\n", 1)
    PAGE.write_text(page)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", "--readme", action="store_true", help="rewrite the table in docs/benchmarks.md")
    args = parser.parse_args(argv)
    text = table(load())
    print(text)
    if args.write:
        update_page(text)


if __name__ == "__main__":
    main()
