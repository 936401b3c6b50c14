"""Shared-prefix packing: positions that several training sequences of a batch share are computed once.

Under causal attention a position's hidden states depend only on the tokens up to it, so sequences that begin
with the same n tokens have the same states at those n positions in every layer, whatever the weights. The
default training contexts repeat beginnings inside a batch: every ``chat`` sequence starts with the template's
header, and a request's ``lead`` sequences share its question. :func:`pack_prefixes` merges them. Sequences with a
common beginning of at least ``min_shared`` tokens form a group; each group becomes a prefix tree (one node per
distinct beginning; a large group several trees of at most ``max_nodes`` nodes), and the trees are packed
first-fit into rows, several to a row where they fit. A node attends
to itself and its ancestors only (a ``R x 1 x L x L`` boolean mask, block-diagonal over the trees of a row) at its
depth as position id, so it computes exactly the states of the positions it stands for. A target token is predicted
from the node of the position before it: the packed loss has the padded batch's terms, one per target token of
every sequence (a node shared by several sequences appears once per sequence in ``rows``), so its mean and its
gradients are the padded batch's up to the order of the additions. Padding rows of the packed layout attend to
themselves only and feed no loss.

Whether packing pays is decided per batch by :func:`packing_pays` from a cost per computed position that grows with
the row length (the attention; the packed rows are longer than the padded batch's). The fast loss
(:mod:`.fastpath`) checks the packed loss against the plain loss before it uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "PackedBatch",
    "pack_prefixes",
    "packing_pays",
    "group_sequences",
    "ATTENTION_LENGTH",
    "MIN_SHARED",
    "MAX_TREE_NODES",
]

MIN_SHARED = 4  # sequences join a group when they share at least this many leading tokens
# a group's tree is split beyond this many nodes: in several smaller trees each position attends to fewer others,
# which saves more than one large tree's longer shared prefix does
MAX_TREE_NODES = 256
# the row length at which a position's attention costs about as much as the rest of its work in a decoder block
# (fitted to timed fast-path steps), rounded down to stay on the cautious side
ATTENTION_LENGTH = 2048


@dataclass
class PackedBatch:
    """A right-padded ``B x T`` batch as prefix trees in ``R x L`` rows: ``input_ids`` and ``position_ids``
    (``R x L`` long; a node's depth in its sequence), ``mask`` (``R x 1 x L x L`` bool, True = attend: a node to
    its ancestors and itself, padding to itself), ``source`` (``R·L`` long: for every packed position, the flat
    index ``b·T + t`` of a position of the batch that it stands for; padding points at 0), ``rows`` / ``targets``
    (the flat packed positions that predict a target token, with repeats where sequences share the position, and
    those tokens: the packed counterpart of :func:`~crispedit.editing.fastpath.target_rows`), ``nodes`` (the
    distinct positions: what a forward computes besides the packing's padding) and ``where`` (``B x T`` long: the
    flat packed position ``r·L + l`` that computes each position of the batch; -1 at padding — the inverse of
    ``source``, many to one where sequences share a beginning)."""

    input_ids: Tensor
    position_ids: Tensor
    mask: Tensor
    source: Tensor
    rows: Tensor
    targets: Tensor
    nodes: int
    where: Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, L)``."""
        return tuple(self.input_ids.shape)

    def to(self, device) -> PackedBatch:
        """The same packing on ``device``."""
        return PackedBatch(
            *(
                t.to(device)
                for t in (self.input_ids, self.position_ids, self.mask, self.source, self.rows, self.targets)
            ),
            self.nodes,
            None if self.where is None else self.where.to(device),
        )


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def group_sequences(seqs: Sequence[Sequence[int]], min_shared: int = MIN_SHARED) -> list[list[int]]:
    """Indices of ``seqs`` (token lists) grouped so that each sequence of a group shares at least ``min_shared``
    leading tokens with another of it (connected components; in sorted order the longest common beginning of a
    sequence is with a neighbour, so joining neighbours finds them). Groups in order of their first index."""
    order = sorted(range(len(seqs)), key=lambda i: tuple(seqs[i]))
    groups: list[list[int]] = []
    for j, i in enumerate(order):
        if j and _common(seqs[order[j - 1]], seqs[i]) >= min_shared:
            groups[-1].append(i)
        else:
            groups.append([i])
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


class _Tree:
    """One prefix tree under construction: per node its token, parent (-1 at the root), depth and the flat
    ``b·T + t`` position it was first seen at; per sequence ``(b, its nodes)``."""

    def __init__(self):
        self.index: dict[tuple[int, int], int] = {}
        self.tok: list[int] = []
        self.par: list[int] = []
        self.dep: list[int] = []
        self.src: list[int] = []
        self.paths: list[tuple[int, list[int]]] = []

    def new_nodes(self, seq: Sequence[int]) -> int:
        """How many nodes adding ``seq`` would create."""
        parent = -1
        for t, x in enumerate(seq):
            parent = self.index.get((parent, x), -2)
            if parent == -2:
                return len(seq) - t
        return 0

    def add(self, b: int, seq: Sequence[int], T: int) -> None:
        """Add sequence ``b`` of a ``B x T`` batch."""
        parent, path = -1, []
        for t, x in enumerate(seq):
            node = self.index.get((parent, x))
            if node is None:
                node = self.index[(parent, x)] = len(self.tok)
                self.tok.append(x), self.par.append(parent), self.dep.append(t), self.src.append(b * T + t)
            path.append(node)
            parent = node
        self.paths.append((b, path))


def pack_prefixes(
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor,
    min_shared: int = MIN_SHARED,
    max_nodes: int | None = MAX_TREE_NODES,
) -> PackedBatch:
    """Pack a right-padded batch (``B x T`` ``input_ids``, ``attention_mask`` 1 = token, ``labels`` -100 = no
    target; on the host) into prefix trees (see the module docstring): one tree per group of
    :func:`group_sequences` — split, in sorted order, into trees of at most ``max_nodes`` nodes (``None``: no
    limit; a longer row makes every position's attention dearer, so the shared beginning is then computed once per
    tree) —
    the trees placed first-fit in decreasing size into rows as long as the largest tree."""
    ids, lab = input_ids.tolist(), labels.tolist()
    lengths = attention_mask.sum(1).tolist()
    B, T = input_ids.shape
    seqs = [ids[b][: lengths[b]] for b in range(B)]
    trees: list[_Tree] = []
    for group in group_sequences(seqs, min_shared):
        tree = _Tree()
        for b in sorted(group, key=lambda b: seqs[b]):
            if max_nodes is not None and tree.paths and len(tree.tok) + tree.new_nodes(seqs[b]) > max_nodes:
                trees.append(tree)
                tree = _Tree()
            tree.add(b, seqs[b], T)
        trees.append(tree)
    L = max(len(t.tok) for t in trees)
    rows_fill: list[int] = []  # used length of each row
    place = [0] * len(trees)  # (row, offset) of each tree, as row * L + offset
    for g in sorted(range(len(trees)), key=lambda g: -len(trees[g].tok)):
        n = len(trees[g].tok)
        r = next((r for r, used in enumerate(rows_fill) if used + n <= L), None)
        if r is None:
            r = len(rows_fill)
            rows_fill.append(0)
        place[g] = r * L + rows_fill[r]
        rows_fill[r] += n
    R = len(rows_fill)
    flat_ids = np.zeros(R * L, dtype=np.int64)
    flat_pos = np.zeros(R * L, dtype=np.int64)
    flat_src = np.zeros(R * L, dtype=np.int64)
    mask = np.zeros((R, L, L), dtype=bool)
    mask[:, np.arange(L), np.arange(L)] = True  # every position attends to itself (padding: only itself)
    rows, targets = [], []
    where = np.full((B, T), -1, dtype=np.int64)
    for tree, start in zip(trees, place):
        r, off = divmod(start, L)
        n = len(tree.tok)
        flat_ids[start : start + n], flat_pos[start : start + n], flat_src[start : start + n] = (
            tree.tok,
            tree.dep,
            tree.src,
        )
        m = mask[r]
        for j, p in enumerate(tree.par):  # nodes come after their parents: copy the parent's ancestors
            if p >= 0:
                m[off + j, off : off + j] = m[off + p, off : off + j]
        for b, path in tree.paths:
            where[b, : len(path)] = start + np.asarray(path, dtype=np.int64)
            for t in range(len(path) - 1):
                if lab[b][t + 1] != -100:
                    rows.append(start + path[t])
                    targets.append(lab[b][t + 1])
    return PackedBatch(
        torch.from_numpy(flat_ids).view(R, L),
        torch.from_numpy(flat_pos).view(R, L),
        torch.from_numpy(mask).unsqueeze(1),
        torch.from_numpy(flat_src),
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(targets, dtype=torch.long),
        sum(len(t.tok) for t in trees),
        torch.from_numpy(where),
    )


def _cost(rows: int, length: int, attention_length: int) -> float:
    """Relative cost of a forward over ``rows x length`` positions: per position 1 + length / attention_length."""
    return rows * length * (1 + length / attention_length)


def packing_pays(
    batch_shape: tuple[int, int], packed: PackedBatch, attention_length: int = ATTENTION_LENGTH, margin: float = 0.9
) -> bool:
    """Whether the packed layout (``R x L``) is predicted to cost at most ``margin`` of the padded ``B x T`` batch,
    each position costing ``1 + row length / attention_length`` (:data:`ATTENTION_LENGTH`)."""
    (B, T), (R, L) = batch_shape, packed.shape
    return _cost(R, L, attention_length) <= margin * _cost(B, T, attention_length)
