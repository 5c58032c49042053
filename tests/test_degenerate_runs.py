"""Runs that would report numbers from nothing: a held-out set that is all padding, and
settings that train little or nothing. They must say so rather than log zeros as measured."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
from test_train import make_config, small_overrides

from albert_jax import metrics_writer
from albert_jax.data.builders import base
from albert_jax.pretrain import train
from albert_jax.pretrain.settings import validate_config


def test_eval_without_a_real_token_records_no_metric(corpus, tmp_path, caplog):
    # 12 real documents; the one the builder holds out (the smallest title hash, since none
    # falls below validation_fraction in so small a corpus) is only a zero-width space.
    texts = []
    with gzip.open(corpus["austen"], "rt", encoding="utf-8") as f:
        for line, _ in zip(f, range(12), strict=False):
            texts.append(json.loads(line)["text"])
    titles = [f"doc-{i}" for i in range(len(texts))]
    held_out = min(titles, key=base._title_hash)
    path = tmp_path / "zwsp.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for title, text in zip(titles, texts, strict=True):
            f.write(json.dumps({"title": title, "text": "\u200b" if title == held_out else text}))
            f.write("\n")
    overrides = small_overrides(
        corpus, num_train_steps=2, eval_every_steps=2, eval_batches=1, checkpoint_every_steps=100,
        **{"data.sources": f"documents/zwsp={path}", "data.data_dir": str(tmp_path / "tfds")},
    )  # fmt: skip
    workdir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(make_config(overrides), workdir)
    assert not [k for k in result if k.startswith("eval_")]
    records = metrics_writer.read_metrics(workdir)
    assert records and not [k for r in records for k in r if k.startswith("eval_")]
    assert "split 'validation' of documents/zwsp" in caplog.text
    assert "no real token to predict" in caplog.text


def test_masked_lm_prob_zero_warns_and_fails_without_another_task(corpus, caplog):
    config = make_config({**small_overrides(corpus), "data.masked_lm_prob": 0.0})
    with caplog.at_level(logging.WARNING):
        validate_config(config)
    assert "config.data.masked_lm_prob=0: no token is masked" in caplog.text
    config.objective = "none"
    with pytest.raises(ValueError, match="nothing would be trained"):
        validate_config(config)


def test_masked_lm_prob_zero_reports_no_mlm_metric(corpus, tmp_path):
    """With nothing masked there is no MLM prediction to measure: no `mlm_*` metric in
    metrics.jsonl (they were logged as a measured 0.0), none in the eval, and none on the
    console; the SOP metrics and the loss (SOP alone) are there."""
    overrides = small_overrides(
        corpus, num_train_steps=2, eval_every_steps=2, eval_batches=1, log_every_steps=1,
        checkpoint_every_steps=100, **{"data.masked_lm_prob": 0.0},
    )  # fmt: skip
    workdir = str(tmp_path / "run")
    result = train.train_and_evaluate(make_config(overrides), workdir)
    records = metrics_writer.read_metrics(workdir)
    keys = {k for r in records for k in r} | set(result)
    assert not [k for k in keys if "mlm" in k], sorted(keys)
    train_rows = [r for r in records if "loss" in r]
    assert train_rows and all(r["loss"] == r["sop_loss"] for r in train_rows)
    assert "eval_sop_accuracy" in result
    line = metrics_writer.progress_line(2, 2, {**train_rows[-1], **result}, None)
    assert "mlm_acc" not in line and "sop_acc" in line, line
