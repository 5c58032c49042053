"""Parameter counting: `python -m albert_jax.params --config=configs/pretrain.py:size=base`.

Counts come from the real Flax model (`jax.eval_shape` of `init`, so nothing is allocated),
grouped like the official checkpoint: embeddings (V x E + P x E + T x E + LN), the E->H
projection, the encoder, the pooler, and the two pretraining heads.

`--paper` prints the rows of the paper's Tables 1, 3 and 4 next to our counts. The paper mixes
two conventions: all-shared and partially-shared ALBERT rows count embeddings + projection +
encoder + pooler ("core"), while the not-shared rows (and BERT) leave the pooler out; both
exclude the MLM/SOP heads, and both round to the nearest million.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig, model_config_from

GROUPS = ("embeddings", "projection", "encoder", "pooler", "mlm_head", "sop_head")


def _size(tree: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Parameter counts per group plus `core` (what the paper reports) and `total`."""
    model = AlbertForPreTraining(config)
    shapes = jax.eval_shape(lambda: nn.meta.unbox(init_params(model, jax.random.key(0))))
    p = shapes["params"]
    encoder = dict(p["albert"]["encoder"])
    projection = encoder.pop("embedding_hidden_mapping_in", {})
    counts = {
        "embeddings": _size(p["albert"]["embeddings"]),
        "projection": _size(projection),
        "encoder": _size(encoder),
        "pooler": _size(p["albert"]["pooler"]),
        "mlm_head": _size(p["predictions"]),
        "sop_head": _size(p["sop_classifier"]),
    }
    counts["core"] = sum(counts[k] for k in ("embeddings", "projection", "encoder", "pooler"))
    counts["total"] = sum(counts[k] for k in GROUPS)
    return counts


# (label, preset, overrides, paper's figure in millions, counts pooler?)
PAPER_ROWS: tuple[tuple[str, str, dict[str, Any], int, bool], ...] = (
    ("Table 1: ALBERT-base", "base", {}, 12, True),
    ("Table 1: ALBERT-large", "large", {}, 18, True),
    ("Table 1: ALBERT-xlarge", "xlarge", {}, 59, True),
    ("Table 3: not-shared E=64", "base", {"sharing": "none", "embedding_size": 64}, 87, False),
    ("Table 3: not-shared E=128", "base", {"sharing": "none", "embedding_size": 128}, 89, False),
    ("Table 3: not-shared E=256", "base", {"sharing": "none", "embedding_size": 256}, 93, False),
    ("Table 3: not-shared E=768", "base", {"sharing": "none", "embedding_size": 768}, 108, False),
    ("Table 3: all-shared E=64", "base", {"sharing": "all", "embedding_size": 64}, 10, True),
    ("Table 3: all-shared E=128", "base", {"sharing": "all", "embedding_size": 128}, 12, True),
    ("Table 3: all-shared E=256", "base", {"sharing": "all", "embedding_size": 256}, 16, True),
    ("Table 3: all-shared E=768", "base", {"sharing": "all", "embedding_size": 768}, 31, True),
    ("Table 4: E=768 all-shared", "base", {"sharing": "all", "embedding_size": 768}, 31, True),
    (
        "Table 4: E=768 shared-attention",
        "base",
        {"sharing": "attention", "embedding_size": 768},
        83,
        True,
    ),
    ("Table 4: E=768 shared-FFN", "base", {"sharing": "ffn", "embedding_size": 768}, 57, True),
    ("Table 4: E=768 not-shared", "base", {"sharing": "none", "embedding_size": 768}, 108, False),
    ("Table 4: E=128 all-shared", "base", {"sharing": "all", "embedding_size": 128}, 12, True),
    (
        "Table 4: E=128 shared-attention",
        "base",
        {"sharing": "attention", "embedding_size": 128},
        64,
        True,
    ),
    ("Table 4: E=128 shared-FFN", "base", {"sharing": "ffn", "embedding_size": 128}, 38, True),
    ("Table 4: E=128 not-shared", "base", {"sharing": "none", "embedding_size": 128}, 89, False),
)


def paper_table() -> list[dict[str, Any]]:
    """Our counts for every row of the paper's Tables 1, 3, 4, with the paper's convention."""
    rows = []
    for label, preset, overrides, paper_m, with_pooler in PAPER_ROWS:
        counts = count_parameters(ModelConfig.preset(preset, **overrides))
        counted = counts["core"] if with_pooler else counts["core"] - counts["pooler"]
        rows.append(
            {
                "row": label,
                "convention": "core" if with_pooler else "core - pooler",
                "count": counted,
                "millions": round(counted / 1e6, 2),
                "paper": paper_m,
                "match": round(counted / 1e6) == paper_m,
            }
        )
    return rows


def _format(counts: Mapping[str, int]) -> str:
    return "\n".join(f"{k:>12}: {v:>14,}" for k, v in counts.items())


def _define_flags() -> None:
    """Flags are defined only when run as a program, so importing `count_parameters` (the
    sweep table does) adds none."""
    config_flags.DEFINE_config_file(
        "config", None, "Run config, e.g. configs/pretrain.py:size=base,sharing=all,embed=128."
    )
    flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
    flags.DEFINE_bool("paper", False, "Print the paper's Tables 1/3/4 next to our counts.")


def main(argv: list[str]) -> None:
    del argv
    FLAGS = flags.FLAGS
    if FLAGS.paper:
        rows = paper_table()
        if FLAGS.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                mark = "ok" if r["match"] else "MISMATCH"
                print(f"{r['row']:<34} {r['millions']:>8.2f}M  paper {r['paper']:>4}M  {mark}")
        return
    if FLAGS.config is None:
        raise app.UsageError("--config is required (or --paper)")
    counts = count_parameters(model_config_from(FLAGS.config))
    print(json.dumps(counts) if FLAGS.json else _format(counts))


if __name__ == "__main__":
    from albert_jax.runtime import cli

    _define_flags()
    cli.run(main)
