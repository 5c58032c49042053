"""The analysis instruments on a tiny model the tests pretrain (test_sop_diagnostics'
`sop_run`: test_train's model, all-shared, 2 layers, 6 LAMB steps, evaluated on 2 held-out
batches): the depth sweep CLI, Figure 2's layer transitions against hidden states computed
another way, and a shared checkpoint run at another depth by continued pretraining and
fine-tuning; the depth changes that are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from test_finetune import task_files, tiny_scratch_config
from test_sop_diagnostics import sop_run

from albert_jax import metrics_writer, trees
from albert_jax.analysis import depth, heldout, layer_transitions
from albert_jax.finetune import settings as finetune_config
from albert_jax.finetune import train as finetune
from albert_jax.model.albert import AlbertForPreTraining, AlbertModel, init_params
from albert_jax.model.config import ModelConfig
from albert_jax.pretrain import train
from albert_jax.pretrain.settings import validate_config
from albert_jax.pretrained import save_model_dir
from albert_jax.resume import load_params_only
from albert_jax.runtime import checkpoint_dirs
from configs.pretrain import get_config as pretrain_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 1000  # the corpus tokenizer's (conftest `corpus`)


@pytest.fixture(scope="module")
def shared_init(corpus, tmp_path_factory) -> str:
    return sop_run(corpus, tmp_path_factory)[0]


def test_depth_sweep_cli_one_value_per_depth_and_the_runs_own_eval(shared_init, tmp_path):
    out = tmp_path / "depth"
    command = [sys.executable, "-m", "albert_jax.analysis.depth", f"--init={shared_init}",
               "--layers=1,2,4", "--eval_batches=2", f"--out={out}", "--json"]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON line on stdout, the logs go to stderr
    result = json.loads(lines[0])
    assert result["layers"] == [1, 2, 4] and result["trained_layers"] == 2
    for key in ("eval_mlm_accuracy", "eval_sop_accuracy", "eval_loss"):
        assert len(result[key]) == 3 and all(np.isfinite(result[key])), key
    # At the trained depth: the run's own last evaluation (same 2 held-out batches).
    final = [r for r in metrics_writer.read_metrics(shared_init) if "eval_loss" in r][-1]
    for key in ("eval_mlm_accuracy", "eval_sop_accuracy", "eval_loss"):
        assert result[key][1] == pytest.approx(final[key], rel=1e-5), key
    # Other depths run other functions of the same weights.
    assert result["eval_loss"][0] != result["eval_loss"][1] != result["eval_loss"][2]
    assert json.loads((out / depth.JSON_FILE).read_text()) == result
    assert (out / depth.PNG_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _hidden_states_by_depth(config: ModelConfig, params, batch) -> np.ndarray:
    """h_0 (embeddings through the E->H projection, by hand) and h_k = the sequence output of
    the same weights run at depth k, k = 1..L (possible because they are all-shared):
    [L+1, B, S, H]."""
    albert = params["albert"]
    inputs = (batch["input_ids"], batch["segment_ids"], batch["input_mask"])
    embedded = AlbertModel(config).apply(
        {"params": albert}, *inputs[:2], method=lambda m, ids, seg: m.embeddings(ids, seg, True)
    )
    projection = albert["encoder"]["embedding_hidden_mapping_in"]
    states = [embedded @ projection["kernel"] + projection["bias"]]
    for k in range(1, config.num_hidden_layers + 1):
        out = AlbertModel(config.with_depth(k)).apply({"params": albert}, *inputs)
        states.append(out["sequence_output"])
    return np.stack([np.asarray(s, np.float64) for s in states])


def test_layer_transitions_equal_hidden_states_computed_by_depth(shared_init, tmp_path):
    data = heldout.load(shared_init, num_batches=1)
    result = layer_transitions.measure(data)
    config = data.pretrained.config
    assert result["layers"] == [1, 2] == list(range(1, config.num_hidden_layers + 1))
    assert all(v >= 0 for v in result["l2"]) and all(-1 <= c <= 1 for c in result["cosine"])

    batch = heldout.unmasked(data.batches[0])
    # The restored batch is plain text: no [MASK] token left, the masked ids back in place.
    assert not np.any(batch["input_ids"] == data.pretrained.tokenizer.mask_id)
    states = _hidden_states_by_depth(config, data.pretrained.params, batch)
    x, y = states[:-1], states[1:]
    real = (batch["input_mask"] > 0) & (batch["example_weight"] > 0)[:, None]
    l2 = np.linalg.norm(y - x, axis=-1)[:, real].mean(axis=1)
    cosine = np.sum(x * y, -1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
    assert result["tokens"] == int(real.sum())
    np.testing.assert_allclose(result["l2"], l2, rtol=1e-4)
    np.testing.assert_allclose(result["cosine"], cosine[:, real].mean(axis=1), rtol=1e-5)

    path = tmp_path / "fig2.png"
    figure = layer_transitions.plot({layer_transitions.label(result, config): result})
    metrics_writer.write_figure(figure, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_continued_pretraining_and_fine_tuning_at_another_depth(
    shared_init, tmp_path, corpus, shared_data
):
    # Continued pretraining of the 2-layer all-shared init at 4 layers, 1 small step.
    config = heldout.run_config_of(shared_init)
    config.init_from, config.model.num_hidden_layers = shared_init, 4
    config.num_train_steps, config.warmup_steps, config.learning_rate = 1, 0, 1e-6
    config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps = 1, 0, 1
    workdir = str(tmp_path / "deeper")
    assert train.train_and_evaluate(config, workdir)["step"] == 1
    step_dir = checkpoint_dirs.latest_step_dir(workdir)
    meta, params = checkpoint_dirs.read_step_dir(step_dir)
    assert meta["model_config"]["num_hidden_layers"] == 4
    _, start = checkpoint_dirs.read_step_dir(checkpoint_dirs.latest_step_dir(shared_init))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)  # started from the init, 1 tiny step
    # The run's own workdir at another depth is a resume of another model: refused.
    config.model.num_hidden_layers, config.num_train_steps = 2, 2
    with pytest.raises(ValueError, match="num_hidden_layers: checkpoint 4, config 2"):
        train.train_and_evaluate(config, workdir)

    # Fine-tuning the same init at 4 layers (1 step): every backbone weight loads.
    train_file, dev_file = task_files(shared_data, "sentiment_rt")
    ft = tiny_scratch_config(
        "sentiment_rt", corpus["tokenizer"], num_train_steps=1, checkpoint_every_steps=1,
        **{"data.train_files": train_file, "data.eval_files": dev_file,
           "data.max_train_examples": 64, "data.max_eval_examples": 64},
    )  # fmt: skip
    for field in list(ft.model):  # the architecture comes from the checkpoint
        if field not in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            del ft.model[field]
    ft.model.num_hidden_layers, ft.init = 4, shared_init
    results = finetune.finetune_and_evaluate(ft, str(tmp_path / "ft"))
    assert results["init"]["loaded"] == len(jax.tree.leaves(start["albert"]))
    assert 0 <= results["accuracy"] <= 1
    ft_meta, _ = checkpoint_dirs.read_step_dir(
        checkpoint_dirs.latest_step_dir(str(tmp_path / "ft"))
    )
    assert ft_meta["model_config"]["num_hidden_layers"] == 4


def random_params(config: ModelConfig, seed: int = 0):
    """{"params": ...} of random numpy float32 arrays for `config` (shapes traced, not
    compiled)."""
    model = AlbertForPreTraining(config)
    shapes = jax.eval_shape(lambda k: nn.meta.unbox(init_params(model, k)), jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: 0.1 * rng.standard_normal(s.shape).astype(np.float32), shapes)


def _model_dir(directory, **overrides) -> str:
    """A tiny model with random weights saved as a model dir (the corpus tokenizer's vocab)."""
    config = ModelConfig.preset("tiny", vocab_size=VOCAB, **overrides)
    save_model_dir(str(directory), random_params(config), config)
    return str(directory)


def test_depth_changes_that_are_refused_name_the_fields(tmp_path, corpus, shared_data):
    tiny = ModelConfig.preset("tiny")  # 4 layers
    assert tiny.with_depth(7).num_hidden_layers == 7
    grouped = tiny.replace(num_hidden_groups=2)
    assert grouped.with_depth(6).layers_per_group == 3
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 must be a multiple of "
                       r"num_hidden_groups=2"):  # fmt: skip
        grouped.with_depth(3)
    for sharing in ("none", "attention", "ffn"):
        with pytest.raises(ValueError, match=rf"num_hidden_layers=8: .*sharing='{sharing}'"):
            tiny.replace(sharing=sharing).with_depth(8)
        assert tiny.replace(sharing=sharing).with_depth(4).sharing == sharing  # same depth
    with pytest.raises(ValueError, match="--layers"):
        depth.parse_layers("1,0")
    assert depth.parse_layers("1, 2,24") == [1, 2, 24]

    # Fine-tuning a grouped init at a depth that is no multiple of its groups: refused before
    # anything compiles, naming both fields.
    init = _model_dir(tmp_path / "grouped", num_hidden_groups=2)
    train_file, dev_file = task_files(shared_data, "sentiment_rt")
    ft = tiny_scratch_config(
        "sentiment_rt", corpus["tokenizer"],
        **{"data.train_files": train_file, "data.eval_files": dev_file},
    )  # fmt: skip
    for field in list(ft.model):
        del ft.model[field]
    ft.model.num_hidden_layers, ft.init = 3, init
    with pytest.raises(ValueError, match="num_hidden_layers=3 .* num_hidden_groups=2"):
        finetune.finetune_and_evaluate(ft, str(tmp_path / "ft"))
    ft.model.num_hidden_layers = 4  # a multiple: accepted
    saved = ModelConfig.from_dict(
        json.loads((tmp_path / "grouped" / "model_config.json").read_text())
    )
    assert finetune_config.model_config(ft, saved, VOCAB).layers_per_group == 2

    # Continued pretraining from a not-shared init at another depth: the error says why.
    none_init = _model_dir(tmp_path / "none", sharing="none")
    deeper = ModelConfig.preset("tiny", vocab_size=VOCAB, sharing="none", num_hidden_layers=6)
    abstract = jax.eval_shape(
        lambda: nn.meta.unbox(init_params(AlbertForPreTraining(deeper), jax.random.key(0)))
    )
    with pytest.raises(ValueError, match="config.model.num_hidden_layers must stay"):
        load_params_only(none_init, trees.flatten(abstract["params"]))
    # ... and a grouped pretraining config whose depth is no multiple of its groups.
    config = pretrain_config("size=tiny")
    config.model.num_hidden_groups, config.model.num_hidden_layers = 2, 3
    with pytest.raises(ValueError, match=r"num_hidden_layers \(3\) .* num_hidden_groups \(2\)"):
        validate_config(config)


def test_mean_over_tokens_is_weighted_by_real_tokens_only():
    """transition_sums ignores padding rows and padding positions."""
    config = ModelConfig.preset(
        "tiny", vocab_size=50, hidden_size=16, embedding_size=8, intermediate_size=32,
        num_hidden_layers=3, max_position_embeddings=16,
    )  # fmt: skip
    albert = random_params(config, seed=1)["params"]["albert"]
    ids = np.random.default_rng(2).integers(1, 50, (3, 8), dtype=np.int32)
    mask = np.array([[1] * 8, [1] * 5 + [0] * 3, [1] * 8], np.int32)
    batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask,
             "example_weight": np.array([1.0, 1.0, 0.0], np.float32)}  # fmt: skip

    @jax.jit
    def run(albert, batch):
        args = (batch["input_ids"], batch["segment_ids"], batch["input_mask"])
        return (
            layer_transitions.transition_sums(config, albert, batch),
            layer_transitions.hidden_states(config, albert, *args),
            AlbertModel(config).apply({"params": albert}, *args)["sequence_output"],
        )

    sums, states, sequence_output = run(albert, batch)
    assert int(sums["tokens"]) == 13 and sums["l2"].shape == sums["cosine"].shape == (3,)
    assert states.shape == (4, 3, 8, 16)
    np.testing.assert_allclose(states[-1], sequence_output, atol=1e-5)  # the last state
    real = np.asarray(mask, bool) & np.array([True, True, False])[:, None]
    l2 = np.linalg.norm(np.asarray(states[1:] - states[:-1]), axis=-1)[:, real].sum(axis=1)
    np.testing.assert_allclose(sums["l2"], l2, rtol=1e-5)
