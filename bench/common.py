"""Small helpers shared by the benchmarks: percentiles, a printed table, the JSON result file."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def machine() -> dict[str, Any]:
    """Where the numbers were taken (a shared 2-core box gives different numbers than an idle one)."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def print_table(rows: Iterable[tuple[str, Any]] | Mapping[str, Any], title: str = "") -> None:
    items = list(rows.items() if isinstance(rows, Mapping) else rows)
    width = max((len(k) for k, _ in items), default=0)
    if title:
        print(f"\n{title}")
        print("-" * max(len(title), width + 14))
    for key, value in items:
        print(f"{key.ljust(width)}  {fmt(value)}")


def write_result(name: str, result: Mapping[str, Any]) -> Path:
    """bench/results/<name>.json, with a timestamp."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {**result, "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
