"""SOP diagnostics: the kind of every sentence pair (`pair_kind`), evaluation split by label and
by kind, and the Table 5 cross-evaluation (`albert_jax.analysis.sop_table`).

Real data throughout: Austen chapters from the shared corpora, a real sentencepiece model, tiny
real pretraining runs with Orbax checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from conftest import build_once, session_dir
from test_train import REPO, make_config, small_overrides

from albert_jax import metrics_writer
from albert_jax.analysis import sop_table
from albert_jax.data import batches, pipeline
from albert_jax.data.corpus import iter_jsonl_documents, tokenize_documents
from albert_jax.data.data_config import DataConfig
from albert_jax.data.instances import (
    A_HI,
    A_LO,
    B_HI,
    B_LO,
    IN_ORDER,
    KIND,
    LABEL,
    PAIR_KINDS,
    RANDOM_B,
    SPLIT_IN_ORDER,
    SPLIT_SWAPPED,
    SWAPPED,
    create_instances,
)
from albert_jax.data.masking import MaskingSettings
from albert_jax.data.tokenizer import Tokenizer
from albert_jax.pretrain import train
from albert_jax.pretrain.heldout import eval_metrics

SWAPPED_KINDS = (SWAPPED, SPLIT_SWAPPED)


@pytest.fixture(scope="module")
def austen(corpus):
    """The first 40 Austen chapters, tokenized (TokenizedCorpus), and the tokenizer."""
    import itertools

    tokenizer = Tokenizer(corpus["tokenizer"])
    docs = itertools.islice(iter_jsonl_documents(corpus["austen"]), 40)
    return tokenize_documents(docs, tokenizer), tokenizer


def instances(tokenized, objective, single_segment="split", seed=0):
    counters = Counter()
    table = create_instances(
        tokenized, np.random.default_rng(seed), max_seq_length=48, objective=objective,
        single_segment=single_segment, counters=counters,
    )  # fmt: skip
    return table, counters


def sentence_of(tokenized, token):
    return np.searchsorted(tokenized.sentence_starts, token, side="right") - 1


@pytest.mark.parametrize("single_segment", ["split", "random_b"])
def test_sop_kinds_are_what_the_pairs_are(austen, single_segment):
    """SOP: the label-1 instances are exactly the swapped kinds (and, in random_b mode, the
    random-document ones); a swapped pair's B precedes its A in one document, an in-order
    pair's A precedes B; a split pair is the two halves of one sentence, adjacent at the cut."""
    tokenized, _ = austen
    table, counters = instances(tokenized, "sop", single_segment)
    kind, label = table[:, KIND], table[:, LABEL]
    doc_a = tokenized.document_of_token(table[:, A_LO])
    doc_b = tokenized.document_of_token(table[:, B_HI] - 1)
    negatives = SWAPPED_KINDS + ((RANDOM_B,) if single_segment == "random_b" else ())
    np.testing.assert_array_equal(label == 1, np.isin(kind, negatives))
    present = set(np.unique(kind).tolist())
    if single_segment == "split":
        assert present == {IN_ORDER, SWAPPED, SPLIT_IN_ORDER, SPLIT_SWAPPED}
        assert (
            counters["instances_split_sentence"]
            == np.isin(kind, (SPLIT_IN_ORDER, SPLIT_SWAPPED)).sum()
        )
        assert counters["instances_random_b"] == 0
    else:
        assert present == {IN_ORDER, SWAPPED, RANDOM_B}
        assert counters["instances_random_b"] == (kind == RANDOM_B).sum()
        assert (doc_a[kind == RANDOM_B] != doc_b[kind == RANDOM_B]).all()
    same_doc = np.isin(kind, (IN_ORDER, SWAPPED, SPLIT_IN_ORDER, SPLIT_SWAPPED))
    assert (doc_a[same_doc] == doc_b[same_doc]).all()
    in_order, swapped = kind == IN_ORDER, kind == SWAPPED
    assert (table[in_order, A_HI] <= table[in_order, B_LO]).all()
    assert (table[swapped, B_HI] <= table[swapped, A_LO]).all()
    for k, (first_lo, first_hi, second_lo, second_hi) in (
        (SPLIT_IN_ORDER, (A_LO, A_HI, B_LO, B_HI)),
        (SPLIT_SWAPPED, (B_LO, B_HI, A_LO, A_HI)),
    ):
        rows = table[kind == k]
        np.testing.assert_array_equal(rows[:, first_hi], rows[:, second_lo])  # adjacent
        np.testing.assert_array_equal(
            sentence_of(tokenized, rows[:, first_lo]),
            sentence_of(tokenized, rows[:, second_hi] - 1),
        )
    # Not a split: A and B hold different sentences.
    whole = np.isin(kind, (IN_ORDER, SWAPPED))
    assert (
        sentence_of(tokenized, table[whole, A_LO]) != sentence_of(tokenized, table[whole, B_LO])
    ).all()


def test_nsp_kinds_are_what_the_pairs_are(austen):
    """NSP: label 1 is exactly the random-document kind, whose B comes from another
    document; label 0 is B following A in the same document. No swap, no split."""
    tokenized, _ = austen
    table, counters = instances(tokenized, "nsp")
    kind, label = table[:, KIND], table[:, LABEL]
    assert set(np.unique(kind).tolist()) == {IN_ORDER, RANDOM_B}
    np.testing.assert_array_equal(label == 1, kind == RANDOM_B)
    assert counters["instances_random_b"] == (kind == RANDOM_B).sum()
    doc_a = tokenized.document_of_token(table[:, A_LO])
    doc_b = tokenized.document_of_token(table[:, B_HI] - 1)
    assert (doc_a[kind == RANDOM_B] != doc_b[kind == RANDOM_B]).all()
    nxt = kind == IN_ORDER
    assert (doc_a[nxt] == doc_b[nxt]).all() and (table[nxt, A_HI] <= table[nxt, B_LO]).all()


def test_batches_carry_the_kind(austen, corpus):
    """`build_batch` and the pipeline's batches carry `pair_kind` [B] int32 (the instance
    table's KIND; consistent with the label), and padding rows have kind -1."""
    tokenized, tokenizer = austen
    table, _ = instances(tokenized, "sop")
    rows = table[:64]
    batch = batches.build_batch(
        [tokenized], np.zeros(len(rows), np.int32), rows, np.random.default_rng(0), seq_len=48,
        masking_settings=MaskingSettings(max_predictions=7), word_start=tokenizer.word_start,
    )  # fmt: skip
    assert batch["pair_kind"].dtype == np.int32
    np.testing.assert_array_equal(batch["pair_kind"], rows[:, KIND])
    cfg = DataConfig(
        seq_len=32, max_predictions_per_seq=5, batch_size=16, objective="nsp",
        sources=corpus["sources"], data_dir=corpus["data_dir"],
    )  # fmt: skip
    it = pipeline.make_pretraining_iterator(cfg, tokenizer)
    kinds, labels = [], []
    for _ in range(4):
        b = next(it)
        assert b["pair_kind"].shape == (16,) and b["pair_kind"].dtype == np.int32
        kinds.append(b["pair_kind"])
        labels.append(b["sentence_order_label"])
    it.close()
    kinds, labels = np.concatenate(kinds), np.concatenate(labels)
    np.testing.assert_array_equal(labels == 1, kinds == RANDOM_B)
    assert set(kinds.tolist()) == {IN_ORDER, RANDOM_B}
    assert (pipeline.padding_batch(4, 8, 2, tokenizer.cls_id)["pair_kind"] == -1).all()
    assert PAIR_KINDS[RANDOM_B] == "random_document" and len(PAIR_KINDS) == 5


def test_split_metrics_come_from_counts_and_skip_empty_splits():
    """Split accuracies are ratios of summed counts; a split without sequences has no key, and
    sums without `pair_kind` (batches that lack it) give the label split only."""
    sums = {
        "mlm_loss": np.float32(6.0), "mlm_correct": np.float32(1.0),
        "predictions": np.float32(3.0), "sequences": np.float32(10.0),
        "sop_loss": np.float32(7.0), "sop_correct": np.float32(6.0),
        "sop_sequences_by_label": np.array([4.0, 6.0]),
        "sop_correct_by_label": np.array([1.0, 5.0]),
    }  # fmt: skip
    labels_only = eval_metrics(sums)
    assert labels_only["eval_sop_accuracy_label_0"] == 0.25
    assert labels_only["eval_sop_accuracy_label_1"] == 5 / 6
    assert not any(k.endswith(PAIR_KINDS) for k in labels_only)
    sums["sop_sequences_by_kind"] = np.array([4.0, 5.0, 0.0, 0.0, 1.0])
    sums["sop_correct_by_kind"] = np.array([1.0, 5.0, 0.0, 0.0, 0.0])
    metrics = eval_metrics(sums)
    assert metrics["eval_sop_accuracy_swapped"] == 1.0
    assert metrics["eval_sop_accuracy_split_swapped"] == 0.0
    assert metrics["eval_sop_sequences_split_swapped"] == 1.0
    assert "eval_sop_accuracy_random_document" not in metrics
    assert "eval_sop_accuracy_split_in_order" not in metrics


def tiny_run(corpus, workdir, objective):
    overrides = small_overrides(
        corpus, objective=objective, num_train_steps=6, eval_every_steps=6, eval_batches=2,
        checkpoint_every_steps=6, log_every_steps=3,
    )  # fmt: skip
    return train.train_and_evaluate(make_config(overrides), workdir)


def sop_run(corpus, tmp_path_factory) -> tuple[str, dict]:
    """(workdir, result) of a tiny SOP run (test_train's model: all-shared, 2 layers; 6 steps,
    evaluated at step 6 on 2 held-out batches), pretrained once per session (conftest's
    `build_once`) like test_finetune's `pretrained_workdir`: these tests' run, and
    test_analysis's init. `result` is what `train_and_evaluate` returned, kept beside it."""
    root = session_dir(tmp_path_factory)
    workdir, saved = root / "sop_diagnostics_run", root / "sop_diagnostics_run.result.json"

    def run() -> None:
        shutil.rmtree(workdir, ignore_errors=True)  # a run an earlier failure left unfinished
        result = tiny_run(corpus, str(workdir), "sop")
        saved.write_text(json.dumps(result, default=float))

    build_once(saved, run)
    return str(workdir), json.loads(saved.read_text())


@pytest.fixture(scope="module")
def sop_and_mlm_runs(corpus, tmp_path_factory):
    """The tiny SOP run (`sop_run`), and the same checkpoint as an MLM-only run: a copy whose
    config.json says objective=none (every checkpoint has the SOP head; the table must
    measure it whatever the run trained). One compiled run keeps the test fast."""
    sop_dir, result = sop_run(corpus, tmp_path_factory)
    none_dir = tmp_path_factory.mktemp("sop_runs") / "none"
    shutil.copytree(sop_dir, none_dir)
    config = json.loads((none_dir / "config.json").read_text())
    (none_dir / "config.json").write_text(json.dumps({**config, "objective": "none"}))
    return {"sop": (sop_dir, result), "none": (str(none_dir), None)}


def check_splits_sum_to_total(metrics, splits):
    total = metrics["eval_sop_accuracy"]
    n = sum(metrics[f"eval_sop_sequences_{s}"] for s in splits)
    correct = sum(
        metrics[f"eval_sop_accuracy_{s}"] * metrics[f"eval_sop_sequences_{s}"] for s in splits
    )
    assert correct == pytest.approx(total * n, abs=1e-6)
    return n


def test_eval_reports_sop_accuracy_by_label_and_kind(sop_and_mlm_runs):
    """A tiny SOP run's evaluation has the split keys of the kinds in its data (no random
    document in split mode), in the result and in metrics.jsonl, and each split adds up to
    the total."""
    workdir, result = sop_and_mlm_runs["sop"]
    kinds = ("in_order", "swapped", "split_in_order", "split_swapped")
    for key in ("label_0", "label_1", *kinds):
        assert f"eval_sop_accuracy_{key}" in result, key
    assert "eval_sop_accuracy_random_document" not in result
    n_labels = check_splits_sum_to_total(result, ("label_0", "label_1"))
    n_kinds = check_splits_sum_to_total(result, kinds)
    assert n_labels == n_kinds == 2 * 16  # every held-out sequence, once
    assert result["eval_sop_sequences_label_1"] == (
        result["eval_sop_sequences_swapped"] + result["eval_sop_sequences_split_swapped"]
    )
    last = metrics_writer.read_metrics(workdir)[-1]
    assert last["eval_sop_accuracy_swapped"] == pytest.approx(result["eval_sop_accuracy_swapped"])


def test_cross_evaluation_command(sop_and_mlm_runs, tmp_path):
    """`python -m albert_jax.analysis.sop_table --workdirs=...` on the two runs: every run on
    both tasks (the MLM-only row's head measured too); the SOP run on the SOP task reproduces
    its own training-time evaluation; the NSP data has only in-order and random-document
    pairs; JSON and markdown written."""
    (sop_dir, sop_result), (none_dir, _) = sop_and_mlm_runs["sop"], sop_and_mlm_runs["none"]
    out = tmp_path / "table"
    proc = subprocess.run(
        [sys.executable, "-m", "albert_jax.analysis.sop_table",
         f"--workdirs={none_dir},{sop_dir}", f"--output={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((out / sop_table.TABLE_JSON).read_text())
    assert [r["trained"] for r in table["rows"]] == ["none", "sop"]
    assert table["sequences"] == 32 and table["eval_batches"] == 2
    none_row, sop_row = table["rows"]
    assert sop_row["step"] == none_row["step"] == 6
    assert none_row["nsp"] == sop_row["nsp"] and none_row["sop"] == sop_row["sop"]  # same model
    for row in table["rows"]:
        for task in ("nsp", "sop"):
            assert 0.0 <= row[task]["eval_sop_accuracy"] <= 1.0
            assert math.isfinite(row[task]["eval_mlm_accuracy"])
        assert "eval_sop_accuracy_random_document" in row["nsp"]
        assert "eval_sop_accuracy_swapped" not in row["nsp"]
        assert "eval_sop_accuracy_swapped" in row["sop"]
    assert sop_row["sop"]["eval_sop_accuracy"] == pytest.approx(
        sop_result["eval_sop_accuracy"], abs=1.5 / 32
    )
    assert sop_row["sop"]["eval_mlm_accuracy"] == pytest.approx(
        sop_result["eval_mlm_accuracy"], abs=1e-3
    )
    markdown = (out / sop_table.TABLE_MD).read_text()
    assert "| trained with | steps | MLM acc | NSP acc | SOP acc |" in markdown
    assert "| none | 6 |" in markdown and "SOP swapped" in markdown
    assert proc.stdout == markdown


def test_cross_evaluation_refuses_runs_on_other_data(sop_and_mlm_runs, tmp_path):
    """Runs whose evaluation batches would differ cannot share a table: the field is named."""
    sop_dir, _ = sop_and_mlm_runs["sop"]
    other = tmp_path / "other_seed"
    shutil.copytree(sop_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["seed"] = 7
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="differ in data field 'seed'"):
        sop_table.cross_evaluate([sop_dir, str(other)])
