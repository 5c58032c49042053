"""A sweep's points: the grid of `--sweep.FIELD=v1,v2,...` lists and a config file's sweep
function, each point's name (its workdir under ROOT) and its config.

A point is a set of overrides of the base `--config=FILE:ARG`: config-file arg keys (`size`,
`sharing`, `task`, ...: the file's `ARG_DEFAULTS`) and config fields (`learning_rate`,
`model.sharing`, ...). The grid is the product of the `--sweep.` lists (fields, in the order
given) and, with `--sweep_fn=FILE:FUNCTION`, of the points the function adds:

    def sweep(add):                       # configs/pretrain.py
        for sharing in ("all", "none"):
            add(size="base", sharing=sharing)          # arg keys of the config file
            add(learning_rate=1e-3, model__dtype="bfloat16")   # fields ("__" for ".")

Everything a point is made of is checked before any point runs (`build_configs`): an unknown
field (named with the nearest, as `--config.` is), a value that does not parse for its field, an
empty grid, two points with the same config, a sweep function that raises.

A point's name is its overrides, `key=value` joined by `+` (`learning_rate=0.002+sharing=none`),
keys shortened to their last part unless two would read the same, characters other than
letters, digits and `._=-` replaced by `_`: readable, stable across runs of the same command,
and safe on any file system and in `gs://`. A name over 100 characters keeps its start and a
hash of the whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from albert_jax.runtime import cli

SWEEP_PREFIX = "--sweep."
OPTIONS = ("group",)  # --sweep.group=auto|none: an option of the sweep, not a config field
_MAX_NAME = 100


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of the sweep: `args` (config-file arg keys) and `fields` (config fields), each
    ((key, value as text), ...) in the order they were given; `name` is its workdir."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    fields: tuple[tuple[str, str], ...] = ()

    def overrides(self) -> list[str]:
        """The fields as main.py's flags: ["--config.learning_rate=0.002", ...]."""
        return [f"--config.{k}={v}" for k, v in self.fields]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "args": dict(self.args), "fields": dict(self.fields)}


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """`--config=PATH:ARG`: the file's module, its base arg {key: text}, the arg keys."""

    path: str
    module: ModuleType
    arg: dict[str, str]

    @property
    def arg_keys(self) -> tuple[str, ...]:
        return tuple(getattr(self.module, "ARG_DEFAULTS", {}))

    def get_config(self, args: Mapping[str, str] = ()) -> Any:
        """The file's config with the base arg updated by `args`."""
        merged = {**self.arg, **dict(args)}
        return self.module.get_config(",".join(f"{k}={v}" for k, v in merged.items()))

    def spec(self, args: Mapping[str, str] = ()) -> str:
        """`PATH:k=v,...` of a point: the `--config=` that runs it alone."""
        merged = {**self.arg, **dict(args)}
        return f"{self.path}:{','.join(f'{k}={v}' for k, v in merged.items())}".rstrip(":")


def load_module(path: str) -> ModuleType:
    """A config file as a module (what ml_collections' `--config=FILE` does)."""
    name = "albert_jax_sweep_config_" + re.sub(r"\W", "_", path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--config: {path} is not a Python config file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise ValueError(f"--config: no such config file {path}") from None
    sys.modules[name] = module
    return module


def config_file(spec: str) -> ConfigFile:
    """`configs/pretrain.py:size=tiny` → its ConfigFile (the arg split into keys)."""
    path, _, arg = spec.partition(":")
    if not path.endswith(".py"):
        raise ValueError(f"--config={spec}: expected a config file FILE.py[:ARG]")
    pairs = {}
    for item in filter(None, arg.split(",")):
        key, sep, value = item.partition("=")
        pairs[key.strip()] = value.strip() if sep else "true"
    return ConfigFile(path, load_module(path), pairs)


def parse_sweep_flags(argv: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(`--sweep.FIELD=v1,v2` lists in order, sweep options such as `group`) of `argv`.

    Raises:
      ValueError: a `--sweep.` flag without a value list, or one given twice.
    """
    lists: dict[str, list[str]] = {}
    options: dict[str, str] = {}
    for arg in argv:
        if not arg.startswith(SWEEP_PREFIX):
            continue
        key, sep, text = arg[len(SWEEP_PREFIX) :].partition("=")
        if not sep or not key:
            raise ValueError(f"{arg}: write --sweep.FIELD=VALUE1,VALUE2,...")
        if key in lists or key in options:
            raise ValueError(f"--sweep.{key} is given twice")
        if key in OPTIONS:
            options[key] = text
            continue
        values = [v.strip() for v in text.split(",")]
        if not any(values):
            raise ValueError(f"--sweep.{key}=: no value to sweep")
        if "" in values:
            raise ValueError(f"--sweep.{key}={text}: an empty value in the list")
        lists[key] = values
    return lists, options


def sweep_function(spec: str) -> Callable[[Callable[..., None]], None]:
    """`FILE.py:FUNCTION` → the function."""
    path, sep, name = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"--sweep_fn={spec}: expected FILE.py:FUNCTION")
    function = getattr(load_module(path), name, None)
    if not callable(function):
        raise ValueError(f"--sweep_fn={spec}: {path} has no function {name!r}")
    return function


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def called_points(
    function: Callable[[Callable[..., None]], None], arg_keys: Sequence[str], spec: str
) -> list[tuple[dict[str, str], dict[str, str], str | None]]:
    """The (args, fields, name or None) that `function(add)` adds; `add(_name=...)` names a
    point; a keyword that is an arg key of the config file is an arg, any other a field (with
    `__` for `.`).

    Raises:
      ValueError: the function raised (its error is named).
    """
    added: list[tuple[dict[str, str], dict[str, str], str | None]] = []

    def add(**overrides: Any) -> None:
        name = overrides.pop("_name", None)
        args = {k: _text(v) for k, v in overrides.items() if k in arg_keys}
        fields = {k.replace("__", "."): _text(v) for k, v in overrides.items() if k not in arg_keys}
        added.append((args, fields, name))

    try:
        function(add)
    except Exception as e:
        raise ValueError(f"--sweep_fn={spec} raised {type(e).__name__}: {cli.one_line(e)}") from e
    return added


def expand(
    lists: Mapping[str, Sequence[str]],
    called: Sequence[tuple[Mapping[str, str], Mapping[str, str], str | None]] = (),
) -> list[Point]:
    """The grid: every point of `called` (or one empty point) × the product of `lists`.

    Raises:
      ValueError: an empty grid.
    """
    bases = list(called) or ([({}, {}, None)] if lists else [])
    if not bases:
        raise ValueError("empty grid: give --sweep.FIELD=V1,V2,... lists or a --sweep_fn")
    points = []
    combos = list(itertools.product(*lists.values()))
    for args, fields, given in bases:
        for combo in combos:
            swept = {**fields, **dict(zip(lists, combo, strict=True))}
            args_t, fields_t = tuple(args.items()), tuple(swept.items())
            name = given if given and len(combos) == 1 else point_name(args_t + fields_t)
            if given and len(combos) > 1:
                name = f"{given}+{point_name(tuple(zip(lists, combo, strict=True)))}"
            points.append(Point(name, args_t, fields_t))
    return points


def point_name(pairs: Sequence[tuple[str, str]]) -> str:
    """`key=value` pairs joined by `+`, safe as a path component (see the module docstring)."""
    if not pairs:
        return "base"
    lasts = [k.rsplit(".", 1)[-1] for k, _ in pairs]
    keys = [
        last if lasts.count(last) == 1 else k for (k, _), last in zip(pairs, lasts, strict=True)
    ]
    text = "+".join(f"{k}={v}" for k, (_, v) in zip(keys, pairs, strict=True))
    text = re.sub(r"[^A-Za-z0-9._=+-]", "_", text)
    if len(text) > _MAX_NAME:
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        text = f"{text[: _MAX_NAME - 11]}-{digest}"
    return text


def build_configs(
    base: ConfigFile, points: Sequence[Point], common: Sequence[str] = ()
) -> list[Any]:
    """Each point's config: the file's config with its args, the `--config.X=V` overrides
    `common` to every point, then its fields (the later wins).

    Raises:
      ValueError: naming the point and the field, for an unknown field (with the nearest), a
        value that does not parse, an arg the file refuses; two points with one config or one
        name.
    """
    configs = []
    seen: dict[str, str] = {}
    names: set[str] = set()
    for point in points:
        if point.name in names:
            raise ValueError(f"two points are named {point.name!r}: name them apart (_name=...)")
        names.add(point.name)
        where = f"point {point.name}: "
        try:
            config = base.get_config(dict(point.args))
        except Exception as e:  # the file's own check of its arg
            raise ValueError(f"{where}{base.spec(dict(point.args))}: {cli.one_line(e)}") from e
        fields = [f"--config.{k}={v}" for k, v in point.fields]
        try:
            config = cli.override_config(config, [*common, *fields], where=where)
        except ValueError as e:  # name the --sweep. flag, not the --config. one it became
            message = str(e)
            for k, v in point.fields:
                message = message.replace(f"--config.{k}={v}", f"--sweep.{k}={v}")
            raise ValueError(message) from e
        key = json.dumps(json.loads(config.to_json_best_effort()), sort_keys=True)
        if key in seen:
            raise ValueError(
                f"points {seen[key]} and {point.name} have the same config: drop one of them"
            )
        seen[key] = point.name
        configs.append(config)
    return configs


def flat_fields(config: Any) -> dict[str, Any]:
    """{"a.b": value} of a config (a ConfigDict, or its JSON as a dict)."""
    tree = config if isinstance(config, Mapping) else json.loads(config.to_json_best_effort())
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(tree, "")
    return out
