"""SuffixIndex and RecentDocuments against linear scans (suffix_brute): counts, longest matches,
likeliest continuations and their probabilities, after adds, growth token by token, and FIFO eviction."""
from hypothesis import given, settings
from hypothesis import strategies as st

import suffix_brute as brute
from verispec_suffix.index import RecentDocuments, SuffixIndex

documents = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=6)


def strings_to_check(docs, max_depth):
    """Every substring of the documents up to max_depth, each extended by every token, and a few absent ones."""
    found = {tuple(d[i:j]) for d in docs for i in range(len(d)) for j in range(i + 1, min(len(d), i + max_depth) + 1)}
    return found | {w + (t,) for w in found for t in range(5) if len(w) < max_depth} | {(4,), (0, 4, 0)}


def assert_index_is(index, docs):
    for w in strings_to_check(docs, index.max_depth):
        node = index.find(w)
        want = brute.count(w, docs)
        assert (0 if node is None else node.count) == want, (w, docs)
        if node is not None:
            assert node.depth == len(w)
            assert node.link is index.find(w[1:])  # the root for one token
            for k, pmin in ((3, 0.0), (5, 0.3)):
                assert index.continuation(node, k, pmin) == brute.continuation(w, docs, index.max_depth, k, pmin), w


@settings(max_examples=60, deadline=None)
@given(docs=documents, max_depth=st.integers(1, 5), budget=st.integers(0, 30))
def test_recent_documents_keep_the_latest_within_the_budget_and_index_exactly_them(docs, max_depth, budget):
    recent = RecentDocuments(max_depth, budget)
    kept = []
    for d in docs:
        recent.add(d)
        if budget:  # the reference FIFO: the oldest leave until the new one fits; a long one keeps its tail
            kept.append(d[-budget:])
            while sum(map(len, kept)) > budget:
                kept.pop(0)
        assert list(recent.documents) == kept
        assert recent.num_tokens == sum(map(len, kept)) <= budget
        assert_index_is(recent.index, kept)


@settings(max_examples=60, deadline=None)
@given(docs=documents, max_depth=st.integers(1, 5))
def test_a_document_grown_token_by_token_is_indexed_as_if_added_whole(docs, max_depth):
    index = SuffixIndex(max_depth)
    tails = [index.root] * len(docs)
    grown = [[] for _ in docs]
    for step in range(max(map(len, docs))):  # grow the documents interleaved, one token each in turn
        for i, d in enumerate(docs):
            if step < len(d):
                tails[i] = index.extend(tails[i], d[step])
                grown[i].append(d[step])
                assert tails[i] is index.find(grown[i][-max_depth:])
        assert_index_is(index, grown)


@settings(max_examples=80, deadline=None)
@given(docs=documents, text=st.lists(st.integers(0, 4), max_size=20), max_depth=st.integers(1, 6))
def test_match_from_a_cursor_is_the_longest_suffix_present(docs, text, max_depth):
    index = SuffixIndex(max_depth)
    for d in docs:
        index.add(d)
    cursor = index.root
    for i, t in enumerate(text):
        node = index.match(cursor, t)
        m = brute.longest_match(text[:i + 1], docs, max_depth)
        assert (0 if node is None else node.depth) == m
        if node is not None:
            assert node is index.find(text[i + 1 - m:i + 1])
        cursor = index.advance(cursor, t)


def test_probabilities_are_occurrence_ratios_along_the_path():
    # after [a b]: c three times, d once, nothing once (the document's end): P(c) = 3/5, then
    # after [a b c]: e twice, f once: P(c e) = 3/5 * 2/3.
    a, b, c, d, e, f = range(6)
    index = SuffixIndex(8)
    for doc in ([a, b, c, e], [a, b, c, e], [a, b, c, f], [a, b, d], [a, b]):
        index.add(doc)
    assert index.continuation(index.find([a, b]), 4, 0.0) == ([c, e], [3 / 5, 3 / 5 * 2 / 3])
    assert index.continuation(index.find([a, b]), 4, 0.5) == ([c], [3 / 5])  # 0.4 < 0.5: cut
    assert index.continuation(index.find([a, b]), 1, 0.0) == ([c], [3 / 5])
    index.remove([a, b, c, e])
    index.remove([a, b, c, e])  # now c once, d once: the tie goes to the lower id
    assert index.continuation(index.find([a, b]), 4, 0.0) == ([c, f], [1 / 3, 1 / 3])
    index.remove([a, b, c, f])
    assert index.continuation(index.find([a, b]), 4, 0.0) == ([d], [1 / 2])
    assert index.find([c]) is None and index.find([a, b, c]) is None
