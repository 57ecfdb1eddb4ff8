"""Semantic-cache quality: precision and recall of "semantic hit" on labelled question pairs.

    python -m bench.cache_eval [--pairs bench/data/cache_pairs.jsonl] [--min-precision 0.97] [--seed 0]

Each pair is looked up exactly as the cache does: an exact hit when both questions normalize to
the same key text (services.cache.keys.normalize_prompt), else embedded (MiniLM on the embedding
text) and a predicted semantic hit when the cosine similarity reaches the threshold and the
near-hit guard passes. Precision and recall count both tiers.

The pairs are split in two halves (seeded, stratified by label and kind). The threshold is chosen
on the tuning half: the highest recall whose precision is at least --min-precision (ties: the
stricter threshold). Precision and recall at that threshold are reported on the tuning half
(`semantic_precision`, `semantic_recall`: in-sample, the floor holds there by construction) and on
the held-out half (`heldout_precision`, `heldout_recall`: what a threshold chosen this way does on
pairs it never saw); the targets are on the held-out figures. Writes bench/results/cache_eval.json.

The functions are importable (the gateway latency benchmark reuses them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, print_table, write_result
from services.cache import guard
from services.cache.keys import embedding_text, normalize_prompt

ROOT = Path(__file__).resolve().parent
PAIRS = ROOT / "data" / "cache_pairs.jsonl"
# Near-misses of a literal kind (brackets, braces, quotes, operators, code layout) and spellings
# that mean the same (case, a final mark): evaluated beside the held pairs, at their threshold.
LITERAL_PAIRS = ROOT / "data" / "cache_literal_pairs.jsonl"
# Kinds of the held pairs that are near-misses built to fool an embedding (not the same-topic ones).
ADVERSARIAL = ("negation", "number", "entity", "antonym", "order", "literal")
RESULT = ROOT / "results" / "cache_eval.json"
THRESHOLDS = tuple(round(0.70 + 0.01 * i, 2) for i in range(30))  # 0.70 .. 0.99
MIN_PRECISION = 0.97
MIN_RECALL = 0.6
#: The split's seed: the same halves on every run, so a change of threshold comes from the pairs.
SPLIT_SEED = 0


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    same: bool
    kind: str = ""


def load_pairs(path: Path = PAIRS) -> list[Pair]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            pairs.append(Pair(row["a"], row["b"], bool(row["same"]), row.get("kind", "")))
    return pairs


def similarities(encode: Any, pairs: Sequence[Pair]) -> np.ndarray:
    """Cosine similarity of each pair; `encode(texts) -> normalized rows` (Embedder.encode)."""
    va = encode([embedding_text(p.a) for p in pairs])
    vb = encode([embedding_text(p.b) for p in pairs])
    return np.clip(np.sum(va * vb, axis=1), 0.0, 1.0)


def exact_matches(pairs: Sequence[Pair]) -> np.ndarray:
    """Pairs the exact tier answers: the same normalized question."""
    return np.array([normalize_prompt(p.a) == normalize_prompt(p.b) for p in pairs], dtype=bool)


def guard_reasons(pairs: Sequence[Pair]) -> list[str | None]:
    """The guard's verdict per pair (None: passes), asked question `b` against cached `a`."""
    return [guard.check(p.b, p.a) for p in pairs]


def evaluate(
    pairs: Sequence[Pair],
    sims: np.ndarray,
    thresholds: Sequence[float] = THRESHOLDS,
    reasons: Sequence[str | None] | None = None,
    exact: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """One row per threshold: precision/recall (exact and semantic tiers) with the guard and without it."""
    labels = np.array([p.same for p in pairs])
    passes = np.array([r is None for r in (reasons if reasons is not None else guard_reasons(pairs))])
    exact = exact if exact is not None else exact_matches(pairs)
    rows = []
    for t in thresholds:
        above = exact | (sims >= t - 1e-9)
        row: dict[str, Any] = {"threshold": round(float(t), 2)}
        for name, predicted in (("", exact | (above & passes)), ("_no_guard", above)):
            tp = int(np.sum(predicted & labels))
            fp = int(np.sum(predicted & ~labels))
            fn = int(np.sum(~predicted & labels))
            row[f"precision{name}"] = round(tp / (tp + fp), 4) if tp + fp else None
            row[f"recall{name}"] = round(tp / (tp + fn), 4) if tp + fn else 0.0
            if not name:
                row.update(tp=tp, fp=fp, fn=fn)
        rows.append(row)
    return rows


def pick_threshold(curve: Sequence[dict[str, Any]], min_precision: float = MIN_PRECISION) -> dict[str, Any]:
    """Highest recall with precision >= min_precision; among equals, the stricter threshold."""
    ok = [r for r in curve if r["precision"] is not None and r["precision"] >= min_precision]
    if not ok:
        return max(curve, key=lambda r: (r["precision"] or 0.0, r["threshold"]))
    return max(ok, key=lambda r: (r["recall"], r["threshold"]))


def split(pairs: Sequence[Pair], seed: int = SPLIT_SEED) -> tuple[list[int], list[int]]:
    """Indices of the tuning and the held-out half: each (label, kind) stratum shuffled with the
    seed and halved (an odd one out goes to the held-out half), so both halves keep the share of
    same and different pairs and every kind of near-miss."""
    rng = np.random.default_rng(seed)
    strata: dict[tuple[bool, str], list[int]] = {}
    for i, p in enumerate(pairs):
        strata.setdefault((p.same, p.kind), []).append(i)
    tune: list[int] = []
    heldout: list[int] = []
    for key in sorted(strata):
        members = [strata[key][j] for j in rng.permutation(len(strata[key]))]
        tune += members[: len(members) // 2]
        heldout += members[len(members) // 2 :]
    return sorted(tune), sorted(heldout)


def choose_and_hold_out(
    pairs: Sequence[Pair],
    sims: np.ndarray,
    reasons: Sequence[str | None],
    exact: np.ndarray,
    seed: int = SPLIT_SEED,
    min_precision: float = MIN_PRECISION,
    thresholds: Sequence[float] = THRESHOLDS,
) -> dict[str, Any]:
    """The threshold chosen on the tuning half, with its figures there and on the held-out half."""
    tune, heldout = split(pairs, seed)

    def part(idx: list[int], ts: Sequence[float]) -> list[dict[str, Any]]:
        return evaluate([pairs[i] for i in idx], sims[idx], ts, [reasons[i] for i in idx], exact[idx])

    curve = part(tune, thresholds)
    best = pick_threshold(curve, min_precision)
    held = part(heldout, [best["threshold"]])[0]
    return {
        "threshold": best["threshold"],
        "semantic_precision": best["precision"],
        "semantic_recall": best["recall"],
        "heldout_precision": held["precision"],
        "heldout_recall": held["recall"],
        "heldout_fp": held["fp"],
        "heldout_fn": held["fn"],
        "split": {
            "seed": seed,
            "stratified_by": "label and kind",
            "tune_pairs": len(tune),
            "tune_same_pairs": sum(pairs[i].same for i in tune),
            "heldout_pairs": len(heldout),
            "heldout_same_pairs": sum(pairs[i].same for i in heldout),
        },
        "curve": curve,
    }


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """On the held-out half: the in-sample precision meets its floor by construction."""
    precision, recall = result["heldout_precision"] or 0.0, result["heldout_recall"]
    return {
        f"heldout_precision>={result['min_precision']}": precision >= result["min_precision"],
        f"heldout_recall>={MIN_RECALL}": recall >= MIN_RECALL,
    }


def false_hits(pairs: Sequence[Pair], sims: np.ndarray, reasons: Sequence[str | None], t: float) -> list[dict]:
    return [
        {"a": p.a, "b": p.b, "kind": p.kind, "similarity": round(float(s), 4)}
        for p, s, r in zip(pairs, sims, reasons, strict=True)
        if not p.same and s >= t and r is None
    ]


def print_curve(rows: Sequence[dict[str, Any]]) -> None:
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in cols))


def run(pairs_path: Path = PAIRS, min_precision: float = MIN_PRECISION, seed: int = SPLIT_SEED) -> dict[str, Any]:
    from llmesh.embeddings import Embedder
    from llmesh.testing import real_models_dir

    pairs = load_pairs(pairs_path)
    embedder = Embedder.load(real_models_dir(), "minilm")
    started = time.perf_counter()
    sims = similarities(embedder.encode, pairs)
    reasons = guard_reasons(pairs)
    exact = exact_matches(pairs)
    chosen = choose_and_hold_out(pairs, sims, reasons, exact, seed, min_precision)
    t = chosen["threshold"]
    above = [(p, r) for p, s, r in zip(pairs, sims, reasons, strict=True) if s >= t]
    literal = load_pairs(LITERAL_PAIRS)
    literal_row = evaluate(literal, similarities(embedder.encode, literal), [t])[0]
    hits = [p for p, s, r, e in zip(pairs, sims, reasons, exact, strict=True) if e or (s >= t and r is None)]
    adversarial = [p for p in pairs if p.kind in ADVERSARIAL and not p.same]
    result = {
        "threshold": t,
        # In-sample: on the tuning half the threshold was chosen on.
        "semantic_precision": chosen["semantic_precision"],
        "semantic_recall": chosen["semantic_recall"],
        # On the held-out half, which the choice never saw.
        "heldout_precision": chosen["heldout_precision"],
        "heldout_recall": chosen["heldout_recall"],
        "heldout_false_hits": chosen["heldout_fp"],
        "heldout_missed": chosen["heldout_fn"],
        "min_precision": min_precision,
        "split": chosen["split"],
        "pairs": len(pairs),
        "same_pairs": sum(p.same for p in pairs),
        "different_pairs": sum(not p.same for p in pairs),
        # From here on, counted on all pairs at the chosen threshold.
        # Pairs the exact tier answers (the same normalized question), and of those the different ones.
        "exact_pairs": int(exact.sum()),
        "exact_pairs_different": int(sum(e and not p.same for e, p in zip(exact, pairs, strict=True))),
        "pairs_by_kind": dict(Counter(p.kind for p in pairs)),
        "guard_rejections_at_threshold": {
            "of_different": dict(Counter(r for p, r in above if r and not p.same)),
            "of_same": dict(Counter(r for p, r in above if r and p.same)),
        },
        "false_hits_at_threshold": false_hits(pairs, sims, reasons, t),
        # The near-misses built to fool the embedding: never a hit.
        "adversarial_pairs": len(adversarial),
        "adversarial_false_hits": sum(p.kind in ADVERSARIAL and not p.same for p in hits),
        "literal_pairs": len(literal),
        "literal_false_hits": literal_row["fp"],
        "literal_same_recall": literal_row["recall"],
        "embedding_model": embedder.model_id,
        "embedding_dtype": embedder.dtype,
        "embed_seconds": round(time.perf_counter() - started, 3),
        "curve": chosen["curve"],  # the tuning half's
    }
    result["targets"] = targets(result)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, default=PAIRS)
    parser.add_argument("--min-precision", type=float, default=MIN_PRECISION)
    parser.add_argument("--seed", type=int, default=SPLIT_SEED, help="seed of the tuning / held-out split")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    result = run(args.pairs, args.min_precision, args.seed)
    result["machine"] = machine()
    columns = ("threshold", "precision", "recall", "tp", "fp", "precision_no_guard", "recall_no_guard")
    print_curve([{k: r[k] for k in columns} for r in result["curve"]])
    summary = (
        "threshold",
        "semantic_precision",
        "semantic_recall",
        "heldout_precision",
        "heldout_recall",
        "pairs",
        "same_pairs",
        "different_pairs",
    )
    print_table({k: result[k] for k in summary}, "bench.cache_eval")
    print_table({k: "met" if ok else "MISSED" for k, ok in result["targets"].items()}, "targets")
    if args.out == RESULT:
        path = write_result("cache_eval", result)
    else:
        path = args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
