"""A fine-tuned or pretrained model as a StableHLO serving artifact (`albert_jax.serving`).

  python -m albert_jax.export --src=FINETUNE_WORKDIR --dst=DIR [--run_seed=S]
  python -m albert_jax.export --src=PRETRAINED --dst=DIR --max_seq_length=128   # an encoder

A fine-tuning workdir (or step dir) exports its task model's prediction (`predict`: the kind's
outputs, e.g. logits [b, K]) and its encoder (`embed`: {"cls", "mean"} [b, H]); any other
checkpoint `load_pretrained` reads (a pretraining run, a model dir, an HF or TF1 dir) exports
the encoder alone. Each function is `jax.export`ed with symbolic batch and sequence dimensions
for every platform in `--platforms` (default CPU, CUDA and TPU), taking the weights as an
argument (stored once in `weights.safetensors`, not folded into the program). The directory's
layout and the manifest are `serving`'s module docstring; a several-seed run exports
`--run_seed`, else its best seed by the task's headline metric (printed).

`in_process(src)` is the same model without the artifact: `serving.Served` over the jitted
model, which `albert_jax.predict --src=WORKDIR` serves and the tests compare the artifact with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from albert_jax import files, serving
from albert_jax.interop.hf_task_export import (
    FineTunedRun,
    fine_tuning_run,
    label_names,
    pick_seed,
)
from albert_jax.interop.weight_names import unflatten_params
from albert_jax.pretrained import read_checkpoint

__all__ = ["PLATFORMS", "TASK_FIELDS", "export_artifact", "in_process"]

PLATFORMS = ("cpu", "cuda", "tpu")
#: The record fields of each task's input files (local readers, TFDS GLUE / RACE, SQuAD), by
#: role (`serving._KINDS`); other tasks read the kind's `_DEFAULT_FIELDS`.
TASK_FIELDS: dict[str, dict[str, str]] = {
    "sentiment_rt": {"text_a": "sentence"},
    "sentiment_rt_score": {"text_a": "sentence"},
    "nli_vitaminc": {"text_a": "premise", "text_b": "hypothesis"},
    "sst2": {"text_a": "sentence"},
    "cola": {"text_a": "sentence"},
    "mrpc": {"text_a": "sentence1", "text_b": "sentence2"},
    "qqp": {"text_a": "question1", "text_b": "question2"},
    "stsb": {"text_a": "sentence1", "text_b": "sentence2"},
    "mnli": {"text_a": "premise", "text_b": "hypothesis"},
    "qnli": {"text_a": "question", "text_b": "sentence"},
    "rte": {"text_a": "sentence1", "text_b": "sentence2"},
    "wnli": {"text_a": "sentence1", "text_b": "sentence2"},
    "race": {"context": "article", "question": "question", "options": "options"},
}
_DEFAULT_FIELDS: dict[str, dict[str, str]] = {
    "classification": {"text_a": "text", "text_b": "text_pair"},
    "regression": {"text_a": "text", "text_b": "text_pair"},
    "multiple_choice": {"context": "context", "question": "question", "options": "options"},
    "span_v1": {"question": "question", "context": "context"},
    "span_v2": {"question": "question", "context": "context"},
    "encoder": {"text": "text"},
}
# The run config's featurization and post-processing settings a manifest carries, by kind.
_SETTINGS = {
    "multiple_choice": ("max_qa_length",),
    "span_v1": ("doc_stride", "max_query_length", "n_best_size", "max_answer_length"),
    "span_v2": (
        "doc_stride", "max_query_length", "n_best_size", "max_answer_length", "null_threshold",
    ),
}  # fmt: skip


@dataclasses.dataclass
class _Function:
    """A function of (weights [list, in `weights` order], inputs {name: [b, ...] int32})."""

    fn: Callable[[list, Mapping[str, jax.Array]], dict[str, jax.Array]]
    weights: list[str]
    inputs: dict[str, tuple[str, ...]]  # name -> symbolic shape ("b", "s"), ("b", "4", "s")
    sequence_outputs: tuple[str, ...] = ()


@dataclasses.dataclass
class _Model:
    manifest: dict[str, Any]
    weights: dict[str, np.ndarray]
    functions: dict[str, _Function]
    tokenizer_path: str


def _build(src: str, run_seed: int | None, max_seq_length: int | None) -> _Model:
    """The manifest, weights and functions of `src` (see the module docstring)."""
    run = fine_tuning_run(src)
    if run is None:
        checkpoint = read_checkpoint(src, run_seed=run_seed)
        source = {"path": src, "step": checkpoint.step, "run_seed": run_seed}
        manifest: dict[str, Any] = {"kind": "encoder", "task": None}
        task_function = None
    else:
        holder, seed, why = pick_seed(run, run_seed)
        checkpoint = read_checkpoint(holder.path, run_seed=seed)
        source = {"path": src, "step": run.step, "run_seed": seed, "seed_choice": why}
        manifest, task_function = _task(run, checkpoint)
    config = checkpoint.config
    if max_seq_length is None:
        max_seq_length = int(manifest.get("max_seq_length") or config.max_position_embeddings)
    if not 3 <= max_seq_length <= config.max_position_embeddings:
        raise ValueError(
            f"--max_seq_length={max_seq_length}: the model has "
            f"{config.max_position_embeddings} positions (3 at least: [CLS] x [SEP])"
        )
    if not checkpoint.tokenizer_path:
        raise ValueError(f"{src} has no tokenizer.model: a served model reads raw text")
    fields = TASK_FIELDS.get(manifest["task"] or "", _DEFAULT_FIELDS[manifest["kind"]])
    optional = ["text_pair"] if fields is _DEFAULT_FIELDS.get(manifest["kind"]) else []
    import importlib.metadata

    manifest.update({
        "format": serving.FORMAT, "format_version": serving.FORMAT_VERSION,
        "fields": fields, "optional_fields": [f for f in optional if f in fields.values()],
        "max_seq_length": max_seq_length,
        "lower_case": bool(getattr(checkpoint.tokenizer, "lower", True)),
        "hidden_size": config.hidden_size, "source": source,
        "versions": {
            "albert_jax": importlib.metadata.version("albert_jax"), "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"),
        },
    })  # fmt: skip
    weights = {k: np.asarray(v) for k, v in checkpoint.weights.items()}
    encoder = sorted(k for k in weights if k.startswith("albert/"))
    functions = {"embed": _embed_function(config, encoder)}
    if task_function is not None:
        functions["predict"] = task_function
    return _Model(manifest, weights, functions, checkpoint.tokenizer_path)


def _task(run: FineTunedRun, checkpoint: Any) -> tuple[dict[str, Any], _Function]:
    """The manifest's task entries and the prediction function of a fine-tuning run."""
    import ml_collections

    from albert_jax.finetune.train import build_model
    from albert_jax.tasks.kinds import get_kind
    from albert_jax.tasks.registry import get_task

    spec, kind = get_task(run.task), get_kind(run.kind)
    config = ml_collections.ConfigDict(run.config)
    model = build_model(spec, checkpoint.config, config)
    names = sorted(checkpoint.weights)
    shapes = kind.batch_shapes(1, 1, spec)
    inputs = {}
    for name in kind.predict_inputs:
        middle = tuple(str(d) for d in shapes[name][0][1:-1])  # options of [B, C, S]
        if name in kind.sequence_inputs:
            inputs[name] = ("b", *middle, "s")
        else:
            inputs[name] = ("b", *(str(d) for d in shapes[name][0][1:]))

    def predict(weights: list, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        params = unflatten_params(dict(zip(names, weights, strict=True)))["params"]
        return kind.apply(model, params, batch, train=False)

    manifest = {
        "kind": run.kind, "task": run.task, "num_labels": run.num_labels,
        "labels": list(label_names(run)) if run.kind in ("classification", "regression") else None,
        "max_seq_length": run.max_seq_length,
        **{k: run.config[k] for k in _SETTINGS.get(run.kind, ())},
    }  # fmt: skip
    if run.kind == "multiple_choice":
        manifest["num_choices"] = run.num_labels
    return manifest, _Function(predict, names, inputs, tuple(kind.sequence_outputs))


def _embed_function(config: Any, names: list[str]) -> _Function:
    """The encoder's last layer pooled two ways: {"cls": its [CLS] state, "mean": the mean of
    its states over the real tokens}, each [b, H] float32."""
    from albert_jax.model.albert import AlbertModel

    encoder = AlbertModel(config)

    def embed(weights: list, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        params = unflatten_params(dict(zip(names, weights, strict=True)))["params"]["albert"]
        mask = batch["input_mask"]
        states = encoder.apply({"params": params}, batch["input_ids"], batch["segment_ids"], mask)[
            "sequence_output"
        ].astype(jnp.float32)  # [b, s, H]
        weight = mask[..., None].astype(jnp.float32)
        mean = (states * weight).sum(1) / jnp.maximum(weight.sum(1), 1.0)
        return {"cls": states[:, 0], "mean": mean}

    sequence = {k: ("b", "s") for k in ("input_ids", "segment_ids", "input_mask")}
    return _Function(embed, names, sequence)


def _function_manifest(name: str, function: _Function) -> dict[str, Any]:
    from albert_jax.model.heads import MASKED_LOGIT

    return {
        "file": serving.function_file(name),
        "weights": function.weights,
        "inputs": {k: list(v) for k, v in function.inputs.items()},
        "sequence_inputs": [k for k, v in function.inputs.items() if v[-1] == "s"],
        "sequence_outputs": list(function.sequence_outputs),
        "masked_logit": float(MASKED_LOGIT),
    }


# ------------------------------------------------------------------------------ the ways out
def in_process(
    src: str, *, run_seed: int | None = None, max_seq_length: int | None = None
) -> serving.Served:
    """`src` served from the jitted model (no artifact): what `export_artifact` would write,
    run in this process."""
    from albert_jax.data.tokenizer import Tokenizer

    built = _build(src, run_seed, max_seq_length)
    manifest = {
        **built.manifest,
        "functions": {k: _function_manifest(k, f) for k, f in built.functions.items()},
    }
    functions = {}
    for name, function in built.functions.items():
        weights = [jax.device_put(built.weights[k]) for k in function.weights]
        functions[name] = serving._caller(jax.jit(function.fn), weights)
    tokenizer = Tokenizer(built.tokenizer_path, lower=manifest["lower_case"])
    return serving.Served(manifest=manifest, tokenizer=tokenizer, functions=functions)


def export_artifact(
    src: str,
    dst: str,
    *,
    run_seed: int | None = None,
    max_seq_length: int | None = None,
    platforms: tuple[str, ...] = PLATFORMS,
) -> dict[str, Any]:
    """Writes the serving artifact of `src` into `dst` (see the module docstring); returns its
    manifest."""
    from jax import export
    from safetensors.numpy import save

    unknown = sorted(set(platforms) - set(PLATFORMS))
    if unknown or not platforms:
        raise ValueError(f"--platforms: {unknown or 'none'}; choose from {list(PLATFORMS)}")
    built = _build(src, run_seed, max_seq_length)
    limit = built.manifest["max_seq_length"]
    directory = files.as_path(dst)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {**built.manifest, "platforms": list(platforms), "functions": {}}
    for name, function in built.functions.items():
        # Serving cuts batches to multiples of LENGTH_STEP, never under one: a lower bound
        # that lets beam heads take their top k of the s positions (k <= s).
        shortest = min(serving.LENGTH_STEP, limit)
        scope = export.SymbolicScope([f"s <= {limit}", f"s >= {shortest}"])
        weights = [jax.ShapeDtypeStruct(built.weights[k].shape, built.weights[k].dtype)
                   for k in function.weights]  # fmt: skip
        inputs = {
            k: jax.ShapeDtypeStruct(export.symbolic_shape(", ".join(dims), scope=scope), np.int32)
            for k, dims in function.inputs.items()
        }
        exported = export.export(jax.jit(function.fn), platforms=platforms)(weights, inputs)
        files.write_atomic(directory / serving.function_file(name), exported.serialize())
        manifest["functions"][name] = _function_manifest(name, function)
    used = sorted({k for f in built.functions.values() for k in f.weights})
    files.write_atomic(directory / serving.WEIGHTS, save({k: built.weights[k] for k in used}))
    files.copy(built.tokenizer_path, directory / serving.TOKENIZER)
    files.write_json(directory / serving.MANIFEST, manifest, indent=2)
    return manifest


# ---------------------------------------------------------------------------------------- CLI
def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string(
        "src", None, "A fine-tuning workdir or step dir (its task model and encoder), or any "
        "checkpoint load_pretrained reads (the encoder alone); local or gs://.",
    )  # fmt: skip
    flags.DEFINE_string("dst", None, "The artifact dir, local or gs:// (new or empty).")
    flags.DEFINE_integer(
        "run_seed", None, "A run of several seeds: the seed to export (default: its best by "
        "the task's headline metric).",
    )  # fmt: skip
    flags.DEFINE_integer(
        "max_seq_length", None, "Longest input in tokens (default: the run's max_seq_length; "
        "an encoder: its positions).",
    )  # fmt: skip
    flags.DEFINE_list("platforms", list(PLATFORMS), "Platforms to serialize the functions for.")
    flags.DEFINE_bool("overwrite", False, "Write into a --dst that already holds files.")
    flags.mark_flags_as_required(["src", "dst"])


def main(argv: list[str]) -> None:
    from absl import app, flags

    from albert_jax.convert import check_destination

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    check_destination(FLAGS.src, FLAGS.dst, FLAGS.overwrite, export=True)
    manifest = export_artifact(
        FLAGS.src, FLAGS.dst, run_seed=FLAGS.run_seed, max_seq_length=FLAGS.max_seq_length,
        platforms=tuple(FLAGS.platforms),
    )  # fmt: skip
    source = manifest["source"]
    seed = source.get("run_seed")
    which = "" if seed is None else f", seed {seed} ({source.get('seed_choice') or '--run_seed'})"
    what = "encoder" if manifest["kind"] == "encoder" else f"{manifest['kind']} model of task "
    what += "" if manifest["kind"] == "encoder" else repr(manifest["task"])
    print(
        f"wrote the {what} (step {source['step']}{which}; functions "
        f"{', '.join(manifest['functions'])}; up to {manifest['max_seq_length']} tokens; "
        f"{', '.join(manifest['platforms'])}) to {FLAGS.dst}"
    )


if __name__ == "__main__":
    from albert_jax.runtime import cli

    _define_flags()
    cli.run(main)
