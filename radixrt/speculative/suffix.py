"""Suffix decoding's index: a bounded-depth suffix trie with occurrence counts, and its adaptive drafts.

A ``SuffixTrie`` of depth ``D`` over sequences ``s_1..s_n`` holds a node for every substring of length
``<= D`` of any ``s_i``; a node's ``count`` is the number of places that substring occurs (all
sequences together). That is a suffix tree cut at depth ``D`` (uncompressed), which is all SuffixDecoding
(arXiv 2411.04975) reads: find the longest suffix of the request's tokens that occurs with a
continuation, then walk down the most frequent children while the product of the empirical
continuation probabilities ``count(child) / sum(count(children))`` stays at or above ``min_prob``.

Sequences are added and removed token by token through a window of at most ``D`` open paths, so
adding or removing a sequence of length ``L`` costs ``O(L * D)`` dict operations, and a growing
sequence (a request's own prompt + output) is extended in ``O(D)`` per new token. Removal deletes
nodes whose count reaches 0, so the trie holds exactly the substrings of what it currently indexes.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None


class SuffixTrie:
    """Counts of every substring of length ``<= depth`` of the sequences added (see the module doc)."""

    def __init__(self, depth: int, start: int = 0) -> None:
        """``start``: a growing sequence (``grow``) is indexed from that position on."""
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.nodes = 0  # nodes below the root
        self._open: list[_Node] = []  # growing sequence: paths of its last depth-1 starts, newest first
        self._grown = max(start, 0)  # tokens of the growing sequence added (or skipped)

    # -- building ------------------------------------------------------------------------------------------
    def _feed(self, open_paths: list[_Node], tok: int) -> list[_Node]:
        """Add the occurrences that end at ``tok``: one per open path (and a new one from the root)."""
        paths: list[_Node] = []
        created = 0
        for node in [self.root, *open_paths[: self.depth - 1]]:  # _child inlined: the hot loop
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(tok)
            if child is None:
                child = children[tok] = _Node()
                created += 1
            child.count += 1
            paths.append(child)
        self.nodes += created
        return paths

    def add(self, seq: Sequence[int]) -> None:
        """Index every substring (length ``<= depth``) of ``seq``."""
        paths: list[_Node] = []
        for tok in seq:
            paths = self._feed(paths, tok)

    def remove(self, seq: Sequence[int]) -> None:
        """Undo ``add(seq)`` (``seq`` must have been added): counts drop, nodes at 0 are deleted."""
        parents: list[_Node] = []
        for tok in seq:
            nxt: list[_Node] = []
            for parent in [self.root, *parents[: self.depth - 1]]:
                assert parent.children is not None, "remove() of a sequence that was not added"
                child = parent.children[tok]
                child.count -= 1
                if child.count == 0:
                    del parent.children[tok]
                    if not parent.children:
                        parent.children = None
                    self.nodes -= 1
                nxt.append(child)
            parents = nxt

    def grow(self, seq: Sequence[int]) -> None:
        """Index the tokens ``seq`` gained since the last ``grow`` (one sequence that only ever grows)."""
        for tok in seq[self._grown :]:
            self._open = self._feed(self._open, tok)
        self._grown = max(self._grown, len(seq))

    # -- reading -------------------------------------------------------------------------------------------
    def find(self, pattern: Sequence[int]) -> _Node | None:
        """The node of ``pattern`` (None when it does not occur or is longer than the depth)."""
        node: _Node | None = self.root
        for tok in pattern:
            if node is None or node.children is None:
                return None
            node = node.children.get(tok)
        return node

    def match(self, context: Sequence[int], max_len: int) -> tuple[int, _Node | None]:
        """The longest suffix of ``context`` (at most ``max_len`` tokens, below the depth) that occurs
        followed by some token: (its length, its node); (0, None) when no suffix does."""
        best: tuple[int, _Node | None] = (0, None)
        for m in range(1, min(max_len, self.depth - 1, len(context)) + 1):
            node = self.find(context[len(context) - m :])
            if node is None:
                break  # a longer suffix contains this one, so it does not occur either
            if node.children:
                best = (m, node)
        return best

    def draft(
        self, context: Sequence[int], max_match: int, k: int, min_prob: float
    ) -> tuple[list[int], float]:
        """SuffixDecoding's adaptive chain: from the longest matched suffix of ``context``, append the most
        frequent continuation (ties: the smallest token id) while the running product of continuation
        probabilities is ``>= min_prob``, at most ``k`` tokens and never below the depth. Returns the draft
        and its score, the sum of those running products (the expected number of accepted tokens under
        the index's empirical distribution)."""
        m, node = self.match(context, max_match)
        out: list[int] = []
        score, prob = 0.0, 1.0
        while node is not None and node.children and len(out) < k and m + len(out) < self.depth:
            total = sum(c.count for c in node.children.values())
            tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(tok)
            score += prob
            node = child
        return out, score


def draft_naive(
    corpus: Sequence[Sequence[int]],
    context: Sequence[int],
    depth: int,
    max_match: int,
    k: int,
    min_prob: float,
) -> tuple[list[int], float]:
    """``SuffixTrie.draft`` over ``corpus`` by plain counting of occurrences: the tests' reference."""

    def counts(pattern: list[int]) -> dict[int, int]:
        """Occurrences of ``pattern + [t]`` per token ``t`` (substrings of length <= depth only)."""
        out: dict[int, int] = {}
        n = len(pattern)
        if n + 1 > depth:
            return out
        for seq in corpus:
            for i in range(len(seq) - n):
                if list(seq[i : i + n]) == pattern:
                    out[seq[i + n]] = out.get(seq[i + n], 0) + 1
        return out

    m = 0
    for length in range(min(max_match, depth - 1, len(context)), 0, -1):
        if counts(list(context[len(context) - length :])):
            m = length
            break
    if m == 0:
        return [], 0.0
    pattern = list(context[len(context) - m :])
    draft: list[int] = []
    score, prob = 0.0, 1.0
    while len(draft) < k:
        nxt = counts(pattern + draft)
        if not nxt:
            break
        tok = max(nxt, key=lambda t: (nxt[t], -t))
        prob *= nxt[tok] / sum(nxt.values())
        if prob < min_prob:
            break
        draft.append(tok)
        score += prob
    return draft, score
