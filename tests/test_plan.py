"""`albert_jax.plan`: the training step compiled by the real TPU compiler (libtpu, the `[tpu]`
extra) for Cloud TPU slices that are not attached, and what it reports."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[tpu]'")

from albert_jax import plan, sharding  # noqa: E402
from albert_jax.model import layers
from albert_jax.run_config import model_param_axes, with_fields  # noqa: E402
from albert_jax.tpu import collectives as hlo_collectives
from albert_jax.tpu import slices as tpu_slices
from configs import finetune as finetune_configs  # noqa: E402
from configs import pretrain  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small(**fields):
    """A 2-layer ALBERT (H=128) pretraining config with `fields` set (dotted names)."""
    config = pretrain.get_config("size=tiny")
    return with_fields(config, **fields)


# ----------------------------------------------------------------------------------- slices


def test_slice_names_follow_gcloud():
    assert tpu_slices.slice_spec("v3-32").topology_name == "v3:4x4"
    assert tpu_slices.slice_spec("v3-32").num_devices == 32  # a device per TensorCore
    assert tpu_slices.slice_spec("v4-32").topology_name == "v4:2x2x4"
    assert tpu_slices.slice_spec("v4-32").num_devices == 16  # a megacore device per chip
    assert tpu_slices.slice_spec("v5p-128").topology_name == "v5:4x4x4"
    assert tpu_slices.slice_spec("v5litepod-256").topology_name == "v5e:16x16"
    assert tpu_slices.slice_spec("v6e-64").topology_name == "v6e:8x8"
    assert tpu_slices.slice_spec("v3-2048").topology_name == "v3:32x32"
    for bad in ("v3-16", "v5e-16", "tpu-v3-8", "v7-8"):
        with pytest.raises(ValueError, match=r"valid forms: v2-N with N in \{8, 32"):
            tpu_slices.slice_spec(bad)


@pytest.mark.parametrize("tpu", ["v2-8", "v3-8", "v4-8", "v5litepod-4", "v5p-8", "v6e-4"])
def test_usable_hbm_is_what_the_compiler_allows(tpu):
    """The table's usable HBM per device is the "available HBM" of the compiler's own OOM."""
    spec = tpu_slices.slice_spec(tpu)
    devices = tpu_slices.target_devices(spec)
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    big = jax.ShapeDtypeStruct((64, 2**30), jax.numpy.float32)  # 256 GiB of temporaries
    fn = jax.jit(lambda x: (x * 2 + 1).sum(0), in_shardings=jax.NamedSharding(mesh, jax.P()))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as error:
        fn.lower(big).compile()
    available = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(error.value))
    assert available is not None, str(error.value)
    assert float(available.group(1)) == pytest.approx(spec.usable_hbm_gib, abs=0.006)


# ----------------------------------------------------------------------------------- plans


@pytest.mark.parametrize("tpu", ["v2-8", "v3-8", "v4-8", "v5litepod-8", "v5p-8", "v6e-8"])
def test_one_plan_per_generation(tpu):
    report = plan.plan(small(batch_size=64), plan.make_target(tpu))
    spec = tpu_slices.slice_spec(tpu)
    assert report["fits"] is True, report
    assert report["mesh"] == {"data": spec.num_devices, "fsdp": 1, "tensor": 1}
    assert report["usable_hbm_gib"] == spec.usable_hbm_gib
    assert 0 < report["total_gib"] < 0.1
    assert report["params_gib"] > 0 and report["opt_state_gib"] >= 1.9 * report["params_gib"]
    # Data parallel: the gradients are all-reduced inside the slice, nothing crosses slices.
    assert report["collectives"]["within_slice"]["all-reduce"]["bytes"] > 0
    assert report["collectives"]["cross_slice"] == {}
    assert report["peak_bound_s"] == pytest.approx(
        report["flops_per_device"] / spec.peak_bf16_per_device, rel=1e-3, abs=1e-6
    )


def test_oom_verdict_is_the_compilers_with_exit_code_1():
    command = [
        sys.executable, "-m", "albert_jax.plan", "--config=configs/pretrain.py:size=base",
        "--tpu=v2-8", "--config.batch_size=512", "--config.model.remat_policy=none", "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fits"] is False
    assert "RESOURCE_EXHAUSTED" in report["error"] and "HBM" in report["error"]
    assert report["temporaries_gib"] > report["usable_hbm_gib"]


def test_bad_tpu_name_lists_the_valid_forms():
    command = [sys.executable, "-m", "albert_jax.plan", "--config=configs/pretrain.py:size=tiny",
               "--tpu=v3-7"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--tpu='v3-7'" in done.stderr and "valid forms" in done.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--config=configs/pretrain.py:size=tiny"], "error: --config and --tpu are required"),
        (["--config=configs/pretrain.py:size=tiny", "--tpu=v4-8",
          "--config.batch_size=1000000000000"],
         "error: config.batch_size=1000000000000 x config.seq_len=32 is "),
        (["--config=configs/finetune.py:task=rte,init=", "--tpu=v4-8", "--max_batch",
          "--microbatches=1,2"],
         "error: --microbatches: fine-tuning has no gradient accumulation"),
    ],
)  # fmt: skip
def test_usage_errors_exit_2_before_the_compiler(flags, message):
    """#67: a missing --tpu exited 1, the "does not fit" status; an absurd batch aborted inside
    XLA (SIGABRT, exit 134, a C++ stack). Both are usage errors: one line, status 2."""
    command = [sys.executable, "-m", "albert_jax.plan", *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr[-3000:]


def test_memory_per_device_does_not_grow_with_the_slice():
    """One sequence per device: the same work a device, so the same temporaries on a slice 16x
    larger (the CPU-only matmul in a TPU program made them grow with the global batch)."""
    fields = {
        "model.dtype": "bfloat16",
        "model.hidden_size": 256,
        "model.intermediate_size": 1024,
        "model.num_attention_heads": 4,
        "seq_len": 128,
        "max_predictions_per_seq": 20,
    }
    reports = [plan.plan(small(batch_size=n, **fields), plan.make_target(f"v3-{n}"))
               for n in (8, 128)]  # fmt: skip
    few, many = (r["temporaries_gib"] for r in reports)
    assert reports[0]["mesh"]["data"] == 8 and reports[1]["mesh"]["data"] == 128
    assert many <= 1.1 * few, (few, many)


def _compiled_text(config, tpu):
    texts = []
    original = hlo_collectives.summarize
    hlo_collectives.summarize = lambda text: texts.append(text) or original(text)
    try:
        plan.plan(config, plan.make_target(tpu))
    finally:
        hlo_collectives.summarize = original
    return texts[0]


def test_tpu_program_has_no_cpu_matmul_and_no_activation_all_gather(monkeypatch):
    config = small(batch_size=64, **{"model.dtype": "bfloat16", "model.remat_policy": "none"})
    text = _compiled_text(config, "v3-32")
    assert "_bf16_matmul_cpu" not in text
    assert not re.search(r" all-gather(-start)?\(", text)  # data parallel: nothing to gather
    # The control: the host's branch (what a step deciding on jax.default_backend() compiled)
    # puts the CPU-only matmul in. (It also gathered the activations of the global batch
    # while the forward ran under the automatic partitioner; run once per batch shard, the
    # forward has no global batch to gather.)
    monkeypatch.setattr(layers, "target_platform", lambda: "cpu")
    text = _compiled_text(config, "v3-32")
    assert "_bf16_matmul_cpu" in text


def test_target_platform_reads_the_mesh():
    assert layers.target_platform() == "cpu"  # no mesh: the default backend
    devices = tpu_slices.target_devices(tpu_slices.slice_spec("v3-8"))
    with jax.set_mesh(sharding.slice_mesh((8, 1, 1), devices)):
        assert layers.target_platform() == "tpu"
    with jax.set_mesh(sharding.create_mesh((-1, 1, 1))):
        assert layers.target_platform() == "cpu"


def test_a_run_on_devices_of_two_slices_gets_the_multi_slice_mesh():
    """`create_mesh` (what a run builds) lays devices of several slices (their slice_index)
    as `slice_mesh` does: each slice a contiguous block of the data axis, fsdp and tensor
    inside a slice. The CPU's devices (no slice_index) keep the one-slice layout."""
    devices = tpu_slices.target_devices(tpu_slices.slice_spec("v4-8"), 2)
    mesh = sharding.create_mesh((8, 1, 1), devices=devices)
    assert sharding.slice_count(devices) == 2 and sharding.slice_count(jax.devices()) == 1
    expected = sharding.slice_mesh((8, 1, 1), devices, 2)
    assert mesh.devices.tolist() == expected.devices.tolist()
    slices = [d.slice_index for d in mesh.devices[:, 0, 0]]
    assert slices == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="must be a multiple of the 2 slices"):
        sharding.create_mesh((1, 8, 1), devices=devices)
    with pytest.raises(ValueError, match=r"config.mesh.slices=4 but the devices span 2 TPU"):
        sharding.create_mesh((8, 1, 1), devices=devices, slices=4)


def base_parameters(**fields):
    """ALBERT-base's parameters (shared across layers: the same at 2 layers as at 12) at 2
    layers and 128 tokens: quick to compile, with arrays large enough that the TPU's tiles
    add little padding to what is sent."""
    fields = {"model.num_hidden_layers": 2, "seq_len": 128, "max_predictions_per_seq": 20,
              **fields}  # fmt: skip
    return with_fields(pretrain.get_config("size=base"), **fields)


@pytest.mark.parametrize("tpu", ["v4-8", "v5litepod-8", "v5p-8", "v6e-8"])
def test_only_one_gradient_reduction_crosses_slices(tpu):
    """Two slices of each generation: what crosses the data-center network is all-reductions
    (of the gradients and the metrics), no gathered activations; their bytes do not grow with
    the batch (v4: 32 and 64 rows), and they are one gradient copy: a slice device's share
    of each weight's gradient, once (the forward runs once per data replica:
    `sharding.forward_per_replica`), up to the tiles' padding and the scalar metrics.

    Without it the automatic partitioner reduced a weight used twice (the shared block in
    the scan and in the split-off last layer, the word embeddings in the lookup and the tied
    decoder) once per use: 2.01x for base on 2 x v4-8."""
    batches = (32, 64) if tpu == "v4-8" else (32,)
    reports = [plan.plan(base_parameters(batch_size=b), plan.make_target(tpu, num_slices=2))
               for b in batches]  # fmt: skip
    for report in reports:
        assert report["fits"] and report["num_slices"] == 2
        assert report["mesh"]["data"] == report["devices"]
        assert set(report["collectives"]["cross_slice"]) == {"all-reduce"}
    sent = [r["collectives"]["cross_slice"]["all-reduce"]["bytes"] for r in reports]
    assert len(set(sent)) == 1  # independent of the batch: no activation crosses
    ratio = reports[0]["cross_slice_over_gradient"]
    assert ratio == pytest.approx(sent[0] / reports[0]["gradient_share_bytes"], rel=1e-3)
    assert 1.0 <= ratio <= 1.07


@pytest.mark.parametrize(
    "name,mesh,tpu",
    [("data_parallel", (4, 1, 1), "v5p-8"), ("fsdp", (1, 4, 1), "v5p-8"),
     ("fsdp_tensor", (1, 2, 2), "v5p-8"), ("fine_tuning", (4, 1, 1), "v5p-8")],
)  # fmt: skip
def test_each_weight_is_reduced_once_a_step(name, mesh, tpu):
    """#67: under the automatic partitioner each use of a weight had its gradient reduced:
    the shared block once per layer application (in the scanned loop, again in the split-off
    last layer, in each unrolled layer of fine-tuning), the word embeddings in the lookup and
    the tied decoder (base data parallel: 1.35 gradient copies a step; fine-tuning on race:
    4.0). The forward now runs once per batch shard and each weight is reduced once."""
    axes = {"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]}
    if name == "fine_tuning":  # layers unrolled, the default
        config = with_fields(finetune_configs.get_config("task=sentiment_rt,init="),
                             size="base", batch_size=32, max_seq_length=128,
                             **{"model.num_hidden_layers": 3, **axes})  # fmt: skip
    else:
        config = base_parameters(batch_size=32, **{"model.num_hidden_layers": 3, **axes})
    report = plan.plan(config, plan.make_target(tpu))
    assert report["fits"] and tuple(report["mesh"].values()) == mesh
    assert 0.99 <= report["gradient_reduction_over_params"]["within_slice"] <= 1.1, report
    if mesh[2] > 1:  # tensor parallelism's partial activations are counted apart
        assert report["tensor_parallel_reduction_bytes"] > 0


def test_the_gradient_reduction_precision_is_a_config_field():
    """config.mesh.gradient_reduction_dtype: bfloat16 sends half the bytes of float32."""
    config = base_parameters(batch_size=32, **{"model.num_hidden_layers": 3})
    ratios = [
        plan.plan(with_fields(config, **{"mesh.gradient_reduction_dtype": dtype}),
                  plan.make_target("v5p-8"))["gradient_reduction_over_params"]["within_slice"]
        for dtype in ("float32", "bfloat16")
    ]  # fmt: skip
    assert ratios[0] == pytest.approx(1.0, abs=0.02)
    assert ratios[1] == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError, match="config.mesh.gradient_reduction_dtype='float16'"):
        plan.plan(with_fields(config, **{"mesh.gradient_reduction_dtype": "float16"}),
                  plan.make_target("v5p-8"))  # fmt: skip


def test_fine_tuning_across_slices_reduces_each_gradient_once():
    """The task model runs its forward per data replica too (`TaskModel.lay_on`): one
    gradient copy crosses, for one seed and for several in one program."""
    config = with_fields(finetune_configs.get_config("task=sentiment_rt,init="),
                         batch_size=32, max_seq_length=128,
                         **{"model.num_hidden_layers": 2, "num_seeds": 2})  # fmt: skip
    report = plan.plan(config, plan.make_target("v5litepod-8", num_slices=2))
    assert report["fits"] and set(report["collectives"]["cross_slice"]) == {"all-reduce"}
    assert 1.0 <= report["cross_slice_over_gradient"] <= 1.07


# ------------------------------------------------------------------------------------ meshes


def test_explicit_mesh_that_cannot_shard_names_the_dimension_and_axis():
    config = small(batch_size=256, **{"mesh.data": 1, "mesh.fsdp": -1})  # fsdp=256 > H=128
    with pytest.raises(ValueError, match=r"dimension \d \(embed, size 128\) is not divisible by "
                                         r"mesh axis fsdp=256.*mesh.auto=True"):  # fmt: skip
        plan.plan(config, plan.make_target("v3-256"))
    auto = plan.plan(with_fields(config, **{"mesh.auto": True}), plan.make_target("v3-256"))
    assert auto["fits"] and auto["mesh_auto"]
    assert auto["mesh"] == {"data": 256, "fsdp": 1, "tensor": 1}


def test_auto_mesh_shards_only_as_far_as_needed():
    xxlarge = model_param_axes(pretrain_model("xxlarge"))
    # 223M parameters x 16 bytes (weights, gradients, two LAMB moments) = 3.3 GiB.
    shape, why = sharding.choose_mesh_shape(xxlarge, 512, 4096, 16, 15.48 * 2**30)
    assert shape == (512, 1, 1), why  # a quarter of a v3 core's HBM holds it: data parallel
    shape, why = sharding.choose_mesh_shape(xxlarge, 512, 4096, 16, 7.48 * 2**30)
    assert shape == (256, 2, 1), why  # a v2 core's does not: FSDP over 2
    shape, _ = sharding.choose_mesh_shape(xxlarge, 512, 128, 16, None)
    assert shape == (128, 1, 4)  # 128 rows over 512 devices: tensor parallel for the rest
    with pytest.raises(ValueError, match="no .* layout of 512 devices"):
        sharding.choose_mesh_shape(xxlarge, 512, 100, 16, None)


def pretrain_model(size):
    from albert_jax.model.config import model_config_from

    return model_config_from(pretrain.get_config(f"size={size}"))


# ------------------------------------------------------------------------------- fine-tuning


def test_fine_tuning_config_is_planned():
    config = finetune_configs.get_config("task=sentiment_rt,init=")
    config = with_fields(
        config,
        batch_size=64,
        max_seq_length=128,
        **{
            "model.hidden_size": 256,
            "model.num_attention_heads": 4,
            "model.intermediate_size": 1024,
        },
    )
    report = plan.plan(config, plan.make_target("v5litepod-8"))
    assert report["fits"] and report["global_batch"] == 64 and report["seq_len"] == 128
    assert report["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    # Multiple choice: a row is 4 sequences (one an option), so 4x the model FLOPs.
    fields = {k: config[k] for k in ("batch_size", "max_seq_length")}
    fields.update({f"model.{k}": v for k, v in config.model.items() if v is not None})
    race = with_fields(finetune_configs.get_config("task=race"), **fields)
    choice = plan.plan(race, plan.make_target("v5litepod-8"))
    assert choice["fits"]
    assert choice["flops_per_device"] == pytest.approx(4 * report["flops_per_device"])


def test_max_batch_finds_the_largest_fitting_batch():
    config = small(**{"model.max_position_embeddings": 1024, "seq_len": 1024,
                      "model.num_attention_heads": 8})  # fmt: skip
    found = plan.max_batch(config, plan.make_target("v2-8"), "none")
    rows = found["max_batch"]
    assert rows > 0 and rows % 8 == 0 and found["plan"]["fits"]
    over = plan.plan(with_fields(config, batch_size=rows + 8,
                                         **{"model.remat_policy": "none"}),
                     plan.make_target("v2-8"))  # fmt: skip
    assert not over["fits"]


# ------------------------------------------------------------- collectives, counted exactly


def _independent_count(text: str) -> dict[str, dict[str, float]]:
    """Collectives of an optimized HLO module's text, counted without `tpu/collectives.py`'s
    parser: every collective line (async: its `-start`) times the trip count of the `while`
    whose body holds it (one level of loops, asserted), grouped by op. Bytes only for
    all-gathers (the result) and permutes (read from the definition of the operand)."""
    defined, where, bodies = {}, {}, {}
    computation = None
    ops = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    found = []
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split("%", 1)[1].split(" ", 1)[0] if "%" in line else None
            continue
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z\-]+)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        defined[name] = shape
        where[name] = computation
        if op == "while":
            body = re.search(r"body=%(\S+?),", rest).group(1)
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
            bodies[body] = int(trip.group(1)) if trip else 1
        base = op.removesuffix("-start")
        if base in ops and not op.endswith("-done"):
            found.append((computation, base, op, shape, rest))
    assert not any(where.get(b) in bodies for b in bodies), "nested loops"
    counts: dict[str, dict[str, float]] = {}
    for comp, base, op, shape, rest in found:
        times = bodies.get(comp, 1)
        entry = counts.setdefault(base, {"count": 0, "bytes": 0})
        entry["count"] += times
        if base == "all-gather" and op == base:
            entry["bytes"] += times * sum(hlo_collectives._bytes(shape))
        if base == "collective-permute":
            operand = re.match(r"%([\w.\-]+)", rest).group(1)
            entry["bytes"] += times * sum(hlo_collectives._bytes(defined[operand]))
    return counts


@pytest.mark.parametrize(
    "name,make",
    [
        ("dp", lambda: (small(batch_size=64), "v5p-16", 1)),
        ("fsdp", lambda: (small(batch_size=64, **{"mesh.data": 1, "mesh.fsdp": 4}), "v5p-8", 1)),
        ("multi_slice", lambda: (small(batch_size=64), "v5p-8", 2)),
        ("fine_tuning", lambda: (with_fields(finetune_configs.get_config(
            "task=sentiment_rt,init="), size="tiny"), "v5litepod-8", 1)),
    ],
)  # fmt: skip
def test_the_plan_counts_every_collective_of_the_program(name, make):
    """#67: collectives that share a `channel_id` were counted once (a multi-slice program's 17
    all-gathers, all on channel 1, as 1), and a permute's bytes were its two `u32[]` context
    scalars (8 B). The plan's count now equals an independent count of the HLO text."""
    config, tpu, slices = make()
    texts = []
    original = hlo_collectives.summarize
    hlo_collectives.summarize = lambda text: texts.append(text) or original(text)
    try:
        report = plan.plan(config, plan.make_target(tpu, slices))
    finally:
        hlo_collectives.summarize = original
    ours = report["collectives"]["within_slice"]
    theirs = _independent_count(texts[0])
    # The gradient traffic: the all-reduces and reduce-scatters over the batch axes (with
    # tensor parallelism's sums of activations, every one), against one gradient copy.
    reduced = sum(ours.get(k, {}).get("bytes", 0) for k in ("all-reduce", "reduce-scatter"))
    split = report["gradient_reduction_bytes"]["within_slice"]
    assert abs(split + report["tensor_parallel_reduction_bytes"] - reduced) <= 1024
    assert 0.99 <= report["gradient_reduction_over_params"]["within_slice"] <= 1.1, report
    if slices > 1:
        assert (
            report["gradient_reduction_over_params"]["cross_slice"]
            == (report["cross_slice_over_gradient"])
        )
    # The TPU compiler's reduce-scatter is an all-reduce in an `all-reduce-scatter` computation.
    merged = lambda c, k: c.get(k, {}).get("count", 0)  # noqa: E731
    assert merged(ours, "all-reduce") + merged(ours, "reduce-scatter") == (
        merged(theirs, "all-reduce") + merged(theirs, "reduce-scatter")
    ), (ours, theirs)
    for kind in ("all-gather", "all-to-all", "collective-permute"):
        assert merged(ours, kind) == merged(theirs, kind), (kind, ours, theirs)
    for kind in ("all-gather", "collective-permute"):
        if kind in theirs:
            assert ours[kind]["bytes"] == theirs[kind]["bytes"], (kind, ours, theirs)


def test_auto_mesh_plans_with_the_targets_hbm():
    """#67: compile-only devices report no memory, so `mesh.auto` in a plan had no HBM limit and
    chose pure data parallelism, (32, 1, 1), for the unshared xxlarge on a v4-64: out of memory,
    a false "does not fit". With the generation's usable HBM it chooses what the pod would."""
    from albert_jax.pretrain.settings import validate_config

    config = with_fields(
        pretrain.get_config("size=xxlarge,sharing=none"), batch_size=256,
        **{"model.dtype": "bfloat16", "model.remat_policy": "full", "mesh.auto": True},
    )  # fmt: skip
    target = plan.make_target("v4-64")
    layout = validate_config(config, devices=target.devices, processes=target.processes)
    assert layout.mesh.shape == (4, 8, 1)
