"""Sweeps: one command runs a grid of config overrides, resumably, and tabulates it.

    python -m albert_jax.sweep --config=configs/pretrain.py:size=tiny --root=DIR \\
      --sweep.learning_rate=1e-3,2e-3,4e-3 --sweep.model.sharing=all,none [--config.X=V ...]
    python -m albert_jax.sweep --config=configs/pretrain.py:size=tiny \\
      --sweep_fn=configs/pretrain.py:sweep --root=DIR
    python -m albert_jax.sweep ... --table_only        # the table again, from the workdirs

The grid (`sweep_grid`): the product of the `--sweep.FIELD` lists, times the points of a sweep
function; `--config.X=V` applies to every point; pretraining and fine-tuning configs alike. Each
point runs in ROOT/<its name> through the one training loop (`train.train_and_evaluate` or
`finetune.finetune_and_evaluate`, in this process, one after the other); every config is built
and checked before the first point starts.

Points that differ only in the optimizer's per-run fields (learning rate, warmup, weight
decay, ...) train as one program (`sweep_group`, `--sweep.group=auto`, the default;
`--sweep.group=none` runs every point alone); the log says why any other point runs alone.

Resumable: each point's workdir records its state in `sweep_point.json`. Running the same
command again reads the finished points, resumes an interrupted one from its checkpoints (a
group from ROOT/groups/<name>) and runs the rest; a SIGTERM (or a TPU preemption notice) saves
the running point and ends the sweep with status 0. A point whose workdir holds a run of
another config is refused before anything runs, naming both. A failed point is recorded with its
error and the sweep goes on; the command exits 1 at the end if any failed (a failed point is
tried again by the next run of the command). Results: ROOT/sweep.json, sweep.md, sweep.png
(`sweep_table`), rewritten after every point.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import app, flags, logging

from albert_jax import files
from albert_jax.runtime import cli, process_setup
from albert_jax.sweep import table as sweep_table
from albert_jax.sweep.grid import (
    SWEEP_PREFIX,
    ConfigFile,
    Point,
    build_configs,
    called_points,
    config_file,
    expand,
    flat_fields,
    parse_sweep_flags,
    sweep_function,
)

GROUPS_DIR = "groups"
TOKENIZERS_DIR = "tokenizers"
GROUP_MODES = ("auto", "none")
CONFIG_PREFIX = "--config."
RUN_CONFIG_FILE = "config.json"  # = run_config.RUN_CONFIG_FILE (not imported: jax-free)


@dataclasses.dataclass
class Sweep:
    """A sweep's points and configs under `root`; `describe` is the base `--config=` (for
    the table); `group` is `--sweep.group`; `runner(config, workdir)` runs one point alone
    (default: main.py's choice of pretraining or fine-tuning)."""

    root: str
    points: list[Point]
    configs: list[Any]
    describe: str
    group: str = "auto"
    base: ConfigFile | None = None  # the `--config=` file (None: a sweep built in code)
    common: tuple[str, ...] = ()  # the `--config.X=V` overrides every point has
    runner: Callable[[Any, str], Mapping[str, Any]] | None = None
    after_point: Callable[[], Any] | None = None  # e.g. glue_table's own table, each time

    def workdir(self, point: Point) -> str:
        return str(files.as_path(self.root) / point.name)


# ------------------------------------------------------------------------------------ checks
def check_root(root: str) -> None:
    """ROOT must be new, empty, or a sweep's (it has sweep.json): nothing else is overwritten."""
    path = files.as_path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--root={root} is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / sweep_table.SWEEP_JSON).exists():
        raise ValueError(
            f"--root={root} holds files but no {sweep_table.SWEEP_JSON}: it is not a sweep's "
            "directory; give a new or empty --root"
        )


def config_differences(stored: Mapping[str, Any], config: Any) -> list[str]:
    """`field: A there, B here` for each field (debugging hooks aside) where a workdir's
    config.json differs from `config`."""
    mine, theirs = flat_fields(config), flat_fields(stored)
    keys = sorted(k for k in set(mine) | set(theirs) if not k.startswith("debug."))
    return [f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here"
            for k in keys if mine.get(k) != theirs.get(k)]  # fmt: skip


def check_workdirs(sweep: Sweep) -> None:
    """Refuses (before anything runs) a point whose workdir holds a run of another config."""
    for point, config in zip(sweep.points, sweep.configs, strict=True):
        path = files.as_path(sweep.workdir(point)) / RUN_CONFIG_FILE
        if not path.exists():
            continue
        differ = config_differences(files.read_json(path), config)
        if differ:
            raise ValueError(
                f"point {point.name}: {path.parent} holds a run of another config "
                f"({'; '.join(differ[:4])}{'; ...' if len(differ) > 4 else ''}); use another "
                "--root, or delete that directory to run the point anew"
            )


# ----------------------------------------------------------------------------------- running
def run_alone(config: Any, workdir: str) -> Mapping[str, Any]:
    """One point through the one loop: fine-tuning when its config names a task."""
    if "task" in config:
        from albert_jax.finetune import train as finetune

        return finetune.finetune_and_evaluate(config, workdir)
    from albert_jax.pretrain import train

    return train.train_and_evaluate(config, workdir)


def run_group(sweep: Sweep, members: Sequence[int]) -> tuple[str, Mapping[str, Any]]:
    """Points `members` as one program in ROOT/groups/<name>; returns (name, its result)."""
    from albert_jax.sweep import group as sweep_group

    names = [sweep.points[i].name for i in members]
    name = "group-" + hashlib.sha1("\n".join(names).encode()).hexdigest()[:10]
    workdir = str(files.as_path(sweep.root) / GROUPS_DIR / name)
    configs = [sweep.configs[i] for i in members]
    dirs = [sweep.workdir(sweep.points[i]) for i in members]
    files.as_path(workdir).mkdir(parents=True, exist_ok=True)
    files.write_json(files.as_path(workdir) / "group.json", {"points": names})
    if "task" in configs[0]:
        from albert_jax.finetune import train as finetune

        objective, run = sweep_group.grouped_fine_tuning, finetune.finetune_and_evaluate
    else:
        from albert_jax.pretrain import train
        from albert_jax.pretrain.settings import validate_config

        run = train.train_and_evaluate
        point_settings = [validate_config(c) for c in configs]
        objective = functools.partial(
            sweep_group.grouped_pretraining, point_settings=point_settings
        )

    def make_objective(*args: Any) -> Any:
        return objective(*args, point_configs=configs, point_dirs=dirs)

    return name, run(configs[0], workdir, make_objective=make_objective)


def _status(result: Mapping[str, Any]) -> str:
    return "preempted" if result.get("preempted") else "ok"


def run_sweep(sweep: Sweep) -> dict[str, Any]:
    """Runs every point not finished yet (see the module docstring) and returns the table
    (ROOT/sweep.json's content), written after every point."""
    from albert_jax.runtime import compile_cache
    from albert_jax.sweep import group as sweep_group

    check_root(sweep.root)
    check_workdirs(sweep)
    files.as_path(sweep.root).mkdir(parents=True, exist_ok=True)
    write_table(sweep, {})  # ROOT is a sweep's from now on
    train_shared_tokenizers(sweep)
    # One persistent compilation cache for the sweep: points of one shape compile once.
    compile_cache.use_for_run(sweep.configs[0].get("compilation_cache_dir", ""), sweep.root)
    states = {p.name: sweep_table.read_point(sweep.workdir(p)) or {} for p in sweep.points}
    todo = [i for i, p in enumerate(sweep.points) if states[p.name].get("status") != "ok"]
    logging.info("sweep: %d points in %s", len(sweep.points), sweep.root)
    for point in sweep.points:
        if states[point.name].get("status") == "ok":
            logging.info("point %s: finished before, not re-run (delete %s to run it again)",
                         point.name, sweep.workdir(point))  # fmt: skip
    # A point that started a run of its own (a checkpoint in its workdir) resumes it alone.
    started = {
        k: "it resumes the run in its workdir"
        for k, i in enumerate(todo)
        if not states[sweep.points[i].name].get("group")
        and (files.as_path(sweep.workdir(sweep.points[i])) / "checkpoints").exists()
    }
    configs = [sweep.configs[i] for i in todo]
    grouped, alone = sweep_group.plan_groups(configs, sweep.group == "auto", started)
    units = [[todo[i] for i in g] for g in grouped] + [[todo[i]] for i in sorted(alone)]
    units.sort(key=lambda members: members[0])
    for i, reason in sorted(alone.items()):
        if len(todo) > 1:
            logging.info("point %s runs alone: %s", sweep.points[todo[i]].name, reason)
    for members in units:
        if len(members) > 1:
            logging.info("one program: %s", ", ".join(sweep.points[i].name for i in members))
    groups: dict[str, Any] = {}
    for members in units:
        start = time.time()
        for i in members:
            _mark(sweep, i, status="running")
        try:
            if len(members) > 1:
                group, result = run_group(sweep, members)
                groups[group] = {"points": [sweep.points[i].name for i in members]}
            else:
                point = sweep.points[members[0]]
                runner = sweep.runner or run_alone
                group, result = None, runner(sweep.configs[members[0]], sweep.workdir(point))
            status, error = _status(result), None
        except Exception as e:  # recorded in the table; the sweep goes on
            if not cli.is_expected(e):
                logging.exception("point %s failed", sweep.points[members[0]].name)
            group, status, error = None, "failed", f"{type(e).__name__}: {cli.one_line(e)}"
        wall = time.time() - start
        for i in members:
            own, own_error = status, error
            if group and status == "ok":  # a run of the group may have diverged alone
                own_error = sweep_group.divergence(sweep.workdir(sweep.points[i]))
                own = "failed" if own_error else "ok"
            _mark(sweep, i, status=own, error=own_error, wall_seconds=wall, group=group)
            note = f" ({own_error})" if own_error else ""
            logging.info("point %s: %s%s", sweep.points[i].name, own, note)
        write_table(sweep, groups)
        if sweep.after_point is not None:
            sweep.after_point()
        if status == "preempted":
            logging.warning("sweep stopped by preemption; run the same command again to finish")
            break
    return write_table(sweep, groups)


def _mark(sweep: Sweep, i: int, **fields: Any) -> None:
    """Updates point i's sweep_point.json (process 0)."""
    if not is_first_process():
        return
    point = sweep.points[i]
    workdir = sweep.workdir(point)
    record = {**(sweep_table.read_point(workdir) or {}), **point.as_dict(), **fields}
    record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    sweep_table.write_point(workdir, record)


def parameters(config: Any, workdir: str) -> int | None:
    """The point's parameter count in the paper's convention (`params.count_parameters`'s
    core): from the config for pretraining, from the run's checkpoint for fine-tuning."""
    from albert_jax import params
    from albert_jax.model.config import ModelConfig, model_config_from

    try:
        if "task" not in config:
            return params.count_parameters(model_config_from(config))["core"]
        from albert_jax.runtime import checkpoint_dirs

        step_dir = files.as_path(checkpoint_dirs.latest_step_dir(workdir))
        meta = checkpoint_dirs.read_json_item(step_dir / "meta")
        return params.count_parameters(ModelConfig.from_dict(meta["model_config"]))["core"]
    except (ValueError, KeyError, OSError):
        return None


def write_table(sweep: Sweep, groups: Mapping[str, Any]) -> dict[str, Any]:
    """The table of the sweep's points as their workdirs say, written to ROOT/sweep.*."""
    rows = []
    for point, config in zip(sweep.points, sweep.configs, strict=True):
        workdir = sweep.workdir(point)
        state = sweep_table.read_point(workdir) or point.as_dict()
        if state.get("group") and state["group"] not in groups:
            groups = {**groups, state["group"]: {"points": []}}
        rows.append(sweep_table.row(workdir, state, parameters(config, workdir)))
    for name, group in groups.items():
        group["points"] = [r["name"] for r in rows if r["group"] == name]
    table = sweep_table.make_table(sweep.describe, rows, groups)
    if is_first_process():
        sweep_table.write(table, sweep.root)
    return table


def is_first_process() -> bool:
    """Process 0 writes the sweep's files (JAX is imported only where it already is)."""
    jax = sys.modules.get("jax")
    return jax is None or jax.process_index() == 0


# --------------------------------------------------------------------------------------- CLI
def make_sweep(config: str, root: str, argv: Sequence[str], sweep_fn: str | None) -> Sweep:
    """The sweep of a command line: points and their configs, every one checked."""
    base: ConfigFile = config_file(config)
    lists, options = parse_sweep_flags(argv)
    group = options.get("group", "auto")
    if group not in GROUP_MODES:
        raise ValueError(f"--sweep.group={group}: one of {', '.join(GROUP_MODES)}")
    called = called_points(sweep_function(sweep_fn), base.arg_keys, sweep_fn) if sweep_fn else []
    if sweep_fn and not called:
        raise ValueError(f"empty grid: --sweep_fn={sweep_fn} added no point")
    points = expand(lists, called)
    common = [a for a in argv if a.startswith(CONFIG_PREFIX)]
    configs = build_configs(base, points, common)
    root = files.run_directory(root, "--root")
    share_tokenizers(configs, root)
    _validate(points, configs)
    return Sweep(root, points, configs, describe=config, group=group, base=base,
                 common=tuple(common))  # fmt: skip


def _tokenizer_inputs(config: Any) -> tuple[Any, ...]:
    """What a pretraining run's own tokenizer is trained from (`prepare.prepare_tokenizer`)."""
    data = config.data
    # Not the seed (the sentences sampled): a sweep of seeds shares the first point's tokenizer,
    # so its points differ in init and data order only.
    return (data.sources, data.data_dir, data.tokenizer_max_sentences, config.model.vocab_size)


def share_tokenizers(configs: Sequence[Any], root: str) -> None:
    """Pretraining points that would each train their own tokenizer (`data.tokenizer` unset)
    on the same text get one, trained once before the first of them runs
    (ROOT/tokenizers/<key>/tokenizer.model, `train_shared_tokenizers`): their numbers are
    then measured on the same tokens, and the sweep trains it once instead of N times. Sets
    `config.data.tokenizer` of those points."""
    for config in configs:
        if "task" in config or config.data.tokenizer:
            continue
        key = hashlib.sha1(json.dumps(_tokenizer_inputs(config)).encode()).hexdigest()[:10]
        config.data.tokenizer = str(files.as_path(root) / TOKENIZERS_DIR / key / "tokenizer.model")


def train_shared_tokenizers(sweep: Sweep) -> None:
    """Trains each shared tokenizer (`share_tokenizers`) the sweep does not have yet, as its
    first point's run would have (the sources built first)."""
    from albert_jax.pretrain.prepare import PrepareSettings, build_sources, prepare_tokenizer

    shared = str(files.as_path(sweep.root) / TOKENIZERS_DIR)
    done: set[str] = set()
    for config in sweep.configs:
        path = config.get("data", {}).get("tokenizer") or ""
        if not path.startswith(shared) or path in done or files.as_path(path).exists():
            continue
        own = config.copy_and_resolve_references()
        own.data.tokenizer = None
        prepare = PrepareSettings.from_config(own)
        build_sources(prepare)
        prepare_tokenizer(prepare, str(files.as_path(path).parent))
        done.add(path)


def largest_point_flags(sweep: Sweep) -> list[str]:
    """`--config=FILE:ARG` and the `--config.X=V` overrides of the point whose program is the
    largest (parameters, then tokens a step), as `python -m albert_jax.main` or `.plan` take
    them. A group of points holds one copy of the parameters and optimizer state per point,
    which for ALBERT's sizes is small beside the activations."""
    from albert_jax import params
    from albert_jax.model.config import ModelConfig, model_config_from

    def size(config: Any) -> tuple[int, int]:
        if "task" in config:
            model = ModelConfig.preset(config.size)
            tokens = config.batch_size * config.max_seq_length * config.get("num_seeds", 1)
        else:
            model, tokens = model_config_from(config), config.batch_size * config.seq_len
        return params.count_parameters(model)["total"], tokens

    i = max(range(len(sweep.points)), key=lambda i: size(sweep.configs[i]))
    point = sweep.points[i]
    return [f"--config={sweep.base.spec(dict(point.args))}", *sweep.common, *point.overrides()]


def _validate(points: Sequence[Point], configs: Sequence[Any]) -> None:
    """Each point's config passes its run's own checks (before anything is built)."""
    for point, config in zip(points, configs, strict=True):
        try:
            if "task" in config:
                from albert_jax.finetune.settings import validate_config
            else:
                from albert_jax.pretrain.settings import validate_config
            validate_config(config)
        except ValueError as e:
            raise ValueError(f"point {point.name}: {cli.one_line(e)}") from e


def define_flags() -> None:
    flags.DEFINE_string(
        "config", None, "Base config file and arg, e.g. configs/pretrain.py:size=tiny."
    )
    flags.DEFINE_string(
        "root", None, "Sweep directory (local or gs://): a workdir per point, the table."
    )
    flags.DEFINE_string("sweep_fn", None, "FILE.py:FUNCTION adding points (config args / fields).")
    flags.DEFINE_bool(
        "table_only", False, "Only rebuild ROOT/sweep.{json,md,png} from the workdirs."
    )
    flags.DEFINE_bool(
        "largest", False, "Print the largest point's albert_jax.main flags, one a line (no --root)."
    )
    flags.mark_flags_as_required(["config"])


_grid_args: list[str] = []  # the --sweep.X and --config.X arguments, taken out before absl parses


def parse_flags(argv: list[str]) -> list[str]:
    """absl parses the sweep's own flags; `--sweep.` and `--config.` ones are kept apart."""
    ours = (SWEEP_PREFIX, CONFIG_PREFIX)
    _grid_args[:] = [a for a in argv[1:] if a.startswith(ours)]
    return cli.parse_flags([a for a in argv if not a.startswith(ours)])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    FLAGS = flags.FLAGS
    if FLAGS.root is None and not FLAGS.largest:
        raise app.UsageError("--root is required")
    root = (FLAGS.root or ".") if FLAGS.largest else FLAGS.root  # "" is refused, not "."
    sweep = make_sweep(FLAGS.config, root, _grid_args, FLAGS.sweep_fn)
    if FLAGS.largest:  # `launch/tpu_pod.sh plan` plans it
        print("\n".join(largest_point_flags(sweep)), flush=True)
        return
    if FLAGS.table_only:
        if not files.as_path(sweep.root).is_dir():
            raise ValueError(f"--table_only: no sweep at --root={sweep.root}")
        table = write_table(sweep, {})
    else:
        process_setup.set_up_process(all("task" in c for c in sweep.configs))
        if not process_setup.initialize_distributed():  # several: each runs the same sweep
            cli.stop_on_sigterm()
        table = run_sweep(sweep)
    logging.info("table: %s", files.as_path(sweep.root) / sweep_table.SWEEP_MD)
    print(sweep_table.render_markdown(table), flush=True)
    if table["failed"]:
        logging.error("failed points: %s (see %s)", table["failed"], sweep_table.SWEEP_JSON)
        sys.exit(1)


def run() -> None:
    """The command line: `python -m albert_jax.sweep` (`sweep/__main__.py`)."""
    cli.run(main, flags_parser=parse_flags)
