"""Adversarial draft trees for the lossless tests (ECHO_VLLM_TREE_ADVERSARY=<seed>; never for serving).

Each request's drafts are replaced by a random tree of random size and topology, in spine-first order. The head's
real chain is laid along a random root-to-node path, which is usually *not* the spine, and every other node carries
a random token distinct from its siblings'. The target therefore accepts non-spine paths of several nodes, which
exercises what spine + sibling trees never reach: deep non-spine fix-up rows, multi-node KV compaction and the
drafter's path reordering. Whatever the drafts, the output must equal the target's.
"""

from __future__ import annotations

import os
import random

ADVERSARY_ENV = "ECHO_VLLM_TREE_ADVERSARY"


def adversary_from_env() -> random.Random | None:
    seed = os.environ.get(ADVERSARY_ENV)
    return random.Random(int(seed)) if seed else None


def adversarial_tree(
    chain: list[int], capacity: int, vocab_size: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """(tokens, parent_local) of a random tree in spine-first order that contains `chain` along one path."""
    if capacity < 1:
        return [], []
    size = rng.randint(1, capacity)
    parent = [-1] + [rng.randrange(-1, j) for j in range(1, size)]  # parents precede children
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parent):
        children.setdefault(p, []).append(j)
    # The chain goes down a random path from the root.
    path: list[int] = []
    node = -1
    while children.get(node) and len(path) < len(chain):
        node = rng.choice(children[node])
        path.append(node)
    tokens = [0] * size
    for d, j in enumerate(path):
        tokens[j] = chain[d]
    on_path = set(path)
    for kids in children.values():
        used = {tokens[j] for j in kids if j in on_path}
        for j in kids:
            if j in on_path:
                continue
            token = rng.randrange(vocab_size)
            while token in used:
                token = rng.randrange(vocab_size)
            used.add(token)
            tokens[j] = token
    # Spine-first relisting: the chain of first children from the root, then everyone else in index order.
    spine: list[int] = []
    node = -1
    while children.get(node):
        node = children[node][0]
        spine.append(node)
    listed = spine + [j for j in range(size) if j not in set(spine)]
    position = {j: i for i, j in enumerate(listed)}
    return [tokens[j] for j in listed], [-1 if parent[j] < 0 else position[parent[j]] for j in listed]
