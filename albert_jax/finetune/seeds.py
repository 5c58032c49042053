"""Several fine-tuning seeds in one program: their batches, their summary and their failures.

`config.num_seeds = N` runs seeds `seed, seed + 1, ..., seed + N - 1` as one compiled program
(`train_state.py`: a leading seed axis on the state, the update under `jax.vmap`). Seed i
draws its head init, dropout and data order from `seed + i`, so it is the run a one-seed
config with `seed + i` would make. This module holds what is about seeds, not about the loop:

- `interleave`: the N seeds' batches of a step as one batch [B * N, ...] (row b of seed i at
  b * N + i), the layout the seeded step splits without communication.
- `summarize`: eval_results.json's per-seed metrics with `median`, `mean`, `std`, `min`, `max`
  of each metric and `failed_seeds`: seeds that diverged (non-finite parameters) or ended at
  the level of a constant predictor (`failure`) — ALBERT's known fine-tuning failure, a run
  stuck at the majority class.
- `merge_restarted`: those results with the failed seeds replaced by a run of fresh ones
  (`config.restart_failed_seeds`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

STATISTICS = ("median", "mean", "std", "min", "max")

# A seed "at chance" scores at most this much above the constant predictor: one point on the
# metric's scale (accuracies are fractions, SQuAD's EM / F1 percentages).
_MARGIN = 0.01
_SQUAD_MARGIN = 1.0
# |Pearson| below this: a regression head that learned nothing (a constant has none at all).
_MIN_CORRELATION = 0.1


def seeds_of(seed: int, num_seeds: int) -> list[int]:
    return [int(seed) + i for i in range(int(num_seeds))]


def interleave(batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """N batches {name: [B, ...]} → one {name: [B * N, ...]} with row b of batch i at
    b * N + i (one batch is returned as it is)."""
    if len(batches) == 1:
        return dict(batches[0])
    return {
        k: np.stack([b[k] for b in batches], axis=1).reshape(-1, *batches[0][k].shape[1:])
        for k in batches[0]
    }


def failure(metrics: Mapping[str, Any]) -> str | None:
    """Why a seed's metrics are at the level of a constant predictor, or None.

    Each task kind's `score` reports its own baseline: classification `majority_accuracy`
    (always the most frequent label), multiple choice `chance_accuracy`, SQuAD v2 the share of
    unanswerable questions (always answering ""); SQuAD v1 and regression have 0. With several
    eval sets (metric names "<set>/..."), a seed fails when any of its sets does.
    """
    groups: dict[str, dict[str, Any]] = {}
    for name, value in metrics.items():
        prefix, _, metric = name.rpartition("/")
        groups.setdefault(prefix, {})[metric] = value
    for prefix, group in sorted(groups.items()):
        reason = _set_failure(group)
        if reason:
            return f"{prefix}: {reason}" if prefix else reason
    return None


def _set_failure(m: Mapping[str, Any]) -> str | None:
    def number(name: str) -> float | None:
        value = m.get(name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok and math.isfinite(value) else None

    accuracy = number("accuracy")
    for baseline in ("majority_accuracy", "chance_accuracy"):
        level = number(baseline)
        if accuracy is not None and level is not None and accuracy <= level + _MARGIN:
            return f"accuracy {accuracy:.4f} <= {baseline} {level:.4f} + {_MARGIN}"
    pearson = number("pearson")
    if "pearson" in m and (pearson is None or abs(pearson) < _MIN_CORRELATION):
        return f"pearson {m['pearson']} below {_MIN_CORRELATION} in magnitude"
    f1, total = number("f1"), number("total")
    if f1 is not None and total:
        null_f1 = 100.0 * (number("NoAns_total") or 0.0) / total  # answering "" everywhere
        if f1 <= null_f1 + _SQUAD_MARGIN:
            return f"f1 {f1:.2f} <= {null_f1:.2f} (no answer everywhere) + {_SQUAD_MARGIN}"
    return None


def summarize(
    per_seed: Mapping[int, Mapping[str, Any]], finite: Mapping[int, bool]
) -> dict[str, Any]:
    """eval_results.json of N seeds.

    Args:
      per_seed: {seed: that seed's results (metrics and counts, as a one-seed run reports)}.
      finite: {seed: whether its parameters are all finite at the end}.
    Returns:
      {"num_seeds", "seeds", "per_seed": {"<seed>": results}, "median" / "mean" / "std" /
      "min" / "max": {metric: value over the seeds} (numeric metrics; std is the population
      std), "failed_seeds": [{"seed", "reason"}]}. A diverged seed's NaN metrics count in
      none of the statistics.
    """
    seeds = list(per_seed)
    names = [k for k, v in per_seed[seeds[0]].items() if is_number(v)]
    stats: dict[str, dict[str, float]] = {s: {} for s in STATISTICS}
    for name in names:
        values = np.array([float(per_seed[s][name]) for s in seeds if finite[s]], np.float64)
        values = values[np.isfinite(values)]
        if not len(values):
            continue
        for stat, fn in zip(STATISTICS, (np.median, np.mean, np.std, np.min, np.max), strict=True):
            stats[stat][name] = float(fn(values))
    failed = []
    for s in seeds:
        reason = "diverged (non-finite parameters)" if not finite[s] else failure(per_seed[s])
        if reason:
            failed.append({"seed": s, "reason": reason})
    return {
        "num_seeds": len(seeds),
        "seeds": seeds,
        "per_seed": {str(s): dict(per_seed[s]) for s in seeds},
        **stats,
        "failed_seeds": failed,
    }


def merge_restarted(results: Mapping[str, Any], rerun: Mapping[str, Any]) -> dict[str, Any]:
    """`results` of a run with `failed_seeds`, with the `rerun` of as many fresh seeds in
    their place: `per_seed` and the statistics over the kept and the new seeds,
    `replaced_seeds` [{"seed", "reason", "replaced_by", "metrics"}], `failed_seeds` those of
    the new seeds that failed too, the prediction files of both."""
    failed = results["failed_seeds"]
    dropped = {f["seed"] for f in failed}
    per_seed = {int(s): v for s, v in results["per_seed"].items() if int(s) not in dropped}
    per_seed.update({int(s): v for s, v in rerun["per_seed"].items()})
    diverged = {f["seed"] for f in rerun["failed_seeds"] if f["reason"].startswith("diverged")}
    merged = summarize(per_seed, {s: s not in diverged for s in per_seed})
    merged["replaced_seeds"] = [
        {**f, "replaced_by": int(s), "metrics": results["per_seed"][str(f["seed"])]}
        for f, s in zip(failed, rerun["seeds"], strict=True)
    ]
    files = list(results.get("prediction_files", [])) + list(rerun.get("prediction_files", []))
    return {**results, **merged, "prediction_files": files}


def is_number(value: Any) -> bool:
    """A metric value (int or float, not bool): what the statistics and logs take."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
