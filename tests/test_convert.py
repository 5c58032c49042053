"""Checkpoint interop against HF transformers (PyTorch ALBERT) and official TF1 checkpoints.

Reference outputs come from HF's own code: `AlbertForPreTraining.forward` for parity,
`save_pretrained` / `from_pretrained` for the file format and `load_tf_weights_in_albert` as an
independent reader of the official TF1 variable names.
"""

import json
import logging
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

os.environ.setdefault("USE_TF", "0")  # keep transformers from importing TF (we import it once)
os.environ.setdefault("USE_FLAX", "0")
import torch  # noqa: E402
import transformers  # noqa: E402
from gcs import assert_local_unchanged  # noqa: E402
from safetensors.numpy import load, load_file  # noqa: E402

from albert_jax.interop.hf_checkpoint import (  # noqa: E402
    hf_state_dict_to_params,
    load_hf_checkpoint,
    load_hf_state_dict,
    params_to_hf_state_dict,
    save_hf_checkpoint,
    to_hf_config,
)
from albert_jax.interop.tf1_checkpoint import tf_checkpoint_to_params  # noqa: E402
from albert_jax.interop.weight_names import missing_parts  # noqa: E402
from albert_jax.model.albert import AlbertForPreTraining, init_params  # noqa: E402
from albert_jax.model.config import ModelConfig  # noqa: E402
from albert_jax.pretrained import load_pretrained, load_tf_checkpoint, save_model_dir  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # fp32 parity bound (absolute)

# Small ALBERT shapes (HF AlbertConfig field names). "e_eq_h" has E == H, odd sizes and 3 types.
HF_CONFIGS = {
    "shared": dict(
        vocab_size=320,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
    ),
    "groups": dict(
        vocab_size=200,
        embedding_size=24,
        hidden_size=48,
        num_hidden_layers=4,
        num_hidden_groups=2,
        inner_group_num=2,
        num_attention_heads=6,
        intermediate_size=64,
        max_position_embeddings=16,
    ),
    "e_eq_h": dict(
        vocab_size=333,
        embedding_size=40,
        hidden_size=40,
        num_hidden_layers=3,
        num_attention_heads=5,
        intermediate_size=72,
        max_position_embeddings=24,
        type_vocab_size=3,
    ),
}


# ----------------------------------------------------------------------------------- helpers
def make_batch(vocab_size: int, seed: int, batch: int = 3, seq: int = 12, preds: int = 4):
    """Random inputs with padding (rows of length 12, 9, 5) and a nonzero segment B."""
    rng = np.random.default_rng(seed)
    lengths = np.array([seq, seq - 3, 5])[:batch]
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    ids = rng.integers(5, vocab_size, (batch, seq)).astype(np.int32) * mask
    segments = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, preds), np.int32)
    for b, n in enumerate(lengths):
        segments[b, n // 2 : n] = 1
        positions[b] = np.sort(rng.choice(n, preds, replace=False))
    return {"ids": ids, "segments": segments, "mask": mask, "positions": positions}


def random_hf_model(config: dict, seed: int, cls=transformers.AlbertForPreTraining):
    """An eval-mode HF model whose every tensor (biases and LayerNorms too) is random."""
    torch.manual_seed(seed)
    model = cls(transformers.AlbertConfig(hidden_act="gelu_new", **config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def hf_outputs(model, batch) -> dict[str, np.ndarray]:
    t = {k: torch.from_numpy(v).long() for k, v in batch.items()}
    with torch.no_grad():
        out = model(
            input_ids=t["ids"],
            attention_mask=t["mask"],
            token_type_ids=t["segments"],
            output_hidden_states=True,
        )
    logits = out.prediction_logits.numpy()  # [B,S,V]: gather the masked positions
    return {
        "sequence_output": out.hidden_states[-1].numpy(),
        "mlm_logits": np.take_along_axis(logits, batch["positions"][..., None], axis=1),
        "sop_logits": out.sop_logits.numpy(),
    }


def random_params(config: ModelConfig, seed: int):
    """Random values for every parameter of our model (shapes from tracing `init` only:
    compiling the init program costs far more than these tests). No zero biases or unit
    LayerNorm scales, which would hide mapping mistakes."""
    model = AlbertForPreTraining(config)
    shapes = jax.eval_shape(lambda k: nn.meta.unbox(init_params(model, k)), jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, s: (
            (1.0 if path[-1].key == "scale" else 0.0)
            + 0.05 * rng.standard_normal(s.shape, np.float32)
        ),
        shapes,
    )


_APPLY: dict = {}


def jax_outputs(config: ModelConfig, params, batch) -> dict[str, np.ndarray]:
    # One compiled function per distinct model (the projection flag only matters when E == H).
    key = config.replace(always_project_embeddings=config.has_embedding_projection)
    if key not in _APPLY:
        _APPLY[key] = jax.jit(AlbertForPreTraining(key).apply)
    out = _APPLY[key](params, batch["ids"], batch["segments"], batch["mask"], batch["positions"])
    return {k: np.asarray(out[k]) for k in ("sequence_output", "mlm_logits", "sop_logits")}


def assert_parity(ours: dict, ref: dict, tol: float = TOL) -> None:
    for name in ("sequence_output", "mlm_logits", "sop_logits"):
        assert ours[name].shape == ref[name].shape, name
        err = np.abs(ours[name] - ref[name]).max()
        assert err <= tol, f"{name}: max abs diff {err:.3g} > {tol}"
        assert np.abs(ref[name]).max() > 1e-2, f"{name} is degenerate"


# ------------------------------------------------------------------------- HF -> albert_jax
@pytest.mark.parametrize(
    "name,safetensors", [("shared", True), ("groups", True), ("e_eq_h", True), ("shared", False)]
)
def test_hf_parity(name, safetensors, tmp_path):
    cfg = HF_CONFIGS[name]
    hf = random_hf_model(cfg, seed=len(name))
    # Where HF differs from the official model: its MLM-head LayerNorm must use the config eps
    # (1e-12, as TF) and its SOP-head dropout must be off (eval mode), else parity is void.
    assert hf.predictions.LayerNorm.eps == 1e-12 and not hf.training
    hf.save_pretrained(tmp_path, safe_serialization=safetensors)
    weights = "model.safetensors" if safetensors else "pytorch_model.bin"
    assert os.path.exists(tmp_path / weights)

    loaded = load_pretrained(str(tmp_path))
    assert loaded.source == "hf" and loaded.initialized == () and loaded.tokenizer is None
    # HF always projects E->H, also when E == H.
    assert loaded.config.always_project_embeddings and loaded.config.hidden_act == "gelu_new"
    batch = make_batch(cfg["vocab_size"], seed=1)
    assert_parity(jax_outputs(loaded.config, loaded.variables, batch), hf_outputs(hf, batch))

    if safetensors:
        # HF -> ours -> HF gives back exactly the saved tensors.
        saved = load_file(str(tmp_path / "model.safetensors"))
        back = params_to_hf_state_dict(loaded.variables, loaded.config)
        assert sorted(back) == sorted(saved)
        for key in saved:
            np.testing.assert_array_equal(back[key], saved[key], err_msg=key)
    if name == "groups":
        # With the tied copies the export also loads strictly into a fresh PyTorch model.
        tied = params_to_hf_state_dict(loaded.variables, loaded.config, tied_duplicates=True)
        fresh = transformers.AlbertForPreTraining(hf.config).eval()
        fresh.load_state_dict({k: torch.tensor(v) for k, v in tied.items()}, strict=True)
        assert_parity(jax_outputs(loaded.config, loaded.variables, batch), hf_outputs(fresh, batch))


def test_hf_state_dict_prefix_heads_and_extras(caplog):
    """A base-model state dict (no `albert.` prefix, no heads) plus an unknown tensor."""
    cfg = HF_CONFIGS["shared"]
    hf = random_hf_model(cfg, seed=3, cls=transformers.AlbertModel)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert not any(k.startswith("albert.") for k in state)
    state["classifier.weight"] = np.zeros((3, 32), np.float32)
    config = ModelConfig.from_dict({**cfg, "always_project_embeddings": True})
    with caplog.at_level(logging.WARNING, logger="albert_jax.convert"):
        params = hf_state_dict_to_params(state, config)
    assert missing_parts(params) == ["predictions", "sop_classifier"]
    assert "classifier.weight" in caplog.text and "'predictions', 'sop_classifier'" in caplog.text
    np.testing.assert_array_equal(
        params["params"]["albert"]["encoder"]["group_0"]["inner_group_0"]["attention"]["query"][
            "kernel"
        ],
        state["encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight"].T.reshape(
            32, 4, 8
        ),
    )


def test_hf_sharded_bfloat16_checkpoint(tmp_path):
    """Sharded safetensors (index.json) holding bfloat16, which numpy itself cannot read."""
    hf = random_hf_model(HF_CONFIGS["shared"], seed=5).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    state = load_hf_state_dict(str(tmp_path))
    reference = hf.state_dict()
    assert set(state) == set(reference) - {"predictions.decoder.weight", "predictions.decoder.bias"}
    for key, value in state.items():
        assert value.dtype.name == "bfloat16", key
        np.testing.assert_array_equal(value.astype(np.float32), reference[key].float().numpy())
    config, params = load_hf_checkpoint(str(tmp_path))
    assert config.param_dtype == "float32" and config.dtype == "float32"
    word = params["params"]["albert"]["embeddings"]["word_embeddings"]
    assert word.dtype == np.float32
    np.testing.assert_array_equal(
        word, reference["albert.embeddings.word_embeddings.weight"].float().numpy()
    )


def test_hf_errors_list_every_problem():
    cfg = HF_CONFIGS["shared"]
    state = {k: v.numpy() for k, v in random_hf_model(cfg, seed=4).state_dict().items()}
    config = ModelConfig.from_dict({**cfg, "always_project_embeddings": True})
    bad_shape = "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight"
    gone = "albert.pooler.bias"
    state[bad_shape] = state[bad_shape][:, :-1]
    del state[gone]
    with pytest.raises(ValueError) as err:
        hf_state_dict_to_params(state, config)
    assert bad_shape in str(err.value) and gone in str(err.value)
    assert "(48, 31)" in str(err.value)

    # HF has the projection even for E == H; an official-style config cannot take it.
    with pytest.raises(ValueError, match="always_project_embeddings"):
        hf_state_dict_to_params(
            state, config.replace(embedding_size=32, always_project_embeddings=False)
        )
    # Only the all-shared layout has an HF / TF equivalent.
    with pytest.raises(ValueError, match="sharing='ffn'"):
        params_to_hf_state_dict({}, config.replace(sharing="ffn"))
    with pytest.raises(ValueError, match="sharing"):
        hf_state_dict_to_params(state, config.replace(sharing="none"))


# ------------------------------------------------------------------------- albert_jax -> HF
@pytest.mark.parametrize("official_e_eq_h", [False, True])
def test_ours_to_hf_round_trip(official_e_eq_h, tmp_path):
    if official_e_eq_h:
        # E == H without a projection (official layout): exported with an identity projection.
        config = ModelConfig.from_dict(HF_CONFIGS["e_eq_h"])
        assert not config.has_embedding_projection
    else:
        config = ModelConfig.from_dict(HF_CONFIGS["groups"])
    params = random_params(config, seed=1)

    save_hf_checkpoint(params, config, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        hf_json = json.load(f)
    assert hf_json["model_type"] == "albert"
    assert hf_json["architectures"] == ["AlbertForPreTraining"]
    assert hf_json["layer_norm_eps"] == 1e-12 and hf_json["hidden_act"] == "gelu_new"
    hf, info = transformers.AlbertForPreTraining.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert all(not v for v in info.values()), info  # no missing / unexpected / mismatched keys
    batch = make_batch(config.vocab_size, seed=2)
    assert_parity(jax_outputs(config, params, batch), hf_outputs(hf.eval(), batch))


# ----------------------------------------------------------------------- official TF1 -> ours
def official_variables(c: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random values under the official google-research/albert names (G = inner = 1)."""
    V, E, H = c["vocab_size"], c["embedding_size"], c["hidden_size"]
    F, P = c["intermediate_size"], c["max_position_embeddings"]
    out: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple, center: float = 0.0) -> None:
        out[name] = (center + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    def dense(scope: str, n_in: int, n_out: int) -> None:
        add(f"{scope}/kernel", (n_in, n_out))
        add(f"{scope}/bias", (n_out,))

    def layer_norm(scope: str, width: int) -> None:
        add(f"{scope}/gamma", (width,), 1.0)
        add(f"{scope}/beta", (width,))

    add("bert/embeddings/word_embeddings", (V, E))
    add("bert/embeddings/token_type_embeddings", (2, E))
    add("bert/embeddings/position_embeddings", (P, E))
    layer_norm("bert/embeddings/LayerNorm", E)
    dense("bert/encoder/embedding_hidden_mapping_in", E, H)
    block = "bert/encoder/transformer/group_0/inner_group_0"
    for proj in ("query", "key", "value"):
        dense(f"{block}/attention_1/self/{proj}", H, H)
    dense(f"{block}/attention_1/output/dense", H, H)
    layer_norm(f"{block}/LayerNorm", H)
    dense(f"{block}/ffn_1/intermediate/dense", H, F)
    dense(f"{block}/ffn_1/intermediate/output/dense", F, H)
    layer_norm(f"{block}/LayerNorm_1", H)
    dense("bert/pooler/dense", H, H)
    dense("cls/predictions/transform/dense", H, E)
    layer_norm("cls/predictions/transform/LayerNorm", E)
    add("cls/predictions/output_bias", (V,))
    add("cls/seq_relationship/output_weights", (2, H))
    add("cls/seq_relationship/output_bias", (2,))
    return out


def write_tf1_checkpoint(prefix: str, variables: dict, step: int | None, write_state: bool):
    """A real TF1 checkpoint: v1 variables in a graph, saved by `tf.compat.v1.train.Saver`."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf_vars = [
            tf.compat.v1.Variable(value, name=name, dtype=tf.float32)
            for name, value in variables.items()
        ]
        tf_vars.append(tf.compat.v1.train.get_or_create_global_step())
        saver = tf.compat.v1.train.Saver(tf_vars)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(
                sess, prefix, global_step=step, write_meta_graph=False, write_state=write_state
            )


def test_tf1_official_checkpoint(tmp_path, caplog):
    sizes = HF_CONFIGS["shared"]
    values = official_variables(sizes, np.random.default_rng(0))
    # Optimizer slots as the official LAMB/Adam optimizers name them: must be ignored.
    slots = {
        f"{n}/{s}": np.zeros_like(v)
        for n, v in list(values.items())[:3]
        for s in ("adam_m", "adam_v")
    }
    official = tmp_path / "official"
    official.mkdir()
    official_json = {
        **{k: sizes[k] for k in sizes},
        "hidden_act": "gelu",  # TF's gelu is the tanh form
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "num_hidden_groups": 1,
        "inner_group_num": 1,
        "down_scale_factor": 1,  # released keys that modeling.py ignores
        "net_structure_type": 0,
        "gap_size": 0,
        "num_memory_blocks": 0,
        "layers_to_keep": [],
    }
    (official / "albert_config.json").write_text(json.dumps(official_json))
    write_tf1_checkpoint(str(official / "model.ckpt"), {**values, **slots}, 7, True)

    loaded = load_pretrained(str(official))
    assert loaded.source == "tf" and loaded.config.hidden_act == "gelu_new"
    assert not loaded.config.always_project_embeddings and loaded.initialized == ()

    # Reference: HF's own TF1 reader into a PyTorch model.
    hf = transformers.AlbertForPreTraining(
        transformers.AlbertConfig(hidden_act="gelu_new", **sizes)
    ).eval()
    transformers.load_tf_weights_in_albert(hf, hf.config, str(official / "model.ckpt-7"))
    batch = make_batch(sizes["vocab_size"], seed=5)
    assert_parity(jax_outputs(loaded.config, loaded.variables, batch), hf_outputs(hf, batch))
    sop_kernel = loaded.params["sop_classifier"]["classifier"]["kernel"]
    np.testing.assert_array_equal(sop_kernel, values["cls/seq_relationship/output_weights"].T)

    # A bare checkpoint prefix next to albert_config.json loads the same.
    by_prefix = load_pretrained(str(official / "model.ckpt-7"))
    jax.tree.map(np.testing.assert_array_equal, by_prefix.params, loaded.params)

    # TF-Hub style names (`module/` prefix), LAMB slots, a fine-tuning head, no `checkpoint`
    # file: only our importer (HF's reader trips over the LAMB slots).
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "albert_config.json").write_text(json.dumps(official_json))
    hub_vars = {f"module/{k}": v for k, v in values.items()}
    hub_vars.update({f"module/{k}/lamb_m": np.zeros_like(v) for k, v in list(values.items())[:2]})
    hub_vars["module/cls/squad/output_weights"] = np.zeros((2, sizes["hidden_size"]), np.float32)
    write_tf1_checkpoint(str(hub / "model.ckpt-best"), hub_vars, None, False)
    assert not (hub / "checkpoint").exists()
    with caplog.at_level(logging.INFO, logger="albert_jax.convert"):
        from_hub = load_pretrained(str(hub))
    jax.tree.map(np.testing.assert_array_equal, from_hub.params, loaded.params)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cls/squad/output_weights" in w for w in warnings)
    assert not any("lamb_m" in w or "global_step" in w for w in warnings)
    assert any("lamb_m" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_tf1_missing_and_misshaped(tmp_path):
    sizes = HF_CONFIGS["shared"]
    values = official_variables(sizes, np.random.default_rng(1))
    gone = "bert/encoder/transformer/group_0/inner_group_0/LayerNorm_1/beta"
    bad = "cls/predictions/transform/dense/kernel"
    del values[gone]
    values[bad] = values[bad][:, :3]
    write_tf1_checkpoint(str(tmp_path / "model.ckpt"), values, 1, True)
    config = ModelConfig.from_dict(sizes)
    with pytest.raises(ValueError) as err:
        tf_checkpoint_to_params(str(tmp_path / "model.ckpt-1"), config)
    assert gone in str(err.value) and bad in str(err.value)


# -------------------------------------------------------------------------------------- CLI
def run_cli(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    python_path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": python_path}
    return subprocess.run(
        [sys.executable, "-m", "albert_jax.convert", *args],
        cwd=cwd, env=env, capture_output=True, text=True,
    )  # fmt: skip


def test_cli_hf_round_trip(tmp_path):
    cfg = HF_CONFIGS["shared"]
    hf = random_hf_model(cfg, seed=9)
    hf.save_pretrained(tmp_path / "hf")
    ours, back = tmp_path / "ours", tmp_path / "hf_back"
    done = run_cli("--from=hf", f"--src={tmp_path / 'hf'}", f"--dst={ours}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote albert_jax model dir" in done.stdout
    assert (ours / "model_config.json").exists() and (ours / "params").is_dir()
    loaded = load_pretrained(str(ours))
    assert loaded.source == "albert_jax"
    batch = make_batch(cfg["vocab_size"], seed=6)
    assert_parity(jax_outputs(loaded.config, loaded.variables, batch), hf_outputs(hf, batch))

    done = run_cli("--to=hf", f"--src={ours}", f"--dst={back}")
    assert done.returncode == 0, done.stderr[-2000:]
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(back / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    for key in original:
        np.testing.assert_array_equal(original[key], exported[key], err_msg=key)

    bad = run_cli("--from=hf", "--to=hf", f"--src={ours}", f"--dst={back}")
    assert bad.returncode != 0 and "exactly one of --from" in bad.stderr


def test_cli_refuses_to_write_over_its_source_or_a_run(tmp_path):
    """`--to=hf --src=W --dst=W` replaced the run's config.json with the HF config."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"seed": 0}\n')
    for dst in (run, run / "hf"):
        done = run_cli("--to=hf", f"--src={run}", f"--dst={dst}")
        assert done.returncode != 0 and f"--dst={dst} is inside --src={run}" in done.stderr
    done = run_cli("--to=hf", f"--src={tmp_path / 'elsewhere'}", f"--dst={run}")
    assert done.returncode != 0 and "holds a training run (checkpoints)" in done.stderr
    assert (run / "config.json").read_text() == '{"seed": 0}\n'
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]


def test_missing_sources_are_named(tmp_path):
    """Every reader of a foreign checkpoint, and the CLI, name a missing source."""
    missing = str(tmp_path / "nowhere")
    config = ModelConfig.from_dict(HF_CONFIGS["shared"])
    for read in (load_hf_checkpoint, load_hf_state_dict, load_tf_checkpoint):
        with pytest.raises(ValueError, match=re.escape(missing) + r".* does not exist"):
            read(missing)
    with pytest.raises(ValueError, match=re.escape(f"{missing}/model.ckpt-1.index does not")):
        tf_checkpoint_to_params(f"{missing}/model.ckpt-1", config)
    dst = tmp_path / "out"
    done = run_cli("--from=tf", f"--src={missing}", f"--dst={dst}")
    assert done.returncode != 0 and f"error: official TF1 checkpoint: {missing}" in done.stderr
    assert not dst.exists()


def test_cli_to_hf_and_back_on_gcs(gcs, tmp_path, monkeypatch):
    """`--to=hf` from a gs:// model dir into a gs:// HF dir writes the tensors the local
    conversion writes, and `--from=hf` of that gs:// HF dir into a gs:// model dir gives back
    the same params; nothing is written to the local working directory."""
    hf = random_hf_model(HF_CONFIGS["shared"], seed=11)
    hf.save_pretrained(tmp_path / "hf")
    config, params = load_hf_checkpoint(str(tmp_path / "hf"))
    save_hf_checkpoint(params, config, str(tmp_path / "hf_local"))
    ours, hf_dir, back = (gcs.url(f"test_convert/{name}") for name in ("ours", "hf", "back"))
    save_model_dir(ours, params, config)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    done = run_cli("--to=hf", f"--src={ours}", f"--dst={hf_dir}", cwd=str(cwd))
    assert done.returncode == 0, done.stderr[-2000:]
    want = load_file(str(tmp_path / "hf_local" / "model.safetensors"))
    got = load(gcs.read("test_convert/hf/model.safetensors"))
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert json.loads(gcs.read("test_convert/hf/config.json")) == to_hf_config(config)

    done = run_cli("--from=hf", f"--src={hf_dir}", f"--dst={back}", cwd=str(cwd))
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = load_pretrained(back)
    assert loaded.source == "albert_jax" and loaded.config == config
    jax.tree.map(np.testing.assert_array_equal, loaded.variables, params)
    assert_local_unchanged(str(cwd))
