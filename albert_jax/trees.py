"""Parameter trees as flat {"a/b/c": leaf} dicts: the one way the package names a weight
(optimizer masks, checkpoint conversion, init merges, error messages)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax


def path_to_str(path: Sequence[Any]) -> str:
    """Joins a `jax.tree_util` key path into the "a/b/c" form used for name matching."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def flatten(tree: Any) -> dict[str, Any]:
    """Any pytree -> {"a/b/c": leaf}; flax's logical-axis boxes are unboxed."""
    return {
        path_to_str(p): (x.value if _is_box(x) else x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_box)
    }


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b/c": x} -> {"a": {"b": {"c": x}}}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree
