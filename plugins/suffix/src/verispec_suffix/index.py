"""The suffix index: every string of up to `max_depth` consecutive tokens of some documents, with its count.

A node is one string w, |w| = node.depth <= max_depth; node.count = its occurrences in the
documents (one at a document's end counts, though nothing follows it yet). Its children are the
strings w·t; its link is the node of w without its first token (the root for one token), which
exists whenever w does (each occurrence of w holds one of w[1:]). This is SuffixDecoding's suffix
tree (arXiv 2411.04975 §3) as a plain trie cut at max_depth: no path compression, so a token costs
up to max_depth nodes (~100 bytes each) where the text does not repeat.

Cost: a token appended to a document adds one occurrence to each of the <= max_depth strings ending
there, found by walking the links down from the previous tail: O(max_depth). Matching the next token
from a cursor follows links as Aho-Corasick does (O(1) amortised along a stream, O(max_depth) at
worst); a continuation of n tokens costs O(n), each node caching its likeliest child. Removing a
document walks each of its suffixes: O(max_depth) per token.

The likeliest continuation (`continuation`): from the matched node, repeatedly the child with the
most occurrences (the lower token id on a tie); the estimated probability of the draft's i-th
token is the product of count(child) / count(node) along the path (the fraction of the matched
string's occurrences that go on that way), and the draft stops before the first token whose
product falls under min_prob. The score, the sum of those products, is the expected number of
accepted tokens; candidates (several indexes) compare by it.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

_versions = itertools.count()  # one sequence for every index: a version never names two index states


class Node:
    """One string of the index: the last token, length, occurrences, children, link (see the module docstring).

    `children` is None (a leaf), the one child itself (most nodes: text that does not repeat is a
    chain), or a dict token -> child; read it through `child` and `child_nodes`."""

    __slots__ = ("token", "depth", "count", "children", "link", "_best")

    def __init__(self, token: int | None, depth: int):
        self.token = token
        self.depth = depth
        self.count = 0
        self.children: Node | dict[int, Node] | None = None
        self.link: Node | None = None
        self._best: Node | None = None  # cached likeliest child; None = recompute on demand

    def child(self, token: int) -> Node | None:
        children = self.children
        if children is None or type(children) is Node:
            return children if children is not None and children.token == token else None
        return children.get(token)

    def child_nodes(self) -> list[Node]:
        children = self.children
        if children is None:
            return []
        return [children] if type(children) is Node else list(children.values())

    def _add_child(self, token: int) -> Node:
        node = Node(token, self.depth + 1)
        children = self.children
        if children is None:
            self.children = node
        elif type(children) is Node:
            self.children = {children.token: children, token: node}
        else:
            children[token] = node
        return node

    def _remove_child(self, token: int) -> None:
        children = self.children
        if type(children) is Node:
            self.children = None
        else:
            del children[token]
            if len(children) == 1:
                (self.children,) = children.values()

    def best_child(self) -> Node | None:
        """The child with the most occurrences, the lower token on a tie; None for a leaf."""
        if self._best is None and self.children is not None:
            self._best = min(self.child_nodes(), key=_rank)
        return self._best


def _rank(node: Node) -> tuple[int, int]:
    return -node.count, node.token


class SuffixIndex:
    """A suffix trie cut at `max_depth` over some documents (see the module docstring).

    A document grows token by token through `extend(tail, token)` (a sequence's own index) or is
    added whole by `add` and taken out again by `remove` (the engine-wide index). `version` changes
    whenever `add` or `remove` changes which strings exist (and differs between indexes): a cursor
    kept across that is stale.
    """

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth}: give >= 1")
        self.max_depth = max_depth
        self.root = Node(None, 0)
        self.version = next(_versions)

    def extend(self, tail: Node, token: int) -> Node:
        """Append `token` to a document whose last min(length, max_depth) tokens are `tail` (the root
        for an empty document); returns the new tail."""
        node = tail if tail.depth < self.max_depth else tail.link
        new_tail = longer = None
        while node is not None:  # the strings ending at the old end, longest first, down to the root
            child = node.child(token)
            if child is None:
                child = node._add_child(token)
            child.count += 1
            best = node._best
            if best is not None and best is not child and _rank(child) < _rank(best):
                node._best = child
            if longer is None:
                new_tail = child
            else:
                longer.link = child  # (u·t)[1:] = u[1:]·t
            longer, node = child, node.link
        longer.link = self.root
        return new_tail

    def add(self, tokens: Iterable[int]) -> None:
        """Index one whole document."""
        tail = self.root
        for t in tokens:
            tail = self.extend(tail, int(t))
        self.version = next(_versions)

    def remove(self, tokens: list[int]) -> None:
        """Take out a document `add` indexed (the same tokens)."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.max_depth]:
                child = node.child(t)
                child.count -= 1
                if node._best is child:
                    node._best = None
                if child.count == 0:  # its subtree held only this occurrence: drop it whole
                    node._remove_child(t)
                    break
                node = child
        self.version = next(_versions)

    def match(self, cursor: Node, token: int) -> Node | None:
        """The longest string present that is a suffix of (cursor's string)·token, or None.

        `cursor` must be the longest suffix of some text present in the index; the result is then
        the longest suffix of text·token present (links visit every shorter suffix in turn)."""
        node = cursor
        while node is not None:
            if node.depth < self.max_depth:
                child = node.child(token)
                if child is not None:
                    return child
            node = node.link
        return None

    def advance(self, cursor: Node, token: int) -> Node:
        """`match`, or the root when not even `token` alone is present."""
        node = self.match(cursor, token)
        return self.root if node is None else node

    def find(self, tokens: Iterable[int]) -> Node | None:
        """The node of exactly this string, or None."""
        node = self.root
        for t in tokens:
            node = node.child(t)
            if node is None:
                return None
        return node

    def continuation(self, node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """The likeliest continuation of `node`'s string, at most max_tokens, and each token's
        estimated probability; it stops before a token under min_prob (module docstring)."""
        tokens, probs = [], []
        prob = 1.0
        while len(tokens) < max_tokens:
            child = node.best_child()
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            tokens.append(child.token)
            probs.append(prob)
            node = child
        return tokens, probs


class RecentDocuments:
    """The engine-wide index: the latest documents within `max_tokens`, the oldest dropped first (FIFO).

    A document longer than the budget keeps its last `max_tokens` tokens; a budget of 0 keeps nothing.
    """

    def __init__(self, max_depth: int, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens}: give >= 0 (0 keeps nothing)")
        self.index = SuffixIndex(max_depth)
        self.max_tokens = max_tokens
        self.documents: deque[list[int]] = deque()
        self.num_tokens = 0

    def add(self, tokens: Iterable[int]) -> None:
        tokens = [int(t) for t in tokens]
        if self.max_tokens == 0 or not tokens:
            return
        tokens = tokens[-self.max_tokens:]
        while self.num_tokens + len(tokens) > self.max_tokens:
            oldest = self.documents.popleft()
            self.index.remove(oldest)
            self.num_tokens -= len(oldest)
        self.index.add(tokens)
        self.documents.append(tokens)
        self.num_tokens += len(tokens)
