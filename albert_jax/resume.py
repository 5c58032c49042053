"""Restoring a run: the checks a checkpoint must pass to be continued (`check_resumable`), the
newest checkpoint that restores (falling back past damaged ones) and params-only
initialization from another model. (The input pipeline's position is the
pipeline's own: `data.pipeline.ShardedIterator.restore`.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from albert_jax import checkpointing, trees

PyTree = Any


def check_resumable(
    objective: Any, settings: Any, path: str, step: int, data: Any, meta: Any
) -> None:
    """Refuses a checkpoint of another model (before its arrays are read: they would not
    fit), of another kind of run or vocabulary, and one whose data state the objective
    (`loop.Objective`; `settings`: the loop's) cannot continue."""
    _check_same_task(objective.model.task, path, step, meta)
    _check_same_tokenizer(objective.meta(), settings.tokenizer, path, step, meta)
    saved = meta.get("model_config") if isinstance(meta, Mapping) else None
    differ = objective.model.model_config.architecture_differences(saved or {})
    if isinstance(saved, Mapping) and differ:
        raise ValueError(
            f"cannot resume {path} at step {step}: its model differs from this config's "
            f"({'; '.join(differ)}); restore the model settings (config.json of that run, "
            "config.model.*, size) or use a new --workdir"
        )
    objective.data.check_resume(data, step)


def _check_same_tokenizer(
    ours_meta: Mapping[str, Any], given: str, path: str, step: int, meta: Any
) -> None:
    """Refuses checkpoints trained on another vocabulary. The workdir's tokenizer.model
    guards this while it exists; once it is gone, any sentencepiece model of the same size
    would train on (its ids mean other pieces), so the fingerprint saved with every
    checkpoint is what decides."""
    saved = meta.get("tokenizer_fingerprint") if isinstance(meta, Mapping) else None
    ours = ours_meta.get("tokenizer_fingerprint")
    if saved is None or ours is None or saved == ours:
        return
    given = given or "found for this run"
    raise ValueError(
        f"cannot resume {path} at step {step}: its checkpoints were trained with another "
        f"tokenizer than this run's ({given}; fingerprints {saved} and {ours}); put the "
        "run's own sentencepiece model back as WORKDIR/tokenizer.model or pass it as "
        "config.data.tokenizer, or start a new --workdir"
    )


def _check_same_task(ours: str | None, path: str, step: int, meta: Any) -> None:
    """Refuses checkpoints of another kind of run (pretraining / a fine-tuning task),
    naming both and the way that keeps them: they are healthy, only not this run's."""
    if not isinstance(meta, Mapping):
        return
    saved = meta.get("task")
    if saved == ours:
        return
    what = f"fine-tuning run of task {saved!r}" if saved else "pretraining run"
    this = f"fine-tunes task {ours!r}" if ours else "pretrains"
    if ours and not saved:
        fix = f"to fine-tune from it, pass --config.init={path} and a new --workdir"
    elif ours:
        fix = f"use a new --workdir (or --config.task={saved} to continue that run)"
    else:
        fix = "pretrain into a new --workdir"
    raise ValueError(
        f"cannot resume {path} at step {step}: it holds the checkpoints of a {what}, and "
        f"this config {this}; {fix}. Its checkpoints are fine: leave them in place"
    )


def restore_newest_intact(
    source: checkpointing.Checkpointer,
    newest: int,
    abstract_params: PyTree,
    abstract_opt_state: PyTree,
    check: Callable[[int, Any, Any], None],
    *,
    strict: bool,
    prune: bool,
) -> checkpointing.Restored:
    """The newest checkpoint of `source` at or before step `newest` that restores.

    A checkpoint whose items cannot be read (a truncated array file, an emptied JSON item) is
    reported with its directory and the reason, and the next older one is tried; with `strict`
    the run stops there instead. It never starts from scratch over unreadable checkpoints.
    With `prune` (the run's own workdir) the unreadable steps are deleted once an older one has
    restored: Orbax saves only steps after its latest, so a damaged step left in place would
    block every save up to it and be picked again by each restart.

    Args:
      source: the checkpoints to read.
      newest: the step to try first (the latest committed one).
      abstract_params / abstract_opt_state: restore targets (with shardings).
      check: `check(step, data, meta)` refuses (ValueError) a checkpoint this run cannot
        continue (another model, another data state). A refusal is about the config, not a
        damaged checkpoint: it stops the run.
      strict: stop at the first unreadable checkpoint (`config.resume_strict`).
      prune: delete the unreadable steps after a successful fallback.

    Raises:
      CheckpointError: `strict` and the newest checkpoint cannot be read, or none can be.
      ValueError: from `check`.
    """
    unreadable: list[tuple[int, str]] = []
    for step in sorted((s for s in source.all_steps() if s <= newest), reverse=True):
        where = source.step_dir(step)
        saved, reason = _agreed(_json_items, source, step)
        if reason is None:
            check(step, *saved)
            restored, reason = _agreed(source.restore, step, abstract_params, abstract_opt_state)
        if reason is None:
            break
        logging.error("checkpoint %s cannot be restored: %s", where, reason)
        if strict:
            raise checkpointing.CheckpointError(
                f"checkpoint {where} (step {step}) cannot be restored ({reason}); "
                "config.resume_strict=True stops here: repair or remove it, or unset "
                "resume_strict to resume from the newest earlier checkpoint that restores"
            )
        unreadable.append((step, reason))
    else:
        listed = "; ".join(f"step {s}: {r}" for s, r in unreadable) or "none committed"
        raise checkpointing.CheckpointError(
            f"no checkpoint under {source.directory} can be restored ({listed}); the run does "
            "not start from scratch over them: remove that directory to do so, or use "
            "another --workdir"
        )
    if unreadable:
        steps = [s for s, _ in unreadable]
        if prune:
            for bad in steps:
                source.delete(bad)
        logging.warning(
            "resumed from step %d, the newest checkpoint that restores; unreadable: %s (%s)",
            step, steps, "deleted" if prune else "left in place",
        )  # fmt: skip
    return restored


def _json_items(source: checkpointing.Checkpointer, step: int) -> tuple[Any, Any]:
    return source.read_json(step, "data"), source.read_json(step, "meta")


def _agreed(read: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """(read(*args), None), or (None, the reason it failed); with several processes, a failure
    on any of them counts for all, so that they all fall back to the same step."""
    try:
        value, reason = read(*args), None
    except Exception as e:  # Orbax, TensorStore, JSON and OS errors alike
        value, reason = None, checkpointing.describe_error(e)
    if jax.process_count() > 1:
        failed = multihost_utils.process_allgather(np.int32(reason is not None))
        if reason is None and np.any(failed):
            value, reason = None, "unreadable on another process"
    return value, reason


def load_params_only(path: str, abstract: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{"a/b/c": host array} of another model's params (any layout `load_pretrained` reads)
    for every weight of `abstract` ({"a/b/c": ShapeDtypeStruct}, the model of this config).

    An all-shared init fits a model of any depth (its weights have no layer axis: continued
    pretraining at another `config.model.num_hidden_layers`); one with per-layer weights fits
    only its own depth, and the error then says so.

    Raises:
      ValueError: a weight is missing or has another shape (all of them listed).
    """
    from albert_jax.pretrained import load_pretrained

    pretrained = load_pretrained(path)
    loaded = trees.flatten(pretrained.params)
    problems = [f"missing {k}" for k in abstract if k not in loaded]
    reshaped = [k for k, x in abstract.items() if k in loaded and loaded[k].shape != x.shape]
    problems += [f"{k}: checkpoint {loaded[k].shape}, model {abstract[k].shape}" for k in reshaped]
    if problems:
        raise ValueError(
            f"config.init_from={path!r} does not fit the model of this config: "
            + _depth_hint(pretrained.config, reshaped, loaded, abstract)
            + "; ".join(problems[:10])
            + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else "")
        )
    return {k: np.asarray(loaded[k]) for k in abstract}


def _depth_hint(
    init_config: Any, reshaped: list[str], loaded: Mapping[str, Any], abstract: Mapping[str, Any]
) -> str:
    """What to change when the only difference is the layer axis of per-layer encoder weights
    (a not-shared init at another depth), else ""."""
    layer_axis_only = reshaped and all(
        k.startswith("albert/encoder/") and loaded[k].shape[1:] == abstract[k].shape[1:]
        for k in reshaped
    )
    if not layer_axis_only:
        return ""
    return (
        f"the init keeps weights per layer (sharing={init_config.sharing!r}, "
        f"num_hidden_layers={init_config.num_hidden_layers}), so config.model.num_hidden_layers "
        "must stay at its depth (only an all-shared init runs at another depth); "
    )
