"""Executes a step plan (scheduler.py) on the model runner: the forward the plan names (prefill,
the long prompt's chunk, decode, or a mixed forward of decode rows and a chunk), and the choice
of each row's token with the row's sampling, grammar mask, logit adjustments and log
probabilities. It decides nothing: the plan says what runs, the scheduler applies the output."""

from __future__ import annotations

import time

from services.inference.engine.runner import ModelRunner, Sampling
from services.inference.engine.sampling import (
    Adjustments,
    Constraints,
    GrammarRows,
    LogprobRows,
    RowAdjustment,
    choose_scored,
)
from services.inference.engine.scheduler import StepOutput, StepPlan
from services.inference.engine.sequence import SequenceState


def execute(runner: ModelRunner, plan: StepPlan) -> StepOutput:
    """Runs `plan`'s forward and chooses its tokens (raises what the forward raises: the engine
    core answers an out-of-memory error through the scheduler)."""
    if plan.prefills:
        started_ns = time.time_ns()
        group = [r.seq for r in plan.prefills]
        logits = runner.prefill([(r.ids, r.start, r.blocks) for r in plan.prefills])
        chosen, scores = choose_scored(logits, *sampling_of(group))
        return StepOutput(prefill_tokens=tuple(chosen.tolist()), prefill_scores=scores, started_ns=started_ns)
    chunk = plan.chunk
    if plan.mixed:
        assert chunk is not None
        running = list(plan.decodes)
        decode_logits, chunk_logits = runner.mixed(plan.decode_rows(), (chunk.ids, chunk.start, chunk.blocks))
        chosen, decode_scores = choose_scored(decode_logits, *sampling_of(running), stage=runner.decode_stage)
        decoded = tuple(chosen[: len(running)].tolist())
        if not chunk.completes:
            return StepOutput(decode_tokens=decoded, decode_scores=decode_scores)
        first, chunk_scores = choose_scored(chunk_logits, *sampling_of([chunk.seq]))
        return StepOutput(
            chunk_token=int(first[0]), chunk_scores=chunk_scores, decode_tokens=decoded, decode_scores=decode_scores
        )
    if chunk is not None:
        logits = runner.prefill([(chunk.ids, chunk.start, chunk.blocks)])
        if not chunk.completes:
            return StepOutput()
        first, chunk_scores = choose_scored(logits, *sampling_of([chunk.seq]))
        return StepOutput(chunk_token=int(first[0]), chunk_scores=chunk_scores)
    tokens, scores = runner.decode_scored(plan.decode_rows(), sampling_of(list(plan.decodes)))
    return StepOutput(decode_tokens=tuple(tokens), decode_scores=scores)


def sampling_of(seqs: list[SequenceState]) -> Sampling:
    """Sampling of the batch rows 0..len(seqs)-1 (row i is seqs[i])."""
    picked = [(row, s) for row, s in enumerate(seqs) if not s.params.greedy]
    return (
        [row for row, _ in picked],
        [s.params.temperature for _, s in picked],
        [s.params.top_p for _, s in picked],
        [s.seed for _, s in picked],
        [len(s.generated) for _, s in picked],
        constraints_of(seqs),
        adjustments_of(seqs),
        logprob_rows_of(seqs),
    )


def constraints_of(seqs: list[SequenceState]) -> Constraints | None:
    """The token masks of the rows under a grammar (None when no row has one)."""
    constrained = [(row, s.grammar) for row, s in enumerate(seqs) if s.grammar is not None]
    if not constrained:
        return None
    # The masks are computed in the choice, in one batch call (engine/sampling.py).
    grammars = constrained[0][1].grammars
    return GrammarRows(
        [row for row, _ in constrained], [g for _, g in constrained], grammars.words, grammars.fill_masks
    )


def adjustments_of(seqs: list[SequenceState]) -> Adjustments | None:
    """Penalties, biases and top_k / min_p of the rows that ask for them (None when none does)."""
    adjusted: list[RowAdjustment] = []
    filters: dict[int, tuple[int, float]] = {}
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.adjusts_logits:
            adjusted.append(
                RowAdjustment(
                    row=row,
                    bias=p.logit_bias,
                    repetition=p.repetition_penalty,
                    presence=p.presence_penalty,
                    frequency=p.frequency_penalty,
                    seen=(*seq.prompt_ids, *seq.generated) if p.repetition_penalty != 1.0 else (),
                    generated=tuple(seq.generated) if p.presence_penalty or p.frequency_penalty else (),
                )
            )
        if not p.greedy and (p.top_k or p.min_p):
            filters[row] = (p.top_k, p.min_p)
    if not adjusted and not filters:
        return None
    return Adjustments(tuple(adjusted), filters)


def logprob_rows_of(seqs: list[SequenceState]) -> LogprobRows | None:
    """The rows that return log probabilities (None when none does: the batch pays nothing)."""
    asked = [(row, s.params) for row, s in enumerate(seqs) if s.params.logprobs]
    if not asked:
        return None
    return LogprobRows(
        rows=tuple(row for row, _ in asked),
        temperatures=tuple(1.0 if p.greedy else p.temperature for _, p in asked),
        top=tuple(p.top_logprobs for _, p in asked),
    )
