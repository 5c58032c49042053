"""The paper's Figure 2: how much each layer changes its input.

    python -m albert_jax.analysis.layer_transitions --init=PATH [--out=DIR] [--eval_batches=N]

For every layer application l = 1..L (Sec. 4.5 / Fig. 2 of the paper): the L2 distance
||h_l - h_{l-1}|| and the cosine similarity between the layer's input h_{l-1} and output h_l,
per token, averaged over the real tokens of held-out pretraining batches (`analysis.heldout`:
the checkpoint's own run's by default), with their masked positions given back their
original tokens. h_0 is the encoder's input (the embeddings after the E->H projection). ALBERT's
all-shared layers change their input smoothly; BERT-style (not shared) ones oscillate.

Writes OUT/layer_transitions.json (`{"init", "layers": [1..L], "l2": [...], "cosine": [...],
"tokens"}`) and OUT/layer_transitions.png; --json prints that record as one line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import app, flags

from albert_jax import files, metrics_writer
from albert_jax.analysis import heldout
from albert_jax.model.albert import AlbertModel
from albert_jax.model.config import ModelConfig
from albert_jax.runtime import cli

JSON_FILE = "layer_transitions.json"
PNG_FILE = "layer_transitions.png"


def hidden_states(
    config: ModelConfig,
    albert_params: Any,
    input_ids: jax.Array,
    segment_ids: jax.Array,
    input_mask: jax.Array,
) -> jax.Array:
    """The encoder's input and every layer application's output: [L+1, B, S, H] float32.

    `albert_params` is the `albert` subtree of an `AlbertForPreTraining` params tree (what
    `AlbertModel` reads). The encoder runs unrolled (`scan_layers=False`, the same parameter
    tree) so that Flax's `capture_intermediates` records each group call, i.e. each layer.
    """
    config = config.replace(scan_layers=False, remat_policy="none")

    def keep(module: Any, method: str) -> bool:  # the encoder input and every layer
        name = module.name or ""
        return method == "__call__" and (
            name.startswith("group_") or name in ("embedding_hidden_mapping_in", "embeddings")
        )

    _, state = AlbertModel(config).apply(
        {"params": albert_params},
        input_ids,
        segment_ids,
        input_mask,
        capture_intermediates=keep,
        mutable=["intermediates"],
    )
    captured = state["intermediates"]
    encoder = captured["encoder"]
    if config.has_embedding_projection:
        first = encoder["embedding_hidden_mapping_in"]["__call__"][0]
    else:  # E == H without a projection: the embeddings feed the first layer
        first = captured["embeddings"]["__call__"][0]
    outputs = [
        y  # a group's call returns (x, None): the scan body's carry
        for g in range(config.num_hidden_groups)
        for y, _ in encoder[f"group_{g}"]["__call__"]
    ]
    return jnp.stack([first, *outputs]).astype(jnp.float32)


def transition_sums(
    config: ModelConfig, albert_params: Any, batch: Mapping[str, jax.Array]
) -> dict[str, jax.Array]:
    """Per-layer sums over the batch's real tokens: "l2" [L] of ||h_l - h_{l-1}||, "cosine"
    [L] of cos(h_{l-1}, h_l), and "tokens" (scalar) counted: tokens of `input_mask` in rows of
    `example_weight` > 0 (padding rows count for nothing)."""
    states = hidden_states(
        config, albert_params, batch["input_ids"], batch["segment_ids"], batch["input_mask"]
    )
    x, y = states[:-1], states[1:]  # [L, B, S, H]: each layer's input and output
    norm_x, norm_y = jnp.linalg.norm(x, axis=-1), jnp.linalg.norm(y, axis=-1)
    l2 = jnp.linalg.norm(y - x, axis=-1)  # [L, B, S]
    cosine = jnp.sum(x * y, axis=-1) / jnp.maximum(norm_x * norm_y, 1e-30)
    real = (batch["input_mask"] > 0) & (batch["example_weight"] > 0)[:, None]  # [B, S]
    # `where`, not a product: a padding token's value never reaches the sums.
    per_layer = lambda v: jnp.sum(jnp.where(real, v, 0.0), axis=(1, 2))  # noqa: E731
    return {"l2": per_layer(l2), "cosine": per_layer(cosine), "tokens": jnp.sum(real)}


def measure(data: heldout.Heldout) -> dict[str, Any]:
    """The mean L2 distance and cosine similarity of each layer's input and output over the
    real tokens of `data`'s batches (masked tokens restored): {"init", "layers": [1..L],
    "l2": [L], "cosine": [L], "tokens"}."""
    config = data.pretrained.config
    data = heldout.Heldout(
        data.pretrained, data.config, [heldout.unmasked(b) for b in data.batches], data.mesh
    )
    step = jax.jit(lambda params, batch: transition_sums(config, params["albert"], batch))
    sums: dict[str, jax.Array] | None = None
    with data.context():
        params = data.params()
        for batch in data.placed_batches():
            out = step(params, batch)
            sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    totals = {k: np.asarray(v, np.float64) for k, v in jax.device_get(sums).items()}
    tokens = float(totals["tokens"])
    if tokens == 0:
        raise ValueError(f"the held-out batches of {data.pretrained.path} hold no real token")
    return {
        "init": data.pretrained.path,
        "layers": list(range(1, len(totals["l2"]) + 1)),
        "l2": (totals["l2"] / tokens).tolist(),
        "cosine": (totals["cosine"] / tokens).tolist(),
        "tokens": int(tokens),
    }


def plot(results: Mapping[str, Mapping[str, Any]]) -> Any:
    """Figure 2 as a matplotlib figure: L2 distance (left) and cosine similarity (right)
    against the layer, one line per model of `results` ({label: `measure` record})."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_l2, ax_cos) = plt.subplots(1, 2, figsize=(11, 4))
    for label, result in results.items():
        ax_l2.plot(result["layers"], result["l2"], marker="o", label=label)
        ax_cos.plot(result["layers"], result["cosine"], marker="o", label=label)
    ax_l2.set(xlabel="layer", ylabel="L2 distance (input, output)", title="L2 distance")
    ax_cos.set(
        xlabel="layer", ylabel="cosine similarity (input, output)", title="cosine similarity"
    )
    for ax in (ax_l2, ax_cos):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def label(result: Mapping[str, Any], config: ModelConfig) -> str:
    """ "<sharing>-shared (<checkpoint dir name>)", the legend of one model."""
    return f"{config.sharing}-shared ({files.as_path(result['init']).name})"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    FLAGS = flags.FLAGS
    data = heldout.load_from_flags()
    result = measure(data)
    files.write_json(heldout.output_path(FLAGS.out, JSON_FILE), result, indent=1)
    matplotlib.use("Agg")  # no display: the figure goes to a file
    figure = plot({label(result, data.pretrained.config): result})
    metrics_writer.write_figure(figure, heldout.output_path(FLAGS.out, PNG_FILE))
    if FLAGS.json:
        print(json.dumps(result))
    else:
        print(f"{'layer':>5} {'L2':>10} {'cosine':>10}   ({result['tokens']} tokens)")
        for n, l2, cos in zip(result["layers"], result["l2"], result["cosine"], strict=True):
            print(f"{n:>5} {l2:>10.4f} {cos:>10.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    heldout.define_flags()
    cli.run(main)
