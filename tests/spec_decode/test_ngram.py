"""N-gram prompt lookup proposer: propose_ngram against a brute-force reference, and NgramProposer's cache."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heron.spec_decode.ngram import NgramProposer, propose_ngram


def arr(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def ngram(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Brute force: longest n first; the earliest occurrence that ends before the last position."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > total:
            continue
        pattern = tokens[total - n :]
        for start in range(total - n):  # start + n - 1 <= total - 2
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


# --- propose_ngram ------------------------------------------------------------------------------


def test_longest_n_wins_over_shorter():
    # 3-gram [2, 3, 4] first occurs at 0 (-> 5, 1), but the 4-gram [1, 2, 3, 4] occurs at 4 (-> 1, 2).
    tokens = [2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4]
    assert ngram(tokens, 3, 4, 2) == [1, 2]
    assert ngram(tokens, 3, 3, 2) == [5, 1]
    # 2- and 3-grams match, not 4: the 3-gram [2, 3, 4] at 3 wins over the 2-gram [3, 4] at 0.
    assert ngram([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2) == [1, 2]


def test_min_n_respected():
    tokens = [7, 9, 1, 2, 3, 4, 8, 2]  # only a 1-gram ([2]) matches
    assert ngram(tokens, 1, 3, 2) == [3, 4]
    assert ngram(tokens, 2, 3, 2) == []
    tokens = [1, 2, 3, 4, 1, 2, 3]  # the longest match is the 3-gram
    assert ngram(tokens, 4, 4, 2) == []
    assert ngram(tokens, 3, 4, 2) == [4, 1]


def test_at_most_k_and_fewer_at_end_of_context():
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert ngram(tokens, 2, 2, 3) == [4, 1, 2]
    assert ngram(tokens, 2, 2, 2) == [4, 1]
    assert ngram(tokens, 2, 2, 1) == [4]
    assert ngram(tokens, 2, 2, 0) == []
    # vLLM's docstring example: [2, 3] matches at 1, only 3 tokens follow it.
    assert ngram([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]
    # An overlapping match right before the suffix proposes the single token left.
    assert ngram([5, 1, 1], 1, 1, 4) == [1]


def test_no_match_is_empty():
    out = propose_ngram(arr(1, 2, 3, 4, 5), 1, 3, 4)
    assert out.shape == (0,) and out.dtype == np.int64
    assert ngram([], 1, 3, 4) == []
    assert ngram([7], 1, 3, 4) == []


def test_several_occurrences_pick_the_earliest_like_vllm():
    # vLLM: "Multiple 3-gram matched, but always pick the first one."
    tokens = [1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3]
    assert ngram(tokens, 3, 3, 2) == [100, 1]
    assert ngram([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2) == [6, 2]
    assert ngram([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]


def test_suffix_itself_is_not_a_match():
    assert ngram([4, 5, 6], 1, 3, 2) == []
    assert ngram([4, 5, 6], 3, 3, 2) == []
    # A run: the suffix [9, 9, 9] overlaps its own earliest occurrence, which ends before the last token.
    assert ngram([1, 9, 9, 9, 9], 3, 3, 5) == [9]
    assert ngram([1, 9, 9, 9], 3, 3, 5) == []


def test_result_is_a_copy_with_the_input_dtype():
    tokens = arr(1, 2, 3, 1, 2)
    out = propose_ngram(tokens, 1, 2, 3)
    assert out.tolist() == [3, 1, 2]
    out[0] = -1
    assert tokens.tolist() == [1, 2, 3, 1, 2]
    assert propose_ngram(tokens.astype(np.int32), 1, 2, 3).dtype == np.int32


@pytest.mark.parametrize("min_n,max_n,k", [(0, 2, 1), (3, 2, 1), (1, 2, -1)])
def test_bad_parameters_raise(min_n: int, max_n: int, k: int):
    with pytest.raises(ValueError):
        propose_ngram(arr(1, 2, 1), min_n, max_n, k)
    with pytest.raises(ValueError):
        NgramProposer(k, min_n, max_n)


def test_not_1d_raises():
    with pytest.raises(ValueError):
        propose_ngram(np.zeros((2, 3), dtype=np.int64), 1, 2, 1)


def test_matches_reference_seeded_random():
    rng = random.Random(1234)
    for _ in range(500):
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 6)
        assert ngram(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
    k=st.integers(0, 8),
)
def test_matches_reference_hypothesis(tokens: list[int], min_n: int, extra: int, k: int):
    assert ngram(tokens, min_n, min_n + extra, k) == reference(tokens, min_n, min_n + extra, k)


def test_long_context():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 30_000, size=5000)
    # The output starts copying the prompt from position 1234: the continuation is the prompt's.
    tokens = np.concatenate([prompt, prompt[1234:1240]])
    assert propose_ngram(tokens, 2, 5, 4).tolist() == prompt[1240:1244].tolist()


# --- NgramProposer --------------------------------------------------------------------------------


@dataclass
class FakeSeq:
    seq_id: int
    token_ids: list[int] = field(default_factory=list)


def test_proposer_matches_propose_ngram_as_tokens_grow():
    rng = random.Random(7)
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    seqs = [FakeSeq(i, [rng.randrange(5) for _ in range(rng.randint(1, 20))]) for i in range(4)]
    for _ in range(60):
        for seq in seqs:  # grow by 0..3 tokens (0 included: a step without output for it)
            seq.token_ids.extend(rng.randrange(5) for _ in range(rng.randint(0, 3)))
        got = proposer.propose(seqs)
        want = {}
        for seq in seqs:
            draft = ngram(seq.token_ids, 1, 3, 3)
            if draft:
                want[seq.seq_id] = draft
        assert got == want
        assert all(1 <= len(d) <= 3 for d in got.values())
        assert proposer.num_cached() == len(seqs)


def test_proposer_leaves_out_sequences_without_match():
    proposer = NgramProposer(2, 2, 3)
    got = proposer.propose([FakeSeq(1, [1, 2, 3, 1, 2]), FakeSeq(2, [1, 2, 3, 4])])
    assert got == {1: [3, 1]}


def test_proposer_rebuilds_when_tokens_shrink_or_change():
    proposer = NgramProposer(2, 1, 2)
    seq = FakeSeq(0, [1, 2, 3, 1, 2, 9, 9])
    assert proposer.propose([seq]) == {0: [9]}
    seq.token_ids = [1, 2, 3, 1]  # shorter than the cache
    assert proposer.propose([seq]) == {0: [2, 3]}
    seq.token_ids = [1, 2, 3, 5, 6, 7, 5]  # longer, but the cached prefix was rewritten
    assert proposer.propose([seq]) == {0: [6, 7]}


def test_proposer_buffer_growth_keeps_contents():
    proposer = NgramProposer(4, 1, 4)
    seq = FakeSeq(3, [0])
    for t in range(1, 300):  # many doublings, one token at a time
        seq.token_ids.append(t % 17)
        got = proposer.propose([seq]).get(3, [])
        assert got == ngram(seq.token_ids, 1, 4, 4)


def test_forget_and_cache_bound():
    proposer = NgramProposer(2, 1, 2)
    a, b, c = FakeSeq(1, [1, 2, 1]), FakeSeq(2, [3, 4, 3]), FakeSeq(3, [5, 6, 5])
    proposer.propose([a, b, c])
    assert proposer.num_cached() == 3
    proposer.forget([2, 99])  # unknown ids are ignored
    assert proposer.num_cached() == 2
    assert proposer.propose([a, b]) == {1: [2, 1], 2: [4, 3]}
    assert proposer.num_cached() == 2  # c was not in the latest call: dropped
    assert proposer.propose([]) == {}
    assert proposer.num_cached() == 0
