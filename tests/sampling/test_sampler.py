"""The batched Sampler on synthetic logits: greedy, masks, biases, min_tokens, seeds, statistics, logprobs."""

from __future__ import annotations

import pytest
import torch

from heron.sampling.sampler import Sampler, SamplingRow, gather_logprobs
from heron.sampling_params import SamplingParams

VOCAB = 64
EOS = 2
CHI2_CRIT_999_DF19 = 43.820  # scipy.stats.chi2.ppf(0.999, 19)


def row(output: list[int] | None = None, prompt: list[int] | None = None, seed: int | None = None,
        **params) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), prompt or [5, 6], output or [], gen)


def logits_for(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def sample_many(logits_row: torch.Tensor, num: int, **params) -> torch.Tensor:
    """Tokens of ``num`` rows with identical logits and params, in one sampler call."""
    torch.manual_seed(0)
    out = Sampler(logits_row.shape[0], [EOS])(logits_row.repeat(num, 1), [row(**params) for _ in range(num)])
    return torch.tensor(out.token_ids)


def test_greedy_takes_argmax_and_leaves_logits_untouched():
    logits = logits_for(4)
    before = logits.clone()
    out = Sampler(VOCAB, [EOS])(logits, [row(temperature=0) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4
    assert torch.equal(logits, before)
    Sampler(VOCAB, [EOS])(logits, [row(temperature=0.7, top_k=3, repetition_penalty=1.5) for _ in range(4)])
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = logits_for(6)
    rows = [row(temperature=0 if i % 2 else 1.5) for i in range(6)]
    out = Sampler(VOCAB, [EOS])(logits, rows)
    assert out.token_ids[1::2] == logits[1::2].argmax(-1).tolist()


@pytest.mark.parametrize("params, allowed_of", [
    (dict(top_k=4), lambda p: set(p.topk(4).indices.tolist())),
    (dict(top_p=0.5), lambda p: set(p.argsort(descending=True)[: int(((p.sort(descending=True).values.cumsum(0)
                                                                           - p.sort(descending=True).values)
                                                                          < 0.5).sum())].tolist())),
    (dict(min_p=0.2), lambda p: set((p >= 0.2 * p.max()).nonzero().flatten().tolist())),
    (dict(top_k=6, top_p=0.7, min_p=0.05, temperature=0.8), None),
])
def test_sampling_never_leaves_the_allowed_set(params, allowed_of):
    logits = logits_for(1, seed=5)[0]
    tokens = set(sample_many(logits, 3000, **params).tolist())
    probs = torch.softmax(logits / params.get("temperature", 1.0), -1)
    if allowed_of is None:  # min_p, then top-k, then top-p, all at temperature 0.8
        p = probs.clone()
        p[p < 0.05 * p.max()] = 0
        top = p.topk(6)
        pk = top.values / top.values.sum()
        allowed = set(top.indices[: int(((pk.cumsum(0) - pk) < 0.7).sum())].tolist())
    else:
        allowed = allowed_of(probs)
    assert tokens <= allowed
    assert len(tokens) == len(allowed)  # with 3000 draws every allowed token shows up


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_temperature_sampling_matches_softmax_chi_square(temperature):
    logits = logits_for(1, seed=9, vocab=20)[0] * 0.5
    counts = torch.bincount(sample_many(logits, 20000, temperature=temperature), minlength=20).double()
    expected = torch.softmax(logits.double() / temperature, 0) * counts.sum()
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_999_DF19
    wrong = torch.softmax(logits.double(), 0) * counts.sum()  # the untempered distribution is rejected
    assert float(((counts - wrong) ** 2 / wrong).sum()) > CHI2_CRIT_999_DF19


def test_same_seed_same_tokens_whatever_the_batch():
    vocab = 1000
    sampler = Sampler(vocab, [EOS])
    steps = [logits_for(8, seed=s, vocab=vocab) * 0.1 for s in range(6)]
    gen = torch.Generator().manual_seed(1234)
    alone = [sampler(lg[:1], [SamplingRow(SamplingParams(top_p=0.95), [5, 6], [], gen)]) for lg in steps]
    gen = torch.Generator().manual_seed(1234)
    mixed = []
    for s, lg in enumerate(steps):
        mine = SamplingRow(SamplingParams(top_p=0.95), [5, 6], [], gen)
        batch = [row(temperature=0.3 + s), row(seed=s, top_k=3), row(temperature=0), mine, row(min_p=0.1)]
        lgs = torch.cat([lg[1:4], lg[:1], lg[4:5]])
        mixed.append(sampler(lgs, batch).token_ids[3])
    assert [o.token_ids[0] for o in alone] == mixed
    assert len(set(mixed)) > 1


def test_seeded_rows_differ_by_seed_and_repeat_by_seed():
    logits = torch.zeros(1, 1000)
    a = [Sampler(1000)(logits, [row(seed=s)]).token_ids[0] for s in (1, 1, 2)]
    assert a[0] == a[1] != a[2]


def test_allowed_token_ids_and_logit_bias():
    logits = logits_for(3)
    allowed = [3, 17, 40]
    rows = [row(temperature=0, allowed_token_ids=allowed), row(temperature=0, logit_bias={9: 100.0}),
            row(temperature=0, logit_bias={int(logits[2].argmax()): -1e9})]
    out = Sampler(VOCAB, [EOS])(logits, rows)
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.token_ids[1] == 9
    assert out.token_ids[2] == int(logits[2].topk(2).indices[1])
    assert set(sample_many(logits[0], 500, allowed_token_ids=allowed).tolist()) == set(allowed)


def test_bad_words_single_and_multi_token():
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 10.0  # the favourite
    logits[:, 8] = 5.0
    params = dict(temperature=0, bad_words=["x"])
    rows = [row(output=[1], **params), row(output=[3, 6], **params), row(output=[6, 3], **params),
            row(output=[], **params)]
    for r, words in zip(rows, ([[7]], [[6, 7]], [[6, 7]], [[6, 7]]), strict=True):
        r.params.bad_words_token_ids = words
    out = Sampler(VOCAB, [EOS])(logits, rows)
    # single-token word always banned; [6, 7] bans 7 only right after a 6
    assert out.token_ids == [8, 8, 7, 7]


def test_bad_words_need_tokenized_ids():
    with pytest.raises(AssertionError, match="update_from_tokenizer"):
        Sampler(VOCAB)(logits_for(1), [row(bad_words=["x"])])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 11] = 9.0
    logits[:, 12] = 8.0
    rows = [row(output=[4], temperature=0, min_tokens=3, stop_token_ids=[11]),
            row(output=[4, 4, 4], temperature=0, min_tokens=3, stop_token_ids=[11]),
            row(output=[], temperature=0, min_tokens=1, ignore_eos=True),
            row(output=[], temperature=0, stop_token_ids=[11])]
    assert Sampler(VOCAB, [EOS])(logits, rows).token_ids == [12, EOS, 11, EOS]


def test_logprobs_are_raw_and_truncated():
    logits = logits_for(4)
    rows = [row(logprobs=3, temperature=0.5, repetition_penalty=2.0, output=[1, 2], logit_bias={0: 5.0}),
            row(), row(logprobs=0, temperature=0), row(logprobs=5, top_k=2)]
    out = Sampler(VOCAB, [EOS])(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i, k in ((0, 3), (2, 0), (3, 5)):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(raw[i, tok]), abs=1e-6)
        assert lp.rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert [t for t, _ in lp.top] == raw[i].topk(k).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(raw[i].topk(k).values.tolist(), abs=1e-6)


def test_gather_logprobs_for_given_tokens():
    logits = logits_for(3)
    targets = torch.tensor([0, 5, int(logits[2].argmax())])
    lps = gather_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, -1)
    assert [lp.logprob for lp in lps] == pytest.approx(raw[torch.arange(3), targets].tolist(), abs=1e-6)
    assert lps[2].rank == 1 and len(lps[0].top) == 2


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    from heron.sampling.topk_topp import greedy

    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    logits[:, 700] = logits[:, 300] = 50.0
    logits[0, :] = float("-inf")
    logits[0, 5] = logits[0, 9] = 0.0
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert greedy(logits)[1:].eq(300).all() and greedy(logits)[0] == 5


@pytest.mark.parametrize("vocab", [1, 63, 64, 1000, 49_152])
def test_the_cpu_argmax_kernel_gives_torch_max_indices_for_ties_nans_infinities_and_strided_rows(vocab):
    from heron.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler: greedy takes torch.max")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab + 5, generator=g)[:, 2:vocab + 2]  # rows strided past their length
    last = vocab - 1
    logits[1, :] = float("-inf")  # no number at all: the first index
    logits[2, last] = float("inf")
    logits[3, last // 2] = logits[3, last] = 1e9  # a tie: the first
    logits[4, last] = float("nan")
    logits[5, last // 3] = logits[5, last] = float("nan")  # NaN above everything, the first NaN
    logits[6, :] = 7.0
    logits[7, 0] = float("nan")
    logits[8, :] = float("nan")
    expected = logits.max(dim=-1).indices
    assert torch.equal(kernels.argmax_rows(logits), expected)
    assert torch.equal(kernels.argmax_rows(logits[:0]), expected[:0])
