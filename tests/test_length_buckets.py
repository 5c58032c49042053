"""Fine-tuning batches cut to length buckets (32·2^k up to max_seq_length): a bounded set of
shapes, and the predictions of a fixed checkpoint exactly those of batches padded to
max_seq_length (multiple choice, SQuAD spans; classification in test_finetune.py)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from test_finetune import (
    _read_results,
    cosmos_config,
    cosmos_run,
    pretrained_workdir,
    run_cli,
    sentiment_tiny_config,
    squad_shifts_config,
    squad_shifts_run,
    tiny_tokenizer_path,
)

from albert_jax import checkpointing, metrics_writer
from albert_jax.finetune import train as finetune
from albert_jax.runtime import checkpoint_dirs
from albert_jax.tasks.batching import bucket_length, bucket_lengths, trim_to_bucket


def test_bucket_lengths_are_bounded():
    assert bucket_lengths(512) == (32, 64, 128, 256, 512)
    assert bucket_lengths(100) == (32, 64, 100) and bucket_lengths(32) == (32,)
    assert [bucket_length(n, 512) for n in (1, 32, 33, 64, 65, 511)] == [32, 32, 64, 64, 128, 512]


def test_trim_cuts_to_the_longest_row_of_the_whole_batch():
    mask = np.zeros((4, 3, 128), np.int32)  # [B, options, S]
    mask[0, 1, :40], mask[3, 0, :7] = 1, 1
    batch = {"input_mask": mask, "input_ids": mask * 7, "label": np.arange(4)}
    cut, length = trim_to_bucket(batch, ("input_mask", "input_ids"))
    assert length == 64 and cut["input_ids"].shape == (4, 3, 64)
    assert cut["label"] is batch["label"]
    np.testing.assert_array_equal(cut["input_ids"], batch["input_ids"][..., :64])
    assert not batch["input_mask"][..., 64:].any()  # nothing real was cut


def _predictions(workdir, name):
    with open(os.path.join(workdir, name)) as f:
        return [json.loads(line) for line in f] if name.endswith(".jsonl") else json.load(f)


@pytest.mark.parametrize(
    "run, make_config, files",
    [
        (cosmos_run, cosmos_config, ["predictions.jsonl"]),
        (squad_shifts_run, squad_shifts_config, ["predictions.json", "nbest_predictions.json"]),
    ],
    ids=["mc_cosmosqa", "squad_shifts"],
)
def test_cut_batches_predict_as_padded_ones(
    run, make_config, files, tmp_path_factory, shared_data, tmp_path, caplog
):
    trained = run(tmp_path_factory, shared_data)
    results = {}
    for buckets in (True, False):
        config = make_config(trained, shared_data, num_train_steps=0, length_buckets=buckets)
        config.data.train_files = ""  # evaluation only
        workdir = str(tmp_path / f"buckets_{buckets}")
        with caplog.at_level("INFO"):
            results[buckets] = finetune.finetune_and_evaluate(config, workdir)
        results[buckets]["files"] = {name: _predictions(workdir, name) for name in files}
    cut, padded = results[True], results[False]
    assert cut["files"][files[0]] == padded["files"][files[0]]  # the same answers
    if "nbest_predictions.json" in files:  # span probabilities: float sums in another order
        for qid, candidates in padded["files"]["nbest_predictions.json"].items():
            got = cut["files"]["nbest_predictions.json"][qid]
            assert [c["text"] for c in got] == [c["text"] for c in candidates]
            np.testing.assert_allclose(
                [c["probability"] for c in got], [c["probability"] for c in candidates],
                rtol=1e-5, atol=1e-7,
            )  # fmt: skip
    metric = "accuracy" if "accuracy" in padded else "f1"
    assert cut[metric] == padded[metric]
    # The cut run compiled more than one length, each a bucket of max_seq_length, and said so.
    assert "length bucket" in caplog.text
    assert _read_results(str(tmp_path / "buckets_True"))["step"] == 0


# Each padded twin trains where its cached run did: mc_cosmosqa (250 steps) on one device
# through the CLI, squad_shifts (60 steps) in this process, as test_catalog_tasks repeats it.
@pytest.mark.parametrize(
    "run, make_config, train",
    [
        (cosmos_run, cosmos_config, run_cli),
        (squad_shifts_run, squad_shifts_config, finetune.finetune_and_evaluate),
    ],
    ids=["mc_cosmosqa", "squad_shifts"],
)
def test_training_on_cut_batches_scores_as_padded_training(
    run, make_config, train, tmp_path_factory, shared_data, tmp_path
):
    """The same fine-tuning on batches padded to max_seq_length ends within a point of the
    length-bucketed run (only float summation orders differ). Measured on these and
    sentiment_rt (500 steps): equal to the last digit."""
    cut = _read_results(run(tmp_path_factory, shared_data))
    init = pretrained_workdir(tmp_path_factory, shared_data)
    padded = train(make_config(init, shared_data, length_buckets=False), str(tmp_path / "padded"))
    metric, point = ("accuracy", 0.01) if "accuracy" in padded else ("f1", 1.0)
    assert abs(cut[metric] - padded[metric]) <= point, (cut[metric], padded[metric])


@pytest.mark.parametrize("pack", [False, True], ids=["buckets", "packed"])
def test_training_on_cut_batches_resumes_bit_exactly(pack, tmp_path_factory, shared_data, tmp_path):
    # max_seq_length 128, 16 a batch: these sentences' batches fall in two buckets (64, 128);
    # packed (tasks/packing.py), in rows of 128.
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    config = sentiment_tiny_config(
        spm, shared_data, max_seq_length=128, batch_size=16, pack_examples=pack
    )
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    finetune.finetune_and_evaluate(config, straight)
    if not pack:
        assert _training_lengths(config) == {64, 128}
    shutil.copytree(straight, resumed)
    for step in (8, 12):  # as if the run had stopped after the checkpoint of step 4
        shutil.rmtree(os.path.join(checkpoint_dirs.checkpoint_dir(resumed), str(step)))
    os.remove(os.path.join(resumed, finetune.EVAL_RESULTS_FILE))
    finetune.finetune_and_evaluate(config, resumed)
    with (
        checkpointing.Checkpointer(straight, read_only=True) as a,
        checkpointing.Checkpointer(resumed, read_only=True) as b,
    ):
        for item in ("params", "opt_state"):
            for x, y in zip(
                jax_leaves(a.restore_numpy(12, item)), jax_leaves(b.restore_numpy(12, item)),
                strict=True,
            ):  # fmt: skip
                np.testing.assert_array_equal(x, y)
    losses = {r["step"]: r["loss"] for r in metrics_writer.read_metrics(resumed) if "loss" in r}
    assert losses == {
        r["step"]: r["loss"] for r in metrics_writer.read_metrics(straight) if "loss" in r
    }
    assert _read_results(resumed)["accuracy"] == _read_results(straight)["accuracy"]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _training_lengths(config):
    """The lengths the training batches of `config` are cut to, from the public pieces
    fine-tuning uses: the features, `train_batch` of each step, `trim_to_bucket`."""
    from albert_jax.data.tokenizer import Tokenizer
    from albert_jax.tasks import registry
    from albert_jax.tasks.batching import train_batch
    from albert_jax.tasks.kinds import get_kind

    train_set = registry.read_train(config.task, config.data)
    tokenizer = Tokenizer(config.data.tokenizer)
    features = registry.featurize(config.task, train_set.examples, tokenizer, config)
    kind = get_kind(registry.get_task(config.task).kind)
    arrays = {k: features.arrays[k] for k in kind.model_inputs}
    return {
        trim_to_bucket(train_batch(arrays, step, config.batch_size, config.seed),
                       kind.sequence_inputs)[1]
        for step in range(config.num_train_steps)
    }  # fmt: skip
