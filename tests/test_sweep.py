"""Sweeps (albert_jax/sweep/runner.py): the grid, the names, every bad input refused before a point
runs, points of one shape trained as one program exactly as their solo runs, resume after a
SIGTERM of the whole sweep, a failed point recorded, and the table rebuilt from the workdirs.

The runs are the small real ALBERT of test_train (Austen, a 1000-piece tokenizer) for a few
steps; the resume test goes through `python -m albert_jax.sweep` in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import xla_flags
from test_glue_table import OVERRIDES as GLUE_OVERRIDES
from test_glue_table import init_dir, local_data  # noqa: F401 (fixtures)
from test_train import REPO, assert_trees_equal, final_state, losses_by_step, small_overrides

from albert_jax import checkpointing, files, metrics_writer
from albert_jax.pretrain import train
from albert_jax.pretrained import load_pretrained
from albert_jax.run_config import with_fields
from albert_jax.sweep import grid as sweep_grid
from albert_jax.sweep import group as sweep_group
from albert_jax.sweep import runner as sweep
from albert_jax.sweep import table as sweep_table
from configs import pretrain

TINY = "configs/pretrain.py:size=tiny"


def flags_of(overrides: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in overrides.items()]


def make(root, argv, sweep_fn=None, config=TINY) -> sweep.Sweep:
    return sweep.make_sweep(config, str(root), argv, sweep_fn)


# ------------------------------------------------------------------------------ grid, names
def test_grid_is_the_product_of_the_lists_and_names_are_readable_and_safe():
    lists, options = sweep_grid.parse_sweep_flags(
        ["--sweep.learning_rate=1e-3,2e-3", "--sweep.model.sharing=all,none", "--sweep.group=none"]
    )
    points = sweep_grid.expand(lists)
    assert options == {"group": "none"}
    assert [p.name for p in points] == [
        "learning_rate=1e-3+sharing=all", "learning_rate=1e-3+sharing=none",
        "learning_rate=2e-3+sharing=all", "learning_rate=2e-3+sharing=none",
    ]  # fmt: skip
    assert points[1].overrides() == ["--config.learning_rate=1e-3", "--config.model.sharing=none"]
    # Keys that end alike keep their full name; unsafe characters become "_"; long names a hash.
    assert sweep_grid.point_name([("model.dtype", "a"), ("data.dtype", "b/c d")]) == (
        "model.dtype=a+data.dtype=b_c_d"
    )
    long = sweep_grid.point_name([("data.sources", "x" * 300)])
    assert len(long) == 100 and long == sweep_grid.point_name([("data.sources", "x" * 300)])


def test_the_papers_ablation_function_gives_fourteen_distinct_points(tmp_path):
    s = make(tmp_path / "root", [], sweep_fn="configs/pretrain.py:sweep")
    assert len(s.points) == 14  # Tables 3, 4 and 5, the points they share once
    by_name = dict(zip([p.name for p in s.points], s.configs, strict=True))
    table4 = by_name["sharing=attention+embed=128"]
    assert (table4.size, table4.model.sharing, table4.model.embedding_size) == (
        "tiny",
        "attention",
        128,
    )
    assert by_name["sharing=all+embed=128+objective=nsp"].objective == "nsp"
    # The function's fields (`__` for `.`) and a --sweep. list multiply.
    called = sweep_grid.called_points(
        lambda add: add(sharing="none", model__dtype="bfloat16", _name="bf16"), ("sharing",), "f"
    )
    points = sweep_grid.expand({"seed": ["0", "1"]}, called)
    assert [p.name for p in points] == ["bf16+seed=0", "bf16+seed=1"]
    assert points[0].args == (("sharing", "none"),)
    assert points[0].fields == (("model.dtype", "bfloat16"), ("seed", "0"))


def _raising_sweep(add):
    add(learning_rate=1.0)
    raise RuntimeError("no grid today")


@pytest.mark.parametrize(
    "argv, sweep_fn, message",
    [
        (["--sweep.lerning_rate=1e-3,2e-3"], None,
         "unknown field 'lerning_rate' in --sweep.lerning_rate=1e-3; did you mean "
         "'learning_rate'?"),
        (["--sweep.learning_rate=1e-3,fast"], None,
         "point learning_rate=fast: flag --sweep.learning_rate=fast: could not convert"),
        (["--sweep.batch_size=16,-1"], None, "point batch_size=-1: config.batch_size must be"),
        ([], None, "empty grid"),
        (["--sweep.learning_rate="], None, "--sweep.learning_rate=: no value to sweep"),
        (["--sweep.learning_rate=1e-3,0.001"], None,
         "points learning_rate=1e-3 and learning_rate=0.001 have the same config"),
        ([], "tests/test_sweep.py:_raising_sweep",
         "raised RuntimeError: no grid today"),
        (["--sweep.group=some", "--sweep.seed=1,2"], None,
         "--sweep.group=some: one of auto, none"),
        (["--sweep.seed=1,2", "--config.lerning_rate=1"], None, "unknown field 'lerning_rate'"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_any_point_runs(tmp_path, argv, sweep_fn, message):
    with pytest.raises(ValueError) as error:
        make(tmp_path / "root", argv, sweep_fn)
    assert message in str(error.value)
    assert not (tmp_path / "root").exists()


def test_a_root_that_is_not_a_sweep_is_refused_in_one_line(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    argv = [sys.executable, "-m", "albert_jax.sweep", f"--config={TINY}", f"--root={root}",
            "--sweep.seed=1,2"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --root=") and "is not a sweep's directory" in last
    assert sorted(os.listdir(root)) == ["notes.txt"]
    # An empty --root (an unset variable) is not the current directory.
    argv = [sys.executable, "-m", "albert_jax.sweep", f"--config={REPO}/{TINY}", "--root=",
            "--sweep.seed=1,2"]  # fmt: skip
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --root is empty")
    assert sorted(os.listdir(root)) == ["notes.txt"]


# --------------------------------------------------------------------- one program, grouped
@pytest.fixture(scope="module")
def grouped(corpus, tmp_path_factory):
    """Two learning rates as one program (and a third point of another shape, alone), and the
    solo run of the second learning rate."""
    root = tmp_path_factory.mktemp("sweep") / "root"
    base = small_overrides(corpus, eval_every_steps=4, eval_batches=2)
    argv = [*flags_of(base), "--sweep.learning_rate=0.002,0.004"]
    s = make(root, argv)
    table = sweep.run_sweep(s)
    solo = str(root.parent / "solo")
    train.train_and_evaluate(with_fields(pretrain.get_config("size=tiny"), **{
        **base, "learning_rate": 0.004}), solo)  # fmt: skip
    return {"sweep": s, "table": table, "solo": solo, "root": str(root)}


def test_points_of_one_shape_train_as_one_program_exactly_as_alone(grouped):
    s, table = grouped["sweep"], grouped["table"]
    assert [r["status"] for r in table["points"]] == ["ok", "ok"]
    (group,) = table["groups"].values()
    assert group["points"] == ["learning_rate=0.002", "learning_rate=0.004"]
    point = s.workdir(s.points[1])
    alone = metrics_writer.read_metrics(grouped["solo"])
    mine = metrics_writer.read_metrics(point)
    assert [r["step"] for r in mine] == [r["step"] for r in alone]
    for a, b in zip(alone, mine, strict=True):
        assert set(a) == set(b)
        for key in a:
            if key in ("examples_per_sec", "mfu", "step"):
                continue
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    # Its checkpoint is the solo run's (within float tolerance), and a notebook loads it.
    params, _ = final_state(point, 8)
    solo_params, _ = final_state(grouped["solo"], 8)
    for x, y in zip(
        sweep_group.jax.tree.leaves(params), sweep_group.jax.tree.leaves(solo_params), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    assert load_pretrained(point).config.hidden_size == 32
    config = files.read_json(os.path.join(point, "config.json"))
    assert config["learning_rate"] == 0.004
    # The two runs really differ, and the table holds both rows with their metrics.
    first = metrics_writer.read_metrics(s.workdir(s.points[0]))
    assert first[-1]["loss"] != mine[-1]["loss"]
    row = table["points"][1]
    assert row["parameters"] > 0 and row["steps"] == 8 and row["group"]
    assert row["final"]["eval_mlm_accuracy"] == mine[-1]["eval_mlm_accuracy"]
    with open(os.path.join(grouped["root"], sweep_table.SWEEP_MD)) as f:
        md = f.read()
    assert "`learning_rate=0.004` | ok" in md and "one program" in md
    assert os.path.exists(os.path.join(grouped["root"], sweep_table.SWEEP_PNG))


def test_points_with_their_own_data_train_as_one_program_exactly_as_alone(corpus, tmp_path):
    """Two seeds with two masking rates: one program, each run its own input pipeline and
    held-out set, the second point equal to its solo run."""
    base = small_overrides(corpus, eval_every_steps=4, eval_batches=2)
    argv = [*flags_of(base), "--sweep.seed=0,1", "--sweep.data.masked_lm_prob=0.15,0.3"]
    s = make(tmp_path / "root", argv)
    s.points, s.configs = s.points[::3], s.configs[::3]  # (0, 0.15) and (1, 0.3)
    table = sweep.run_sweep(s)
    assert [r["status"] for r in table["points"]] == ["ok", "ok"] and table["groups"]
    solo = str(tmp_path / "solo")
    overrides = {**base, "seed": 1, "data.masked_lm_prob": 0.3}
    train.train_and_evaluate(with_fields(pretrain.get_config("size=tiny"), **overrides), solo)
    point = s.workdir(s.points[1])
    alone, mine = metrics_writer.read_metrics(solo), metrics_writer.read_metrics(point)
    assert [r["step"] for r in mine] == [r["step"] for r in alone]
    for a, b in zip(alone, mine, strict=True):
        assert set(a) == set(b)
        for key in set(a) - {"examples_per_sec", "mfu", "step"}:
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    other = metrics_writer.read_metrics(s.workdir(s.points[0]))
    assert other[0]["loss"] != mine[0]["loss"]  # another init, other batches
    # Its checkpoint holds its own data position: a solo run of the point resumes from it.
    with checkpointing.Checkpointer(point, read_only=True) as ckpt:
        saved = ckpt.read_json(8, "data")
    with checkpointing.Checkpointer(solo, read_only=True) as ckpt:
        assert saved == ckpt.read_json(8, "data")


def test_points_of_other_shapes_run_alone_and_say_why(corpus):
    configs = [
        with_fields(pretrain.get_config("size=tiny"), **small_overrides(corpus, **extra))
        for extra in ({"learning_rate": 0.1}, {"learning_rate": 0.2}, {"model.sharing": "none"},
                      {"seed": 3, "data.masked_lm_prob": 0.2}, {"batch_size": 8},
                      {"learning_rate": 0.3})
    ]  # fmt: skip
    groups, alone = sweep_group.plan_groups(configs, forced={5: "it resumes its own run"})
    assert groups == [[0, 1, 3]]  # a seed and a masking rate: each run its own data
    assert "model.sharing" in alone[2] and "batch_size" in alone[4]
    assert alone[5] == "it resumes its own run"
    assert sweep_group.plan_groups(configs, enabled=False)[0] == []


# -------------------------------------------------------------- resume, failures, the table
def _sweep_cli(root, argv, timeout=600):
    args = [
        sys.executable,
        "-m",
        "albert_jax.sweep",
        f"--config={TINY}",
        f"--root={root}",
        *argv,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


GRID = """
def sweep(add):
    add(learning_rate=0.002, num_train_steps=2, warmup_steps=1)  # done before the SIGTERM
    add(learning_rate=0.003)
    add(learning_rate=0.004, debug__nan_at_step=2)  # diverges at step 2
"""


def test_a_sigtermed_sweep_resumes_and_records_a_failed_point(corpus, tmp_path):
    root, straight = tmp_path / "root", tmp_path / "straight"
    base = flags_of(small_overrides(corpus))
    (tmp_path / "grid.py").write_text(GRID)
    grid = [*base, f"--sweep_fn={tmp_path / 'grid.py'}:sweep", "--sweep.group=none"]
    # The grid, which a SIGTERM stops after step 3 of its second point (the first has 2 steps).
    stopped = _sweep_cli(root, [*grid, "--config.debug.sigterm_after_step=3"])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    done = root / "learning_rate=0.002+num_train_steps=2+warmup_steps=1"
    resumed = root / "learning_rate=0.003"
    finished = sweep_table.read_point(str(done))
    assert finished["status"] == "ok"
    assert sweep_table.read_point(str(resumed))["status"] == "preempted"
    assert not (root / "learning_rate=0.004+nan_at_step=2").exists()  # the sweep stopped
    # The same command again: the finished point is read, the stopped one resumes at step 3,
    # the diverging one is recorded as failed, and the command ends with status 1.
    again = _sweep_cli(root, grid)
    assert again.returncode == 1, again.stderr[-3000:]
    assert "resumed at step 3" in again.stderr
    assert sweep_table.read_point(str(done)) == finished  # not run again
    table = files.read_json(root / sweep_table.SWEEP_JSON)
    rows = {r["name"]: r for r in table["points"]}
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "failed"]
    assert "TrainingDivergedError: non-finite" in rows["learning_rate=0.004+nan_at_step=2"]["error"]
    assert table["failed"] == ["learning_rate=0.004+nan_at_step=2"]
    assert "failed: TrainingDivergedError" in again.stdout
    # The resumed point is an uninterrupted run, bit for bit.
    assert _sweep_cli(straight, [*base, "--sweep.learning_rate=0.003"]).returncode == 0
    alone = straight / "learning_rate=0.003"
    assert losses_by_step(resumed) == losses_by_step(alone)
    assert_trees_equal(final_state(resumed, 8), final_state(alone, 8))
    # --table_only rebuilds the table from the workdirs alone.
    for name in (sweep_table.SWEEP_MD, sweep_table.SWEEP_JSON):  # (no eval curves: no png)
        os.remove(root / name)
    rebuilt = _sweep_cli(root, [*grid, "--table_only"])
    assert rebuilt.returncode == 1  # it still has a failed point
    again_rows = files.read_json(root / sweep_table.SWEEP_JSON)["points"]
    for row in again_rows:
        expected = rows[row["name"]]
        assert {k: row[k] for k in ("status", "final", "steps", "wall_seconds")} == {
            k: expected[k] for k in ("status", "final", "steps", "wall_seconds")
        }
    assert (root / sweep_table.SWEEP_MD).exists()


def test_a_point_whose_workdir_holds_another_config_is_refused_naming_both(corpus, tmp_path):
    base = flags_of(small_overrides(corpus))
    s = make(tmp_path / "root", [*base, "--sweep.learning_rate=0.002,0.003"])
    other = os.path.join(s.root, "learning_rate=0.003")
    os.makedirs(other)
    files.write_json(os.path.join(s.root, sweep_table.SWEEP_JSON), {})  # a sweep's root
    stored = json.loads(s.configs[1].to_json_best_effort())
    stored["warmup_steps"] = 5
    files.write_json(os.path.join(other, "config.json"), stored)
    with pytest.raises(ValueError, match=r"point learning_rate=0\.003: .* holds a run of another "
                       r"config \(warmup_steps: 5 there, 2 here\)"):  # fmt: skip
        sweep.run_sweep(s)


# --------------------------------------------------------------------- fine-tuning, grouped
def test_fine_tuning_points_of_one_shape_train_as_one_program_exactly_as_alone(
    init_dir,  # noqa: F811 (test_glue_table's fixture)
    local_data,  # noqa: F811
    tmp_path,
):
    """Two learning rates (and warmup fractions) of sentiment_rt from a tiny init as one
    program, against the solo run of the second: the same losses, eval results and
    predictions."""
    from albert_jax.finetune import train as finetune
    from albert_jax.runtime.cli import override_config
    from configs import finetune as finetune_configs

    files_ = [f"--config.data.train_files={local_data}/sentiment_rt/train.jsonl.gz",
              f"--config.data.eval_files={local_data}/sentiment_rt/dev.jsonl.gz"]  # fmt: skip
    overrides = [*GLUE_OVERRIDES, *files_, "--config.eval_every_steps=3"]
    config = f"configs/finetune.py:task=sentiment_rt,init={init_dir}"
    argv = [*overrides, "--sweep.learning_rate=1e-3,3e-3", "--sweep.warmup_fraction=0,0.5"]
    s = make(tmp_path / "root", argv, config=config)
    s.points, s.configs = s.points[::3], s.configs[::3]  # (1e-3, 0) and (3e-3, 0.5)
    table = sweep.run_sweep(s)
    assert [r["status"] for r in table["points"]] == ["ok", "ok"] and table["groups"]
    solo_config = override_config(
        finetune_configs.get_config(f"task=sentiment_rt,init={init_dir}"),
        [*overrides, "--config.learning_rate=3e-3", "--config.warmup_fraction=0.5"],
    )
    solo = str(tmp_path / "solo")
    alone = finetune.finetune_and_evaluate(solo_config, solo)
    point = s.workdir(s.points[1])
    mine = files.read_json(os.path.join(point, "eval_results.json"))
    assert mine["accuracy"] == pytest.approx(alone["accuracy"], abs=1e-6)
    assert mine["step"] == alone["step"] and mine["init"] == alone["init"]
    with (
        open(os.path.join(point, "predictions.jsonl")) as a,
        open(os.path.join(solo, "predictions.jsonl")) as b,
    ):
        assert a.read() == b.read()
    for a, b in zip(metrics_writer.read_metrics(solo), metrics_writer.read_metrics(point),
                    strict=True):  # fmt: skip
        assert a["step"] == b["step"]
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=2e-5)
        np.testing.assert_allclose(b["learning_rate"], a["learning_rate"], rtol=1e-6)
    first = files.read_json(os.path.join(s.workdir(s.points[0]), "eval_results.json"))
    assert first["step"] == mine["step"]
    assert load_pretrained(point).config.vocab_size > 0
