"""Checkpoint conversion CLI: HuggingFace (PyTorch) <-> albert_jax, official TF1 -> albert_jax.

  python -m albert_jax.convert --from=hf --src=HF_DIR --dst=MODEL_DIR
  python -m albert_jax.convert --from=tf --src=OFFICIAL_DIR_OR_CKPT_PREFIX --dst=MODEL_DIR
  python -m albert_jax.convert --to=hf --src=MODEL_DIR_OR_WORKDIR_OR_STEP_DIR --dst=HF_DIR
  python -m albert_jax.convert --to=onnx --src=FINETUNE_WORKDIR_OR_STEP_DIR --dst=HF_DIR
  python -m albert_jax.convert --unshare --src=ANY_CHECKPOINT --dst=MODEL_DIR
  python -m albert_jax.convert --reshare --src=ANY_CHECKPOINT --dst=MODEL_DIR

`--unshare` writes the same function as `sharing="none"` (each layer a copy of the block it
ran); `--reshare` averages the layers of a not-shared checkpoint into one shared block (a
research baseline; outputs change). Both print and write (`DST/unshare_report.json`,
`DST/reshare_report.json`) how far the new model's outputs are from the source's (see
`albert_jax.interop.unshare`).

`--to=hf` of a fine-tuning workdir (or step dir) writes the head the run trained as its HF
transformers class (`albert_jax.interop.hf_task_export`): `AlbertForSequenceClassification`
(classification and regression, with `id2label`, `label2id`, `problem_type`),
`AlbertForQuestionAnswering` (SQuAD v1 spans) or `AlbertForMultipleChoice`, with
`spiece.model` and the tokenizer config, ready for `transformers.pipeline` and the Auto classes.
A run of several seeds exports `--run_seed=S`, else its best seed by the task's headline metric
(printed). A SQuAD v2 head has no HF class and is refused, naming the heads that export;
`--hf_class` names the class expected, and a task class asked of a source without a task head
(a pretraining run, model, HF or TF1 dir: those export as `AlbertForPreTraining`) is refused.

`--to=onnx` writes the same HF task export (same flags, same checks and refusals) and then
`model.onnx` into the same dir (`albert_jax.interop.onnx_export`): the task model for
onnxruntime, inputs `input_ids`, `attention_mask`, `token_type_ids` (int64, [batch, sequence];
multiple choice [batch, choices, sequence]) and HF's output names (`logits`, or `start_logits`
and `end_logits`), every dimension symbolic. It takes fine-tuning runs only: a source without a
task head is refused in one line before anything is written (a pretraining model has no
prediction to serve; `--to=hf` exports it, `python -m albert_jax.export` serves its encoder).

A `--dst` that is `--src` or inside it, or that holds a training run (`checkpoints/`,
`metrics.jsonl`), is refused before anything is read unless `--overwrite` is given: the outputs
(`config.json` among them) would replace its files. So is a `--to=hf` / `--to=onnx` export dir
that already holds anything: files of another model beside the new ones would make a mixed dir.

Every path may be local or `gs://`. The work is done by the modules below this one, which
import each other one way only (weight_names <- hf_checkpoint, tf1_checkpoint <- pretrained <-
convert):

  weight_names     the name / shape table HF <-> TF1 <-> ours, the shared importer (pure)
  hf_checkpoint    HF state dicts <-> params; HF dirs read and written
  tf1_checkpoint   official TF1 checkpoints -> params
  pretrained       `load_pretrained` (any layout) and `save_model_dir`
  unshare          `unshare` / `reshare` of the encoder's layers (pretrained <- unshare)
  hf_task_export   fine-tuning runs -> HF task models (pretrained <- hf_task_export)
  onnx_export      HF task models -> model.onnx (torch.onnx; imports none of the above)

Import their functions from them: this module is the CLI only. Missing or mis-shaped tensors
raise one `ValueError` listing all of them; extra tensors are logged (warning, logger
"albert_jax.convert") with their names; optimizer slots and `global_step` are logged as
ignored. Absent heads (pooler, MLM, SOP) are left out and initialized by `load_pretrained`.
"""

from __future__ import annotations

from albert_jax import files
from albert_jax.interop.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from albert_jax.interop.hf_task_export import (
    HF_CLASSES,
    PRETRAINING_CLASS,
    export_hf_task_model,
    fine_tuning_run,
)
from albert_jax.interop.unshare import convert_sharing
from albert_jax.interop.weight_names import flatten_params, missing_parts
from albert_jax.pretrained import (
    find_spm_model,
    load_pretrained,
    load_tf_checkpoint,
    save_model_dir,
)

__all__ = ["check_destination", "main"]


# ---------------------------------------------------------------------------------------- CLI
def _define_flags() -> None:
    """Flags are defined only when run as a program, so importing this module adds none."""
    from absl import flags

    flags.DEFINE_enum(
        "from",
        None,
        ["hf", "tf"],
        "Import into an albert_jax model dir: from an HF dir (hf), or from an official TF1 dir "
        "or checkpoint prefix (tf).",
    )
    flags.DEFINE_enum(
        "to",
        None,
        ["hf", "onnx"],
        "Export an albert_jax checkpoint (model dir, workdir or step dir) to an HF dir "
        "(config.json + model.safetensors + tokenizer files): a fine-tuning run as the HF task "
        "class of its head, anything else as AlbertForPreTraining (hf); onnx: a fine-tuning "
        "run's HF task export and its model.onnx beside it.",
    )
    flags.DEFINE_integer(
        "run_seed",
        None,
        "--to=hf/onnx of a fine-tuning run of several seeds (config.num_seeds): the seed to export "
        "(default: the best by the task's headline metric in its eval_results.json).",
    )
    flags.DEFINE_enum(
        "hf_class",
        None,
        [PRETRAINING_CLASS, *sorted(set(HF_CLASSES.values()))],
        "--to=hf/onnx: the HF class expected (default: the source's own); an error when the source "
        "does not export as it.",
    )
    flags.DEFINE_bool(
        "unshare",
        False,
        "Write the checkpoint (any layout load_pretrained reads) as an albert_jax model dir with "
        'sharing="none": each layer a copy of the block it ran (same outputs).',
    )
    flags.DEFINE_bool(
        "reshare",
        False,
        'Average the layers of a not-shared checkpoint into one block (sharing="all"; outputs '
        "change, the difference is printed and written to DST/reshare_report.json).",
    )
    flags.DEFINE_string(
        "src",
        None,
        "Source, local or gs://: a dir, or a TF checkpoint prefix for --from=tf (--unshare / "
        "--reshare: any layout load_pretrained reads).",
    )
    flags.DEFINE_string("dst", None, "Destination dir, local or gs:// (created).")
    flags.DEFINE_string(
        "config",
        None,
        "albert_config.json for --from=tf when --src is a checkpoint prefix "
        "(default: the albert_config.json next to it).",
    )
    flags.DEFINE_string(
        "tokenizer",
        None,
        "Sentencepiece model to bundle (default: the one found next to the source, if any).",
    )
    flags.DEFINE_bool(
        "overwrite",
        False,
        "Write into a --dst that is inside --src or holds a training run (checkpoints/, "
        "metrics.jsonl): refused without it, since the outputs would replace the run's files.",
    )
    flags.mark_flags_as_required(["src", "dst"])


# What marks a directory as a training run's workdir.
_RUN_MARKERS = ("checkpoints", "metrics.jsonl")


def check_destination(src: str, dst: str, overwrite: bool, *, export: bool = False) -> None:
    """Refuses (ValueError) a `dst` that is `src` or inside it, or that holds a training run,
    or (`export`: an HF export dir) that holds anything, unless `overwrite`: conversion outputs
    (`config.json`, weights) would replace its files or mix with them."""
    if overwrite:
        return
    source, target = files.absolute(src).rstrip("/"), files.absolute(dst).rstrip("/")
    if target == source or target.startswith(source + "/"):
        raise ValueError(
            f"--dst={dst} is inside --src={src}: the conversion would write over the source's "
            "files; choose another --dst (or pass --overwrite)"
        )
    held = [m for m in _RUN_MARKERS if (files.as_path(target) / m).exists()]
    if held:
        raise ValueError(
            f"--dst={dst} holds a training run ({', '.join(held)}): the conversion would write "
            "over its files (config.json among them); choose another --dst (or pass --overwrite)"
        )
    target_path = files.as_path(target)
    if export and target_path.is_dir():
        held = sorted(p.name for p in target_path.iterdir())
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise ValueError(
                f"--dst={dst} already holds {shown}: an export dir must be new or empty, or "
                "the model files would mix with those; choose another --dst (or pass "
                "--overwrite)"
            )


def main(argv: list[str]) -> None:
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    direction_from, direction_to = FLAGS["from"].value, FLAGS.to
    given = [direction_from, direction_to, FLAGS.unshare or None, FLAGS.reshare or None]
    if sum(d is not None for d in given) != 1:
        raise app.UsageError(
            "give exactly one of --from=hf|tf, --to=hf|onnx, --unshare or --reshare"
        )
    src, dst, tokenizer = FLAGS.src, FLAGS.dst, FLAGS.tokenizer
    check_destination(src, dst, FLAGS.overwrite, export=direction_to is not None)
    if FLAGS.unshare or FLAGS.reshare:
        direction = "unshare" if FLAGS.unshare else "reshare"
        report = convert_sharing(src, dst, direction)
        source, result = report["source"], report["result"]
        describe = lambda c: (
            f"sharing={c['sharing']!r}, {c['num_hidden_layers']} layers, "
            f"{c['num_hidden_groups']} group(s), inner_group_num={c['inner_group_num']}, "
            f"{c['parameters']:,} parameters"
        )
        print(f"{direction}: {describe(source)} -> {describe(result)}")
        figures = ", ".join(f"{k} {v:.6g}" for k, v in report["output_difference"].items())
        shape = "x".join(map(str, report["probe"]["input_ids"]))
        print(f"outputs vs the source (fp32, probe batch {shape}): {figures}")
        print(f"wrote albert_jax model dir to {dst}")
        return
    if direction_to is not None:
        run = fine_tuning_run(src)
        if run is None and direction_to == "onnx":
            raise ValueError(
                f"--to=onnx: {src} is no fine-tuning run (a pretraining run, model, HF or TF1 "
                "dir): ONNX exports the task head of a fine-tuning run only; fine-tune it and "
                "export the fine-tuning workdir (--to=hf exports it as AlbertForPreTraining)"
            )
        if run is not None:
            written = export_hf_task_model(
                run, dst, run_seed=FLAGS.run_seed, hf_class=FLAGS.hf_class,
                tokenizer_path=tokenizer,
            )  # fmt: skip
            seed = written["run_seed"]
            which = "" if seed is None else f", seed {seed} ({written['seed_choice']})"
            cls, of = written["hf_class"], f"of task {written['task']!r}"
            of += f" (step {written['step']}{which})"
            if direction_to == "hf":
                print(f"wrote HF {cls} {of} to {dst}")
                return
            from albert_jax.interop.onnx_export import ONNX_FILE, OPSET, export_onnx

            export_onnx(dst)
            print(
                f"wrote ONNX {ONNX_FILE} (opset {OPSET}) beside the HF {cls} export {of} in {dst}"
            )
            return
        if FLAGS.hf_class not in (None, PRETRAINING_CLASS):
            raise ValueError(
                f"--hf_class={FLAGS.hf_class}: {src} holds no fine-tuned task head (a "
                f"pretraining checkpoint), so it exports as {PRETRAINING_CLASS} only; fine-tune "
                "it and export the fine-tuning workdir"
            )
        loaded = load_pretrained(src, run_seed=FLAGS.run_seed)
        save_hf_checkpoint(
            loaded.variables, loaded.config, dst, tokenizer_path=tokenizer or loaded.tokenizer_path
        )
        print(f"wrote HF AlbertForPreTraining checkpoint to {dst}")
        return
    if direction_from == "hf":
        config, params = load_hf_checkpoint(src)
        tokenizer = tokenizer or find_spm_model(src, ("spiece.model",))
    else:
        config, params, found = load_tf_checkpoint(src, FLAGS.config)
        tokenizer = tokenizer or found
    missing = missing_parts(params)
    if missing:
        print(f"note: the source has no {missing}; load_pretrained will initialize them")
    save_model_dir(dst, params, config, tokenizer_path=tokenizer)
    n = sum(v.size for v in flatten_params(params).values())
    print(f"wrote albert_jax model dir ({n:,} parameters) to {dst}")


if __name__ == "__main__":
    from albert_jax.runtime import cli

    _define_flags()
    cli.run(main)
