"""Collectives of a compiled (optimized) HLO module: by kind, inside a slice and across slices,
with how many run a step and their bytes.

What the text looks like, and why each rule below:
- Async collectives come as `-start` / `-done` pairs: the `-start` is counted. Every
  instruction counts, whatever its `channel_id`: the partitioner gives many distinct
  collectives one channel (17 all-gathers of a multi-slice program shared `channel_id=1`).
- A collective inside a `while` body (the scanned layers, when the compiler keeps the loop)
  runs once an iteration: its computation's count is multiplied by the loop's
  `known_trip_count`, down the call graph from ENTRY.
- The TPU compiler writes a reduce-scatter as an `all-reduce` + `dynamic-slice` inside a
  computation named `all-reduce-scatter*`: counted as `reduce-scatter`.
- Across slices (multi-slice, over the data-center network) there is no `all-reduce`: each
  transfer is a `send` / `recv` pair to the megascale runtime, its operation in
  `_xla_megascale_transfer_type` (`ALL_REDUCE`, `ALL_GATHER`); the `send`s are counted.
- Bytes are per device and per run of the collective: the buffer reduced (all-reduce,
  reduce-scatter: its input), gathered (all-gather: its output) or moved (the rest). The
  shape of an `all-gather-start` is (operands..., results...), that of a
  `collective-permute-start` (operand, result, u32[], u32[]): the context scalars are no data
  (they were counted as the permute's 8 bytes); an `all-reduce-start`'s is its result.
"""

from __future__ import annotations

import collections
import re
from typing import Any

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|f16|bf16|f32|f64|c64|c128|f8\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)"
                    r"=\{?([^}\s]*(?:,\s*%[\w.\-]+)*)\}?")  # fmt: skip
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# A scalar array in a shape (`u32[]{:S(2)}`): the context values of an async start.
_ARRAY_SCALAR = re.compile(r"\b[a-z0-9]+\[\](\{[^}]*\})?")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")  # fmt: skip


def _bytes(shape_text: str) -> list[float]:
    """Bytes of each array in an HLO shape (a tuple gives several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * _DTYPE_BYTES.get(dtype, 1))
    return out


def _group_size(rest: str) -> int:
    """Devices in one replica group of a collective (the three forms XLA prints)."""
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        n = 1
        for axis in re.findall(r"'(\w+)'", mesh.group(2)):
            n *= int(sizes.get(axis, 1))
        return n
    return 1


def _iota(dims: str, perm: str | None) -> Any:
    """XLA's iota device list `[dims]T(perm)`: arange over `dims`, transposed by `perm`."""
    import numpy as np

    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _first_group(rest: str, devices: int) -> list[int] | None:
    """The device ids of a collective's first replica group, in any of XLA's three forms
    (explicit lists, iota `[G,S]<=[dims]T(perm)`, `mesh[...] {axes}`); None when unreadable."""
    import numpy as np

    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if explicit:
        return [int(i) for i in explicit.group(1).split(",") if i]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        ids = _iota(iota.group(3), iota.group(4))
        return ids.reshape(int(iota.group(1)), int(iota.group(2)))[0].tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(\{[^}]*\})?", rest)
    if mesh:
        sizes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))]
        ids = np.arange(int(np.prod([n for _, n in sizes]))).reshape([n for _, n in sizes])
        order = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", rest)
        if order:
            ids = _iota(order.group(1), order.group(2)).reshape(-1)[ids]
        grouped = set(re.findall(r"'(\w+)'", mesh.group(2) or ""))
        index = tuple(slice(None) if a in grouped else 0 for a, _ in sizes)
        return ids[index].reshape(-1).tolist()
    return None


def reductions_by_axis(
    text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]
) -> dict[str, float]:
    """Bytes a step, per device, of the all-reduces and reduce-scatters inside a slice, keyed
    by the mesh axes their replica groups span ("fsdp", "data+fsdp", "tensor", ...; "?" for a
    group this cannot read). Device ids are positions in the mesh's device order (the
    program's device assignment), so a group of ids maps to the axes along which they differ.
    Tells a gradient reduction (over the batch axes) from tensor parallelism's sums of
    activations (over `tensor` alone)."""
    import numpy as np

    entry, computations = _parse(text)
    runs = _multiplicities(entry, computations)
    devices = int(np.prod(mesh_shape))
    out: dict[str, float] = collections.defaultdict(float)
    for comp, instructions in computations.items():
        times = runs.get(comp, 0)
        for _, shape, op, rest in instructions if times else ():
            base = op.removesuffix("-start")
            if base not in ("all-reduce", "reduce-scatter") or op.endswith("-done"):
                continue
            size = sum(_bytes(shape))
            if base == "reduce-scatter":
                size *= _group_size(rest)
            group = _first_group(rest, devices)
            if group is None or max(group, default=0) >= devices:
                key = "?"
            else:
                coords = np.array(np.unravel_index(group, mesh_shape))
                spans = [n for n, c in zip(axis_names, coords, strict=True) if len(set(c)) > 1]
                key = "+".join(spans) or "none"
            out[key] += times * size
    return dict(out)


def _parse(text: str) -> tuple[str | None, dict[str, list[tuple[str, str, str, str]]]]:
    """(entry computation, {computation: [(name, shape, op, rest)]})."""
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(line)
        if match:
            computations[current].append(match.groups())  # type: ignore[arg-type]
    return entry, computations


def _trip_count(rest: str, computations: dict[str, list[Any]]) -> int:
    """Iterations of a `while`: its `known_trip_count`, else the bound N of a condition
    `i < N` on a constant (what the TPU compiler leaves of a `lax.scan` / `fori_loop`),
    else 1."""
    found = _TRIP.search(rest)
    if found:
        return int(found.group(1))
    condition = re.search(r"\bcondition=%([\w.\-]+)", rest)
    body = computations.get(condition.group(1), []) if condition else []
    constants = {name: r for name, _, op, r in body if op == "constant"}
    for _, _, op, r in body:
        if op == "compare" and "direction=LT" in r:
            for operand in re.findall(r"%([\w.\-]+)", r.split(")")[0]):
                value = re.match(r"\s*(\d+)\)", constants.get(operand, ""))
                if value:
                    return int(value.group(1))
    return 1


def _multiplicities(entry: str | None, computations: dict[str, list[Any]]) -> dict[str, int]:
    """Runs a step of each computation reachable from ENTRY (while bodies × trip count)."""
    runs: dict[str, int] = collections.defaultdict(int)
    if entry is None:
        return {name: 1 for name in computations}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if name not in computations or depth > 64:
            return
        runs[name] += times
        for _, _, op, rest in computations[name]:
            trip = _trip_count(rest, computations) if op == "while" else 1
            for key, targets in _CALLS.findall(rest):
                for target in re.findall(r"%([\w.\-]+)", targets):
                    visit(target, times * (trip if key in ("body", "condition") else 1),
                          depth + 1)  # fmt: skip

    visit(entry, 1)
    return runs


def summarize(text: str) -> dict[str, dict[str, dict[str, float]]]:
    """{"within_slice": {kind: {"count", "bytes"}}, "cross_slice": {...}} a step, per device,
    of an optimized HLO module's text (`compiled.as_text()`)."""
    entry, computations = _parse(text)
    runs = _multiplicities(entry, computations)
    out: dict[str, dict[str, dict[str, float]]] = {"within_slice": {}, "cross_slice": {}}
    for comp, instructions in computations.items():
        times = runs.get(comp, 0)
        if not times:
            continue
        for _, shape, op, rest in instructions:
            base = op.removesuffix("-start")
            if base == "send" and _MEGASCALE.search(rest):
                where, kind = "cross_slice", _MEGASCALE.search(rest).group(1).lower()
                kind = kind.replace("_", "-")
                size = (_bytes(shape) or [0])[0]  # (buffer, u32[], token[])
            elif base in KINDS and not op.endswith("-done"):
                where, kind = "within_slice", base
                arrays = _bytes(shape)
                if op == "collective-permute-start":  # (operand, result, u32[], u32[])
                    arrays = _bytes(_ARRAY_SCALAR.sub("", shape))
                if op in ("collective-permute-start", "all-gather-start") and len(arrays) > 1:
                    arrays = arrays[len(arrays) // 2 :]  # (operands..., results...)
                size = sum(arrays)
                if base == "all-reduce" and comp.startswith("all-reduce-scatter"):
                    kind = "reduce-scatter"
                elif base == "reduce-scatter":
                    size *= _group_size(rest)  # its input: the output times the group
            else:
                continue
            entry_ = out[where].setdefault(kind, {"count": 0, "bytes": 0})
            entry_["count"] += times
            entry_["bytes"] += times * size
    return out
