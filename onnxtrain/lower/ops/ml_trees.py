"""Tree ensembles: TreeEnsemble, TreeEnsembleRegressor and TreeEnsembleClassifier share one evaluator.

Each encoding is turned, on the host, into a `Forest` of static NumPy arrays: one node table in which leaves
are rows too, pointing to themselves, so every tree of the ensemble is walked at once, one gather per level,
for a fixed number of steps (the deepest tree's depth): it runs under jit on traced features. A node's test is
a bit mask over the four outcomes of comparing a feature with the threshold (less, equal, greater, NaN), which
encodes every branch mode and the missing-value rule in one lookup. Leaves are the table's first rows, so the
row a walk ends on indexes the leaf-value matrix directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...dtypes import is_float
from .ml import POST_TRANSFORMS, class_labels, classifier_input, ml_op, pick, transform_scores
from ..values import Value

LESS, EQUAL, GREATER, MISSING = 1, 2, 4, 8
MODE_MASKS = {
    "BRANCH_LEQ": LESS | EQUAL,
    "BRANCH_LT": LESS,
    "BRANCH_GTE": GREATER | EQUAL,
    "BRANCH_GT": GREATER,
    "BRANCH_EQ": EQUAL,
    "BRANCH_NEQ": LESS | GREATER,
    "BRANCH_MEMBER": 0,  # decided by the member set (and MISSING)
}
MODE_CODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "BRANCH_MEMBER")
AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")  # TreeEnsemble's codes index this


@dataclass(frozen=True)
class Forest:
    """Rows [0, L) are leaves, rows [L, K) interior nodes; T trees, C targets."""

    feature: np.ndarray  # [K] the feature a row tests
    threshold: np.ndarray  # [K]
    accept: np.ndarray  # [K] the outcomes (bit mask) that take the true branch
    true_next: np.ndarray  # [K] the next row when the test passes; a leaf's is itself
    false_next: np.ndarray  # [K]
    members: np.ndarray | None  # [K, S] BRANCH_MEMBER sets, NaN-padded; None when no node tests a set
    roots: np.ndarray  # [T]
    depth: int  # steps from the roots to the deepest leaf
    leaf_values: np.ndarray  # [L, C] a leaf's votes, per target (several votes combined by the aggregate)
    leaf_votes: np.ndarray  # [L, C] whether a leaf votes for a target at all (MIN and MAX skip the others)


def _depth(true_next: np.ndarray, false_next: np.ndarray, roots: np.ndarray, n_leaves: int) -> int:
    frontier, depth = np.unique(roots), 0
    while np.any(frontier >= n_leaves):
        inner = frontier[frontier >= n_leaves]
        frontier, depth = np.unique(np.concatenate([true_next[inner], false_next[inner]])), depth + 1
        if depth > len(true_next):
            raise ValueError("the trees' branches form a cycle")
    return depth


def build_forest(
    n_leaves: int,
    nodes: dict[str, np.ndarray],
    roots: np.ndarray,
    votes: tuple[np.ndarray, np.ndarray, np.ndarray],
    n_targets: int,
    aggregate: str,
    members: list[list[float]] | None = None,
) -> Forest:
    """`nodes` holds feature, threshold, accept, true_next, false_next for the interior rows (L onwards), whose
    children are table rows; `votes` are (leaf row, target, weight); `members` the set of each interior row."""
    size = n_leaves + len(nodes["feature"])
    for name in ("true_next", "false_next"):
        bad = (nodes[name] < 0) | (nodes[name] >= size)
        if bad.any():
            raise ValueError(f"a node's {name.replace('_next', '')} branch leads to a missing node")
    leaf_rows = np.arange(n_leaves)

    def table(field: str, leaf_fill: Any) -> np.ndarray:
        return np.concatenate([np.full(n_leaves, leaf_fill, nodes[field].dtype), nodes[field]])

    true_next, false_next = table("true_next", 0), table("false_next", 0)
    true_next[:n_leaves] = false_next[:n_leaves] = leaf_rows
    member_table = None
    if members is not None and any(members):
        width = max(len(m) for m in members)
        member_table = np.full((size, width), np.nan, dtype=nodes["threshold"].dtype)
        for row, values in enumerate(members):
            member_table[n_leaves + row, : len(values)] = values
    leaf, target, weight = votes
    if np.any((leaf < 0) | (leaf >= n_leaves)):
        raise ValueError("a leaf weight belongs to a node that is not a leaf")
    if np.any((target < 0) | (target >= n_targets)):
        raise ValueError(f"a leaf votes for a target outside [0, {n_targets})")
    leaf_values = np.zeros((n_leaves, n_targets), weight.dtype)
    combine = {"MIN": np.minimum, "MAX": np.maximum}.get(aggregate, np.add)
    if aggregate in ("MIN", "MAX"):  # identities, so a leaf's first vote is taken as it is
        leaf_values[:] = np.inf if aggregate == "MIN" else -np.inf
    combine.at(leaf_values, (leaf, target), weight)
    leaf_votes = np.zeros((n_leaves, n_targets), bool)
    leaf_votes[leaf, target] = True
    return Forest(
        feature=table("feature", 0),
        threshold=table("threshold", 0),
        accept=table("accept", 0),
        true_next=true_next,
        false_next=false_next,
        members=member_table,
        roots=roots,
        depth=_depth(true_next, false_next, roots, n_leaves),
        leaf_values=np.where(leaf_votes, leaf_values, 0).astype(weight.dtype),
        leaf_votes=leaf_votes,
    )


def evaluate(forest: Forest, x: Value, aggregate: str, dtype: Any) -> Value:
    """[N, C] aggregated leaf values of `x` [N, F], in `dtype`."""
    x = jnp.asarray(x)
    # Compare in the wider of the features' and thresholds' types; integer features exactly, as float64.
    compare = np.promote_types(x.dtype, forest.threshold.dtype) if is_float(x.dtype) else np.float64
    x = x.astype(compare)
    if x.shape[1] <= int(forest.feature.max(initial=0)):
        raise ValueError(f"the trees test feature {int(forest.feature.max())}, the input has {x.shape[1]} features")
    feature, accept = jnp.asarray(forest.feature), jnp.asarray(forest.accept)
    threshold = jnp.asarray(forest.threshold.astype(compare))
    true_next, false_next = jnp.asarray(forest.true_next), jnp.asarray(forest.false_next)
    members = None if forest.members is None else jnp.asarray(forest.members.astype(compare))

    def step(_: Any, rows: Value) -> Value:
        value = jnp.take_along_axis(x, feature[rows], axis=1)
        limit = threshold[rows]
        outcome = jnp.where(
            jnp.isnan(value), MISSING, jnp.where(value < limit, LESS, jnp.where(value == limit, EQUAL, GREATER))
        )
        passed = (accept[rows] & outcome) != 0
        if members is not None:  # NaN padding never matches, so non-member rows are unaffected
            passed = passed | jnp.any(value[..., None] == members[rows], axis=-1)
        return jnp.where(passed, true_next[rows], false_next[rows])

    start = jnp.broadcast_to(jnp.asarray(forest.roots), (x.shape[0], len(forest.roots)))
    leaves = lax.fori_loop(0, forest.depth, step, start)
    values = jnp.asarray(forest.leaf_values.astype(dtype))[leaves]  # [N, T, C]
    if aggregate in ("SUM", "AVERAGE"):
        total = jnp.sum(values, axis=1)
        return total / len(forest.roots) if aggregate == "AVERAGE" else total
    if aggregate not in ("MIN", "MAX"):
        raise ValueError(f"unknown aggregate_function {aggregate!r}; expected one of {list(AGGREGATES)}")
    votes = jnp.asarray(forest.leaf_votes)[leaves]
    reduce, identity = (jnp.min, np.inf) if aggregate == "MIN" else (jnp.max, -np.inf)
    extreme = reduce(jnp.where(votes, values, identity), axis=1)
    # A target no leaf votes for scores 0, as with SUM (and in ONNX Runtime; ONNX's reference leaves it at the
    # dtype's largest value).
    return jnp.where(jnp.any(votes, axis=1), extreme, 0).astype(dtype)


def _features(x: Value) -> Value:
    return jnp.reshape(x, (1, -1)) if np.ndim(x) == 1 else x


# ---- TreeEnsemble (ai.onnx.ml 5): interior nodes and leaves listed apart ------------------------------------


def _member_sets(modes: np.ndarray, membership_values: np.ndarray | None) -> list[list[float]] | None:
    """One set per node: BRANCH_MEMBER nodes take membership_values' NaN-delimited groups in order."""
    is_member = modes == MODE_CODES.index("BRANCH_MEMBER")
    if not is_member.any():
        return None
    if membership_values is None:
        raise ValueError("BRANCH_MEMBER nodes need membership_values")
    groups, current = [], []
    for value in membership_values.reshape(-1).tolist():
        if np.isnan(value):
            groups.append(current)
            current = []
        else:
            current.append(value)
    if current:
        groups.append(current)
    if len(groups) != int(is_member.sum()):
        raise ValueError(f"{int(is_member.sum())} BRANCH_MEMBER nodes but {len(groups)} member sets")
    sets = iter(groups)
    return [next(sets) if member else [] for member in is_member]


@ml_op("TreeEnsemble")
def tree_ensemble(
    X: Value,
    *,
    nodes_splits: np.ndarray,
    nodes_featureids: list[int],
    nodes_modes: np.ndarray,
    nodes_truenodeids: list[int],
    nodes_falsenodeids: list[int],
    nodes_trueleafs: list[int],
    nodes_falseleafs: list[int],
    leaf_targetids: list[int],
    leaf_weights: np.ndarray,
    tree_roots: list[int],
    aggregate_function: int = 1,
    post_transform: int = 0,
    n_targets: int | None = None,
    nodes_hitrates: np.ndarray | None = None,
    nodes_missing_value_tracks_true: list[int] | None = None,
    membership_values: np.ndarray | None = None,
) -> Value:
    n_leaves, n_nodes = len(leaf_weights), len(nodes_featureids)
    modes = np.asarray(nodes_modes, dtype=np.int64).reshape(-1)
    if np.any((modes < 0) | (modes >= len(MODE_CODES))):
        raise ValueError(f"nodes_modes must be in [0, {len(MODE_CODES)}), got {sorted(set(modes.tolist()))}")
    accept = np.asarray([MODE_MASKS[code] for code in MODE_CODES], dtype=np.int64)[modes]
    # A NaN fails every comparison but "not equal"; missing_value_tracks_true sends it to the true branch too.
    neq = MODE_CODES.index("BRANCH_NEQ")
    missing_true = np.asarray(nodes_missing_value_tracks_true or [0] * n_nodes, dtype=bool) | (modes == neq)
    accept = accept | np.where(missing_true, MISSING, 0)

    def child(ids: list[int], to_leaf: list[int]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        return np.where(np.asarray(to_leaf, dtype=bool), ids, ids + n_leaves)

    nodes = {
        "feature": np.asarray(nodes_featureids, dtype=np.int64),
        "threshold": np.asarray(nodes_splits).reshape(-1),
        "accept": accept,
        "true_next": child(nodes_truenodeids, nodes_trueleafs),
        "false_next": child(nodes_falsenodeids, nodes_falseleafs),
    }
    targets = np.asarray(leaf_targetids, dtype=np.int64)
    n_targets = int(n_targets) if n_targets is not None else int(targets.max(initial=-1)) + 1
    forest = build_forest(
        n_leaves,
        nodes,
        np.asarray(tree_roots, dtype=np.int64) + n_leaves,
        (np.arange(n_leaves), targets, np.asarray(leaf_weights).reshape(-1)),
        n_targets,
        AGGREGATES[aggregate_function],
        _member_sets(modes, membership_values),
    )
    # float16 accumulates in float32, then rounds once
    dtype = np.promote_types(np.dtype(X.dtype), np.float32)
    scores = evaluate(forest, _features(X), AGGREGATES[aggregate_function], dtype)
    return transform_scores(scores, POST_TRANSFORMS[post_transform]).astype(X.dtype)


# ---- TreeEnsembleRegressor / TreeEnsembleClassifier: nodes named (tree id, node id), leaves are mode LEAF ---


def _old_forest(attrs: dict[str, Any], vote_prefix: str, n_targets: int, aggregate: str) -> Forest:
    """A Forest from the nodes_* attributes and the votes `vote_prefix`{treeids, nodeids, ids, weights}."""
    tree_ids, node_ids = list(attrs["nodes_treeids"]), list(attrs["nodes_nodeids"])
    modes = list(attrs["nodes_modes"])
    position = {(t, n): p for p, (t, n) in enumerate(zip(tree_ids, node_ids))}
    is_leaf = np.asarray([m == "LEAF" for m in modes], dtype=bool)
    unknown = sorted({m for m in modes if m != "LEAF" and m not in MODE_MASKS})
    if unknown:
        raise ValueError(f"unknown nodes_modes {unknown}")
    # Leaves first: a node's row is its rank among the leaves, or L + its rank among the interior nodes.
    row_of = np.empty(len(modes), dtype=np.int64)
    row_of[is_leaf] = np.arange(is_leaf.sum())
    row_of[~is_leaf] = is_leaf.sum() + np.arange((~is_leaf).sum())
    interior = np.flatnonzero(~is_leaf)

    def child(field: str) -> np.ndarray:
        targets = [position.get((tree_ids[p], attrs[field][p]), -1) for p in interior]
        if -1 in targets:
            raise ValueError(f"{field} names a node id its tree does not have")
        return row_of[np.asarray(targets, dtype=np.int64)] if targets else np.zeros(0, np.int64)

    values = attrs.get("nodes_values_as_tensor")
    thresholds = np.asarray(attrs["nodes_values"] if values is None else values).reshape(-1)
    missing = np.asarray(attrs.get("nodes_missing_value_tracks_true") or [0] * len(modes), dtype=bool)
    nodes = {
        "feature": np.asarray(attrs["nodes_featureids"], dtype=np.int64)[interior],
        "threshold": (thresholds.astype(np.float32) if values is None else thresholds)[interior],
        # Before TreeEnsemble, a NaN feature follows missing_value_tracks_true alone, whatever the mode.
        "accept": np.asarray([MODE_MASKS[modes[p]] | (MISSING if missing[p] else 0) for p in interior], np.int64),
        "true_next": child("nodes_truenodeids"),
        "false_next": child("nodes_falsenodeids"),
    }
    first_node = {}
    for p, t in enumerate(tree_ids):
        first_node.setdefault(t, p)  # a tree's root is its first node listed
    roots = row_of[np.asarray([first_node[t] for t in sorted(first_node)], dtype=np.int64)]
    weights = attrs.get(f"{vote_prefix}_weights_as_tensor")
    if weights is None:  # a FLOATS attribute holds float32 values
        weights = np.asarray(attrs[f"{vote_prefix}_weights"], dtype=np.float32)
    weights = weights.reshape(-1)
    voted = [position.get(key, -1) for key in zip(attrs[f"{vote_prefix}_treeids"], attrs[f"{vote_prefix}_nodeids"])]
    if -1 in voted:
        raise ValueError(f"{vote_prefix}_treeids/nodeids name a node that does not exist")
    voted = np.asarray(voted, dtype=np.int64)
    if voted.size and not is_leaf[voted].all():
        raise ValueError(f"{vote_prefix} weights are attached to a node that is not a LEAF")
    votes = (row_of[voted] if voted.size else voted, np.asarray(attrs[f"{vote_prefix}_ids"], np.int64), weights)
    return build_forest(int(is_leaf.sum()), nodes, roots, votes, n_targets, aggregate)


def _old_attributes(**attrs: Any) -> dict[str, Any]:
    required = ("nodes_treeids", "nodes_nodeids", "nodes_modes", "nodes_featureids", "nodes_truenodeids",
                "nodes_falsenodeids")
    missing = [name for name in required if attrs.get(name) is None]
    if missing or (attrs.get("nodes_values") is None and attrs.get("nodes_values_as_tensor") is None):
        raise ValueError(f"missing node attributes {missing or ['nodes_values']}")
    return attrs


def _base(values: Sequence[float] | None, as_tensor: np.ndarray | None) -> np.ndarray | None:
    if as_tensor is not None:
        return as_tensor.reshape(-1)
    return None if not values else np.asarray(values, dtype=np.float32)


@ml_op("TreeEnsembleRegressor")
def tree_ensemble_regressor(
    X: Value,
    *,
    aggregate_function: str = "SUM",
    post_transform: str = "NONE",
    n_targets: int | None = None,
    base_values: list[float] | None = None,
    base_values_as_tensor: np.ndarray | None = None,
    target_ids: list[int] | None = None,
    target_nodeids: list[int] | None = None,
    target_treeids: list[int] | None = None,
    target_weights: list[float] | None = None,
    target_weights_as_tensor: np.ndarray | None = None,
    **nodes: Any,
) -> Value:
    targets = int(n_targets) if n_targets is not None else int(max(target_ids or [-1])) + 1
    attrs = _old_attributes(
        target_ids=target_ids or [], target_nodeids=target_nodeids or [], target_treeids=target_treeids or [],
        target_weights=target_weights or [], target_weights_as_tensor=target_weights_as_tensor, **nodes
    )
    forest = _old_forest(attrs, "target", targets, aggregate_function)
    x = _features(X)
    dtype = np.promote_types(forest.leaf_values.dtype, np.float64 if x.dtype == np.float64 else np.float32)
    scores = evaluate(forest, x, aggregate_function, dtype)
    base = _base(base_values, base_values_as_tensor)
    if base is not None:
        scores = scores + base.astype(dtype)
    return transform_scores(scores, post_transform).astype(np.float32)


@ml_op("TreeEnsembleClassifier")
def tree_ensemble_classifier(
    X: Value,
    *,
    post_transform: str = "NONE",
    classlabels_int64s: list[int] | None = None,
    classlabels_strings: list[str] | None = None,
    base_values: list[float] | None = None,
    base_values_as_tensor: np.ndarray | None = None,
    class_ids: list[int] | None = None,
    class_nodeids: list[int] | None = None,
    class_treeids: list[int] | None = None,
    class_weights: list[float] | None = None,
    class_weights_as_tensor: np.ndarray | None = None,
    **nodes: Any,
) -> tuple[Value, Value]:
    labels = class_labels(classlabels_int64s, classlabels_strings)
    if not len(labels):
        raise ValueError("one of classlabels_int64s and classlabels_strings must be set")
    attrs = _old_attributes(
        class_ids=class_ids or [], class_nodeids=class_nodeids or [], class_treeids=class_treeids or [],
        class_weights=class_weights or [], class_weights_as_tensor=class_weights_as_tensor, **nodes
    )
    forest = _old_forest(attrs, "class", len(labels), "SUM")
    dtype = np.promote_types(forest.leaf_values.dtype, np.float32)
    scores = evaluate(forest, _features(classifier_input(X, labels)), "SUM", dtype)
    base = _base(base_values, base_values_as_tensor)
    if base is not None:
        scores = scores + base.astype(dtype)
    voted = sorted(set(class_ids or []))
    if len(voted) == 1 and len(labels) <= 2:
        # Binary: one class carries the score s; the columns become (1 - s, s), or (-s, s) when a transform
        # follows that is symmetric around zero. This is ONNX's reference; ONNX Runtime also takes (-s, s) with
        # NONE when some weight is negative (and then decides at 0 rather than 0.5).
        score = scores[:, voted[0] : voted[0] + 1]
        other = 1 - score if post_transform in ("NONE", "PROBIT") else -score
        scores = jnp.concatenate([other, score], axis=1)
    scores = transform_scores(scores, post_transform)
    best = jnp.argmax(scores, axis=1)
    if len(labels) == 1:  # one label: it is chosen by the second column, the first stands for "not it"
        negative = np.asarray(["" if labels.dtype == object else 0], dtype=labels.dtype)
        labels = np.concatenate([negative, labels])
    return pick(labels, best), scores.astype(np.float32)
