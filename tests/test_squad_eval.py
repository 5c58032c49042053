"""SQuAD evaluator: hand-computed cases, a real SQuAD-Shifts file, and the CLI."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from albert_jax.tasks import squad_eval
from albert_jax.tasks.squad_eval import evaluate, exact_match, normalize_answer, token_f1

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dataset(qas, version="v2.0"):
    return {
        "version": version,
        "data": [{"title": "T", "paragraphs": [{"context": "c", "qas": qas}]}],
    }


def _qa(qid, *golds):
    return {"id": qid, "question": "?", "answers": [{"text": g, "answer_start": 0} for g in golds]}


def test_normalization():
    assert normalize_answer("The Cat") == "cat"  # case, leading article
    assert normalize_answer("  a   dog\tand\nAN owl ") == "dog and owl"  # articles, whitespace
    assert normalize_answer("theory of the anthem") == "theory of anthem"  # whole words only
    assert normalize_answer("U.S.A., (1999)!") == "usa 1999"  # punctuation deleted, not spaced
    assert normalize_answer("don't") == "dont"
    assert normalize_answer("the") == ""
    assert exact_match("The Eiffel Tower.", "eiffel   tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0


def test_token_f1_by_hand():
    # "the quick brown fox" → [quick, brown, fox]; "a quick red fox jumps" → [quick, red, fox,
    # jumps]; 2 common tokens: precision 2/3, recall 2/4, F1 = 2·(2/3)(1/2) / (2/3 + 1/2) = 4/7.
    assert token_f1("the quick brown fox", "a quick red fox jumps") == pytest.approx(4 / 7)
    # Bag of tokens: "fox fox fox" vs "fox fox" share 2 → P = 2/3, R = 1, F1 = 0.8.
    assert token_f1("fox fox fox", "fox fox") == pytest.approx(0.8)
    assert token_f1("red", "blue") == 0.0
    # Empty sides: v2.0 scores empty vs empty as a match, v1.1 as no overlap.
    assert token_f1("", "the") == 1.0
    assert token_f1("", "the", empty_matches_empty=False) == 0.0
    assert token_f1("", "cat") == 0.0


def test_max_over_gold_answers():
    qas = [_qa("q1", "Denver Broncos", "Broncos of Denver")]
    result = evaluate(_dataset(qas, "1.1"), {"q1": "Broncos"})
    # EM: no gold normalizes to "broncos". F1: vs "Denver Broncos" P = 1, R = 1/2 → 2/3;
    # vs "Broncos of Denver" P = 1, R = 1/3 → 1/2; the maximum is 2/3.
    assert result["exact_match"] == 0.0
    assert result["f1"] == pytest.approx(100 * 2 / 3)
    result = evaluate(_dataset(qas, "1.1"), {"q1": "the broncos of  Denver!"})
    assert result["exact_match"] == result["f1"] == 100.0
    assert result["version"] == "1.1" and "HasAns_exact" not in result


def _v2_example():
    """Two answerable and two unanswerable questions, scored by hand in the tests below."""
    qas = [
        _qa("q1", "Paris"),
        _qa("q2", "42 apples", "forty-two apples"),
        {"id": "q3", "question": "?", "answers": [], "is_impossible": True},
        {"id": "q4", "question": "?", "answers": [], "is_impossible": True},
    ]
    predictions = {"q1": "paris", "q2": "42", "q3": "", "q4": "something"}
    # Raw scores: q1 EM 1 F1 1; q2 EM 0, F1 vs "42 apples" = 2·1·(1/2)/(3/2) = 2/3;
    # q3 (no answer, predicted "") 1 / 1; q4 (no answer, predicted text) 0 / 0.
    na_probs = {"q1": 0.1, "q2": 0.6, "q4": 0.7, "q3": 0.9}
    return _dataset(qas), predictions, na_probs


def test_v2_no_answer_breakdown():
    dataset, predictions, _ = _v2_example()
    result = evaluate(dataset, predictions)
    assert result["version"] == "2.0"
    assert result["exact_match"] == pytest.approx(100 * 2 / 4)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0) / 4)
    assert result["HasAns_exact"] == pytest.approx(50.0)
    assert result["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert result["NoAns_exact"] == result["NoAns_f1"] == pytest.approx(50.0)
    assert result["HasAns_total"] == result["NoAns_total"] == 2 and result["total"] == 4
    assert result["missing_predictions"] == 0 and "best_f1" not in result


def test_v2_thresholds():
    dataset, predictions, na_probs = _v2_example()
    result = evaluate(dataset, predictions, na_probs)
    assert result["exact_match"] == pytest.approx(50.0)  # default threshold 1.0 changes nothing
    # Best threshold, walking na_prob upwards from "all abstain" (score 2 = the two NoAns):
    #   EM: q1 +1 → 3 (best, at 0.1); q2 +0 → 3; q4 −1 → 2; q3 +0 → 2.
    #   F1: q1 +1 → 3; q2 +2/3 → 3.67 (best, at 0.6); q4 −1; q3 +0.
    assert result["best_exact"] == pytest.approx(75.0)
    assert result["best_exact_thresh"] == pytest.approx(0.1)
    assert result["best_f1"] == pytest.approx(100 * (3 + 2 / 3) / 4)
    assert result["best_f1_thresh"] == pytest.approx(0.6)

    # Threshold 0.5 makes q2, q4, q3 "no answer": q2 → 0, q4 → 1, q3 → 1, q1 stays 1.
    result = evaluate(dataset, predictions, na_probs, na_prob_thresh=0.5)
    assert result["exact_match"] == result["f1"] == pytest.approx(75.0)
    assert result["HasAns_f1"] == pytest.approx(50.0) and result["NoAns_exact"] == 100.0


def test_missing_predictions_count_as_wrong():
    dataset, predictions, na_probs = _v2_example()
    del predictions["q1"]
    result = evaluate(dataset, predictions, na_probs)
    assert result["missing_predictions"] == 1 and result["total"] == 4
    assert result["exact_match"] == pytest.approx(25.0)  # only q3 right, out of 4
    assert result["best_exact"] == pytest.approx(50.0)  # start 2/4; nothing improves on it
    with pytest.raises(ValueError, match="na_probs has no entry"):
        evaluate(dataset, predictions, {"q2": 0.5})
    with pytest.raises(ValueError, match=r"predictions\['q2'\] must be a string"):
        evaluate(dataset, {"q2": ["42"]})


def _load_json_gz(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def test_gold_answers_score_100_on_squad_shifts(shared_data):
    dataset = _load_json_gz(os.path.join(shared_data, "tasks/squad_shifts/new_wiki_v1.0.json.gz"))
    # The first gold answer that keeps a token after normalization: under v1.1 rules an answer
    # that normalizes to "" (e.g. the letter grade "A", an article) scores F1 0 even against
    # itself, as in the official script.
    golds = {
        qa["id"]: next(a["text"] for a in qa["answers"] if normalize_answer(a["text"]))
        for article in dataset["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    }
    result = evaluate(dataset, golds)
    assert result["version"] == "1.1" and result["total"] == len(golds) == 7936
    assert result["exact_match"] == result["f1"] == 100.0
    # Dropping every other prediction halves the score and reports the missing ones.
    half = dict(list(golds.items())[::2])
    result = evaluate(dataset, half)
    assert result["missing_predictions"] == len(golds) - len(half)
    assert result["exact_match"] == pytest.approx(100.0 * len(half) / len(golds))


def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "albert_jax.tasks.squad_eval", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


def test_cli_prints_one_json_object(tmp_path):
    dataset, predictions, na_probs = _v2_example()
    data_path = tmp_path / "dev.json.gz"
    with gzip.open(data_path, "wt", encoding="utf-8") as f:
        json.dump(dataset, f)
    (tmp_path / "pred.json").write_text(json.dumps(predictions))
    (tmp_path / "na.json").write_text(json.dumps(na_probs))
    proc = _run_cli(
        f"--data={data_path}",
        f"--predictions={tmp_path / 'pred.json'}",
        f"--na_probs={tmp_path / 'na.json'}",
        "--na_prob_thresh=0.5",
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert printed == pytest.approx(evaluate(dataset, predictions, na_probs, 0.5))
    assert printed["exact_match"] == pytest.approx(75.0)

    help_proc = _run_cli("--help")
    for flag in ("--data", "--predictions", "--na_probs", "--na_prob_thresh"):
        assert flag in help_proc.stdout + help_proc.stderr


def test_cli_names_an_unparsable_file(tmp_path):
    """A truncated data or predictions file ends the CLI with one line naming the flag, the
    file, the line and the column (not a bare JSONDecodeError)."""
    dataset, predictions, _ = _v2_example()
    text = json.dumps(dataset, indent=1)
    cut_data = tmp_path / "dev.json"
    cut_data.write_text(text[: len(text) // 2])
    predictions_path = tmp_path / "pred.json.gz"
    predictions_path.write_bytes(gzip.compress(json.dumps(predictions)[:-2].encode()))
    good_data = tmp_path / "good.json"
    good_data.write_text(text)
    for data, what, bad in (
        (cut_data, "data", cut_data),
        (good_data, "predictions", predictions_path),
    ):
        proc = _run_cli(f"--data={data}", f"--predictions={predictions_path}")
        assert proc.returncode != 0 and not proc.stdout
        assert f"--{what}: {bad}: not valid JSON at line " in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_flags_are_not_defined_on_import():
    # A training binary that imports evaluate() must not inherit --data / --predictions.
    assert "predictions" not in squad_eval.FLAGS
