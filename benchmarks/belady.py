"""An exact offline simulator of a radix prefix cache over a recorded trace, with LRU, priority and
Belady (clairvoyant) eviction.

The model is radixrt's RadixCache at page size 1, one request at a time in trace order:

1. request t matches its prompt (at most ``len(prompt) - min_compute`` tokens; the runtime's is 1:
   it always computes the last prompt token) against the cache of its namespace; the matched length is its hit;
2. its tokens (``prompt + output``, the tokens whose KV the request computed) are inserted;
3. while the cache holds more than ``capacity`` tokens, a whole unlocked leaf node is evicted (the
   nodes on request t's own path are locked, as the runtime locks a running request's prefix).

Nodes are compressed (one node per branch-free run of tokens, split where a match or insert ends
inside one), exactly as the runtime's tree, so node-level eviction frees the same tokens it does.

Policies rank the evictable leaves; the lowest rank goes first:

- ``lru``: (last access, node id); a node's access time is the index of the last request that matched
  or inserted it;
- ``priority``: (priority, last access, node id); a node's priority is the highest priority of the
  requests that matched or inserted it (``TraceRequest.priority``);
- ``belady``: the leaf whose next use is furthest in the future goes first, where the next use of a
  node is the next request whose prompt passes through the node's first token (keeping the node then
  saves that request at least one token); never-used-again leaves first, ties by LRU.

Belady's rule is optimal for unit-size pages; with variable-size nodes it is the classical clairvoyant
heuristic (exact optimal caching of variable-size items is NP-hard), so a brute force may beat it on
adversarial traces. Next uses are found with a 61-bit polynomial hash of every prompt prefix.

``python -m benchmarks.belady TRACE.json --capacity N`` simulates a trace saved by
``benchmarks.retention`` (``{"requests": [{"prompt": [...], "output": [...], "priority": p}, ...]}``).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

POLICIES = ("lru", "priority", "belady")
_MOD = (1 << 61) - 1
_BASE = 1_000_003
_NEVER = 1 << 62


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: its prompt ids, the ids it added after them (whose KV it computed), its
    cache namespace (``cache_salt``), retention priority and, where it is lower than the prompt allows,
    the most tokens it may take from the cache (the runtime computes the positions whose prompt
    logprobs a request asks for: ``logprob_start_len - 1``)."""

    prompt: list[int]
    output: list[int] = field(default_factory=list)
    namespace: str | None = None
    priority: int = 0
    hit_limit: int | None = None


@dataclass(slots=True)
class SimResult:
    """Hit tokens per request and in total, with the prompt tokens they are out of."""

    policy: str
    capacity: int | None
    hits: list[int]
    prompt_tokens: int
    evicted_tokens: int

    @property
    def hit_tokens(self) -> int:
        return sum(self.hits)


def _extend(h: int, token: int) -> int:
    return (h * _BASE + token + 1) % _MOD


class _Node:
    __slots__ = ("key", "children", "parent", "depth", "h_first", "access", "priority", "id", "next_use")

    def __init__(
        self, key: tuple[int, ...], parent: _Node | None, depth: int, h_first: int, nid: int
    ) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.depth = depth  # tokens above this node's first token
        self.h_first = h_first  # hash of the path up to and including key[0]
        self.access = -1
        self.priority = 0
        self.id = nid
        self.next_use = _NEVER


class _Future:
    """For every (namespace, prefix length, prefix hash) of the trace's prompts: the sorted indices of
    the requests whose prompt starts with that prefix."""

    def __init__(self, trace: Sequence[TraceRequest]) -> None:
        self.uses: dict[tuple[str | None, int, int], list[int]] = {}
        for t, req in enumerate(trace):
            h = 0
            for n, tok in enumerate(req.prompt, 1):
                h = _extend(h, tok)
                self.uses.setdefault((req.namespace, n, h), []).append(t)

    def next_use(self, namespace: str | None, node: _Node, after: int) -> int:
        uses = self.uses.get((namespace, node.depth + 1, node.h_first))
        if not uses:
            return _NEVER
        i = bisect.bisect_right(uses, after)
        return uses[i] if i < len(uses) else _NEVER


class PrefixCacheSim:
    """The simulated cache: ``run(trace)`` gives the hit tokens of every request."""

    def __init__(self, capacity: int | None, policy: str = "lru", min_compute: int = 1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} not in {POLICIES}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity: expected None or >= 1 tokens, got {capacity}")
        self.capacity, self.policy = capacity, policy
        self.min_compute = min_compute  # prompt tokens always computed (the runtime's: 1)
        self.roots: dict[str | None, _Node] = {}
        self.leaves: dict[int, tuple[str | None, _Node]] = {}
        self.size = 0
        self.evicted = 0
        self._ids = itertools.count(1)
        self._future: _Future | None = None
        self._now = -1  # index of the request being served

    # -- tree -----------------------------------------------------------------------------------
    def _root(self, ns: str | None) -> _Node:
        if ns not in self.roots:
            self.roots[ns] = _Node((), None, -1, 0, 0)
        return self.roots[ns]

    def _split(self, ns: str | None, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; the new upper node takes its place and is returned."""
        assert node.parent is not None and 0 < at < len(node.key)
        upper = _Node(node.key[:at], node.parent, node.depth, node.h_first, next(self._ids))
        upper.access, upper.priority, upper.next_use = node.access, node.priority, node.next_use
        node.parent.children[node.key[0]] = upper
        h = node.h_first
        for tok in node.key[1 : at + 1]:
            h = _extend(h, tok)
        node.key, node.parent, node.depth, node.h_first = node.key[at:], upper, node.depth + at, h
        upper.children[node.key[0]] = node
        if self._future is not None:
            node.next_use = self._future.next_use(ns, node, self._now)
        return upper

    def _walk(self, ns: str | None, tokens: Sequence[int], insert: bool) -> tuple[int, list[_Node]]:
        """Follow ``tokens`` from the root; (matched length, nodes on the path). With ``insert`` the
        unmatched rest becomes a new leaf; a match that ends inside a node splits it."""
        node, pos, path = self._root(ns), 0, []
        h = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = 0
            while n < len(child.key) and pos + n < len(tokens) and child.key[n] == tokens[pos + n]:
                n += 1
            if n < len(child.key):
                child = self._split(ns, child, n)
            path.append(child)
            for tok in child.key:
                h = _extend(h, tok)
            node, pos = child, pos + n
        matched = pos
        if insert and pos < len(tokens):
            leaf = _Node(tuple(tokens[pos:]), node, pos, _extend(h, tokens[pos]), next(self._ids))
            node.children[leaf.key[0]] = leaf
            self.size += len(leaf.key)
            if self._future is not None:
                leaf.next_use = self._future.next_use(ns, leaf, self._now)
            path.append(leaf)
        return matched, path

    def _touch(self, ns: str | None, path: Iterable[_Node], priority: int) -> None:
        for node in path:
            node.access = self._now
            node.priority = max(node.priority, priority)
            if self._future is not None:
                node.next_use = self._future.next_use(ns, node, self._now)

    def _refresh_leaves(self, ns: str | None, path: list[_Node]) -> None:
        for node in path:
            self.leaves.pop(node.id, None)
            if node.parent is not None:
                self.leaves.pop(node.parent.id, None)
        if path and not path[-1].children:
            self.leaves[path[-1].id] = (ns, path[-1])

    def _rank(self, node: _Node) -> tuple[int, ...]:
        if self.policy == "lru":
            return (node.access, node.id)
        if self.policy == "priority":
            return (node.priority, node.access, node.id)
        return (-node.next_use, node.access, node.id)

    def _evict(self, locked: set[int]) -> None:
        assert self.capacity is not None
        while self.size > self.capacity:
            cands = [(self._rank(n), ns, n) for ns, n in self.leaves.values() if n.id not in locked]
            if not cands:
                raise ValueError(f"capacity: {self.capacity} tokens cannot hold one request's path")
            _, ns, victim = min(cands, key=lambda c: c[0])
            parent = victim.parent
            assert parent is not None
            del parent.children[victim.key[0]]
            del self.leaves[victim.id]
            self.size -= len(victim.key)
            self.evicted += len(victim.key)
            if not parent.children and parent.parent is not None:
                self.leaves[parent.id] = (ns, parent)

    # -- trace ----------------------------------------------------------------------------------
    def step(self, t: int, req: TraceRequest) -> int:
        """Serve request ``t`` of the trace; its hit tokens."""
        self._now = t
        limit = max(len(req.prompt) - self.min_compute, 0)
        if req.hit_limit is not None:
            limit = min(limit, req.hit_limit)
        hit, matched_path = self._walk(req.namespace, req.prompt[:limit], insert=False)
        self._touch(req.namespace, matched_path, req.priority)
        _, path = self._walk(req.namespace, list(req.prompt) + list(req.output), insert=True)
        self._touch(req.namespace, path, req.priority)
        self._refresh_leaves(req.namespace, path)
        if self.capacity is not None:
            self._evict({n.id for n in path})
        return hit

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        """Serve the whole trace from an empty cache."""
        self._future = _Future(trace) if self.policy == "belady" else None
        hits = [self.step(t, req) for t, req in enumerate(trace)]
        return SimResult(self.policy, self.capacity, hits, sum(len(r.prompt) for r in trace), self.evicted)


def simulate(
    trace: Sequence[TraceRequest], capacity: int | None, policy: str = "lru", min_compute: int = 1
) -> SimResult:
    """Hit tokens of ``trace`` on a fresh cache of ``capacity`` tokens (None: unbounded); every request
    computes at least ``min_compute`` prompt tokens."""
    return PrefixCacheSim(capacity, policy, min_compute).run(trace)


def working_set(trace: Sequence[TraceRequest]) -> int:
    """Tokens an unbounded cache holds after the trace (the union trie of every request's tokens)."""
    sim = PrefixCacheSim(None, "lru")
    sim.run(trace)
    return sim.size


def load_trace(path: Path) -> list[TraceRequest]:
    """A trace saved by ``benchmarks.retention`` (a JSON object with a ``requests`` list)."""
    data = json.loads(path.read_text())
    return [
        TraceRequest(
            list(r["prompt"]),
            list(r.get("output", [])),
            r.get("namespace"),
            int(r.get("priority", 0)),
            r.get("hit_limit"),
        )
        for r in data["requests"]
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--capacity", type=int, default=None, help="tokens (default: unbounded)")
    args = p.parse_args()
    trace = load_trace(args.trace)
    print(f"{len(trace)} requests, working set {working_set(trace)} tokens")
    for policy in POLICIES:
        res = simulate(trace, args.capacity, policy)
        print(f"{policy:8s} hit {res.hit_tokens:8d} / {res.prompt_tokens} prompt tokens")


if __name__ == "__main__":
    main()
