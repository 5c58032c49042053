"""`load_pretrained` on every layout: model dir, training workdir / step dir (real Orbax
CheckpointManager, params saved sharded over 8 devices), HF checkpoints that lack heads; and
the errors that name a missing or unreadable checkpoint file."""

import gzip
import itertools
import json
import os
import re
import shutil
import struct

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from gcs import assert_local_unchanged
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from albert_jax import checkpointing, files
from albert_jax.data.tokenizer import Tokenizer, train_tokenizer
from albert_jax.interop.weight_names import flatten_params
from albert_jax.model.albert import AlbertForPreTraining, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.pretrained import (
    TRAINING_ITEMS,
    checkpoint_meta,
    detect_layout,
    load_pretrained,
    load_tf_checkpoint,
    read_checkpoint,
    save_model_dir,
)

CONFIG = ModelConfig(
    vocab_size=120,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=40,
    max_position_embeddings=32,
    sharing="attention",  # our own format stores any sharing strategy (FFN has a layer axis)
)


def random_params(config: ModelConfig, seed: int):
    """Random numpy values for every parameter (shapes from tracing init, nothing compiled)."""
    model = AlbertForPreTraining(config)
    shapes = jax.eval_shape(lambda k: nn.meta.unbox(init_params(model, k)), jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


def assert_same_tree(a, b) -> None:
    fa, fb = flatten_params(a), flatten_params(b)
    assert sorted(fa) == sorted(fb)
    for key in fa:
        np.testing.assert_array_equal(np.asarray(fa[key]), np.asarray(fb[key]), err_msg=key)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, shared_data) -> str:
    """A real (tiny) ALBERT sentencepiece model trained on Jane Austen."""
    with gzip.open(os.path.join(shared_data, "corpora", "austen.jsonl.gz"), "rt") as f:
        docs = [json.loads(line)["text"] for line in itertools.islice(f, 3)]
    lines = [line for doc in docs for line in doc.split("\n") if line.strip()]
    prefix = str(tmp_path_factory.mktemp("spm") / "austen")
    return train_tokenizer(lines, prefix, vocab_size=CONFIG.vocab_size, num_threads=1)


def test_model_dir(tmp_path, spm_model):
    params = random_params(CONFIG, seed=0)
    save_model_dir(str(tmp_path), params, CONFIG, tokenizer_path=spm_model)
    assert detect_layout(str(tmp_path)) == "model_dir"
    loaded = load_pretrained(str(tmp_path))
    assert loaded.source == "albert_jax" and loaded.step is None and loaded.initialized == ()
    assert loaded.config == CONFIG
    assert_same_tree(loaded.variables, params)
    assert isinstance(loaded.tokenizer, Tokenizer)
    assert loaded.tokenizer.encode("it is a truth universally acknowledged")
    assert loaded.tokenizer.vocab_size == CONFIG.vocab_size

    # `.variables` is `{"params": .params}`, what `.model.apply` takes.
    ids = np.array([[2, 17, 33, 58, 3, 0]], np.int32)
    apply = jax.jit(loaded.model.apply)
    out = apply(loaded.variables, ids, np.zeros_like(ids), (ids > 0).astype(np.int32))
    assert out["sop_logits"].shape == (1, 2) and np.isfinite(out["mlm_logits"]).all()

    half = load_pretrained(str(tmp_path), dtype="bfloat16", param_dtype="bfloat16")
    assert half.config.dtype == "bfloat16" and half.model.config.param_dtype == "bfloat16"
    assert {str(v.dtype) for v in flatten_params(half.variables).values()} == {"bfloat16"}
    with pytest.raises(ValueError, match="ModelConfig.dtype"):
        load_pretrained(str(tmp_path), dtype="float8")
    # Only training checkpoints hold runs of seeds to pick from.
    with pytest.raises(ValueError, match=r"run_seed=1: .* \(model_dir\) holds one model"):
        load_pretrained(str(tmp_path), run_seed=1)


def test_model_dir_config_mismatch_lists_all(tmp_path):
    save_model_dir(str(tmp_path), random_params(CONFIG, seed=1), CONFIG)
    with open(tmp_path / "model_config.json") as f:
        raw = json.load(f)
    raw["intermediate_size"] = 48
    with open(tmp_path / "model_config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError) as err:
        load_pretrained(str(tmp_path))
    ffn = "albert/encoder/group_0/inner_group_0/ffn"
    for name in ("intermediate/kernel", "intermediate/bias", "output/kernel"):
        assert f"{ffn}/{name}: checkpoint" in str(err.value)


def test_training_workdir_and_step_dir(tmp_path, spm_model):
    """The training layout: CheckpointManager items params / opt_state / data / meta."""
    config = CONFIG.replace(sharing="all")
    mesh = jax.make_mesh((8,), ("data",))
    workdir = tmp_path / "workdir"
    saved = {}
    with ocp.CheckpointManager(workdir / "checkpoints", item_names=TRAINING_ITEMS) as manager:
        for step in (100, 200):
            params = random_params(config, seed=step)
            saved[step] = params
            # As a training loop holds them: device arrays, the embedding table sharded 8-way.
            on_device = jax.device_put(params)
            table = params["params"]["albert"]["embeddings"]["word_embeddings"]
            on_device["params"]["albert"]["embeddings"]["word_embeddings"] = jax.device_put(
                table, NamedSharding(mesh, P("data", None))
            )
            # Both conventions for the params item: the variables tree or its inner dict.
            item = on_device if step == 200 else on_device["params"]
            manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(item),
                    opt_state=ocp.args.StandardSave({"count": np.int32(step)}),
                    data=ocp.args.JsonSave({"next_index": step * 4}),
                    meta=ocp.args.JsonSave(checkpoint_meta(config, step, seed=0)),
                ),
            )
        manager.wait_until_finished()
    shutil.copyfile(spm_model, workdir / "tokenizer.model")

    assert detect_layout(str(workdir)) == "workdir"
    latest = load_pretrained(str(workdir))
    assert latest.step == 200 and latest.source == "albert_jax" and latest.config == config
    assert_same_tree(latest.variables, saved[200])
    assert isinstance(latest.tokenizer, Tokenizer)

    step_dir = workdir / "checkpoints" / "100"
    assert detect_layout(str(step_dir)) == "step_dir"
    first = load_pretrained(str(step_dir))
    assert first.step == 100 and first.tokenizer_path == str(workdir / "tokenizer.model")
    assert_same_tree(first.variables, saved[100])
    assert isinstance(first.tokenizer, Tokenizer)

    empty = tmp_path / "fresh_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="no finished checkpoint"):
        load_pretrained(str(empty))


def test_hf_checkpoints_without_heads(tmp_path):
    """HF `AlbertModel` (no MLM / SOP heads) and `AlbertForMaskedLM` (no pooler, no SOP head):
    the backbone matches HF, the absent parts are initialized like our model and reported."""
    import torch
    import transformers

    hf_config = transformers.AlbertConfig(
        vocab_size=150,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        max_position_embeddings=32,
        hidden_act="gelu_new",
    )
    ids = np.array([[2, 9, 18, 27, 3, 40, 41, 3], [2, 70, 71, 3, 80, 3, 0, 0]])
    segments = np.array([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    inputs = dict(
        input_ids=torch.from_numpy(ids),
        token_type_ids=torch.from_numpy(segments),
        attention_mask=torch.from_numpy(mask),
    )
    apply = None
    for cls, absent in (
        (transformers.AlbertModel, ("predictions", "sop_classifier")),
        (transformers.AlbertForMaskedLM, ("albert/pooler", "sop_classifier")),
    ):
        torch.manual_seed(0)
        hf = cls(hf_config).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
            ref = hf(**inputs, output_hidden_states=True)
        hf_dir = tmp_path / cls.__name__
        hf.save_pretrained(hf_dir)
        loaded = load_pretrained(str(hf_dir), seed=3)
        assert loaded.source == "hf" and loaded.initialized == absent
        # One read as stored (what fine-tuning takes): the absent parts are absent.
        stored = read_checkpoint(str(hf_dir))
        assert stored.absent == absent and not any(k.startswith(absent) for k in stored.weights)
        completed = flatten_params(loaded.variables)
        for name, value in stored.weights.items():
            np.testing.assert_array_equal(value, completed[name])
        apply = apply or jax.jit(loaded.model.apply)  # same config: compile once
        out = apply(loaded.variables, ids, segments, mask)
        seq = np.asarray(out["sequence_output"])
        assert np.abs(seq - ref.hidden_states[-1].numpy()).max() < 1e-4
        if cls is transformers.AlbertModel:
            assert np.abs(np.asarray(out["pooled_output"]) - ref.pooler_output.numpy()).max() < 1e-4
        else:
            assert np.abs(np.asarray(out["mlm_logits"]) - ref.logits.numpy()).max() < 1e-4
        # Fresh parts follow the model's init: unit LN scale, zero biases, truncated normal.
        sop = loaded.params["sop_classifier"]["classifier"]
        assert not sop["bias"].any()
        assert np.abs(sop["kernel"]).max() <= 2 * CONFIG.initializer_range
        assert 0.5 < sop["kernel"].std() / CONFIG.initializer_range < 1.2
        if "predictions" in absent:
            assert (loaded.params["predictions"]["LayerNorm"]["scale"] == 1).all()


def test_unknown_layout(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError) as err:
        load_pretrained(str(tmp_path))
    for looked_for in ("model_config.json", "checkpoints/", "config.json", "albert_config.json"):
        assert looked_for in str(err.value)
    assert "notes.txt" in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(str(tmp_path / "missing"))


def test_missing_paths_are_named(tmp_path, monkeypatch):
    """A missing workdir, step dir or model dir: ValueError naming the path as given, before
    anything is built; nothing is written where the caller runs."""
    monkeypatch.chdir(tmp_path)
    for path in ("no_such_run", str(tmp_path / "run" / "checkpoints" / "10"), "gs_typo/model"):
        with pytest.raises(ValueError, match=re.escape(repr(path)) + " does not exist"):
            load_pretrained(path)
    assert os.listdir(tmp_path) == []


TINY_HF = dict(
    vocab_size=64,
    embedding_size=8,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=16,
    max_position_embeddings=16,
)


def test_truncated_hf_weights_are_named(tmp_path):
    """A cut-off `model.safetensors` (in its header or in its data) or `pytorch_model.bin`:
    the HF reader, `load_pretrained`, fine-tuning's `init=` and `convert --from=hf` each end
    in one ValueError that names the file and says why."""
    from test_convert import random_hf_model, run_cli

    from albert_jax.finetune.train import finetune_and_evaluate
    from albert_jax.interop.hf_checkpoint import load_hf_checkpoint
    from configs.finetune import get_config

    hf = random_hf_model(TINY_HF, seed=1)
    safe, legacy = tmp_path / "safe", tmp_path / "legacy"
    hf.save_pretrained(safe)
    hf.save_pretrained(legacy, safe_serialization=False)
    weights = safe / "model.safetensors"
    intact = weights.read_bytes()
    expected = re.escape(f"{weights}: not a readable safetensors file: truncated")
    for keep in (20, len(intact) - 10):  # inside the header; inside the last tensor
        weights.write_bytes(intact[:keep])
        with pytest.raises(ValueError, match=expected):
            load_hf_checkpoint(str(safe))
        with pytest.raises(ValueError, match=expected):
            load_pretrained(str(safe))

    # Fine-tuning reads `init=` through load_pretrained before any data or compilation.
    config = get_config(f"task=sentiment_rt,init={safe}")
    config.data.train_files = config.data.eval_files = str(tmp_path / "unused.jsonl")
    with pytest.raises(ValueError, match=expected):
        finetune_and_evaluate(config, str(tmp_path / "run"))

    done = run_cli("--from=hf", f"--src={safe}", f"--dst={tmp_path / 'out'}")
    assert done.returncode != 0
    assert re.match("error: " + expected, done.stderr.strip().splitlines()[-1]), done.stderr
    assert "Traceback" not in done.stderr  # an expected error: one line (albert_jax.runtime.cli)
    assert not (tmp_path / "out").exists()

    legacy_weights = legacy / "pytorch_model.bin"
    legacy_weights.write_bytes(legacy_weights.read_bytes()[:-100])
    bin_error = re.escape(f"{legacy_weights}: not a readable PyTorch state dict: ")
    with pytest.raises(ValueError, match=bin_error):
        load_pretrained(str(legacy))


@pytest.mark.parametrize("shape", [[-2, -4], [-1, 4], [2.5, 3.2], ["2", 4], [True, 8]])
def test_safetensors_header_with_bad_dims_is_named(shape):
    """numpy's own ValueError / TypeError for a negative or non-integer dimension named
    neither the file nor the tensor."""
    from albert_jax.interop.hf_checkpoint import read_safetensors

    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 32]}})
    data = struct.pack("<Q", len(header)) + header.encode() + bytes(32)
    expected = r"x/model.safetensors: not a readable safetensors file: "
    with pytest.raises(ValueError, match=expected):
        read_safetensors(data, "x/model.safetensors")


def _with_offsets(data: bytes, change) -> bytes:
    """`data` (a safetensors file) with its header rewritten by `change(header)`."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    change(header)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + size :]


def test_safetensors_with_overlapping_or_shifted_offsets_are_refused(tmp_path):
    """A header whose tensor ranges overlap (a LayerNorm scale given its bias's bytes) or are
    shifted into a neighbour has the right sizes, so a parser that only checks sizes loaded
    the wrong weights without a word. The safetensors library refuses both; the error names
    the file."""
    from test_convert import random_hf_model

    from albert_jax.interop.hf_checkpoint import load_hf_checkpoint

    hf = random_hf_model(TINY_HF, seed=1)
    hf.save_pretrained(tmp_path / "ok")
    intact = (tmp_path / "ok" / "model.safetensors").read_bytes()
    scale, bias = "albert.embeddings.LayerNorm.weight", "albert.embeddings.LayerNorm.bias"

    def overlap(header):
        header[scale]["data_offsets"] = header[bias]["data_offsets"]

    def shift(header):
        begin, end = header[scale]["data_offsets"]
        header[scale]["data_offsets"] = [begin + 4, end + 4]

    for name, change in [("overlap", overlap), ("shift", shift)]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_bytes((tmp_path / "ok" / "config.json").read_bytes())
        (bad / "model.safetensors").write_bytes(_with_offsets(intact, change))
        expected = re.escape(f"{bad / 'model.safetensors'}: not a readable safetensors file: ")
        with pytest.raises(ValueError, match=expected + ".*offset"):
            load_hf_checkpoint(str(bad))
        with pytest.raises(ValueError, match=expected):
            load_pretrained(str(bad))


def test_broken_tf1_checkpoints_are_named(tmp_path):
    """An official TF1 checkpoint with a cut-off data file, a corrupt index or no index at all
    ends in one ValueError naming the file."""
    from test_convert import official_variables, write_tf1_checkpoint

    official = tmp_path / "official"
    official.mkdir()
    (official / "albert_config.json").write_text(json.dumps({**TINY_HF, "hidden_act": "gelu"}))
    write_tf1_checkpoint(
        str(official / "model.ckpt"), official_variables(TINY_HF, np.random.default_rng(0)), 3, True
    )
    prefix = official / "model.ckpt-3"
    data, index = official / "model.ckpt-3.data-00000-of-00001", official / "model.ckpt-3.index"
    intact_data, intact_index = data.read_bytes(), index.read_bytes()

    data.write_bytes(intact_data[: len(intact_data) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{data}: not a readable TF checkpoint data")):
        load_pretrained(str(official))
    data.write_bytes(intact_data)

    index.write_bytes(intact_index[: len(intact_index) // 2])
    for read, src in ((load_tf_checkpoint, official), (load_pretrained, prefix)):
        with pytest.raises(ValueError, match=re.escape(f"{index}: not a readable TF checkpoint")):
            read(str(src))

    index.unlink()
    for read in (load_pretrained, load_tf_checkpoint):
        for src in (official, prefix):
            with pytest.raises(
                ValueError, match=re.escape(f"{src}: incomplete TF checkpoint: {index} ")
            ):
                read(str(src))


def test_gcs_workdir_and_step_dir(gcs, tmp_path, monkeypatch, spm_model):
    """A training workdir on gs:// (as the loop writes it: Orbax checkpoints, the tokenizer next
    to them): `load_pretrained` of the workdir and of a step dir gives what the same files give
    locally, tokenizer included; nothing is written to the local working directory."""
    config = CONFIG.replace(sharing="all")
    local, remote = str(tmp_path / "local_run"), gcs.url("test_pretrained/run")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    saved = {step: random_params(config, seed=step) for step in (3, 6)}
    for workdir in (local, remote):
        with checkpointing.Checkpointer(workdir, every_steps=1) as ckpt:
            for step, params in saved.items():
                ckpt.save(
                    step,
                    params=params["params"],
                    opt_state={"count": np.int32(step)},
                    data={"next_index": step},
                    meta=checkpoint_meta(config, step),
                    force=True,
                )
        files.copy(spm_model, f"{workdir}/{checkpointing.TOKENIZER_FILE}")
    text = "it is a truth universally acknowledged"
    for suffix, step in (("", 6), ("/checkpoints/3", 3)):
        want, got = load_pretrained(local + suffix), load_pretrained(remote + suffix)
        assert got.step == want.step == step and got.config == want.config == config
        assert got.tokenizer_path == f"{remote}/tokenizer.model"
        assert got.tokenizer.encode(text) == want.tokenizer.encode(text)
        assert_same_tree(got.params, want.params)
        assert_same_tree(got.variables, saved[step])
    missing = gcs.url("test_pretrained/no_such_run")
    with pytest.raises(ValueError, match=re.escape(repr(missing)) + " does not exist"):
        load_pretrained(missing)
    assert_local_unchanged(str(cwd))
