"""The speculation policy's cost model: interpolated step times, the choice of k, per-request cut-off."""

from __future__ import annotations

import random

from heron.spec_decode.policy import SpeculationPolicy, StepTimes


def test_step_times_interpolate_and_extrapolate():
    t = StepTimes()
    assert t.estimate(10) == 0.0 and not t
    t.observe(1, 0.010)
    t.observe(8, 0.020)
    assert t.estimate(1) == 0.010 and t.estimate(0) == 0.010
    assert abs(t.estimate(4) - (0.010 + 0.010 * 3 / 7)) < 1e-12
    assert abs(t.estimate(16) - 0.040) < 1e-12  # beyond the largest: proportional


def policy_with(step_seconds, rate: float, k: int = 4) -> SpeculationPolicy:
    policy = SpeculationPolicy(k)
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        policy.observe_step(n, step_seconds(n))
    rng = random.Random(0)
    for _ in range(400):  # each draft accepted with probability ``rate`` once the ones before it were
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        policy.observe_verification(k, accepted)
    return policy


def test_speculates_fully_when_steps_cost_the_same_at_any_size():
    policy = policy_with(lambda n: 0.010, rate=0.8)
    assert policy.choose(1, 0) == 4
    assert policy.choose(32, 0) == 4


def test_stops_speculating_when_a_step_costs_its_tokens():
    policy = policy_with(lambda n: 0.001 * n, rate=0.5)  # compute-bound: time grows with every token
    assert policy.choose(1, 0) == 0
    assert policy.choose(32, 0) == 0


def test_turns_off_under_load_on_a_memory_then_compute_bound_machine():
    policy = policy_with(lambda n: max(0.010, 0.0005 * n), rate=0.75)  # flat to 20 tokens, then linear
    assert policy.choose(1, 0) > 0
    assert policy.choose(64, 0) == 0


def test_drafting_cost_counts():
    policy = policy_with(lambda n: 0.010, rate=0.5)
    assert policy.choose(1, 0) > 0
    policy.observe_drafting(1, 1, 0.500)  # a first draft call: a warm-up, not counted
    assert policy.choose(1, 0) > 0
    policy.observe_drafting(1, 1, 0.050)  # a draft forward costs five target steps
    assert policy.choose(1, 0) == 0


def test_fixed_rule_when_disable_by_batch_size_is_given():
    policy = SpeculationPolicy(3, disable_by_batch_size=4)
    assert [policy.choose(n, 0) for n in (0, 1, 3, 4, 10)] == [0, 3, 3, 0, 0]


def test_acceptance_rates_are_conditional_on_reaching_the_position():
    policy = SpeculationPolicy(3)
    for _ in range(98):
        policy.observe_verification(3, 0)  # rejected at the first draft: later positions were never tested
    assert policy.acceptance_rates() == [1 / 100] * 3  # later positions: the prior, the rate before them


def test_a_position_not_yet_reached_is_expected_to_do_as_the_one_before_it():
    policy = SpeculationPolicy(6)
    for _ in range(98):
        policy.observe_verification(2, 2)  # two drafts a step so far, both always accepted
    rates = policy.acceptance_rates()
    assert rates[0] == 99 / 100 and rates[1] > 0.99
    assert rates[2:] == [rates[1]] * 4
    policy.observe_step(1, 0.010)
    policy.observe_step(16, 0.010)
    assert policy.choose(1, 0) == 6  # so the policy tries the deeper positions


def test_a_request_with_low_acceptance_stops_drafting():
    policy = SpeculationPolicy(4, min_acceptance_rate=0.2)
    assert policy.drafts_for(8, 0)  # too few verified to judge
    assert not policy.drafts_for(40, 4)
    assert policy.drafts_for(40, 10)
