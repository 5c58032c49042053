"""The data of one fine-tuning run: its examples read and featurized, the packing decision, the
training batch of every step and the evaluation batches — fine-tuning's counterpart of
pretraining's data pipeline, what fine-tuning's data half (`finetune.train.FineTuningData`)
trains and scores on.

Batch s is a pure function of (training features, seed, s, packing decision): `batch(s)`
rebuilds it from nothing, so a resumed run sees exactly the batches of an uninterrupted one,
and `state(s)` is what a checkpoint keeps to check that (`check_resume`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from absl import logging

from albert_jax.finetune import seeds
from albert_jax.model import heads
from albert_jax.sharding import process_rows
from albert_jax.tasks import packing, registry
from albert_jax.tasks.batching import bucket_lengths, eval_batches, train_batch, trim_to_bucket
from albert_jax.tasks.records import ReadStats

Batch = dict[str, np.ndarray]


class TaskData:
    """The task's training and evaluation features and their batches.

    Attributes read by the objective: `train_set` / `eval_sets` (the examples read, with their
    counts), `train_features` / `eval_features`, `total_steps` (the schedule's updates),
    `init_batch` ({name: [rows, ...]} the init runs on) and `packing` (whether training rows
    are packed).
    """

    def __init__(self, config: Any, kind: Any, tokenizer: Any, run_seeds: list[int], rows: int,
                 processes: int):  # fmt: skip
        """`rows`: the mesh's (data × fsdp) shards, which split every batch; `processes`: the
        processes that each put their part of it."""
        self.config, self.kind, self.seeds = config, kind, run_seeds
        start = time.perf_counter()
        eval_only = config.num_train_steps == 0 and config.num_train_epochs <= 0
        if eval_only and not config.data.train_files:
            self.train_set = registry.EvalSet("", [], ReadStats())
        else:
            self.train_set = registry.read_train(config.task, config.data)
        self.eval_sets = registry.read_eval(config.task, config.data)
        self.train_features = registry.featurize(
            config.task, self.train_set.examples, tokenizer, config
        )
        self.eval_features = [
            registry.featurize(config.task, s.examples, tokenizer, config) for s in self.eval_sets
        ]
        logging.info(
            "read and featurized %d train / %s eval examples in %.1fs",
            len(self.train_set.examples),
            [len(s.examples) for s in self.eval_sets],
            time.perf_counter() - start,
        )
        for eval_set, features in zip(self.eval_sets, self.eval_features, strict=True):
            if not len(features):  # found now, not after training
                raise ValueError(f"eval set {eval_set.name!r} has no examples")
        self.total_steps = self._num_train_steps()
        if len(self.train_features) == 0 and self.total_steps > 0:
            raise ValueError(f"no training examples for task {config.task!r}")
        self.train_fingerprint = self.train_features.fingerprint()
        self.train_arrays = {k: self.train_features.arrays[k] for k in kind.model_inputs}
        features = self.train_features if len(self.train_features) else self.eval_features[0]
        self.init_batch = {k: features.arrays[k][:1].repeat(rows, 0) for k in kind.model_inputs}
        self.buckets = bucket_lengths(config.max_seq_length)
        self.lengths_seen: set[int] = set()  # length buckets compiled so far
        self.packed_shapes: set[packing.PackPlan] = set()  # packed training shapes so far
        # Packed rows per seed: a multiple of the data shards and processes that split them,
        # and no coarser: on sentiment_rt at batch 32, multiples of 4 rows cost 8% more tokens
        # than multiples of 1 (32.4 against 30.0 a row) for 2 shapes instead of 4.
        self.row_granularity = math.lcm(rows, processes)
        self.packing = self._packs(config.pack_examples)

    def _num_train_steps(self) -> int:
        config = self.config
        if config.num_train_epochs > 0:
            return int(
                math.ceil(config.num_train_epochs * len(self.train_features) / config.batch_size)
            )
        return int(config.num_train_steps)

    def _packs(self, wanted: bool | None) -> bool:
        """Whether training batches are packed: `config.pack_examples`, or with None (auto)
        whether packed rows of the first steps' batches of `config.seed` hold at most
        `packing.AUTO_MAX_PACKED_SHARE` of their unpacked tokens. A function of the config,
        the training features and the row granularity (the mesh), the same on every process
        and for any `num_seeds`; a resume keeps the decision its checkpoint recorded
        (`resume_packing`)."""
        if not self.kind.packable or self.total_steps == 0:
            return False
        if wanted is not None:
            return bool(wanted)
        steps = [
            [train_batch(self.train_arrays, step, int(self.config.batch_size),
                         int(self.config.seed))]
            for step in range(min(packing.AUTO_SAMPLE_STEPS, self.total_steps))
        ]  # fmt: skip
        share = packing.packed_share(
            steps, self.config.max_seq_length, self.row_granularity, self.config.length_buckets
        )
        packs = share <= packing.AUTO_MAX_PACKED_SHARE
        logging.info(
            "pack_examples=None (auto): packed rows would hold %.2f of the tokens of the first "
            "%d steps' batches unpacked: packing %s (on at <= %.2f)", share, len(steps),
            "on" if packs else "off", packing.AUTO_MAX_PACKED_SHARE,
        )  # fmt: skip
        return packs

    # ---------------------------------------------------------------------------- position
    def state(self, step: int) -> dict[str, Any]:
        """What decides the training batches after `step`, saved in every checkpoint.

        Batch s is `train_batch(features, s, batch_size, seed)`, a pure function of these, so
        a resumed run continues the exact data order of an uninterrupted one; the fingerprint
        of the training features makes a resume on other data (other files, tokenizer or
        featurization settings) an error instead of a silent change.
        """
        return {
            "step": int(step),
            "seed": int(self.config.seed),
            "num_seeds": len(self.seeds),
            "batch_size": int(self.config.batch_size),
            "num_train_steps": int(self.total_steps),
            "num_train_features": len(self.train_features),
            "train_fingerprint": self.train_fingerprint,
            "packed": self.packing,  # auto's decision, kept on resume (`resume_packing`)
        }

    def check_resume(self, saved: Any, step: int, workdir: str) -> None:
        """Refuses a checkpoint's data state (`state`) that differs from this run's."""
        expected = self.state(step)
        if not isinstance(saved, dict):
            raise ValueError(f"{workdir}: checkpoint {step} has no data state: {saved!r}")
        differ = sorted(
            k for k, v in expected.items() if k in saved and saved[k] != v and k != "packed"
        )
        if differ:
            details = ", ".join(f"{k}: saved {saved[k]!r}, now {expected[k]!r}" for k in differ)
            raise ValueError(
                f"cannot resume {workdir} at step {step}: the run's data or schedule "
                f"changed ({details}); restore the config (config.json in the workdir) or use "
                "a new --workdir"
            )

    def resume_packing(self, saved: Any) -> None:
        """Keeps the packing decision of the checkpoint's state: batches are a pure function
        of the step and of that decision, and a run resumed on another mesh could decide
        otherwise; a forced `pack_examples` is the user's to change."""
        saved_packing = saved.get("packed") if isinstance(saved, dict) else None
        if saved_packing is not None and self.config.pack_examples is None:
            if bool(saved_packing) != self.packing:
                logging.info("resumed with the checkpoint's packing decision: %s", saved_packing)
            self.packing = bool(saved_packing)

    # ----------------------------------------------------------------------------- batches
    def batch(self, step: int) -> Batch:
        """This process's rows of update `step`'s (1-based) batch: each seed's batch of
        `batch_size` rows [rows, ...], packed or cut to its length bucket, seeds interleaved."""
        rows = int(self.config.batch_size)
        batches = [train_batch(self.train_arrays, step - 1, rows, seed) for seed in self.seeds]
        if self.packing:
            return process_rows(seeds.interleave(self._pack(batches)))
        return process_rows(self._cut(seeds.interleave(batches)))

    def _pack(self, batches: list[Batch]) -> list[Batch]:
        """Each seed's batch packed (tasks/packing.py) into the step's one shape; each new
        shape is logged with the count so far (bounded, see the module)."""
        plan, placements = packing.plan_packing(
            batches, self.config.max_seq_length, self.row_granularity
        )
        if plan not in self.packed_shapes:
            self.packed_shapes.add(plan)
            tokens = sum(int(b["input_mask"].sum()) for b in batches)
            logging.info(
                "packed shape %d rows x %d tokens (%.0f%% real tokens): compiled shapes %d "
                "(%s)", plan.rows, plan.row_length,
                100 * tokens / (plan.rows * plan.row_length * len(batches)),
                len(self.packed_shapes), sorted(self.packed_shapes),
            )  # fmt: skip
        return [packing.pack_batch(b, plan, p) for b, p in zip(batches, placements, strict=True)]

    def _cut(self, batch: Batch) -> Batch:
        """The global batch cut to its length bucket (`config.length_buckets`); each new
        length is one more compiled shape, at most `len(bucket_lengths(max_seq_length))`."""
        if not self.config.length_buckets:
            return batch
        batch, length = trim_to_bucket(batch, self.kind.sequence_inputs)
        if length not in self.lengths_seen:
            self.lengths_seen.add(length)
            logging.info(
                "length bucket %d: compiled shapes %d of at most %d (%s)", length,
                len(self.lengths_seen), len(self.buckets), sorted(self.lengths_seen),
            )  # fmt: skip
        return batch

    # -------------------------------------------------------------------------- evaluation
    def eval_outputs(
        self, features: Any, run: Callable[[Batch, int], Mapping[str, np.ndarray]]
    ) -> dict[str, np.ndarray]:
        """The model's outputs on every row of an eval set's `features`, in feature order:
        {name: [rows, ...]} (N seeds: [rows, N, ...]). `run(batch, rows)` computes one batch
        of `rows` rows (this process's part given; the outputs of all rows returned).

        Rows go shortest first, so that batches of alike lengths share a short bucket, and
        are put back in feature order; padding rows are dropped."""
        arrays = {k: features.arrays[k] for k in self.kind.predict_inputs}  # labels stay here
        order = self._eval_order(arrays)
        arrays = {k: v[order] for k, v in arrays.items()}
        gathered: dict[str, list[np.ndarray]] = {}
        for batch in eval_batches(arrays, self.config.eval_batch_size):
            real = batch.pop("example_weight") > 0
            out = run(process_rows(self._cut(batch)), len(real))
            for k, v in out.items():
                gathered.setdefault(k, []).append(self._uncut(k, np.asarray(v)[real]))
        return {k: np.concatenate(v)[np.argsort(order)] for k, v in gathered.items()}

    def _eval_order(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """Feature rows by real length (stable), or as they are without length buckets."""
        mask = arrays["input_mask"]
        if not self.config.length_buckets:
            return np.arange(len(mask))
        return np.argsort(mask.reshape(len(mask), -1).sum(axis=1), kind="stable")

    def _uncut(self, name: str, value: np.ndarray) -> np.ndarray:
        """An output of a cut batch with its sequence axis padded back to max_seq_length, as
        the head masks padding positions (`heads.MASKED_LOGIT`)."""
        width = self.config.max_seq_length - value.shape[-1]
        if name not in self.kind.sequence_outputs or width == 0:
            return value
        pad = [(0, 0)] * (value.ndim - 1) + [(0, width)]
        return np.pad(value, pad, constant_values=heads.MASKED_LOGIT)

    # ------------------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """What was read, kept, skipped and featurized, and whether training rows were
        packed (eval_results.json's `data`)."""

        def read(stats: Any) -> dict[str, Any]:
            return {"read": stats.read, "kept": stats.kept, "skipped": dict(stats.skipped),
                    "first_skipped": dict(stats.first_skipped),  # where: "file:line"
                    "adjusted": dict(stats.adjusted)}  # fmt: skip

        return {
            "train": {
                "files": self.train_set.name,
                **read(self.train_set.stats),
                "featurization": self.train_features.stats.as_dict(),
                "packed": self.packing,  # config.pack_examples, or what auto decided
            },
            "eval": [
                {"set": s.name, **read(s.stats), "featurization": f.stats.as_dict()}
                for s, f in zip(self.eval_sets, self.eval_features, strict=True)
            ],
        }

    def eval_pairs(self) -> Iterable[tuple[Any, Any]]:
        """(eval set, its features) of each eval set, in the config's order."""
        return zip(self.eval_sets, self.eval_features, strict=True)
