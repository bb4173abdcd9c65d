"""Seeded sampling: keyed randomness, the filtered distribution, penalties, logprobs, validation.

Oracles are written here from the formulas (HF's warper order, OpenAI's penalties), never taken
from verispec.sampling; chi-square p-values come from the regularised upper incomplete gamma.
"""
from __future__ import annotations

import bisect
import itertools
import math
import random

import attrs
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verispec.sampling import Draw, InvalidLogits, Sampler, SamplingParams, keyed_uniform, mix64

# Ids deliberately out of probability order, so an id-order / rank-order mix-up shows.
LOGITS8 = [0.4, -0.3, 0.9, 0.1, 0.6, -0.8, 0.75, -0.1]
P_MIN = 1e-4  # chi-square acceptance threshold; streams are keyed, so each test is deterministic

# (top_k, top_p, min_p); each bites at T=0.3 or T=1.0 on LOGITS8, with no decision near a boundary.
FILTERS = [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.4), (5, 0.9, 0.2), (6, 0.95, 0.1)]


def oracle(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Brute force, in HF generate's order (temperature, top-k, top-p, min-p) with full sorts.

    Returns (probs [V] as Python floats, margin: the closest any keep/drop decision came to its
    threshold, for skipping cases whose outcome rounding could flip).
    """
    y = (torch.tensor(logits, dtype=torch.float32) / temperature).tolist()  # the sampler's fp32 division
    kept, margin = set(range(len(y))), math.inf

    def probs_of(ks):
        z = max(y[i] for i in ks)
        w = {i: math.exp(y[i] - z) for i in ks}
        total = sum(w.values())
        return {i: w[i] / total for i in ks}

    if 0 < top_k < len(y):
        kth = sorted(y, reverse=True)[top_k - 1]
        kept = {i for i in kept if y[i] >= kth}
    if top_p < 1.0:
        p, mass, nucleus = probs_of(kept), 0.0, set()
        for i in sorted(kept, key=lambda i: (-y[i], i)):
            margin = min(margin, abs(mass - top_p))
            if mass < top_p or not nucleus:
                nucleus.add(i)
            mass += p[i]
        kept = nucleus
    if min_p > 0.0:
        p = probs_of(kept)
        pmax = max(p.values())
        ratios = [math.log(p[i] / pmax) for i in kept if p[i] != pmax]
        margin = min([margin] + [abs(r - math.log(min_p)) for r in ratios])
        kept = {i for i in kept if p[i] >= min_p * pmax}
    p = probs_of(kept)
    return [p.get(i, 0.0) for i in range(len(y))], margin


def keyed_inverse_cdf(probs, seed, positions):
    """Tokens drawn by inverting the CDF (token-id order) at keyed_uniform(seed, pos)."""
    cdf = list(itertools.accumulate(probs))
    last = max(i for i, p in enumerate(probs) if p > 0)
    return [min(bisect.bisect_right(cdf, keyed_uniform(seed, pos) * cdf[-1]), last) for pos in positions]


def chi_square_pvalue(observed, expected):
    """Pearson's chi-square; bins expected below 5 are pooled. p = Q(df/2, stat/2)."""
    pairs = sorted(zip(expected, observed))
    bins, pool_e, pool_o = [], 0.0, 0
    for e, o in pairs:
        pool_e, pool_o = pool_e + e, pool_o + o
        if pool_e >= 5.0:
            bins.append((pool_e, pool_o))
            pool_e, pool_o = 0.0, 0
    if pool_e > 0.0 and bins:
        e, o = bins.pop()
        bins.append((e + pool_e, o + pool_o))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    df = len(bins) - 1
    assert df >= 1, "need at least two bins"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def counts(tokens, vocab_size):
    c = [0] * vocab_size
    for t in tokens:
        c[t] += 1
    return c


def logits8():
    return torch.tensor(LOGITS8, dtype=torch.float32)


# -- keyed randomness ---------------------------------------------------------------------------

def test_mix64_is_splitmix64():
    # SplitMix64 seeded with 1234567 (Rosetta Code "Pseudo-random numbers/Splitmix64", from
    # Vigna's splitmix64.c): output n is mix64(seed + (n + 1) * 0x9E3779B97F4A7C15).
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                4593380528125082431, 16408922859458223821]
    gamma = 0x9E3779B97F4A7C15
    assert [mix64(1234567 + (n + 1) * gamma) for n in range(5)] == expected


def test_keyed_uniform_is_uniform_and_independent():
    n = 100_000
    u = [keyed_uniform(7, pos) for pos in range(n + 1)]
    assert all(0.0 <= x < 1.0 for x in u)
    assert chi_square_pvalue(counts([int(x * 64) for x in u[:n]], 64), [n / 64] * 64) > P_MIN
    # consecutive positions, and the same position under neighbouring seeds, are independent
    pairs = [int(a * 8) * 8 + int(b * 8) for a, b in itertools.pairwise(u)]
    assert chi_square_pvalue(counts(pairs, 64), [n / 64] * 64) > P_MIN
    other = [int(u[pos] * 8) * 8 + int(keyed_uniform(8, pos) * 8) for pos in range(20_000)]
    assert chi_square_pvalue(counts(other, 64), [20_000 / 64] * 64) > P_MIN


# -- greedy and seed determinism ---------------------------------------------------------------

def test_greedy_is_argmax_with_ties_to_lowest_id():
    sampler = Sampler(SamplingParams(), [], 6)
    assert sampler.sample(torch.tensor([0.0, 3.0, -1.0, 3.0, 3.0, 2.9]), pos=0) == 1
    assert sampler.sample(torch.tensor([5.0, 3.0, -1.0, 3.0, 3.0, 2.9]), pos=1) == 0
    assert sampler.sample(torch.tensor([-math.inf, -7.0, -math.inf, -7.0, -8.0, -9.0]), pos=2) == 1


def test_greedy_ignores_seed_and_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-6).is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    logits = logits8()
    for params in (SamplingParams(seed=1), SamplingParams(seed=2, temperature=1e-6, top_k=3)):
        sampler = Sampler(params, [], 8)
        assert [sampler.sample(logits, pos) for pos in range(50)] == [2] * 50


def test_seeded_draw_depends_only_on_seed_and_position():
    params = SamplingParams(temperature=1.0, top_k=6, seed=1234)
    logits = logits8()
    positions = list(range(300))
    in_order = Sampler(params, [], 8)
    expected = {pos: in_order.sample(logits, pos) for pos in positions}
    scrambled = positions[:]
    random.Random(0).shuffle(scrambled)
    fresh = Sampler(params, [1, 2, 3], 8)
    assert {pos: fresh.sample(logits, pos) for pos in scrambled} == expected
    assert {pos: in_order.sample(logits, pos) for pos in reversed(positions)} == expected
    assert len(set(expected.values())) > 1


def test_different_seeds_give_independent_streams():
    # Two independent draws agree with probability sum(p^2); 5 sigma either side.
    n = 3000
    probs, _ = oracle(LOGITS8, 1.0)
    a = Sampler(SamplingParams(temperature=1.0, seed=1), [], 8)
    b = Sampler(SamplingParams(temperature=1.0, seed=2), [], 8)
    logits = logits8()
    agree = sum(a.sample(logits, pos) == b.sample(logits, pos) for pos in range(n))
    q = sum(p * p for p in probs)
    assert abs(agree - n * q) < 5 * math.sqrt(n * q * (1 - q))


def test_seed_none_picks_one_random_seed_that_replays():
    params = SamplingParams(temperature=1.0)
    a, b = Sampler(params, [], 8), Sampler(params, [], 8)
    assert a.seed != b.seed and 0 <= a.seed < 2**64
    replay = Sampler(SamplingParams(temperature=1.0, seed=a.seed), [], 8)
    logits = logits8()
    assert [a.sample(logits, pos) for pos in range(100)] == [replay.sample(logits, pos) for pos in range(100)]
    assert Sampler(SamplingParams(seed=-1), [], 8).seed == 2**64 - 1


# -- the distribution --------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.3, 1.0])
@pytest.mark.parametrize("top_k, top_p, min_p", FILTERS)
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p, min_p):
    """Sampler draws == inverse CDF of keyed uniforms over the brute-force distribution, token
    for token; and that keyed stream, 200k draws, passes chi-square against the distribution."""
    probs, margin = oracle(LOGITS8, temperature, top_k, top_p, min_p)
    assert margin > 1e-3
    seed = 99
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    sampler = Sampler(params, [], 8)
    logits = logits8()
    assert [sampler.sample(logits, pos) for pos in range(1500)] == keyed_inverse_cdf(probs, seed, range(1500))

    n = 200_000
    observed = counts(keyed_inverse_cdf(probs, seed, range(n)), 8)
    assert all(o == 0 for o, p in zip(observed, probs) if p == 0.0)
    support = [(o, n * p) for o, p in zip(observed, probs) if p > 0.0]
    assert chi_square_pvalue([o for o, _ in support], [e for _, e in support]) > P_MIN


def test_direct_draws_chi_square():
    """100k draws straight through Sampler.sample (one cheap config: small tensors cost ~30 us a draw)."""
    n = 100_000
    probs, _ = oracle(LOGITS8, 0.3, top_k=3)
    sampler = Sampler(SamplingParams(temperature=0.3, top_k=3, seed=5), [], 8)
    logits = logits8()
    observed = counts((sampler.sample(logits, pos) for pos in range(n)), 8)
    assert all(o == 0 for o, p in zip(observed, probs) if p == 0.0)
    support = [(o, n * p) for o, p in zip(observed, probs) if p > 0.0]
    assert chi_square_pvalue([o for o, _ in support], [e for _, e in support]) > P_MIN


def test_top_k_keeps_ties_with_the_kth_token():
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, logprobs=5, seed=0), [], 5)
    draw = sampler.draw(torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0]), pos=0)
    assert sorted(t for t, _ in draw.top_logprobs) == [1, 2, 3]
    assert all(lp == pytest.approx(math.log(1 / 3)) for _, lp in draw.top_logprobs)


@settings(max_examples=150, deadline=None)
@given(logits=st.lists(st.integers(-4, 4), min_size=1, max_size=40),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.7]),
       top_k=st.integers(0, 42),
       top_p=st.sampled_from([0.33, 0.61, 0.87, 0.955, 1.0]),
       min_p=st.sampled_from([0.0, 0.013, 0.27, 0.61, 1.0]),
       pos=st.integers(0, 2**40))
def test_kept_set_and_logprobs_match_brute_force(logits, temperature, top_k, top_p, min_p, pos):
    logits = [0.5 * v for v in logits]  # small integers: plenty of exact ties
    probs, margin = oracle(logits, temperature, top_k, top_p, min_p)
    assume(margin > 1e-9)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=3, logprobs=len(logits))
    draw = Sampler(params, [], len(logits)).draw(torch.tensor(logits), pos)
    assert probs[draw.token] > 0.0
    assert draw.logprob == pytest.approx(math.log(probs[draw.token]), abs=1e-9)
    assert {t for t, _ in draw.top_logprobs} == {i for i, p in enumerate(probs) if p > 0.0}
    for token, lp in draw.top_logprobs:
        assert lp == pytest.approx(math.log(probs[token]), abs=1e-9)
    ranks = [(-lp, t) for t, lp in draw.top_logprobs]
    assert ranks == sorted(ranks)


@settings(max_examples=25, deadline=None)
@given(size=st.integers(257, 5000), scale=st.sampled_from([0.5, 2.0, 8.0]),
       top_p=st.sampled_from([0.33, 0.61, 0.87, 0.955]), data_seed=st.integers(0, 2**31))
def test_top_p_over_a_large_vocab_matches_a_full_sort(size, scale, top_p, data_seed):
    """The nucleus is found by growing a top-n set, not sorting V; compare with the full sort."""
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.round(torch.randn(size, generator=g) * scale * 4) / 4  # rounded: ties
    y = logits.tolist()
    z = max(y)
    w = [math.exp(v - z) for v in y]
    total = sum(w)
    nucleus, mass = set(), 0.0
    for i in sorted(range(size), key=lambda i: (-y[i], i)):
        assume(abs(mass - top_p) > 1e-9)
        if mass < top_p or not nucleus:
            nucleus.add(i)
        mass += w[i] / total
    draw = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=1, logprobs=size), [], size).draw(logits, 0)
    assert {t for t, _ in draw.top_logprobs} == nucleus
    assert draw.token in nucleus


# -- penalties ---------------------------------------------------------------------------------

def penalised_logprobs(logits, context, output, rep=1.0, freq=0.0, pres=0.0, temperature=1.0):
    """log_softmax of (logits after HF's repetition penalty over context + output, then
    OpenAI's frequency and presence penalties over the output) / temperature."""
    seen = set(context) | set(output)
    x = []
    for t, v in enumerate(torch.tensor(logits, dtype=torch.float32).tolist()):
        if t in seen:
            v = v / rep if v > 0 else v * rep
        n = output.count(t)
        x.append((v - freq * n - pres * (n > 0)) / temperature)
    z = max(x)
    log_total = z + math.log(sum(math.exp(v - z) for v in x))
    return {t: v - log_total for t, v in enumerate(x)}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("rep, freq, pres", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (1.0, -0.4, 0.3),
                                             (1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.3, 0.5, 0.7)])
def test_penalties_follow_their_formulas(rep, freq, pres, temperature):
    """Penalties act on the raw logits, before temperature (HF/vLLM order)."""
    prompt, output = [0, 1, 1], [3, 3, 5, 3, 2]
    logits = [0.4, -0.3, 0.9, 0.1, 0.6, -0.8, 0.75, 0.0]
    params = SamplingParams(temperature=temperature, repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres, seed=0, logprobs=8)
    sampler = Sampler(params, prompt, 8)
    for t in output:
        sampler.accept(t)
    draw = sampler.draw(torch.tensor(logits), pos=8)
    expected = penalised_logprobs(logits, prompt, output, rep, freq, pres, temperature)
    assert dict(draw.top_logprobs) == pytest.approx(expected, abs=1e-6)
    assert draw.logprob == pytest.approx(expected[draw.token], abs=1e-6)


def test_every_accepted_token_counts():
    """Two accepts are two counts (a penalty that counted once per step would keep token 2)."""
    logits = torch.tensor([0.0, 0.5, 3.0, 1.0])
    sampler = Sampler(SamplingParams(frequency_penalty=1.5), [], 4)
    assert sampler.sample(logits, 0) == 2
    sampler.accept(2)
    assert sampler.sample(logits, 1) == 2  # 3.0 - 1.5 = 1.5 still leads 1.0
    sampler.accept(torch.tensor(2))  # a 0-d tensor from the loop counts the same
    assert sampler.sample(logits, torch.tensor(2)) == 3  # 3.0 - 3.0 = 0.0 now trails 1.0


def test_penalty_after_accept_changes_seeded_draws():
    logits = logits8()
    sampler = Sampler(SamplingParams(temperature=1.0, frequency_penalty=2.0, seed=11), [], 8)
    before = [sampler.sample(logits, pos) for pos in range(400)]
    assert [sampler.sample(logits, pos) for pos in range(400)] == before  # drawing changes nothing
    sampler.accept(2)
    after = [sampler.sample(logits, pos) for pos in range(400)]
    assert after != before
    assert after.count(2) < before.count(2) / 2


def test_speculative_windows_reproduce_the_plain_stream():
    """The loop's protocol over Sampler: verify rows drawn in order, accept each emitted token,
    stop at the first mismatch. Any drafter (right, wrong, random) must give the plain stream."""
    vocab, num_tokens, window = 16, 120, 4
    table = torch.randn(vocab, vocab, vocab, generator=torch.Generator().manual_seed(0)) * 2.0

    def logits_after(history):  # a toy trunk: fp32 [V] from the last two tokens
        return table[history[-2], history[-1]].clone()

    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
                            frequency_penalty=0.6, presence_penalty=0.3, seed=42)
    prompt = [1, 2, 3]
    plain_sampler, history = Sampler(params, prompt, vocab), list(prompt)
    for _ in range(num_tokens):
        token = plain_sampler.sample(logits_after(history), len(history))
        plain_sampler.accept(token)
        history.append(token)
    plain = history[len(prompt):]

    rng = random.Random(1)
    for drafter in ("perfect", "noisy", "random"):
        sampler, history = Sampler(params, prompt, vocab), list(prompt)
        while len(history) - len(prompt) < num_tokens:
            done = len(history) - len(prompt)
            drafts = plain[done:done + window]
            if drafter == "noisy" and drafts:
                drafts[rng.randrange(len(drafts))] = rng.randrange(vocab)
            elif drafter == "random":
                drafts = [rng.randrange(vocab) for _ in range(window)]
            # one verify forward over [last, d1..dK]: row i saw history + d1..di
            rows = [logits_after(history + drafts[:row]) for row in range(len(drafts) + 1)]
            for row in range(len(drafts) + 1):  # draw in order; row i only after d1..di passed
                token = sampler.sample(rows[row], len(history))
                sampler.accept(token)
                history.append(token)
                if row == len(drafts) or token != drafts[row]:
                    break  # correction (mismatch) or bonus (all accepted)
        assert history[len(prompt):len(prompt) + num_tokens] == plain, drafter


# -- logprobs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.3, 3, 1.0, 0.0),
                                                             (1.0, 0, 0.8, 0.0), (0.7, 6, 0.95, 0.1)])
def test_logprob_is_that_of_the_processed_distribution(temperature, top_k, top_p, min_p):
    probs, _ = oracle(LOGITS8, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=4, logprobs=2)
    sampler = Sampler(params, [], 8)
    plain = Sampler(attrs.evolve(params, logprobs=None), [], 8)
    logits = logits8()
    for pos in range(40):
        draw = sampler.draw(logits, pos)
        assert draw.logprob == pytest.approx(math.log(probs[draw.token]), abs=1e-6)
        best = sorted(((-p, t) for t, p in enumerate(probs) if p > 0))[:2]
        assert [t for t, _ in draw.top_logprobs] == [t for _, t in best]
        assert plain.draw(logits, pos) == Draw(draw.token)  # asking for logprobs changes nothing


def test_greedy_logprobs_are_those_of_the_penalised_logits():
    logits = [0.2, -0.3, 0.9, 0.1, 0.6, -0.8, 0.75, 0.0]
    sampler = Sampler(SamplingParams(presence_penalty=0.5, logprobs=3, top_k=2), [], 8)
    sampler.accept(2)
    draw = sampler.draw(torch.tensor(logits), pos=1)
    expected = penalised_logprobs(logits, [], [2], pres=0.5)
    assert draw.token == 6
    assert draw.logprob == pytest.approx(expected[6], abs=1e-6)  # the sampler penalises in fp32
    assert [t for t, _ in draw.top_logprobs] == [6, 4, 2]
    assert dict(draw.top_logprobs) == pytest.approx({t: expected[t] for t in (6, 4, 2)}, abs=1e-6)


def test_logprobs_off_returns_the_token_only():
    assert Sampler(SamplingParams(temperature=1.0, seed=0), [], 8).draw(logits8(), 0).logprob is None


# -- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("presence_penalty", 3.0), ("presence_penalty", math.nan),
    ("seed", 1.5), ("seed", "7"),
    ("logprobs", -1), ("logprobs", 1.0),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_boundary_params_are_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, frequency_penalty=-2.0,
                   presence_penalty=2.0, seed=0, logprobs=0)
    SamplingParams(top_p=1e-9, min_p=1.0, repetition_penalty=1e-3, seed=2**70)


def test_sampler_rejects_bad_ids_and_rows():
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(SamplingParams(), [], 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Sampler(SamplingParams(), [0, 8], 8)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), [], 8)
    with pytest.raises(ValueError, match="accept"):
        sampler.accept(8)
    with pytest.raises(InvalidLogits, match="shape"):
        sampler.sample(torch.zeros(9), 0)
    nan_row = logits8()
    nan_row[3] = math.nan
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams()):
        s = Sampler(params, [], 8)
        with pytest.raises(InvalidLogits) as info:
            s.sample(nan_row, 17)
        assert info.value.pos == 17
        with pytest.raises(InvalidLogits):
            s.sample(torch.full((8,), -math.inf), 0)
