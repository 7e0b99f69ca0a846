"""When to speculate, and how far: a cost model from step times measured in this process.

Speculation pays when the tokens a step yields grow faster than its time. For ``B`` decoding sequences and ``k``
drafts each, a step verifies ``B (k + 1)`` tokens and yields ``B E(k)`` of them, where ``E(k) = 1 + r_1 +
r_1 r_2 + ...`` from the measured acceptance rate ``r_i`` of draft position i; it costs ``T(B (k + 1) + other)``
(the step time at that many tokens, measured) plus drafting (measured per draft step and batch size). Each step
takes the ``k`` in ``0..K`` with the best tokens per second (a k > 0 must promise 10% more than plain decoding), so under light load a single stream speculates
fully and under heavy load, where a step's time grows with its tokens, speculation turns itself off. vLLM's
``disable_by_batch_size``, when given, replaces the cost model: ``K`` drafts below that many running
sequences, none from there. A request whose own acceptance rate stays below
``min_acceptance_rate`` stops drafting.
"""

from __future__ import annotations

import math

_EMA = 0.2  # weight of a new measurement
_MIN_VERIFIED = 16  # drafts a request must have had verified before its acceptance rate can stop it
# expected gain a step must show before it speculates: the cost model sees step times only, not the
# proposing, acceptance and output work around them, so a marginal gain on paper is a loss in practice
_MIN_GAIN = 1.1


class StepTimes:
    """Seconds a step takes by its size: moving averages in power-of-two buckets, interpolated between them.
    With ``warmup``, each bucket's first measurement is dropped (a first call pays for allocations and caches)."""

    def __init__(self, warmup: bool = False) -> None:
        self._points: dict[int, tuple[float, float]] = {}  # bucket -> (mean size, mean seconds)
        self._warm: set[int] | None = set() if warmup else None  # buckets past their first measurement

    def observe(self, size: int, seconds: float) -> None:
        """Record a step of ``size`` (tokens, or sequences) that took ``seconds``."""
        if size <= 0:
            return
        bucket = int(math.log2(size))
        if self._warm is not None and bucket not in self._warm:
            self._warm.add(bucket)
            return
        old = self._points.get(bucket)
        new = (float(size), seconds) if old is None else (
            old[0] + _EMA * (size - old[0]), old[1] + _EMA * (seconds - old[1]))
        self._points[bucket] = new

    def __bool__(self) -> bool:
        return bool(self._points)

    def estimate(self, size: int) -> float:
        """Seconds for a step of ``size``: linear between the nearest measured sizes, proportional beyond the
        largest (a step never gets cheaper per token as it grows), flat below the smallest; 0 if none."""
        points = sorted(self._points.values())
        if not points:
            return 0.0
        if size <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if size <= n1:
                return t0 + (t1 - t0) * (size - n0) / max(n1 - n0, 1e-9)
        n, t = points[-1]
        return t * size / n


class SpeculationPolicy:
    """Chooses each step's number of draft tokens from measured step times and acceptance rates."""

    def __init__(self, max_tokens: int, disable_by_batch_size: int | None = None,
                 min_acceptance_rate: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.step_times = StepTimes()  # by tokens in the step
        # one draft forward, by sequences drafting; unknown until a second measurement (counted as free: the
        # policy drafts and so measures), as a draft model's first call, several target steps long, would
        # otherwise switch speculation off for good (it is only measured while drafting)
        self.draft_times = StepTimes(warmup=True)
        self.reached = [0] * max_tokens  # drafts verified at position i
        self.accepted = [0] * max_tokens  # and accepted there

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.step_times.observe(num_tokens, seconds)

    def observe_drafting(self, num_seqs: int, num_draft_steps: int, seconds: float) -> None:
        if num_draft_steps > 0:
            self.draft_times.observe(num_seqs, seconds / num_draft_steps)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_drafts`` drafts, of which the first ``num_accepted`` held."""
        for i in range(min(num_drafts, num_accepted + 1, self.max_tokens)):  # positions past a rejection: unseen
            self.reached[i] += 1
            self.accepted[i] += i < num_accepted

    def acceptance_rates(self) -> list[float]:
        """Each draft position's acceptance rate given that the drafts before it held: the first with a uniform
        prior, each later one with the rate before it as its prior (weight 2), so a position not yet reached is
        expected to do as the one before it (a uniform prior there kept a well-agreeing draft at the depths it
        had tried first)."""
        rates, prior = [], 0.5
        for a, r in zip(self.accepted, self.reached, strict=True):
            prior = (a + 2 * prior) / (r + 2)
            rates.append(prior)
        return rates

    def choose(self, num_decoding: int, other_tokens: int) -> int:
        """Draft tokens per sequence for the next step of ``num_decoding`` decodes and ``other_tokens`` more."""
        if num_decoding == 0:
            return 0
        if self.disable_by_batch_size is not None:  # vLLM's fixed rule replaces the cost model
            return self.max_tokens if num_decoding < self.disable_by_batch_size else 0
        if not self.step_times:
            return self.max_tokens  # nothing measured yet: speculate, and measure
        best_k, best_rate = 0, _MIN_GAIN * num_decoding / max(self.step_times.estimate(num_decoding + other_tokens),
                                                              1e-9)
        expected, survive = 1.0, 1.0
        for k, rate in enumerate(self.acceptance_rates(), start=1):
            survive *= rate
            expected += survive
            seconds = (self.step_times.estimate(num_decoding * (k + 1) + other_tokens)
                       + k * self.draft_times.estimate(num_decoding))
            tokens_per_second = num_decoding * expected / max(seconds, 1e-9)
            if tokens_per_second > best_rate:
                best_k, best_rate = k, tokens_per_second
        return best_k

    def drafts_for(self, num_verified: int, num_accepted: int) -> bool:
        """Whether a request that had ``num_accepted`` of ``num_verified`` drafts accepted should draft on."""
        return num_verified < _MIN_VERIFIED or num_accepted >= self.min_acceptance_rate * num_verified
