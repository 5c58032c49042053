"""Analytic FLOPs reproduce PERF_ANCHORS.md §4; peaks and MFU."""

import dataclasses
import types

import jax
import pytest

from albert_jax.model import flops

# PERF_ANCHORS.md §4: train GFLOP per sequence @128 (20 preds), @512 (80 preds), attention share.
TABLE = {
    "albert-base": (67.6, 292, 0.10),
    "albert-large": (237, 1007, 0.077),
    "albert-xlarge": (938, 3868, 0.040),
    "albert-xxlarge": (1866, 7580, 0.020),
    "bert-large": (241, 1020, 0.077),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_reproduces_perf_anchor_table(name):
    at_128, at_512, attention_share = TABLE[name]
    shape = flops.REFERENCE_SHAPES[name]
    assert flops.train_flops_per_sequence(shape, 128, 20) / 1e9 == pytest.approx(at_128, rel=0.02)
    assert flops.train_flops_per_sequence(shape, 512, 80) / 1e9 == pytest.approx(at_512, rel=0.02)
    forward = flops.forward_flops_per_sequence(shape, 512, 80)
    assert forward.attention_share == pytest.approx(attention_share, abs=0.005)


def test_mlm_head_on_all_positions_costs_what_the_table_says():
    # Table: BERT-large +8.2%, ALBERT-base +3.5% when the head runs on all 512 positions.
    for name, extra in (("bert-large", 0.082), ("albert-base", 0.035)):
        shape = flops.REFERENCE_SHAPES[name]
        gathered = flops.forward_flops_per_sequence(shape, 512, 80)
        everywhere = flops.forward_flops_per_sequence(shape, 512, 512)
        assert (everywhere.total - gathered.total) / gathered.total == pytest.approx(
            extra, abs=0.002
        )


def test_sharing_does_not_reduce_flops_and_inner_groups_add_layers():
    base = flops.REFERENCE_SHAPES["albert-base"]
    config = types.SimpleNamespace(**dataclasses.asdict(base), num_hidden_groups=12)
    assert flops.train_flops_per_sequence(config, 128, 20) == flops.train_flops_per_sequence(
        base, 128, 20
    )
    one, two = (
        flops.forward_flops_per_sequence(dataclasses.replace(base, inner_group_num=n), 128, 20)
        for n in (1, 2)
    )
    assert two.layer_matmuls == 2 * one.layer_matmuls and two.attention == 2 * one.attention
    assert two.mlm_head == one.mlm_head


def test_projection_only_when_factorized_and_batch_scales():
    albert = flops.forward_flops_per_sequence(flops.REFERENCE_SHAPES["albert-base"], 128, 20)
    bert = flops.forward_flops_per_sequence(flops.REFERENCE_SHAPES["bert-base"], 128, 20)
    assert albert.embedding_projection == 2 * 128 * 128 * 768 and bert.embedding_projection == 0
    shape = flops.REFERENCE_SHAPES["albert-large"]
    step = flops.train_flops_per_step(
        shape, batch_size=4096, seq_len=512, max_predictions_per_seq=20
    )
    assert step == 4096 * flops.train_flops_per_sequence(shape, 512, 20)


def test_last_layer_at_read_rows_only_drops_its_unread_rows():
    """The pretraining step runs the last layer at [CLS] + P rows: keys and values still cover
    all S tokens; queries, O, FFN and attention shrink to T rows."""
    shape = flops.REFERENCE_SHAPES["albert-base"]
    S, P, H, F = 128, 20, shape.hidden_size, shape.intermediate_size
    full = flops.forward_flops_per_sequence(shape, S, P)
    assert flops.forward_flops_per_sequence(shape, S, P, last_layer_positions=S) == full
    last = flops.forward_flops_per_sequence(shape, S, P, last_layer_positions=1 + P)
    unread = S - (1 + P)
    # per unread row: Q and O projections, the two FFN matmuls, its scores and context
    saved = 2 * unread * (2 * H * H + 2 * H * F) + 2 * unread * 2 * S * H
    assert full.total - last.total == pytest.approx(saved, rel=1e-12)
    assert last.mlm_head == full.mlm_head and last.embedding_projection == full.embedding_projection
    # about 1/12 of the encoder, less the K/V projections that every row still needs
    assert 0.05 < saved / full.total < 1 / 12
    assert flops.train_flops_per_step(shape, 8, S, P, 1 + P) == 8 * 3 * last.total
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="last_layer_positions"):
            flops.forward_flops_per_sequence(shape, S, P, last_layer_positions=bad)


def test_bad_config_and_sizes_are_named():
    config = types.SimpleNamespace(vocab_size=10, embedding_size=4, hidden_size=8)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        flops.forward_flops_per_sequence(config, 16, 2)
    with pytest.raises(ValueError, match="seq_len"):
        flops.forward_flops_per_sequence(flops.REFERENCE_SHAPES["albert-base"], 0, 2)
    with pytest.raises(ValueError, match="batch_size"):
        flops.train_flops_per_step(flops.REFERENCE_SHAPES["albert-base"], 0, 128, 20)


@pytest.mark.parametrize(
    "kind,dtype,peak",
    [
        ("TPU v3", "bfloat16", 123e12 / 2),  # a device is one of the chip's two cores
        ("TPU v3", "float32", 123e12 / 2),
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5", "bfloat16", 459e12),
        ("TPU v5p", "bfloat16", 459e12),
        ("TPU v6 lite", "bfloat16", 918e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H100 PCIe", "bfloat16", 756e12),
        ("NVIDIA H200", "bfloat16", 989e12),
        ("NVIDIA H100 80GB HBM3", "float32", 67e12),
    ],
)
def test_device_peaks(kind, dtype, peak):
    assert flops.device_peak_flops(kind, dtype=dtype) == peak


def test_unknown_device_and_dtype_raise():
    with pytest.raises(ValueError, match="device_kind"):
        flops.device_peak_flops("Quantum Abacus 9000")
    with pytest.raises(ValueError, match="dtype"):
        flops.device_peak_flops("TPU v4", dtype="int8")


def test_cpu_peak_is_measured_and_cached():
    peak = flops.device_peak_flops(jax.devices("cpu")[0])
    # Any CPU this runs on does between 0.1 GFLOP/s and 100 TFLOP/s of f32 matmul.
    assert 1e8 < peak < 1e14
    assert flops.measure_cpu_matmul_peak() == peak  # cached: same measurement


def test_mfu():
    assert flops.mfu(4e15, step_seconds=2.0, num_devices=8, peak=1e15) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="step_seconds"):
        flops.mfu(1.0, 0.0, 1, 1.0)
    with pytest.raises(ValueError, match="num_devices"):
        flops.mfu(1.0, 1.0, 0, 1.0)
