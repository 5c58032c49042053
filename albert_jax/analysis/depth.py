"""Depth sweep: one all-shared checkpoint evaluated at other depths L'.

    python -m albert_jax.analysis.depth --init=PATH --layers=1,2,4,8,12,16,24 --json

An all-shared ALBERT has one set of layer weights whatever its depth, so the same checkpoint
runs with any number of layer applications (`ModelConfig.with_depth`; a grouped model at a
multiple of its groups). For each L' this measures what the training loop logs at its
evaluations, on the same held-out pretraining batches (`analysis.heldout`): eval MLM / SOP
accuracy and loss (`pretrain.heldout.make_eval_step` + `evaluate_batches`). At the trained depth the
numbers are the run's own `eval_*` metrics.

Prints one JSON line with --json: `{"layers": [...], "eval_mlm_accuracy": [...],
"eval_sop_accuracy": [...], "eval_loss": [...], ...}` (a metric the objective lacks, e.g. SOP
of an MLM-only run, is null), and writes OUT/depth_sweep.json and OUT/depth_sweep.png (the
accuracies and losses against L', the trained depth and the majority baselines marked).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import jax
import matplotlib
from absl import app, flags, logging

from albert_jax import files, metrics_writer
from albert_jax.analysis import heldout
from albert_jax.model.albert import AlbertForPreTraining
from albert_jax.pretrain.heldout import evaluate_batches, make_eval_step
from albert_jax.runtime import cli

JSON_FILE = "depth_sweep.json"
PNG_FILE = "depth_sweep.png"
# The metrics of the JSON line first, then the two loss terms.
METRICS = (
    "eval_mlm_accuracy",
    "eval_sop_accuracy",
    "eval_loss",
    "eval_mlm_loss",
    "eval_sop_loss",
)


def parse_layers(text: str | Sequence[Any]) -> list[int]:
    """ "1,2,4" (or a list) -> [1, 2, 4]; ValueError naming --layers for anything else."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        layers = [int(str(x).strip()) for x in items if str(x).strip()]
    except ValueError:
        raise ValueError(f"--layers={text!r}: expected positive integers, e.g. 1,2,4,8") from None
    if not layers or min(layers) < 1:
        raise ValueError(f"--layers={text!r}: expected positive integers, e.g. 1,2,4,8")
    return layers


def sweep(data: heldout.Heldout, layers: Sequence[int]) -> dict[str, Any]:
    """Held-out metrics of `data.pretrained` at each depth of `layers`.

    Returns {"init", "trained_layers", "layers": [L'...], one list per name of METRICS (value
    at each L', None where not measured), the majority baselines, "eval_batches",
    "sequences_per_batch"}.

    Raises:
      ValueError: a depth the checkpoint cannot run at (`ModelConfig.with_depth`), checked for
        every depth before anything is compiled.
    """
    trained = data.pretrained.config
    # scan_layers: one compiled layer whatever L' (24 unrolled layers would compile 24).
    configs = [trained.with_depth(n).replace(scan_layers=True) for n in layers]
    result: dict[str, Any] = {
        "init": data.pretrained.path,
        "trained_layers": trained.num_hidden_layers,
        "layers": list(layers),
        **{name: [] for name in METRICS},
    }
    with data.context():
        params, batches = data.params(), data.placed_batches()
        for config in configs:
            eval_step = jax.jit(
                make_eval_step(
                    AlbertForPreTraining(config), sentence_order=data.config.objective != "none"
                )
            )
            metrics = evaluate_batches(eval_step, params, batches)
            for name in METRICS:
                result[name].append(metrics.get(name))
            logging.info("L'=%d: %s", config.num_hidden_layers, metrics)
    result.update(data.baselines())
    result["eval_batches"] = len(data.batches)
    result["sequences_per_batch"] = int(data.config.batch_size)
    return result


def plot(result: dict[str, Any]) -> Any:
    """The matplotlib figure of a `sweep` result: accuracies (left) and losses (right) against
    L' (log2 axis), the trained depth and the most-frequent-token / majority-label baselines
    marked."""
    import matplotlib.pyplot as plt

    layers = result["layers"]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, names in (
        (ax_acc, ("eval_mlm_accuracy", "eval_sop_accuracy")),
        (ax_loss, ("eval_loss", "eval_mlm_loss", "eval_sop_loss")),
    ):
        for name in names:
            points = [(n, v) for n, v in zip(layers, result[name], strict=True) if v is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name.removeprefix("eval_"))
        ax.axvline(result["trained_layers"], color="gray", linestyle=":", label="trained depth")
        ax.set_xscale("log", base=2)
        ax.set_xticks(layers, [str(n) for n in layers])
        ax.set_xlabel("layers L' (same weights)")
        ax.grid(alpha=0.3)
    for key, label, style in (
        ("eval_mlm_majority_accuracy", "most frequent token", "--"),
        ("eval_sop_majority_accuracy", "SOP majority label", "-."),
    ):
        if key in result:
            ax_acc.axhline(result[key], color="gray", linestyle=style, label=label)
    ax_acc.set_ylabel("held-out accuracy")
    ax_loss.set_ylabel("held-out loss")
    ax_acc.legend(fontsize=8)
    ax_loss.legend(fontsize=8)
    fig.suptitle(f"{files.as_path(result['init']).name}: trained at L={result['trained_layers']}")
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    FLAGS = flags.FLAGS
    layers = parse_layers(FLAGS.layers)
    data = heldout.load_from_flags()
    result = sweep(data, layers)
    files.write_json(heldout.output_path(FLAGS.out, JSON_FILE), result, indent=1)
    matplotlib.use("Agg")  # no display: the figure goes to a file
    metrics_writer.write_figure(plot(result), heldout.output_path(FLAGS.out, PNG_FILE))
    if FLAGS.json:
        print(json.dumps(result))
    else:
        print(f"{'L':>4} " + " ".join(f"{n.removeprefix('eval_'):>13}" for n in METRICS))
        for i, n in enumerate(layers):
            values = [result[name][i] for name in METRICS]
            print(
                f"{n:>4} " + " ".join(f"{v:>13.4f}" if v is not None else " " * 13 for v in values)
            )
    sys.stdout.flush()


if __name__ == "__main__":
    heldout.define_flags()
    flags.DEFINE_string("layers", "1,2,4,8,12,16,24", "Depths L' to evaluate, comma-separated.")
    cli.run(main)
