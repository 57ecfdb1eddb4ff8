"""Executes a step plan (scheduler.py) on the model runner: the forward the plan names (prefill,
the long prompt's chunk, decode, or a mixed forward of decode rows with the long prompt's chunk
or with whole prompts that arrived), and the choice
of each row's token with the row's sampling, grammar mask, logit adjustments and log
probabilities. It decides nothing: the plan says what runs, the scheduler applies the output."""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from services.inference.engine.runner import ModelRunner, Sampling
from services.inference.engine.sampling import (
    Adjustments,
    Constraints,
    GrammarRows,
    LogprobRows,
    PromptScore,
    RowAdjustment,
    choose_scored,
    prompt_scores,
)
from services.inference.engine.scheduler import StepOutput, StepPlan
from services.inference.engine.sequence import SequenceState


def execute(runner: ModelRunner, plan: StepPlan, eos_ids: Collection[int] = frozenset()) -> StepOutput:
    """Runs `plan`'s forward and chooses its tokens (raises what the forward raises: the engine
    core answers an out-of-memory error through the scheduler). `eos_ids`: the model's, held off
    rows short of their min_new_tokens."""
    if plan.prefills and plan.mixed:
        # Whole prompts that arrived while rows decode, in the decode rows' forward.
        started_ns = time.time_ns()
        group, running = [r.seq for r in plan.prefills], list(plan.decodes)
        decode_logits, prompt_logits = runner.mixed(
            plan.decode_rows(), [(r.ids, r.start, r.blocks) for r in plan.prefills]
        )
        chosen, decode_scores = choose_scored(decode_logits, *sampling_of(running, eos_ids), stage=runner.decode_stage)
        first, prefill_scores = choose_scored(prompt_logits, *sampling_of(group, eos_ids))
        return StepOutput(
            prefill_tokens=tuple(first.tolist()),
            prefill_scores=prefill_scores,
            started_ns=started_ns,
            decode_tokens=tuple(chosen[: len(running)].tolist()),
            decode_scores=decode_scores,
        )
    if plan.prefills:
        started_ns = time.time_ns()
        group = [r.seq for r in plan.prefills]
        every = [i for i, s in enumerate(group) if s.params.prompt_logprobs is not None]
        logits, full = runner.prefill_scored([(r.ids, r.start, r.blocks) for r in plan.prefills], every)
        chosen, scores = choose_scored(logits, *sampling_of(group, eos_ids))
        scored = tuple((group[i], score_prompt(group[i], plan.prefills[i].start, rows)) for i, rows in full.items())
        return StepOutput(
            prefill_tokens=tuple(chosen.tolist()), prefill_scores=scores, started_ns=started_ns, prompt_scores=scored
        )
    chunk = plan.chunk
    if plan.mixed:
        assert chunk is not None
        running = list(plan.decodes)
        decode_logits, chunk_logits = runner.mixed(plan.decode_rows(), [(chunk.ids, chunk.start, chunk.blocks)])
        chosen, decode_scores = choose_scored(decode_logits, *sampling_of(running, eos_ids), stage=runner.decode_stage)
        decoded = tuple(chosen[: len(running)].tolist())
        if not chunk.completes:
            return StepOutput(decode_tokens=decoded, decode_scores=decode_scores)
        first, chunk_scores = choose_scored(chunk_logits, *sampling_of([chunk.seq], eos_ids))
        return StepOutput(
            chunk_token=int(first[0]), chunk_scores=chunk_scores, decode_tokens=decoded, decode_scores=decode_scores
        )
    if chunk is not None:
        every = [0] if chunk.seq.params.prompt_logprobs is not None else []
        logits, full = runner.prefill_scored([(chunk.ids, chunk.start, chunk.blocks)], every)
        scored = ((chunk.seq, score_prompt(chunk.seq, chunk.start, full[0])),) if full else ()
        if not chunk.completes:
            return StepOutput(prompt_scores=scored)
        first, chunk_scores = choose_scored(logits, *sampling_of([chunk.seq], eos_ids))
        return StepOutput(chunk_token=int(first[0]), chunk_scores=chunk_scores, prompt_scores=scored)
    tokens, scores = runner.decode_scored(plan.decode_rows(), sampling_of(list(plan.decodes), eos_ids))
    return StepOutput(decode_tokens=tuple(tokens), decode_scores=scores)


def score_prompt(seq: SequenceState, start: int, logits: torch.Tensor) -> tuple[PromptScore, ...]:
    """The scores of the prompt tokens that the logits of positions start.. (one row each)
    predict, in order; positions scored before (a requeued prompt) are skipped."""
    prompt = seq.prompt_ids
    low = max(start, len(seq.prompt_scores))
    high = min(start + logits.shape[0], len(prompt) - 1)
    if low >= high:
        return ()
    top = seq.params.prompt_logprobs or 0
    return tuple(prompt_scores(logits[low - start : high - start], prompt[low + 1 : high + 1], top))


def sampling_of(seqs: list[SequenceState], eos_ids: Collection[int] = frozenset()) -> Sampling:
    """Sampling of the batch rows 0..len(seqs)-1 (row i is seqs[i])."""
    picked = [(row, s) for row, s in enumerate(seqs) if not s.params.greedy]
    return (
        [row for row, _ in picked],
        [s.params.temperature for _, s in picked],
        [s.params.top_p for _, s in picked],
        [s.seed for _, s in picked],
        [len(s.generated) for _, s in picked],
        constraints_of(seqs),
        adjustments_of(seqs, eos_ids),
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


def adjustments_of(seqs: list[SequenceState], eos_ids: Collection[int] = frozenset()) -> Adjustments | None:
    """Penalties, biases and top_k / min_p of the rows that ask for them, and EOS and the stop
    token ids banned from rows short of their min_new_tokens (None when no row needs any)."""
    adjusted: list[RowAdjustment] = []
    filters: dict[int, tuple[int, float]] = {}
    for row, seq in enumerate(seqs):
        p = seq.params
        # A grammar's answer ends where the grammar says (its EOS is not held off).
        early = len(seq.generated) < p.min_new_tokens and seq.grammar is None
        if p.adjusts_logits or early:
            adjusted.append(
                RowAdjustment(
                    row=row,
                    bias=p.logit_bias,
                    repetition=p.repetition_penalty,
                    presence=p.presence_penalty,
                    frequency=p.frequency_penalty,
                    seen=(*seq.prompt_ids, *seq.generated) if p.repetition_penalty != 1.0 else (),
                    generated=tuple(seq.generated) if p.presence_penalty or p.frequency_penalty else (),
                    banned=tuple(sorted({*eos_ids, *p.stop_token_ids})) if early else (),
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
