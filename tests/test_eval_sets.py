"""Eval sets of several files (issue #58 cases 5 and 7) and max_*_examples subsets, read through
the registry from small files written here: ids are unique across the files of a set, each
prediction line names its file, and a subset is a fixed random one in file order."""

import json
import re

import pytest

from albert_jax.tasks import json_records, kinds, registry, squad_eval


def _squad_file(path, ids, title="T"):
    """A SQuAD v1.1 file: one paragraph, a question per id, each answered by the context's
    first word."""
    qas = [
        {"id": qid, "question": f"Which {qid}?", "answers": [{"text": "Paris", "answer_start": 0}]}
        for qid in ids
    ]
    context = "Paris is the capital of France."
    data = [{"title": title, "paragraphs": [{"context": context, "qas": qas}]}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "1.1", "data": data}))
    return str(path)


def _sentiment_file(path, labels):
    """A sentiment_rt JSON Lines file: a sentence per label, in this order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"sentence": f"sentence {i}", "label": y}) for i, y in enumerate(labels)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_squad_eval_files_with_a_shared_question_id_are_refused(tmp_path):
    """Case 5: two SQuAD eval files that share question ids were one set whose predictions
    (keyed by id) overwrote each other: 4 examples, 3 scored. Now a ValueError names the id and
    both files; files with distinct ids make one set scored on all of its questions."""
    a = _squad_file(tmp_path / "a.json", ["q1", "q2"])
    b = _squad_file(tmp_path / "b.json", ["q2", "q3"])
    with pytest.raises(ValueError, match=re.escape(f"eval_files: id 'q2' is in both {a} and {b}")):
        registry.read_eval("squad_v1", {"eval_files": f"{a},{b}"})
    with pytest.raises(ValueError, match=re.escape(f"eval_files lists {a} more than once")):
        registry.read_eval("squad_v1", {"eval_files": f"{a},{a}"})
    # Training sets have no predictions: the same ids in two training files are read as they are.
    train = registry.read_train("squad_v1", {"train_files": f"{a},{b}"})
    assert [e.id for e in train.examples] == ["q1", "q2", "q2", "q3"]

    c = _squad_file(tmp_path / "c.json", ["q3", "q4"])
    (dev,) = registry.read_eval("squad_v1", {"eval_files": f"{a},{c}"})
    assert [e.id for e in dev.examples] == ["q1", "q2", "q3", "q4"]
    assert dev.example_sources() == [a, a, c, c]
    result = squad_eval.evaluate(dev.squad_json, {e.id: "Paris" for e in dev.examples})
    assert result["total"] == len(dev.examples) == 4 and result["exact_match"] == 100.0


def test_same_named_eval_files_keep_their_ids_and_files_apart(tmp_path):
    """Case 7: a/dev.jsonl and b/dev.jsonl both gave ids dev-0, dev-1, and every prediction
    line's eval_set was "a/dev.jsonl,b/dev.jsonl". Now ids carry the telling folder and each
    line's eval_set is the file its example came from; a single file is named as before."""
    a = _sentiment_file(tmp_path / "x" / "a" / "dev.jsonl", [0, 0])
    b = _sentiment_file(tmp_path / "x" / "b" / "dev.jsonl", [1, 1])
    (dev,) = registry.read_eval("sentiment_rt", {"eval_files": f"{a},{b}"})
    assert [e.id for e in dev.examples] == ["a/dev-0", "a/dev-1", "b/dev-0", "b/dev-1"]
    assert dev.name == f"{a},{b}"  # the set's name (metrics keys, data report) is unchanged

    records = [{"id": e.id, "prediction": 1, "label": e.label} for e in dev.examples]
    out = tmp_path / "run"
    out.mkdir()
    (written,) = kinds.get_kind("classification").write_predictions(str(out), "", dev, records)
    with open(written) as f:
        rows = [json.loads(line) for line in f]
    assert len({r["id"] for r in rows}) == 4
    assert [(r["eval_set"], r["label"]) for r in rows] == [(a, 0), (a, 0), (b, 1), (b, 1)]

    (single,) = registry.read_eval("sentiment_rt", {"eval_files": a})
    assert [e.id for e in single.examples] == ["dev-0", "dev-1"]
    assert single.example_sources() == [a, a]
    # Names grow by as many folders as tell same-named files apart, and no more.
    paths = ["/x/a/dev.jsonl", "/y/a/dev.jsonl.gz", "/x/b/dev.json", "/x/b/train.jsonl"]
    assert json_records.file_names(paths) == [
        "x/a/dev.jsonl", "y/a/dev.jsonl.gz", "b/dev.json", "train.jsonl",
    ]  # fmt: skip


def test_max_examples_keeps_a_fixed_random_subset_in_file_order(tmp_path):
    """max_eval_examples = N kept the first N rows: on a file sorted by label, one class. Now a
    random N (the same in every read), in file order, for training sets too; SQuAD scores the
    kept questions."""
    labels = [0] * 30 + [1] * 30
    dev = _sentiment_file(tmp_path / "dev.jsonl", labels)
    (first,) = registry.read_eval("sentiment_rt", {"eval_files": dev, "max_eval_examples": 10})
    (again,) = registry.read_eval("sentiment_rt", {"eval_files": dev, "max_eval_examples": 10})
    lines = [int(e.id.removeprefix("dev-")) for e in first.examples]
    assert len(lines) == 10 and lines == sorted(lines) and first.examples == again.examples
    assert {e.label for e in first.examples} == {0, 1}
    assert first.example_sources() == [dev] * 10
    train = registry.read_train("sentiment_rt", {"train_files": dev, "max_train_examples": 10})
    assert train.examples == first.examples
    for everything in (0, 60, 100):
        (whole,) = registry.read_eval(
            "sentiment_rt", {"eval_files": dev, "max_eval_examples": everything}
        )
        assert [e.label for e in whole.examples] == labels

    squad = _squad_file(tmp_path / "squad.json", [f"q{i}" for i in range(8)])
    (subset,) = registry.read_eval("squad_v1", {"eval_files": squad, "max_eval_examples": 3})
    kept = [e.id for e in subset.examples]
    gold = [qa["id"] for a in subset.squad_json["data"] for p in a["paragraphs"] for qa in p["qas"]]
    assert len(kept) == 3 and gold == kept
    assert kept == [f"q{i}" for i in registry.subset(8, 3)]
    result = squad_eval.evaluate(subset.squad_json, {qid: "Paris" for qid in kept})
    assert result["total"] == 3 and result["exact_match"] == 100.0
