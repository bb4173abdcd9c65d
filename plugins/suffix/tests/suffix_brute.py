"""Brute-force references for the suffix index: counts, longest matches and continuations by linear scan."""
import math


def count(w, docs):
    """Occurrences of the string w in the documents."""
    n = len(w)
    return sum(1 for d in docs for i in range(len(d) - n + 1) if list(d[i:i + n]) == list(w))


def longest_match(text, docs, max_depth):
    """Length of the longest suffix of text (at most max_depth) occurring in the documents."""
    for m in range(min(max_depth, len(text)), 0, -1):
        if count(text[-m:], docs):
            return m
    return 0


def continuation(w, docs, max_depth, max_tokens, min_prob):
    """The likeliest continuation of w: most occurrences, lower token on a tie, product of ratios >= min_prob."""
    w, tokens, probs, prob = list(w), [], [], 1.0
    alphabet = sorted({t for d in docs for t in d})
    while len(tokens) < max_tokens and len(w) < max_depth:
        counts = {t: count(w + [t], docs) for t in alphabet}
        counts = {t: c for t, c in counts.items() if c}
        if not counts:
            break
        t = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[t] / count(w, docs)
        if prob < min_prob:
            break
        tokens.append(t)
        probs.append(prob)
        w.append(t)
    return tokens, probs


def candidate(text, last, docs, *, max_depth, max_tokens, min_prob, factor):
    """One index's draft and score after text + [last] (the rule of verispec_suffix.speculator)."""
    s = list(text) + [last]
    m = longest_match(s, docs, max_depth)
    if m == 0:
        return [], 0.0
    best, best_score = [], 0.0
    for u in range(min(m, max(1, max_depth - max_tokens)), 0, -1):  # longest first, a tie keeps the longer
        cap = min(max_tokens, math.floor(factor * u + 1e-9))
        tokens, probs = continuation(s[-u:], docs, max_depth, cap, min_prob)
        if sum(probs) > best_score:
            best, best_score = tokens, sum(probs)
    return best, best_score


def propose(history, last, shared_docs, *, max_depth, max_tokens, min_prob, factor=1.0, stops=()):
    """The speculator's draft by brute force: the better-scoring of the sequence's and the shared candidate."""
    if last in stops or max_tokens <= 0:
        return []
    kw = dict(max_depth=max_depth, max_tokens=max_tokens, min_prob=min_prob, factor=factor)
    draft, score = candidate(history, last, [history], **kw)
    shared_draft, shared_score = candidate(history, last, shared_docs, **kw)
    if shared_score > score:
        draft = shared_draft
    for i, t in enumerate(draft):
        if t in stops:
            return draft[:i + 1]
    return draft
