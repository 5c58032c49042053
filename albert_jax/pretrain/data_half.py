"""Pretraining's data half (`loop.DataHalf`): the sharded training stream, whose position every
checkpoint saves (so restarts are bit-exact), and a fixed held-out set with its majority
baselines, evaluated with the model half's sums (`heldout`).

Any pretraining model half trains on it: the batch contract is the data pipeline's
(`model_half.pretraining_batch_shapes`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from albert_jax import metrics_writer
from albert_jax.pretrain.heldout import evaluate_batches, majority_accuracies


class PretrainingData:
    """The data half of pretraining (`loop.DataHalf`).

    Args:
      settings: the run's `pretrain.settings.PretrainingSettings` (its `data` section is the
        pipeline's `DataConfig`; `num_train_steps`, `eval_split`, `eval_batches`, the loop's
        `eval_every_steps` and the debug hooks' `nan_at_step`).
      tokenizer: the run's `data.tokenizer.Tokenizer`.
    """

    final_eval = False  # evaluation only every `eval_every_steps` (and then at the end)
    eval_progress_fields = tuple(
        (label, f"eval_{key}") for label, key in metrics_writer.PRETRAINING_FIELDS
    )

    def __init__(self, settings: Any, tokenizer: Any):
        self.settings, self.tokenizer = settings, tokenizer
        self.data = settings.data
        self.total_steps = settings.num_train_steps
        self.global_batch = self.data.batch_size
        self.nan_at = settings.loop.debug.nan_at_step
        self.iterator: Any = None
        self.eval_batches: list[dict[str, np.ndarray]] = []
        self.placed_eval_batches: list[dict[str, jax.Array]] | None = None  # on the devices
        self.baselines: dict[str, float] = {}

    def check_resume(self, saved_data: Any, step: int) -> None:
        del saved_data, step  # any data state works: a mismatch recounts the position

    def start(self, step: int, saved_data: Any, meta: Mapping[str, Any] | None) -> None:
        """Builds the training stream at `step` and the held-out set. The number of data
        shards fixes the batches; a resumed run keeps its checkpoint's."""
        from albert_jax.data import pipeline
        from albert_jax.data.data_config import sources_from_spec

        del meta
        settings, data, processes = self.settings, self.data, jax.process_count()
        doc_sources = sources_from_spec(data.sources, data.data_dir)
        where = dict(process_index=jax.process_index(), process_count=processes)
        self.iterator = pipeline.ShardedIterator.restore(
            data, self.tokenizer, doc_sources, step=step, saved=saved_data, **where
        )
        num_shards = self.iterator.num_shards
        logging.info("data: %d shards, %d per process", num_shards, num_shards // processes)
        if settings.loop.eval_every_steps > 0:
            self.eval_batches = list(
                pipeline.EvalBatches(
                    data, self.tokenizer, doc_sources, split=settings.eval_split,
                    num_batches=settings.eval_batches, num_shards=num_shards, **where,
                )
            )  # fmt: skip
            vocab = settings.model_config.vocab_size
            self.baselines = majority_accuracies(self.eval_batches, vocab)
            if data.objective == "none":  # no SOP prediction to compare with the baseline
                self.baselines.pop("eval_sop_majority_accuracy", None)
            if "eval_mlm_majority_accuracy" not in self.baselines:
                # (the baselines count every process's tokens: all processes agree)
                logging.warning(
                    "evaluation: split %r of %s has no real token to predict (%d batches of "
                    "padding only); no eval_mlm_* metric and no eval_loss will be recorded",
                    settings.eval_split, data.sources, len(self.eval_batches),
                )  # fmt: skip

    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        batch = next(self.iterator)
        del batch["pair_kind"]  # for evaluation diagnostics: the step never reads it
        if step == self.nan_at:  # debugging hook: NaN weights make the MLM loss NaN
            weights = np.full_like(batch["masked_lm_weights"], np.nan)
            batch = {**batch, "masked_lm_weights": weights}
        return batch

    def data_state(self, step: int) -> Any:
        """The training stream's position: every process's shard states, merged (the
        checkpoint's `data` item is written by process 0 only)."""
        from albert_jax.data.pipeline import merge_states

        del step  # the iterator is at the step being saved
        return merge_states(_every_process(self.iterator.get_state()))

    def meta(self) -> dict[str, Any]:
        return {"tokenizer_fingerprint": self.tokenizer.fingerprint}

    def place_eval_batches(self, put: Any, rows: int) -> list[dict[str, jax.Array]]:
        """The held-out batches on the devices (placed once, by `put` at `rows` rows)."""
        if self.placed_eval_batches is None:
            self.placed_eval_batches = [put(b, rows) for b in self.eval_batches]
        return self.placed_eval_batches

    def evaluate(self, params: Any, put: Any, eval_step: Any) -> dict[str, float]:
        batches = self.place_eval_batches(put, self.global_batch)
        metrics = evaluate_batches(eval_step, params, batches)
        return {**metrics, **self.baselines}  # only what was measured

    def close(self) -> None:
        if self.iterator is not None:
            self.iterator.close()


def _every_process(value: Any) -> list[Any]:
    """A JSON-able value of every process, in process order (just `[value]` in one process)."""
    if jax.process_count() == 1:
        return [value]
    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.int32(len(encoded)))))
    padded = np.zeros(length, np.uint8)
    padded[: len(encoded)] = encoded
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]
