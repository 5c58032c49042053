"""Fine-tuning runs -> HuggingFace transformers task models (`convert --to=hf`).

A fine-tuning workdir (or one of its step dirs) holds the backbone `albert` and the head its
task kind trained (`tasks/kinds.py`); each head with an HF equivalent is written as that class:

  kind             our head (heads.py)               HF class                          head
  classification   AlbertForSequenceClassification   AlbertForSequenceClassification   [K, H]
  regression       AlbertForSequenceClassification   AlbertForSequenceClassification   [1, H]
  multiple_choice  AlbertForMultipleChoice           AlbertForMultipleChoice           [1, H]
  span_v1          AlbertForQuestionAnswering        AlbertForQuestionAnswering        [2, H]
  span_v2          AlbertForQuestionAnsweringV2      none (XLNet's beam head): refused

into DIR: `config.json` (the architecture, `id2label` / `label2id` / `problem_type` for
sequence classification, `finetuning_task`, and an `albert_jax` entry saying which run, step
and seed it came from), `model.safetensors`, `spiece.model`, `tokenizer_config.json`,
`special_tokens_map.json` and (with transformers installed) a `tokenizer.json` that gives our
tokenizer's ids (`_fast_tokenizer_json`), so that `AutoModelFor...` / `AutoTokenizer` /
`pipeline(...)` load it with no weight initialized afresh. The head's arrays are the run's
own, transposed to PyTorch's [out, in] (names: `weight_names.task_layout`); the backbone is the
pretraining export's (`hf_checkpoint.params_to_hf_state_dict`).

A run of several seeds (`config.num_seeds` N > 1: every array [N, ...]) exports one seed:
`run_seed`, else the best by the task's headline metric in the run's `eval_results.json`
(glue_table's, e.g. accuracy, Pearson, F1), which the report names. Seeds that
`restart_failed_seeds` ran again live in WORKDIR/restarted_seeds and are found there.

Sources without a task head (pretraining workdirs, model dirs, HF and TF1 dirs) are not this
module's: `fine_tuning_run` returns None for them and `convert` writes `AlbertForPreTraining`;
asking for a task class there is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from albert_jax import files
from albert_jax.finetune.seeds import seeds_of
from albert_jax.interop.hf_checkpoint import params_to_hf_state_dict, to_hf_config
from albert_jax.interop.weight_names import task_layout, unflatten_params
from albert_jax.pretrained import detect_layout, read_checkpoint
from albert_jax.runtime import checkpoint_dirs

__all__ = [
    "HF_CLASSES",
    "PRETRAINING_CLASS",
    "FineTunedRun",
    "fine_tuning_run",
    "export_hf_task_model",
    "label_names",
    "pick_seed",
]

log = logging.getLogger("albert_jax.convert")

PRETRAINING_CLASS = "AlbertForPreTraining"
#: Task kind -> the HF transformers class its head is exported as (kinds without one: none).
HF_CLASSES: dict[str, str] = {
    "classification": "AlbertForSequenceClassification",
    "regression": "AlbertForSequenceClassification",
    "multiple_choice": "AlbertForMultipleChoice",
    "span_v1": "AlbertForQuestionAnswering",
}
# Class names in label-index order: the readers' (tasks/local.py) and TFDS's GLUE features,
# so that a pipeline says "positive", not "LABEL_1". Other tasks get HF's LABEL_<i>.
_LABEL_NAMES: dict[str, tuple[str, ...]] = {
    "sentiment_rt": ("negative", "positive"),
    "nli_vitaminc": ("entailment", "neutral", "contradiction"),
    "sst2": ("negative", "positive"),
    "cola": ("unacceptable", "acceptable"),
    "mrpc": ("not_equivalent", "equivalent"),
    "qqp": ("not_duplicate", "duplicate"),
    "mnli": ("entailment", "neutral", "contradiction"),
    "qnli": ("entailment", "not_entailment"),
    "rte": ("entailment", "not_entailment"),
    "wnli": ("not_entailment", "entailment"),
}
# Where finetune._restart_failed_seeds runs the seeds that replace failed ones (RESTART_DIR
# there; not imported: that would load the whole training stack into the converter).
_RESTART_DIR = "restarted_seeds"
_EVAL_RESULTS = "eval_results.json"


@dataclasses.dataclass
class FineTunedRun:
    """A fine-tuning checkpoint's description, read from its step's `meta` (no arrays yet).

    `seeds` are the runs its arrays hold on their leading axis ([N, ...]; one seed: no axis).
    """

    path: str  # the workdir or step dir given
    workdir: str | None  # the run's workdir (eval_results.json, restarted_seeds/)
    step_dir: str
    step: int
    task: str
    kind: str
    num_labels: int
    seeds: list[int]
    max_seq_length: int | None
    classifier_dropout: float | None
    config: dict[str, Any]  # the run's config as its meta recorded it (featurization settings)

    @property
    def hf_class(self) -> str | None:
        return HF_CLASSES.get(self.kind)


def fine_tuning_run(path: str) -> FineTunedRun | None:
    """The fine-tuning run at `path` (a workdir: its latest committed step; or a step dir), or
    None when `path` holds no task head (any other layout `load_pretrained` reads, a
    pretraining run)."""
    layout = detect_layout(path)
    if layout not in ("workdir", "step_dir"):
        return None
    step_dir = checkpoint_dirs.latest_step_dir(path) if layout == "workdir" else path
    meta = checkpoint_dirs.read_json_item(files.as_path(step_dir) / "meta")
    # TaskModel.meta() writes task and head; pretraining checkpoints have neither.
    if not isinstance(meta, dict) or "head" not in meta or "task" not in meta:
        return None
    from albert_jax.tasks.registry import get_task

    config = meta.get("config") or {}
    spec = get_task(str(meta["task"]))
    workdir = path if layout == "workdir" else str(files.as_path(step_dir).parent.parent)
    return FineTunedRun(
        path=path,
        workdir=workdir,
        step_dir=str(step_dir),
        step=int(meta.get("step", 0)),
        task=str(meta["task"]),
        kind=spec.kind,
        num_labels=int(meta.get("num_labels", spec.num_labels)),
        seeds=seeds_of(config.get("seed", 0), config.get("num_seeds", 1)),
        max_seq_length=config.get("max_seq_length"),
        classifier_dropout=config.get("classifier_dropout"),
        config=config,
    )


# ----------------------------------------------------------------------------------- seeds
def _headline(task: str, metrics: dict[str, Any]) -> str | None:
    """The key of `task`'s headline metric (glue_table.HEADLINES) among `metrics`."""
    from albert_jax.glue_table import HEADLINES

    headline = HEADLINES.get(task)
    if headline is None:
        return None
    for key in (headline.key, headline.metric):
        if key in metrics:
            return key
    return None


def best_seed(run: FineTunedRun) -> tuple[int, str]:
    """(seed, why) of the run's best seed by its headline metric in eval_results.json
    (ties: the lower seed). Raises ValueError asking for `--run_seed` when that is unknown."""
    ask = f"pass --run_seed=S (one of {_all_seeds(run)})"
    results_path = files.as_path(run.workdir or run.path) / _EVAL_RESULTS
    if not results_path.is_file():
        raise ValueError(
            f"{run.path} holds the runs of seeds {run.seeds} and no {_EVAL_RESULTS} to pick the "
            f"best by (an unfinished run?); {ask}"
        )
    per_seed = files.read_json(results_path).get("per_seed") or {}
    key = _headline(run.task, next(iter(per_seed.values()), {}))
    if key is None:
        raise ValueError(f"{results_path}: no headline metric of task {run.task!r}; {ask}")
    scores = {}
    for seed, metrics in per_seed.items():
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            scores[int(seed)] = float(value)
    if not scores:
        raise ValueError(f"{results_path}: no seed has a finite {key}; {ask}")
    seed = max(sorted(scores), key=lambda s: scores[s])
    listed = ", ".join(f"{s}: {v:.4g}" for s, v in sorted(scores.items()))
    return seed, f"best {key} {scores[seed]:.4g} of seeds {{{listed}}}"


def _all_seeds(run: FineTunedRun) -> list[int]:
    restarted = _restarted(run)
    return run.seeds + (restarted.seeds if restarted else [])


def _restarted(run: FineTunedRun) -> FineTunedRun | None:
    """The run of the seeds that replaced failed ones (WORKDIR/restarted_seeds), if any."""
    if run.workdir is None:
        return None
    where = files.as_path(run.workdir) / _RESTART_DIR
    if not (where / checkpoint_dirs.CHECKPOINTS_DIR).is_dir():
        return None
    return fine_tuning_run(str(where))


def pick_seed(run: FineTunedRun, run_seed: int | None) -> tuple[FineTunedRun, int | None, str]:
    """(the run holding the seed, the seed to read or None for a one-seed run, why): `run_seed`,
    else the run's only seed, else its best (`best_seed`)."""
    if run_seed is None and len(run.seeds) == 1:
        return run, None, ""
    why = "--run_seed"
    if run_seed is None:
        run_seed, why = best_seed(run)
    if run_seed not in run.seeds:
        restarted = _restarted(run)
        if restarted is not None and run_seed in restarted.seeds:
            return restarted, run_seed, f"{why} (restarted in {restarted.path})"
    # Not held: read_checkpoint names the seeds the checkpoint holds.
    return run, run_seed, why


# ---------------------------------------------------------------------------------- export
def label_names(run: FineTunedRun) -> tuple[str, ...]:
    """The names of the run's outputs in index order: the task's class names, ("score",) for
    regression, HF's LABEL_<i> for tasks without names."""
    if run.kind == "regression":
        return ("score",)
    names = _LABEL_NAMES.get(run.task, ())
    if len(names) != run.num_labels:
        names = tuple(f"LABEL_{i}" for i in range(run.num_labels))
    return names


def _hf_task_config(run: FineTunedRun, config: Any, hf_class: str, seed: int | None) -> dict:
    """HF config.json of the task model: the pretraining export's fields with the class, the
    head's settings and where it came from."""
    out = to_hf_config(config)
    out["architectures"] = [hf_class]
    if run.classifier_dropout is not None:  # HF applies it where our heads do (pooled output)
        out["classifier_dropout_prob"] = float(run.classifier_dropout)
    out["finetuning_task"] = run.task
    if hf_class == "AlbertForSequenceClassification":
        names = label_names(run)
        out["id2label"] = {str(i): name for i, name in enumerate(names)}
        out["label2id"] = {name: i for i, name in enumerate(names)}
        # "regression": HF's loss is MSE and the pipeline returns the raw score (no sigmoid).
        out["problem_type"] = (
            "regression" if run.kind == "regression" else "single_label_classification"
        )
    out["albert_jax"] = {
        "source": run.path, "step": run.step, "task": run.task, "kind": run.kind,
        "run_seed": seed,
    }  # fmt: skip
    return out


def _tokenizer_files(tokenizer: Any, max_seq_length: int | None) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json of HF's `AlbertTokenizer` for our
    sentencepiece model: our normalization (`data.tokenizer.preprocess_text`: whitespace
    collapsed, accents dropped, lower-cased when the tokenizer is) and special pieces.
    `model_max_length` is the run's max_seq_length, what the head was trained on."""
    specials = {
        "bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "<unk>", "sep_token": "[SEP]",
        "pad_token": "<pad>", "cls_token": "[CLS]",
        # HF's ALBERT mask token swallows the space before it, as the official pieces do.
        "mask_token": {"content": "[MASK]", "lstrip": True, "rstrip": False,
                       "normalized": False, "single_word": False},
    }  # fmt: skip
    config = {
        "tokenizer_class": "AlbertTokenizer",
        "do_lower_case": bool(getattr(tokenizer, "lower", True)) if tokenizer else True,
        "remove_space": True,
        "keep_accents": False,
        **specials,
    }
    if max_seq_length:
        config["model_max_length"] = int(max_seq_length)
    return {"tokenizer_config.json": config, "special_tokens_map.json": specials}


def _fast_tokenizer_json(spm_path: str, tokenizer: Any) -> str | None:
    """`tokenizer.json` of the fast (Rust) tokenizer that `AutoTokenizer` and pipelines load,
    made to give our ids; None without transformers (HF then converts `spiece.model` itself).

    HF's own conversion differs from `data.tokenizer.Tokenizer` on real text (sentiment_rt dev:
    133 of 1109 sentences): it splits the sentencepiece model's user-defined pieces (`(`, `.`,
    `"`, ...) out of the text as added tokens before the model sees it (`(s` -> `(`, `▁s`
    where sentencepiece gives `▁`, `(`, `s`), and it rewrites ``` `` ``` / `''` as `"`, which
    the official ALBERT normalization (ours) does not. Both are undone here: only the special
    tokens stay added tokens (the unigram model keeps the other pieces, so its Viterbi search
    segments as sentencepiece does), and the quote rewrites leave the normalizer.
    """
    try:
        from transformers import AlbertTokenizer
        from transformers.convert_slow_tokenizer import convert_slow_tokenizer
    except ImportError:
        return None
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # the slow tokenizer reads a local file
        local = f"{tmp}/spiece.model"
        files.copy(spm_path, local)
        lower = bool(getattr(tokenizer, "lower", True)) if tokenizer else True
        fast = json.loads(
            convert_slow_tokenizer(AlbertTokenizer(local, do_lower_case=lower)).to_str()
        )
    fast["added_tokens"] = [t for t in fast["added_tokens"] if t["special"]]
    normalizers = fast["normalizer"]["normalizers"]
    quotes = [{"String": "``"}, {"String": "''"}]
    fast["normalizer"]["normalizers"] = [
        n for n in normalizers if not (n["type"] == "Replace" and n["pattern"] in quotes)
    ]
    return json.dumps(fast, ensure_ascii=False)


def export_hf_task_model(
    run: FineTunedRun,
    dst: str,
    *,
    run_seed: int | None = None,
    hf_class: str | None = None,
    tokenizer_path: str | None = None,
) -> dict[str, Any]:
    """Writes the fine-tuning `run`'s head as its HF task class into `dst` (see the module
    docstring); returns what was written: {"hf_class", "task", "kind", "step", "run_seed",
    "seed_choice" (why that seed, "" for a one-seed run), "tensors", "labels"}.

    Raises:
      ValueError: the run's head has no HF class (naming the heads that have), `hf_class`
        is not the run's, `run_seed` is not a seed of the run, the run has several seeds and
        no eval results to pick the best by, or no tokenizer.
    """
    if run.hf_class is None:
        have = ", ".join(f"{k} -> {v}" for k, v in HF_CLASSES.items())
        raise ValueError(
            f"{run.path}: its {run.kind} head (task {run.task!r}) has no HF transformers class; "
            f"heads that export: {have}"
        )
    if hf_class not in (None, run.hf_class):
        raise ValueError(
            f"--hf_class={hf_class}: {run.path} fine-tuned a {run.kind} head (task "
            f"{run.task!r}), which exports as {run.hf_class} only"
        )
    holder, seed, why = pick_seed(run, run_seed)
    checkpoint = read_checkpoint(holder.path, run_seed=seed)
    config, cls = checkpoint.config, run.hf_class
    entries = task_layout(config, cls, _head_width(run, cls))
    wanted = {e.path for e in entries}
    dropped = sorted(k for k in checkpoint.weights if k not in wanted)
    if dropped:  # e.g. the pooler, which HF's span model does not have
        log.info("%s: not part of %s, left out: %s", run.path, cls, dropped)
    params = unflatten_params({k: v for k, v in checkpoint.weights.items() if k in wanted})
    state = params_to_hf_state_dict(params, config, entries=entries)

    tokenizer_path = tokenizer_path or checkpoint.tokenizer_path
    if not tokenizer_path:
        raise ValueError(
            f"{run.path} has no tokenizer.model; pass --tokenizer=SPM.model (an HF task model "
            "without its tokenizer cannot be served by a pipeline)"
        )
    from safetensors.numpy import save

    directory = files.as_path(dst)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_task_config(run, config, cls, seed)
    files.write_json(directory / "config.json", hf_config, indent=2)
    # `format: pt` is what HF's loader expects in the safetensors metadata.
    files.write_atomic(directory / "model.safetensors", save(state, metadata={"format": "pt"}))
    files.copy(tokenizer_path, directory / "spiece.model")
    for name, content in _tokenizer_files(checkpoint.tokenizer, run.max_seq_length).items():
        files.write_json(directory / name, content, indent=2)
    fast = _fast_tokenizer_json(tokenizer_path, checkpoint.tokenizer)
    if fast is not None:
        files.write_atomic(directory / "tokenizer.json", fast)
    return {
        "hf_class": cls, "task": run.task, "kind": run.kind, "step": run.step,
        "run_seed": seed, "seed_choice": why, "tensors": len(state),
        "labels": hf_config.get("id2label"),
    }  # fmt: skip


def _head_width(run: FineTunedRun, hf_class: str) -> int:
    """The output width of the run's head as `hf_class`: the classifier's K labels (1:
    regression), one score per option (multiple choice), start and end (spans)."""
    return {"AlbertForMultipleChoice": 1, "AlbertForQuestionAnswering": 2}.get(
        hf_class, run.num_labels
    )
