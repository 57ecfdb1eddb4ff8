"""The quality guard: a model is served in a dtype other than float32 (or quantized) only if,
on a fixed text and the same device, its perplexity stays within 2% of float32's and its
teacher-forced next-token choices (the argmax at every position, given the text so far) agree
with float32's at `MIN_AGREEMENT` of the positions or more. Perplexity alone can hide a model
that is as unsure on average but picks other tokens; greedy decoding serves the argmax.
Agreement counts the positions where float32's choice is clear (its top logit leads the next by
`NEAR_TIE_LOGITS` or more): at a near tie any rounding may pick either token, and a random-weight
model is all near ties.

The fixed text (quality_text.py, a few hundred tokens of plain English) ships with the code.
The check runs once per model version, dtype, quantization and device kind: the first load
reads the weights in float32, measures the reference, converts them and measures again; the
result goes to `quality.json` beside the version's manifest.json, keyed by device kind, dtype
and quantization and stamped with the weights' digest (sha256 of the manifest) and the text's
sha256, so later loads (restarts, replicas sharing the models volume) read it and load straight
into the served dtype. A stored result whose digest or text differs is measured again. Where
the version folder is read-only the result is not stored and each load measures again (a few
seconds for SmolLM2-135M on 2 CPU cores).

A dtype that fails the guard is refused. Chosen by the hardware rule (LLMESH_DTYPE=auto), the
engine logs a warning and serves float32 instead; named explicitly (LLMESH_DTYPE=bfloat16,
LLMESH_QUANTIZE=int8), the load fails with QualityError: the operator asked for something the
model cannot give, and the service does not start (a version switch is refused).

`quality.json` is not in the manifest (it is written after the manifest, on the serving host);
verification ignores it. At worst a forged file makes a drifting dtype pass: it never changes
weights, whose hashes are still checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from llmesh.hardware import DtypeChoice, dtype_name
from llmesh.models import QUALITY_FILE, ModelError, VerifiedModel
from services.inference.engine.quality_text import TEXT

log = logging.getLogger("llmesh.inference.quality")

#: Served perplexity / float32 perplexity must stay at or below this.
MAX_PERPLEXITY_RATIO = 1.02
#: Share of the fixed text's clear positions whose served argmax equals float32's, at least.
#: SmolLM2-135M over all 1024 positions (clear or not), measured: bfloat16 0.985, bfloat16 with
#: int8 weights 0.955, with int4 weights (its own Q4_1 values, the head int8) 0.970; with the LM
#: head in 4-bit groups too 0.851 (refused).
MIN_AGREEMENT = 0.9
#: A float32 top-1 logit lead below this is a near tie, left out of the agreement.
NEAR_TIE_LOGITS = 0.5
QUANTIZE_NONE = "none"


class QualityError(ModelError):
    """The requested dtype or quantization fails the perplexity guard on this model."""


@dataclass(frozen=True)
class QualityCheck:
    device: str
    dtype: str
    quantize: str
    #: sha256 of the version's manifest.json (the exact weights).
    digest: str
    text_sha256: str
    tokens: int
    perplexity: float
    reference_perplexity: float
    seconds: float
    #: Teacher-forced top-1 agreement with float32 over the text's positions.
    agreement: float

    @property
    def key(self) -> str:
        return check_key(self.device, self.dtype, self.quantize)

    @property
    def ratio(self) -> float:
        return self.perplexity / self.reference_perplexity

    @property
    def passes(self) -> bool:
        return math.isfinite(self.perplexity) and self.ratio <= MAX_PERPLEXITY_RATIO and self.agreement >= MIN_AGREEMENT

    def describe(self) -> str:
        served = self.dtype if self.quantize == QUANTIZE_NONE else f"{self.dtype} with {self.quantize} weights"
        return (
            f"{served} on {self.device}: perplexity {self.perplexity:.3f} on the fixed text vs float32's "
            f"{self.reference_perplexity:.3f} ({100 * (self.ratio - 1):+.2f}%; the guard allows "
            f"+{100 * (MAX_PERPLEXITY_RATIO - 1):.0f}%), next-token agreement with float32 "
            f"{self.agreement:.3f} (the guard asks {MIN_AGREEMENT})"
        )


def check_key(device: str, dtype: str, quantize: str) -> str:
    return f"{device}/{dtype}/{quantize}"


def fixed_text() -> str:
    return TEXT


def text_sha256() -> str:
    return hashlib.sha256(TEXT.encode()).hexdigest()


def text_ids(tokenizer: Tokenizer, limit: int) -> list[int]:
    return tokenizer.encode(fixed_text(), add_special_tokens=False).ids[:limit]


#: The logits [tokens, vocab] of every position of a prompt through the forward that serves the
#: model (the engine's own one), or None where the model's own forward serves.
ServingForward = Callable[[Any, list[int], torch.device], "torch.Tensor | None"]


def perplexity(model: Any, ids: list[int], device: torch.device, forward: ServingForward | None = None) -> float:
    """exp(mean next-token negative log-likelihood) over `ids`, one forward, logits in float32.
    `forward`: the forward that serves (the guard measures what serves), else the model's own."""
    return score(model, ids, device, forward)[0]


def score(
    model: Any, ids: list[int], device: torch.device, forward: ServingForward | None = None
) -> tuple[float, torch.Tensor]:
    """The perplexity over `ids` and, at every position but the last, the argmax next token
    and its logit's lead over the runner-up: [positions, 2] (token, lead)."""
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long, device=device)
        served = forward(model, ids, device) if forward is not None else None
        logits = (served if served is not None else model(input_ids=x).logits[0])[:-1].float()
        nll = F.cross_entropy(logits, x[0, 1:])
        top = logits.topk(2, dim=-1)
        lead = top.values[:, 0] - top.values[:, 1]
        return math.exp(float(nll)), torch.stack((top.indices[:, 0].float(), lead), -1).cpu()


def agreement(served: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of the reference's clear positions (lead >= NEAR_TIE_LOGITS) where the served
    argmax is the reference's (1.0 where none is clear)."""
    clear = reference[:, 1] >= NEAR_TIE_LOGITS
    if not bool(clear.any()):
        return 1.0
    return float((served[clear, 0] == reference[clear, 0]).float().mean())


def stored(directory: Path, key: str, digest: str) -> QualityCheck | None:
    """The stored result for `key`, if it was measured on these weights and this text."""
    try:
        entries = json.loads((directory / QUALITY_FILE).read_text()).get("checks", {})
        check = QualityCheck(**entries[key])  # one stored before a field was added: TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if check.digest != digest or check.text_sha256 != text_sha256():
        return None
    return check


def store(directory: Path, check: QualityCheck) -> bool:
    """Adds `check` to the version's quality.json (atomic replace); False where it cannot write."""
    path = directory / QUALITY_FILE
    try:
        data = json.loads(path.read_text())
        checks = data.get("checks", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        checks = {}
    checks[check.key] = asdict(check)
    bounds = {"max_perplexity_ratio": MAX_PERPLEXITY_RATIO, "min_agreement": MIN_AGREEMENT}
    body = json.dumps({**bounds, "checks": checks}, indent=2, sort_keys=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".quality-", dir=directory)
        with os.fdopen(fd, "w") as fh:
            fh.write(body + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not store the perplexity check in %s (%s); the next load measures again", path, exc)
        return False
    return True


def load_weights(verified: VerifiedModel, device: torch.device, dtype: torch.dtype) -> Any:
    """The verified safetensors weights in `dtype` on `device` (no remote code, no network)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        verified.path, use_safetensors=True, dtype=dtype, trust_remote_code=False, local_files_only=True
    )
    return model.to(device).eval()  # type: ignore[arg-type]


def convert(model: Any, dtype: torch.dtype, quantize: str) -> Any:
    """Casts a loaded model to `dtype` and applies `quantize` (tests replace this to inject drift)."""
    model = model.to(dtype)
    if quantize != QUANTIZE_NONE:
        from services.inference.engine.quantize import quantize_model

        quantize_model(model, quantize)
    return model


def measure(
    model_fp32: Any,
    ids: list[int],
    device: torch.device,
    dtype: torch.dtype,
    quantize: str,
    digest: str,
    forward: ServingForward | None = None,
) -> tuple[Any, QualityCheck]:
    """Reference perplexity on `model_fp32`, then `convert` it and measure again (both through
    `forward`, the one that serves, where given). Returns the converted model (the float32 one
    is consumed) and the check."""
    started = time.perf_counter()
    reference, reference_top = score(model_fp32, ids, device, forward)
    model = convert(model_fp32, dtype, quantize)
    if quantize == QUANTIZE_NONE:
        served, top = score(model, ids, device, forward)
    else:
        from services.inference.engine.quantize import quantized_everywhere

        # The quantized arithmetic itself, not the served dtype's matmul that long calls take
        # (the serving forward forces it on its own; transformers' through the layers).
        with quantized_everywhere(model):
            served, top = score(model, ids, device, forward)
    check = QualityCheck(
        device=device.type,
        dtype=dtype_name(dtype),
        quantize=quantize,
        digest=digest,
        text_sha256=text_sha256(),
        tokens=len(ids),
        perplexity=served,
        reference_perplexity=reference,
        seconds=round(time.perf_counter() - started, 3),
        agreement=round(agreement(top, reference_top), 4),
    )
    return model, check


def load_guarded(
    verified: VerifiedModel,
    device: torch.device,
    choice: DtypeChoice,
    quantize: str,
    tokenizer: Tokenizer,
    max_tokens: int,
    forward: ServingForward | None = None,
    quantize_explicit: bool = True,
) -> tuple[Any, torch.dtype, QualityCheck | None, str]:
    """Loads the model in the chosen dtype (and quantization) if it passes the guard.

    Returns (model, dtype served, the check or None for plain float32, quantization served). A
    failing check raises QualityError when the dtype or quantization was asked for explicitly
    (`quantize_explicit`: LLMESH_QUANTIZE named it); a failing automatic quantization is dropped
    with a warning (the dtype is then checked alone), a failing automatic dtype falls back to
    float32 with a warning."""
    if quantize != QUANTIZE_NONE and not quantize_explicit:
        try:
            return load_guarded(verified, device, choice, quantize, tokenizer, max_tokens, forward)
        except (QualityError, ValueError) as exc:
            log.warning("%s; LLMESH_QUANTIZE=auto serves it unquantized", exc)
            return load_guarded(verified, device, choice, QUANTIZE_NONE, tokenizer, max_tokens, forward)
    dtype = choice.dtype
    if dtype == torch.float32 and quantize == QUANTIZE_NONE:
        return load_weights(verified, device, torch.float32), torch.float32, None, quantize
    key = check_key(device.type, dtype_name(dtype), quantize)
    check = stored(verified.path, key, verified.digest)
    model: Any = None
    if check is None:
        ids = text_ids(tokenizer, max_tokens)
        model, check = measure(
            load_weights(verified, device, torch.float32), ids, device, dtype, quantize, verified.digest, forward
        )
        log.info(
            "perplexity guard for %s %s measured in %.1fs: %s",
            verified.model_id,
            verified.version,
            check.seconds,
            check.describe(),
        )
        store(verified.path, check)
    else:
        log.info("perplexity guard for %s %s (stored): %s", verified.model_id, verified.version, check.describe())
    if check.passes:
        if model is None:
            model = convert(load_weights(verified, device, dtype), dtype, quantize)
        return model, dtype, check, quantize
    refused = f"{verified.model_id} {verified.version}: refusing {check.describe()}"
    explicit = choice.explicit or quantize != QUANTIZE_NONE
    if explicit:
        if quantize != QUANTIZE_NONE:
            advice = f"LLMESH_QUANTIZE={quantize} asked for it: set LLMESH_QUANTIZE=none"
        else:
            advice = f"{choice.reason} asked for it: set LLMESH_DTYPE=float32 (or auto)"
        raise QualityError(f"{refused}; {advice} to serve this model")
    log.warning("%s; serving float32 instead", refused)
    del model
    return load_weights(verified, device, torch.float32), torch.float32, check, QUANTIZE_NONE
