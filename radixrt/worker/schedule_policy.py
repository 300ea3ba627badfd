"""Order the waiting queue: ``lpm`` (longest cached prefix first), ``dfs-weight``, ``fcfs``.

The cache-aware policies look each waiting request up in the RadixCache (a match without locking)
and record the length in ``req.prefix_probe_len``.
"""

from __future__ import annotations

from collections import defaultdict

from radixrt.mem_cache.radix_cache import RadixCache, TreeNode
from radixrt.worker.req import Req

# With more waiting requests than this, lpm's per-request tree walks cost more than they save.
_LPM_MAX_QUEUE = 256


def order_waiting(waiting: list[Req], policy: str, tree: RadixCache) -> list[Req]:
    """Return the waiting requests in the order admission should try them."""
    if policy == "fcfs" or len(waiting) > _LPM_MAX_QUEUE or tree.disable:
        return sorted(waiting, key=lambda r: r.arrival)
    nodes: dict[str, TreeNode] = {}
    for req in waiting:
        m = tree.match_prefix(req.fill_ids[: req.max_prefix_len()], req.cache_salt)
        req.prefix_probe_len = len(m.slots)
        nodes[req.rid] = m.last_node
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-r.prefix_probe_len, r.arrival))
    return _dfs_weight(waiting, nodes)


def _dfs_weight(waiting: list[Req], nodes: dict[str, TreeNode]) -> list[Req]:
    """Depth-first over the tree of matched nodes, visiting heavier subtrees (more waiting requests) first."""
    by_node: dict[int, list[Req]] = defaultdict(list)
    node_of: dict[int, TreeNode] = {}
    for req in waiting:
        node = nodes[req.rid]
        by_node[id(node)].append(req)
        node_of[id(node)] = node
    children: dict[int, set[int]] = defaultdict(set)
    weight: dict[int, int] = defaultdict(int)
    roots: set[int] = set()
    for key, reqs in by_node.items():
        cur: TreeNode | None = node_of[key]
        child: TreeNode | None = None
        while cur is not None:
            weight[id(cur)] += len(reqs)
            node_of[id(cur)] = cur
            if child is not None:
                children[id(cur)].add(id(child))
            if cur.parent is None:
                roots.add(id(cur))
            child, cur = cur, cur.parent
    out: list[Req] = []

    def visit(key: int) -> None:
        # Deeper (longer cached) subtrees first, heavier first among siblings, then the node's own.
        for c in sorted(children[key], key=lambda k: -weight[k]):
            visit(c)
        out.extend(sorted(by_node.get(key, []), key=lambda r: r.arrival))

    for root in sorted(roots, key=lambda k: -weight[k]):
        visit(root)
    return out


def shared_uncached_prefix(req: Req, selected: list[Req], cached_len: int) -> int:
    """Longest prefix ``req`` shares with a request already selected in this batch, beyond ``cached_len``
    and within what ``req`` may take from the cache (``max_prefix_len``: a request always computes its
    last token and the positions of its prompt logprobs, so sharing those saves nothing by waiting)."""
    best = 0
    ids = req.fill_ids
    limit = req.max_prefix_len()
    for other in selected:
        if other.cache_salt != req.cache_salt:
            continue
        n = min(len(ids), len(other.fill_ids), limit)
        lo = cached_len
        if lo >= n or ids[lo] != other.fill_ids[lo]:
            continue
        hi = n  # binary search on slice equality (C-speed compares)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ids[cached_len:mid] == other.fill_ids[cached_len:mid]:
                lo = mid
            else:
                hi = mid - 1
        best = max(best, lo - cached_len)
    return best
