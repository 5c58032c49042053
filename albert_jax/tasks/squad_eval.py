"""SQuAD v1.1 and v2.0 evaluation, with the semantics of the official evaluation scripts.

  python -m albert_jax.tasks.squad_eval --data=dev-v2.0.json --predictions=predictions.json
      [--na_probs=null_odds.json] [--na_prob_thresh=1.0] [--squad_version=auto|1.1|2.0]

prints one JSON object: `exact_match`, `f1` (0–100), `total`, `missing_predictions`,
`version`, and for v2.0 data `HasAns_exact`, `HasAns_f1`, `HasAns_total`, `NoAns_exact`,
`NoAns_f1`, `NoAns_total` (each group present when it has questions) and, given na_probs,
`best_exact`, `best_exact_thresh`, `best_f1`, `best_f1_thresh`.

Scoring (Rajpurkar et al. 2016, 2018):
  * answers are normalized: lower-case, punctuation removed, the articles a / an / the removed,
    whitespace collapsed;
  * exact match: normalized prediction == normalized gold; F1: harmonic mean of token precision
    and recall over the bag of normalized tokens; each question takes the maximum over its gold
    answers; the dataset score is the mean over questions, times 100;
  * v2.0: a question without answers is unanswerable, its only gold answer is "" and the
    prediction "" (or anything that normalizes to "") scores 1; gold answers that normalize to
    "" are ignored; an empty prediction or gold scores F1 1 only if both are empty. v1.1 keeps
    every gold answer and scores F1 0 when there is no common token (even if both are empty).
  * with na_probs (P(no answer) per question), a question whose probability exceeds
    na_prob_thresh is predicted unanswerable; best_exact / best_f1 are the scores at the best
    such threshold, found as the official script does (see find_best_threshold).

Departures from the official scripts, both about bad inputs: a question without a prediction
is scored 0, counted in `total` and reported in `missing_predictions` (the v2.0 script leaves it
out of the total); and a predicted question missing from na_probs raises a ValueError (the
scripts raise KeyError).
"""

from __future__ import annotations

import collections
import json
import logging
import re
import string
from collections.abc import Mapping

from absl import app, flags

from albert_jax import files
from albert_jax.tasks import json_records

log = logging.getLogger(__name__)

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# ----------------------------------------------------------------------------- one answer
def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop articles, collapse whitespace: "The  Cat!" → "cat"."""
    text = text.lower()
    # Punctuation is deleted, not replaced by a space: "don't" → "dont", "3.5" → "35".
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 if the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str, *, empty_matches_empty: bool = True) -> float:
    """Bag-of-tokens F1 of the normalized answers.

    With no common token F1 is 0; if either side has no token at all, v2.0 scores 1.0 when both
    are empty (empty_matches_empty=True) and v1.1 scores 0.0 (empty_matches_empty=False).
    """
    prediction_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if empty_matches_empty and (not prediction_tokens or not gold_tokens):
        return float(prediction_tokens == gold_tokens)
    common = collections.Counter(prediction_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


# ----------------------------------------------------------------------------- dataset
def detect_version(dataset_json: Mapping) -> str:
    """ "2.0" if the file says so or has unanswerable questions (is_impossible / no answers)."""
    declared = str(dataset_json.get("version", ""))
    if declared.lstrip("v").startswith("2"):
        return "2.0"
    for qa in _questions(dataset_json):
        if "is_impossible" in qa or not qa.get("answers"):
            return "2.0"
    return "1.1"


def _questions(dataset_json: Mapping):
    data = dataset_json.get("data")
    if not isinstance(data, list):
        raise ValueError("dataset_json: not SQuAD JSON: expected a top-level 'data' list")
    for i, article in enumerate(data):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise ValueError(f"dataset_json: data[{i}] has no 'paragraphs' list")
        for j, paragraph in enumerate(paragraphs):
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(qas, list):
                raise ValueError(f"dataset_json: data[{i}].paragraphs[{j}] has no 'qas' list")
            for qa in qas:
                if not isinstance(qa, dict) or not isinstance(qa.get("id"), str):
                    raise ValueError(f"dataset_json: a question in data[{i}] has no string 'id'")
                yield qa


def _gold_answers(qa: Mapping, version: str) -> list[str]:
    texts = [answer["text"] for answer in qa.get("answers", [])]
    if version == "1.1":
        return texts
    texts = [t for t in texts if normalize_answer(t)]
    return texts or [""]


def find_best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_answer: Mapping[str, bool],
    total: int,
) -> tuple[float, float]:
    """(best score in %, threshold): the official script's search over na_prob thresholds.

    Start from "every question abstains" (each unanswerable one scores 1), then answer the
    questions in increasing order of na_prob (ties in na_probs order): answering an answerable
    question adds its raw score, answering an unanswerable one costs 1 if the prediction is a
    non-empty string (as in the official script, even if it normalizes to ""). The best running
    score and the na_prob of the last question answered at that point are returned. scores: raw
    scores of the predicted questions; total counts all questions (missing ones score 0).
    """
    score = float(sum(1 for qid in scores if not has_answer[qid]))
    best_score, best_threshold = score, 0.0
    # Stable sort of na_probs' own key order: questions with equal na_prob are taken in the
    # order the na_probs file lists them, as in the official script.
    for qid in sorted((q for q in na_probs if q in scores), key=lambda q: na_probs[q]):
        if has_answer[qid]:
            score += scores[qid]
        elif predictions[qid]:
            score -= 1.0
        if score > best_score:
            best_score, best_threshold = score, float(na_probs[qid])
    return 100.0 * best_score / total, best_threshold


def _mean_percent(values: list[float]) -> float:
    return 100.0 * sum(values) / len(values)


def evaluate(
    dataset_json: dict,
    predictions: dict[str, str],
    na_probs: dict[str, float] | None = None,
    na_prob_thresh: float = 1.0,
    *,
    version: str | None = None,
) -> dict:
    """Scores predictions {question id: answer text} against a SQuAD JSON dataset.

    na_probs: {question id: P(no answer)} (needed for best_exact / best_f1); na_prob_thresh:
    a question whose na_prob exceeds it is predicted unanswerable. version: "1.1", "2.0" or
    None (detect_version). Returns the dictionary described in the module docstring.
    """
    version = version or detect_version(dataset_json)
    if version not in ("1.1", "2.0"):
        raise ValueError(f"version must be '1.1' or '2.0', got {version!r}")
    if not isinstance(predictions, Mapping):
        raise ValueError("predictions must be a JSON object {question id: answer text}")
    exact_scores: dict[str, float] = {}  # raw, predicted questions only
    f1_scores: dict[str, float] = {}
    has_answer: dict[str, bool] = {}
    missing: list[str] = []
    for qa in _questions(dataset_json):
        qid = qa["id"]
        # As the official script: answerable means the file lists answers for it.
        has_answer[qid] = bool(qa.get("answers"))
        if qid not in predictions:
            missing.append(qid)
            continue
        prediction = predictions[qid]
        if not isinstance(prediction, str):
            raise ValueError(f"predictions[{qid!r}] must be a string, got {type(prediction)}")
        golds = _gold_answers(qa, version)
        if not golds:
            raise ValueError(f"question {qid!r} has no gold answers: v1.1 rules need one")
        exact_scores[qid] = max(exact_match(prediction, g) for g in golds)
        f1_scores[qid] = max(
            token_f1(prediction, g, empty_matches_empty=version == "2.0") for g in golds
        )
    if not has_answer:
        raise ValueError("dataset_json has no questions")
    if missing:
        log.warning(
            "%d of %d questions have no prediction and score 0 (first: %s)",
            len(missing),
            len(has_answer),
            missing[:5],
        )

    if na_probs is not None:
        absent = [qid for qid in exact_scores if qid not in na_probs]
        if absent:
            raise ValueError(
                f"na_probs has no entry for {len(absent)} predicted questions, e.g. {absent[:3]}"
            )
        for qid in exact_scores:
            p = na_probs[qid]
            # NaN would make the threshold search order meaningless.
            if isinstance(p, bool) or not isinstance(p, int | float) or p != p:
                raise ValueError(f"na_probs[{qid!r}] must be a number, got {p!r}")

    def thresholded(raw: dict[str, float]) -> dict[str, float]:
        """Scores after predicting "no answer" where na_prob > na_prob_thresh; missing → 0."""
        out = {}
        for qid, answerable in has_answer.items():
            if qid not in raw:
                out[qid] = 0.0
            elif na_probs is not None and na_probs[qid] > na_prob_thresh:
                out[qid] = float(not answerable)
            else:
                out[qid] = raw[qid]
        return out

    exact_final = thresholded(exact_scores)
    f1_final = thresholded(f1_scores)
    total = len(has_answer)
    result: dict = {
        "exact_match": _mean_percent(list(exact_final.values())),
        "f1": _mean_percent(list(f1_final.values())),
        "total": total,
        "missing_predictions": len(missing),
        "version": version,
    }
    if version == "2.0":
        for prefix, group in (("HasAns", True), ("NoAns", False)):
            qids = [q for q, answerable in has_answer.items() if answerable == group]
            if qids:
                result[f"{prefix}_exact"] = _mean_percent([exact_final[q] for q in qids])
                result[f"{prefix}_f1"] = _mean_percent([f1_final[q] for q in qids])
                result[f"{prefix}_total"] = len(qids)
    if na_probs is not None:
        for name, raw in (("exact", exact_scores), ("f1", f1_scores)):
            best, threshold = find_best_threshold(predictions, raw, na_probs, has_answer, total)
            result[f"best_{name}"] = best
            result[f"best_{name}_thresh"] = threshold
    return result


# ----------------------------------------------------------------------------- CLI
FLAGS = flags.FLAGS


def define_flags() -> None:
    """Registers the CLI flags; called only when run as a program, so that importing
    evaluate() from a training binary adds nothing to that binary's flags."""
    flags.DEFINE_string("data", None, "SQuAD v1.1 / v2.0 dataset JSON (may be gzip'ed).")
    flags.DEFINE_string(
        "predictions", None, "JSON object {question id: predicted answer text} (may be gzip'ed)."
    )
    flags.DEFINE_string(
        "na_probs",
        None,
        "Optional JSON object {question id: probability of no answer}; adds best_exact, "
        "best_f1 and their thresholds, and enables --na_prob_thresh.",
    )
    flags.DEFINE_float(
        "na_prob_thresh",
        1.0,
        "Predict 'no answer' for questions whose na_prob exceeds this (needs --na_probs).",
    )
    flags.DEFINE_enum(
        "squad_version", "auto", ["auto", "1.1", "2.0"], "Scoring rules; auto reads the data."
    )


def _load_json(path: str, what: str):
    """A (gzip'ed) JSON file, local or gs://; an unreadable one is a usage error naming the
    flag (the message of `json_records.read_json` names the file, line and column)."""
    if not files.as_path(path).is_file():
        raise app.UsageError(f"--{what}={path}: no such file")
    try:
        return json_records.read_json(path)
    except (OSError, ValueError) as e:
        raise app.UsageError(f"--{what}: {e}") from e


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for name in ("data", "predictions"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    dataset_json = _load_json(FLAGS.data, "data")
    predictions = _load_json(FLAGS.predictions, "predictions")
    na_probs = _load_json(FLAGS.na_probs, "na_probs") if FLAGS.na_probs else None
    version = None if FLAGS.squad_version == "auto" else FLAGS.squad_version
    result = evaluate(dataset_json, predictions, na_probs, FLAGS.na_prob_thresh, version=version)
    print(json.dumps(result))


if __name__ == "__main__":
    from albert_jax.runtime import cli

    define_flags()
    cli.run(main)
