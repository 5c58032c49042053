"""Several examples per row (tasks/packing.py, `config.pack_examples`): every example placed
once with its own positions and [CLS], a bounded set of shapes on real features, the same
logits and gradients as unpacked batches, and when auto packs. Training that scores as
unpacked training: test_seeds.py's four seeds, packed; bit-exact resume: test_length_buckets.py,
both ways."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_finetune import (
    sentiment_tiny_config,
    tiny_tokenizer_path,
)

from albert_jax.model import heads, losses
from albert_jax.model.config import ModelConfig
from albert_jax.tasks import packing
from albert_jax.tasks.batching import bucket_lengths, train_batch


def _sentiment_features(tmp_path_factory, shared_data, max_seq_length: int):
    from albert_jax.data.tokenizer import Tokenizer
    from albert_jax.tasks import registry

    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    config = sentiment_tiny_config(spm, shared_data, max_seq_length=max_seq_length)
    config.data.max_train_examples = 0  # all 8431 sentences
    examples = registry.read_train(config.task, config.data).examples
    return registry.featurize(config.task, examples, Tokenizer(spm), config).arrays


def test_every_example_is_placed_once_with_its_own_positions(tmp_path_factory, shared_data):
    arrays = _sentiment_features(tmp_path_factory, shared_data, 512)
    batches = [train_batch(arrays, step, 32, seed) for step, seed in ((0, 0), (0, 1))]
    plan, placements = packing.plan_packing(batches, 512, row_granularity=4)
    assert plan.row_length == 128 and plan.rows % 4 == 0 and plan.rows < 32
    for batch, placement in zip(batches, placements, strict=True):
        packed = packing.pack_batch(batch, plan, placement)
        np.testing.assert_array_equal(packed["label"], batch["label"])  # examples keep order
        slots = packed["cls_positions"].reshape(-1)
        assert len(set(packed["cls_index"].tolist())) == 32  # one slot per example
        for i, flat in enumerate(packed["cls_index"]):
            row, start = flat // plan.slots, slots[flat]
            n = int(batch["input_mask"][i].sum())
            span = slice(start, start + n)
            for k in ("input_ids", "segment_ids"):
                np.testing.assert_array_equal(packed[k][row, span], batch[k][i, :n])
            np.testing.assert_array_equal(packed["position_ids"][row, span], np.arange(n))
            ids = packed["pack_ids"][row]
            assert (ids[span] == flat % plan.slots + 1).all() and (ids == ids[start]).sum() == n
        # Nothing but the examples' tokens: the real tokens of the batch, all of them.
        assert packed["input_mask"].sum() == batch["input_mask"].sum()
        assert (packed["pack_ids"] > 0).sum() == batch["input_mask"].sum()


def test_shapes_are_few_and_bounded_on_real_features(tmp_path_factory, shared_data):
    """Every step of an epoch of sentiment_rt at the SST-2 preset's 512: a handful of shapes,
    each a length bucket x a multiple of the granularity, ~2x fewer tokens than padding each
    batch to its longest row (what HF's dynamic padding computes)."""
    arrays = _sentiment_features(tmp_path_factory, shared_data, 512)
    plans, packed_tokens, dynamic_tokens = set(), 0, 0
    for step in range(len(arrays["label"]) // 32):
        batch = train_batch(arrays, step, 32, seed=0)
        plan, _ = packing.plan_packing([batch], 512, row_granularity=1)  # one device
        plans.add(plan)
        packed_tokens += plan.rows * plan.row_length
        dynamic_tokens += 32 * int(batch["input_mask"].sum(1).max())
    assert {p.row_length for p in plans} <= set(bucket_lengths(512))
    assert len(plans) <= 6, sorted(plans)
    assert packed_tokens < 0.6 * dynamic_tokens, (packed_tokens, dynamic_tokens)


@pytest.mark.parametrize("granularity, batch", [(1, 32), (1, 128), (2, 64), (3, 96), (8, 256)])
def test_row_counts_are_a_ladder_of_eight_an_octave(granularity, batch):
    """Rows: a multiple of the granularity, at most 1/8 above the needed count (exact up to 16
    units), never above the batch, and at most 8 counts from one power of two to the next."""
    counts = [packing.round_rows(n, granularity, batch) for n in range(1, batch + 1)]
    for needed, rows in enumerate(counts, 1):
        assert rows % granularity == 0 and needed <= rows <= batch
        units, got = -(-needed // granularity), rows // granularity
        assert got == units if units <= 16 else got < units * 9 / 8
    assert counts == sorted(counts)
    for octave in range(1, batch.bit_length()):
        units = {r // granularity for r in counts}
        assert len({u for u in units if 2 ** (octave - 1) < u <= 2**octave}) <= 8


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_packed_rows_give_the_logits_and_gradients_of_separate_rows(scan):
    # The tiny preset's layout (4 shared layers, 2 heads: attention runs per head over the
    # block-diagonal mask) with a small vocabulary, so init and compilation stay cheap.
    config = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=500, scan_layers=scan)
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, 12)
    batch = {k: np.zeros((12, 64), np.int32) for k in ("input_ids", "segment_ids", "input_mask")}
    for i, n in enumerate(lengths):
        batch["input_ids"][i, :n] = rng.integers(5, config.vocab_size, n)
        batch["input_mask"][i, :n] = 1
        batch["segment_ids"][i, n // 2 : n] = 1
    batch["label"] = rng.integers(0, 3, 12)
    plan, (placement,) = packing.plan_packing([batch], 64, row_granularity=2)
    packed = packing.pack_batch(batch, plan, placement)
    with pytest.raises(ValueError, match="every example of the batch once"):
        packing.pack_batch(batch, plan, placement[1:])
    assert plan.rows < 12  # several examples share rows
    model = heads.AlbertForSequenceClassification(config, 3)
    params = jax.jit(model.init)(jax.random.key(0), batch["input_ids"])

    def loss(p, b):
        extra = {k: b[k] for k in packing.PACKED_INPUTS if k in b}
        logits = model.apply(p, b["input_ids"], b["segment_ids"], b["input_mask"], **extra)
        return losses.classification_loss(logits, b["label"]), logits

    loss_and_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (loss_a, logits_a), grads_a = loss_and_grads(params, batch)
    (loss_b, logits_b), grads_b = loss_and_grads(params, packed)
    np.testing.assert_allclose(logits_b, logits_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7), grads_a, grads_b
    )


def test_auto_packs_where_rows_hold_several_examples(tmp_path_factory, shared_data):
    """`pack_examples=None` packs when the rows would hold at most AUTO_MAX_PACKED_SHARE of the
    unpacked tokens: at 512 sentences share 128-token rows, at 40 a row holds one of them."""
    shares, steps = {}, {}
    for length in (40, 512):
        arrays = _sentiment_features(tmp_path_factory, shared_data, length)
        steps[length] = [[train_batch(arrays, step, 32, seed=0)] for step in range(64)]
        shares[length] = packing.packed_share(steps[length], length, 1, length_buckets=True)
    assert shares[512] < 0.5 < packing.AUTO_MAX_PACKED_SHARE < shares[40] < 1, shares
    # Without length buckets unpacked rows are padded to max_seq_length: packing saves more.
    assert packing.packed_share(steps[512], 512, 1, length_buckets=False) < shares[512] / 2


def _objective(config, workdir):
    """The data half of the fine-tuning objective of `config` on its mesh, as the loop builds
    it."""
    import flax.linen as nn

    from albert_jax.finetune.settings import validate_config
    from albert_jax.finetune.train import fine_tuning
    from albert_jax.run_config import mesh_layout
    from albert_jax.sharding import LOGICAL_AXIS_RULES

    mesh = mesh_layout(config).create()
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        return fine_tuning(config, str(workdir), validate_config(config), mesh).data


@pytest.mark.parametrize(
    "max_seq_length, batch_size, packs", [(128, 64, True), (32, 32, False)], ids=["128", "32"]
)
def test_auto_decides_once_a_run(
    max_seq_length, batch_size, packs, tmp_path_factory, shared_data, tmp_path
):
    """Auto (`pack_examples=None`) packs sentences in rows of 128, not in rows of 32; the same
    for one seed or four (the share is taken on `config.seed`'s batches), and a resume keeps
    the decision its checkpoint recorded (a resume on another mesh could decide otherwise)."""
    spm = tiny_tokenizer_path(tmp_path_factory, shared_data)
    config = sentiment_tiny_config(
        spm, shared_data, max_seq_length=max_seq_length, batch_size=batch_size
    )
    assert config.pack_examples is None
    for num_seeds in (1, 4):
        config.num_seeds = num_seeds
        assert _objective(config, tmp_path / f"n{num_seeds}").packing is packs
    objective = _objective(config, tmp_path / "resumed")
    saved = {**objective.data_state(4), "packed": not packs}
    objective.check_resume(saved, 4)  # the same run: the decision is not compared
    objective.start(4, saved, {"init": None})
    assert objective.packing is (not packs)
    assert objective.data_report()["train"]["packed"] is (not packs)
