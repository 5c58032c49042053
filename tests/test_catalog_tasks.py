"""The TFDS catalog tasks (`glue/*`, `squad/*`, `race/*`) read through the real catalog builders.

No download is possible here, so each test writes REAL prepared datasets under the catalog's
names into a temporary data dir: `tfds.builder("glue/sst2", data_dir=TMP)` instantiates the
catalog's own builder class offline (its `info.features` and version are in the package), and
`tfds.dataset_builders.store_as_tfds_dataset` writes local records with exactly those features
and that version as the prepared files (`TMP/glue/sst2/2.0.0/glue-train.tfrecord-*`,
`dataset_info.json`). The catalog builder then finds them prepared and reads them the normal way
(`builder.as_dataset`, what the task readers call), and `configs/finetune.py:task=...` runs
fine-tuning and evaluation on them with `data.data_dir=TMP`.

Each catalog run repeats a local-files run of test_finetune (same config, task and source
swapped; the local runs are built once per session) and must reproduce it:

  glue/sst2     <- sentiment_rt (the sentence set SST was built from): the 12-step tiny run,
                   same accuracy, predictions and final parameters, bit for bit
  squad/v1.1    <- SQuAD-Shifts JSON (new_wiki: train, nyt: validation), answers as in the
                   files (shifted offsets included): the SQuAD-Shifts run, same EM / F1,
                   predictions file and final parameters
  race/middle   <- mc_cosmosqa, one article per context; CosmosQA questions with 3 options are
                   written too (RACE's features allow any count) and the reader skips and counts
                   them: the mc_cosmosqa model evaluated on race/middle dev predicts each
                   4-option question as the local run did
"""

from __future__ import annotations

import gzip
import itertools
import json
import os

import jax
import numpy as np
import pytest
from test_finetune import (
    cosmos_config,
    cosmos_run,
    pretrained_workdir,
    run_cli,
    sentiment_tiny_config,
    sentiment_tiny_run,
    squad_shifts_config,
    squad_shifts_run,
    task_files,
    tiny_tokenizer_path,
)

from albert_jax import checkpointing, files
from albert_jax.finetune import train as finetune
from albert_jax.tasks import local, registry


def _store_as_catalog(name: str, splits: dict[str, list[dict]], data_dir: str):
    """Writes `splits` ({split: [record]}) as the prepared files of catalog dataset `name`
    ("dataset/config") in `data_dir`; returns the catalog's builder, reading them.

    Records are plain dicts in the catalog's feature layout; keys are the record index and
    shuffling is off, so the files keep the given order.
    """
    import tensorflow_datasets as tfds

    catalog = tfds.builder(name, data_dir=data_dir)  # the registered class; no download
    assert not catalog.is_prepared()
    dataset, config = name.split("/")
    tfds.dataset_builders.store_as_tfds_dataset(
        name=dataset,
        config=config,
        version=catalog.info.version,
        features=catalog.info.features,
        split_datasets={split: list(enumerate(rows)) for split, rows in splits.items()},
        data_dir=data_dir,
        disable_shuffling=True,
    )
    builder = tfds.builder(name, data_dir=data_dir)
    assert type(builder) is type(catalog) and builder.is_prepared()
    assert {s: builder.info.splits[s].num_examples for s in splits} == {
        s: len(rows) for s, rows in splits.items()
    }
    return builder


def _jsonl(path: str) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def spm(tmp_path_factory, shared_data) -> str:
    return tiny_tokenizer_path(tmp_path_factory, shared_data)


# ------------------------------------------------------------------------------------ glue/sst2
def test_glue_sst2_reproduces_the_local_run(spm, shared_data, tmp_path_factory, tmp_path):
    """glue/sst2 written from sentiment_rt: the catalog reader returns the local sentences, and
    fine-tuning `task=sst2` on them reproduces the local sentiment_rt run bit for bit."""
    data_dir = str(tmp_path / "tfds")
    source = os.path.join(shared_data, "tasks", "sentiment_rt")
    # The whole dev set, and the 200 train sentences the local run keeps (max_train_examples:
    # a fixed random subset; TFDS writes ~1.5k records a second here, the whole 8431 would
    # cost seconds). Kept in file order, all 200 of them are the catalog run's subset too.
    train_rows = _jsonl(os.path.join(source, "train.jsonl.gz"))
    raw = {
        "train": [train_rows[i] for i in registry.subset(len(train_rows), 200)],
        "validation": _jsonl(os.path.join(source, "dev.jsonl.gz")),
    }
    _store_as_catalog(
        "glue/sst2",
        {split: [{"sentence": r["sentence"], "label": r["label"], "idx": i}
                 for i, r in enumerate(rows)] for split, rows in raw.items()},
        data_dir,
    )  # fmt: skip
    # The local run's config (200 train / 128 dev sentences, 12 steps), task and source swapped.
    config = sentiment_tiny_config(spm, shared_data)
    config.task = "sst2"
    config.data.train_files = config.data.eval_files = ""
    config.data.data_dir = data_dir

    # The catalog reader gives the local reader's sentences and labels, in order, all of them.
    (dev,) = registry.read_eval("sst2", {**config.data, "max_eval_examples": 0})
    train = registry.read_train("sst2", {**config.data, "max_train_examples": 0})
    assert dev.name == "validation" and (dev.stats.read, dev.stats.kept) == (1109, 1109)
    assert (train.stats.read, len(train.examples)) == (200, 200)
    for split, examples in (("train", train.examples), ("dev", dev.examples)):
        from_file = local.read_sentiment_rt(os.path.join(source, f"{split}.jsonl.gz"))
        if split == "train":
            from_file = [from_file[i] for i in registry.subset(len(from_file), 200)]
        assert [(e.text_a, e.text_b, e.label) for e in examples] == [
            (e.text_a, e.text_b, e.label) for e in from_file
        ]
    assert [e.id for e in dev.examples[:2]] == ["validation-0", "validation-1"]

    local_run = sentiment_tiny_run(tmp_path_factory, shared_data)
    workdir = str(tmp_path / "run")
    results = finetune.finetune_and_evaluate(config, workdir)
    expected = _results(local_run)
    print("glue/sst2 (catalog files):", {k: results[k] for k in ("accuracy", "majority_accuracy")})
    assert results["task"] == "sst2" and results["step"] == 12 and results["num_examples"] == 128
    assert results["data"]["train"]["read"] == 200 and results["data"]["eval"][0]["read"] == 1109
    for key in ("accuracy", "majority_accuracy"):
        assert results[key] == expected[key], key
    pairs = [[(r["prediction"], r["label"]) for r in _predictions(d)] for d in (workdir, local_run)]
    assert pairs[0] == pairs[1]
    kept = registry.subset(1109, 128)  # the dev sentences both runs evaluate
    assert [r["id"] for r in _predictions(workdir)] == [f"validation-{i}" for i in kept]
    _assert_same_final_params(workdir, local_run, step=12)


# ----------------------------------------------------------------------------------- squad/v1.1
def _squad_records(
    path: str, num_paragraphs: int | None = None, ids: set[str] | None = None
) -> tuple[list[dict], int]:
    """TFDS squad records of the first paragraphs of a SQuAD JSON file (all: None), or of its
    questions `ids`, answers exactly as in the file, and how many of those answers have an
    offset that misses their text (SQuAD-Shifts has a few, shifted by some characters: the
    catalog reader has to cope with them)."""
    with files.open_text(path) as f:
        articles = json.load(f)["data"]
    paragraphs = ((a, p) for a in articles for p in a["paragraphs"])
    records, misplaced = [], 0
    for article, paragraph in itertools.islice(paragraphs, num_paragraphs):
        context = paragraph["context"]
        for qa in paragraph["qas"]:
            if ids is not None and qa["id"] not in ids:
                continue
            answers = qa["answers"]
            misplaced += sum(
                context[a["answer_start"] : a["answer_start"] + len(a["text"])] != a["text"]
                for a in answers
            )
            records.append({
                "id": qa["id"],
                "title": article.get("title", ""),
                "context": context,
                "question": qa["question"],
                "answers": {
                    "text": [a["text"] for a in answers],
                    "answer_start": [a["answer_start"] for a in answers],
                },
            })  # fmt: skip
    return records, misplaced


def test_squad_v11_reproduces_the_local_run(shared_data, tmp_path_factory, tmp_path):
    """squad/v1.1 written from SQuAD-Shifts (new_wiki: train, nyt: validation): the catalog
    reader finds the local JSON reader's questions and answers, and fine-tuning `task=squad_v1`
    on them reproduces the local SQuAD-Shifts run (same EM / F1, same predictions file)."""
    train_file, dev_file = task_files(shared_data, "squad_shifts")
    # The reader first, on nyt's first 40 paragraphs (its paragraph 19 has answers whose
    # offsets miss their text).
    first, misplaced = _squad_records(dev_file, 40)
    assert misplaced > 0
    _store_as_catalog("squad/v1.1", {"validation": first}, str(tmp_path / "reader"))
    stats = local.ReadStats()
    catalog = registry.squad.read_squad_tfds(
        "v1.1", "validation", data_dir=str(tmp_path / "reader"), stats=stats
    )
    from_file = local.read_squad(dev_file)
    assert len(catalog) == len(first) and stats.skipped_total == 0
    assert catalog == from_file[: len(catalog)]  # ids, titles, texts, relocated answers
    assert stats.adjusted == {"answer_start_relocated": misplaced}

    # The run: the questions the local run keeps (max_*_examples: a fixed random subset of
    # 400 train / 120 dev questions), which, all kept in file order, the catalog run keeps too.
    def kept(path: str, count: int) -> set[str]:
        examples = local.read_squad(path)
        return {examples[i].id for i in registry.subset(len(examples), count)}

    train, _ = _squad_records(train_file, ids=kept(train_file, 400))
    validation, _ = _squad_records(dev_file, ids=kept(dev_file, 120))
    assert (len(train), len(validation)) == (400, 120)
    data_dir = str(tmp_path / "tfds")
    _store_as_catalog("squad/v1.1", {"train": train, "validation": validation}, data_dir)

    # The local run's config, task and source swapped.
    local_run = squad_shifts_run(tmp_path_factory, shared_data)
    config = squad_shifts_config(pretrained_workdir(tmp_path_factory, shared_data), shared_data)
    config.task = "squad_v1"
    config.data.train_files = config.data.eval_files = ""
    config.data.data_dir = data_dir
    workdir = str(tmp_path / "run")
    results = finetune.finetune_and_evaluate(config, workdir)
    expected = _results(local_run)
    print("squad/v1.1 (catalog files):", {k: results[k] for k in ("exact_match", "f1")})
    assert results["version"] == "1.1" and results["total"] == 120
    assert results["data"]["train"]["kept"] == len(train)
    for key in ("exact_match", "f1", "total", "missing_predictions"):
        assert results[key] == expected[key], key
    with (
        open(os.path.join(workdir, "predictions.json")) as f,
        open(os.path.join(local_run, "predictions.json")) as g,
    ):
        assert json.load(f) == json.load(g)
    _assert_same_final_params(workdir, local_run, step=60)


# ---------------------------------------------------------------------------------- race/middle
def _race_articles(rows: list[dict], prefix: str) -> list[dict]:
    """CosmosQA records grouped into RACE articles: one per distinct context (first-seen
    order), with its questions, options and answer letters in file order."""
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["context"], []).append(row)
    return [
        {
            "example_id": f"{prefix}{i}.txt",
            "article": context,
            "questions": [q["question"] for q in questions],
            "options": [q["options"] for q in questions],
            "answers": ["ABCD"[q["label"]] for q in questions],
        }
        for i, (context, questions) in enumerate(grouped.items())
    ]


def test_race_middle_scores_like_the_local_run(shared_data, tmp_path_factory, tmp_path):
    """race/middle written from mc_cosmosqa (an article per context): the reader keeps the
    4-option questions (CosmosQA's 3-option ones are RACE records with bad options: skipped and
    counted), and `task=race` evaluation of the mc_cosmosqa model predicts each of them as the
    local run did."""
    data_dir = str(tmp_path / "tfds")
    source = os.path.join(shared_data, "tasks", "mc_cosmosqa")
    # The whole dev set (it is evaluated); the train split only feeds the reader check.
    raw = {
        "train": _jsonl(os.path.join(source, "train.jsonl.gz"))[:600],
        "dev": _jsonl(os.path.join(source, "dev.jsonl.gz")),
    }
    articles = {split: _race_articles(rows, split) for split, rows in raw.items()}
    _store_as_catalog("race/middle", articles, data_dir)

    local_run = cosmos_run(tmp_path_factory, shared_data)
    # The local run's model and shapes; RACE middle's dev split, evaluation only.
    config = cosmos_config(local_run, shared_data, num_train_steps=0)
    config.task = "race"
    config.data.train_files = config.data.eval_files = ""
    config.data.data_dir, config.data.race_levels = data_dir, "middle"
    config.data.eval_split = "dev"

    for split in ("train", "dev"):
        if split == "train":
            got = registry.read_train("race", config.data)
        else:
            (got,) = registry.read_eval("race", config.data)
        rows = raw[split]
        four = [
            (a["article"], q, tuple(opts), "ABCD".index(answer))
            for a in articles[split]
            for q, opts, answer in zip(a["questions"], a["options"], a["answers"], strict=True)
            if len(opts) == 4
        ]
        assert (got.stats.read, got.stats.kept) == (len(rows), len(four))
        assert got.stats.skipped == {"bad_options": len(rows) - len(four)}
        assert [(e.context, e.question, e.options, e.label) for e in got.examples] == four
        assert all(e.option_mask == (1, 1, 1, 1) for e in got.examples)
    assert len(four) == 206  # dev: 206 of CosmosQA's 621 questions have 4 options

    workdir = str(tmp_path / "run")
    results = run_cli(config, workdir)  # as the local run evaluated: one device
    print("race/middle (catalog files):", {k: results[k] for k in ("accuracy", "chance_accuracy")})
    assert results["num_examples"] == 206 and results["chance_accuracy"] == pytest.approx(0.25)
    assert results["init"]["missing"] == []  # the classifier comes with the checkpoint

    # The local run's predictions of the same questions (ids "dev-<line>" of the dev file).
    local_predictions = {r["id"]: r["prediction"] for r in _predictions(local_run)}
    by_text = {
        (r["context"], r["question"], tuple(r["options"])): local_predictions[f"dev-{i}"]
        for i, r in enumerate(raw["dev"])
        if len(r["options"]) == 4
    }
    assert len(by_text) == 206  # the texts identify a question (a few questions repeat)
    (dev,) = registry.read_eval("race", config.data)
    ours = _predictions(workdir)
    assert [r["id"] for r in ours] == [e.id for e in dev.examples]
    assert [r["prediction"] for r in ours] == [
        by_text[e.context, e.question, e.options] for e in dev.examples
    ]
    correct = [r["prediction"] == r["label"] for r in ours]
    assert results["accuracy"] == pytest.approx(float(np.mean(correct)))


# ------------------------------------------------------------------------------------- helpers
def _results(workdir: str) -> dict:
    with open(os.path.join(workdir, finetune.EVAL_RESULTS_FILE)) as f:
        return json.load(f)


def _predictions(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "predictions.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_same_final_params(workdir: str, other: str, step: int) -> None:
    trees = []
    for path in (workdir, other):
        with checkpointing.Checkpointer(path, read_only=True) as ckpt:
            assert ckpt.latest_step() == step
            trees.append(ckpt.restore_numpy(step, "params"))
    a, b = (jax.tree.leaves_with_path(t) for t in trees)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
