"""The fallback for backends that report no load: a limit on the weight in flight learned from
the throughput the gateway sees and from first-token times (a queueing judge)."""

from __future__ import annotations

import math
from collections import deque

# Over its life an admitted request's weight not yet generated falls from its whole reservation to
# nothing: half of it on average. By Little's law the weight in flight is then
# throughput x time in system x this share.
REMAINING_SHARE = 0.5
# The learned limit never drops below initial / this: a few typical requests. Higher, it outweighs
# what a slow machine delivers (at 3,000 weight/s, 16,384 in flight is 11 s in the system).
FLOOR_DIVISOR = 16

# The queueing judge (see CapacityLimit): a judging period's median time to first token is
# "not queueing" while it stays within QUEUE_TOLERANCE x the baseline + QUEUE_SLACK_S, the
# baseline being the lowest period median of the last BASELINE_S (a median, not the fastest
# sample: in a churning batch first tokens spread over a few steps without any queue).
QUEUE_TOLERANCE = 2.0
QUEUE_SLACK_S = 0.05
# ...and, where tokens stream, while it stays within QUEUE_STEPS x the period's median time
# between tokens: a first token waits for the step running and its own prefill, a few steps,
# however long a step takes at the batch size; a queue makes it wait for whole answers.
QUEUE_STEPS = 6.0
BASELINE_S = 120.0
JUDGE_S = 1.0  # a period lasts at least this and holds JUDGE_SAMPLES first tokens...
JUDGE_SAMPLES = 3
JUDGE_MAX_S = 5.0  # ...or lasts this long with at least one
# What the model carried without queueing is allowed again with this headroom, so the limit keeps
# probing upwards while time to first token stays flat; queueing halves it (from at most the
# period's peak), so a queue drains within a few periods: CARRIED_HEADROOM x CARRIED_BACKOFF < 1.
CARRIED_HEADROOM = 1.25
CARRIED_BACKOFF = 0.5


class CapacityLimit:
    """How much weight one model may have in flight from this gateway, learned from what it is
    measured to deliver.

    Throughput is the weight generated per second (input tokens x tokens streamed back), measured
    only while requests are in flight and smoothed over samples of `sample_seconds`. By Little's
    law, with each request's weight in flight falling from its reservation to nothing as its tokens
    come back (half of it on average, `REMAINING_SHARE`), a limit of
    ``throughput x target_seconds / 2`` keeps a request's time in the system near
    `target_seconds`: below capacity, requests finish faster than the target, so the limit sits
    above what is in flight and opens up as throughput follows demand; at capacity, the queue
    stays bounded and the surplus is shed. A cold gateway allows `initial` until it has measured;
    the limit never drops below `initial / 16` (and one request always runs when none is in
    flight), so a gateway that measured nothing recently can still learn. `cap` bounds it all;
    without `adaptive` the cap is the limit.

    Time in the system is not queueing, though: a batching engine (vLLM, or ours on a GPU) runs
    more streams side by side, each slower, and its requests may spend longer than the target in
    the system while none of them waits. So the limit is also at least what the model has been
    seen to carry without queueing, judged like Envoy's adaptive concurrency and Netflix's
    gradient limits judge round trips, with the time to first token (admission to first token:
    the queue and the prefill) as the signal. Per judging period (`JUDGE_S`, `JUDGE_SAMPLES`),
    if the median time to first token stays within `QUEUE_TOLERANCE` x its baseline (the lowest
    period median of the last `BASELINE_S`) plus `QUEUE_SLACK_S`, or within `QUEUE_STEPS` x the
    period's median time between tokens (a step grows with the batch: at 32 streams vLLM's first
    tokens take 3x longer than at one, with no queue), the peak weight in flight
    during the period was carried without queueing: `carried` rises to it, and the limit allows
    `CARRIED_HEADROOM` x that, so it keeps probing upwards while the first tokens stay prompt.
    When they slow down, `carried` halves (from at most that period's peak: `CARRIED_BACKOFF`)
    until Little's law takes over again. A request's deadline is judged apart (`drain_seconds`)."""

    __slots__ = (
        "_busy",
        "_done",
        "_itls",
        "_last",
        "_medians",
        "_peak",
        "_period_start",
        "_ttfts",
        "adaptive",
        "alpha",
        "cap",
        "carried",
        "held",
        "in_flight",
        "initial",
        "requests",
        "sample_seconds",
        "streaming",
        "target_seconds",
        "throughput",
    )

    def __init__(
        self,
        *,
        cap: float,
        adaptive: bool,
        target_seconds: float,
        initial: float,
        now: float,
        sample_seconds: float = 0.5,
        alpha: float = 0.3,
    ) -> None:
        self.cap = cap
        self.adaptive = adaptive
        self.target_seconds = target_seconds
        self.initial = min(initial, cap)
        self.sample_seconds = sample_seconds
        self.alpha = alpha
        self.in_flight = 0.0  # reserved weight of admitted requests not yet generated
        self.requests = 0  # admitted requests not yet finished
        self.streaming = 0  # of those, the ones whose tokens have started to come back
        self.held = 0  # weight held by requests between precheck and admission
        self.throughput = 0.0  # weight per second while busy; 0 until measured
        self._busy = 0.0
        self._done = 0.0
        self._last = now
        self.carried = 0.0  # weight in flight seen carried without queueing; 0 until judged
        self._ttfts: list[float] = []  # this judging period's times to first token
        self._itls: list[float] = []  # and its times between tokens
        self._peak = 0.0  # this period's highest weight in flight
        self._period_start = now
        self._medians: deque[tuple[float, float]] = deque()  # (period end, its median time to first token)

    def limit(self) -> float:
        if not self.adaptive:
            return self.cap
        if not self.throughput:
            little = self.initial
        else:
            little = max(self.initial / FLOOR_DIVISOR, self.throughput * self.target_seconds * REMAINING_SHARE)
        return min(self.cap, max(little, self.carried * CARRIED_HEADROOM))

    def admitted(self, weight: float) -> None:
        """A request of `weight` went in flight."""
        self.in_flight += weight
        self.requests += 1
        self._peak = max(self._peak, self.in_flight)

    def first_token(self, now: float, seconds: float) -> bool | None:
        """A request's first token came back `seconds` after its admission; the verdict of the
        judging period it ended, if it ended one (see `judge`)."""
        if not self._ttfts and now - self._period_start > JUDGE_MAX_S:
            self._period_start = now  # a period with no first tokens yet starts with its first
        self._ttfts.append(seconds)
        return self.judge(now)

    def between_tokens(self, seconds: float) -> None:
        """A stream's next tokens came `seconds` per token after its previous ones."""
        self._itls.append(seconds)

    def baseline(self) -> float | None:
        """The lowest period median time to first token of the last BASELINE_S (None before the
        first period)."""
        return min((median for _, median in self._medians), default=None)

    def judge(self, now: float) -> bool | None:
        """Ends the judging period if it is due: whether the model queued in it (None: not due)."""
        samples, age = len(self._ttfts), now - self._period_start
        if not samples or not ((age >= JUDGE_S and samples >= JUDGE_SAMPLES) or age >= JUDGE_MAX_S):
            return None
        median = sorted(self._ttfts)[samples // 2]
        while self._medians and self._medians[0][0] < now - BASELINE_S:
            self._medians.popleft()
        self._medians.append((now, median))
        base = self.baseline()
        assert base is not None
        queued = median > QUEUE_TOLERANCE * base + QUEUE_SLACK_S
        if queued and self._itls:
            queued = median > QUEUE_STEPS * sorted(self._itls)[len(self._itls) // 2]
        if queued:
            self.carried = CARRIED_BACKOFF * min(self.carried, self._peak)
        else:
            self.carried = max(self.carried, self._peak)
        self._ttfts.clear()
        self._itls.clear()
        self._peak = self.in_flight
        self._period_start = now
        return queued

    def room(self, with_holds: bool) -> float:
        taken = self.in_flight + (self.held if with_holds else 0)
        if not self.requests and not (with_holds and self.held):
            return math.inf if self.adaptive else self.cap  # work-conserving: one always runs
        return self.limit() - taken

    def advance(self, now: float, generated: float = 0.0) -> None:
        """Time passes (and `generated` weight came back): busy time only counts while requests
        are streaming, so neither idle time nor a prefill dilutes the throughput, and a stall
        mid-stream lowers it."""
        if self.streaming:
            self._busy += max(0.0, now - self._last)
        self._last = now
        self._done += generated
        if self._busy >= self.sample_seconds:
            rate = self._done / self._busy
            self.throughput = rate if not self.throughput else self.throughput + self.alpha * (rate - self.throughput)
            self._busy = self._done = 0.0

    def drain_seconds(self, extra: float) -> float:
        """A request of weight `extra` joining now: its expected time in the system at the measured
        throughput (the weight in flight is about REMAINING_SHARE of throughput x time in system,
        and the request's own weight comes on top); 0 until measured."""
        if self.throughput <= 0 or not self.adaptive:
            return 0.0
        return ((self.in_flight + self.held) / REMAINING_SHARE + extra) / self.throughput

    def retry_after(self, need: float, window_seconds: float) -> float:
        """Time for `need` weight in flight to drain at the measured throughput."""
        if self.throughput <= 0:
            return min(window_seconds, self.target_seconds)
        return min(window_seconds, max(0.05, need / self.throughput))
