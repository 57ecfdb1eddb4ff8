"""bench.batching_cuda runs end to end at tiny sizes on the CPU, so the GPU benchmark keeps
working on machines without one (its figures mean nothing here; only that it runs)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import batching_cuda


def test_gpu_benchmark_runs_tiny_on_cpu(tmp_path: Path, models_dir: Path) -> None:
    out = tmp_path / "batching_cuda.json"
    result = batching_cuda.main(["--tiny", "--device", "cpu", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["dtype"] == result["dtype"]
    for key in ("tok_s_1", "tok_s_4", "tok_s_8", "decode_step_ms_4", "decode_step_ms_8"):
        assert written[key] > 0, key
    for key in ("hf_manager_tok_s_8", "static_compiled_tok_s_8"):
        assert written[key] is not None and written[key] > 0, written.get(key.split("_tok")[0] + "_error")
    assert written["cuda_graphs"] == 0  # no capture on the CPU: the same step runs eagerly
