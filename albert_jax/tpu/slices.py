"""Cloud TPU slices by the names gcloud gives them, and their devices without the hardware.

`slice_spec("v3-512")` → a `SliceSpec`: the libtpu topology of that accelerator type, its
devices (one per TensorCore on v2 / v3, one per chip after), the HBM the TPU compiler lets one
device use, and one device's peak bf16 rate. `target_devices(spec, num_slices)` asks libtpu
(`jax.experimental.topologies`) for compile-only devices of the slice(s): a `jax.jit(...)
.lower(...).compile()` on a mesh of them runs the compiler a pod runs, on any machine with the
`[tpu]` extra installed (`pip install -e ".[tpu]"`: `jax[tpu]` at the installed jax's version,
which pins the libtpu that jax was built with).

Names (gcloud's accelerator types): v2-N and v3-N count TensorCores (2 a chip), as do v4-N and
v5p-N (one megacore device a chip, so v4-32 is 16 devices); v5litepod-N and v6e-N count chips.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: how its names count and what one device has."""

    prefix: str  # the gcloud name before "-N"
    topology_prefix: str  # libtpu's topology name before the shape ("v3:4x4")
    chip_config: str  # libtpu's chip config ("megacore": the two cores as one device)
    dims: int  # 2-D or 3-D torus
    cores_per_name_unit: int  # the name's N counts TensorCores (2) or chips (1)
    devices_per_chip: int  # JAX devices a chip: 2 on v2 / v3 (a device per core), else 1
    sizes: tuple[int, ...]  # valid N
    usable_hbm_gib: float  # HBM the TPU compiler lets one device use (its E1000 message)
    peak_bf16_per_chip: float  # dense bf16 FLOP/s of a chip (Cloud TPU docs)
    hbm_gib_per_chip: float  # HBM of a chip (Cloud TPU docs)


_POW2 = tuple(2**i for i in range(14))
# usable_hbm_gib: the "available HBM" of the compiler's CompileTimeHbmOom message for one
# device of libtpu 0.0.42 (tests/test_plan.py checks each against the compiler).
GENERATIONS: dict[str, Generation] = {
    g.prefix: g
    for g in (
        Generation("v2", "v2", "default", 2, 2, 2, (8, 32, 128, 256, 512), 7.48, 45e12, 16),
        Generation("v3", "v3", "default", 2, 2, 2, (8, 32, 64, 128, 256, 512, 1024, 2048),
                   15.48, 123e12, 32),
        Generation("v4", "v4", "megacore", 3, 2, 1, tuple(n for n in _POW2 if 8 <= n <= 4096),
                   30.75, 275e12, 32),
        Generation("v5p", "v5", "megacore", 3, 2, 1, tuple(n for n in _POW2 if 8 <= n <= 8192),
                   95.74, 459e12, 95),
        Generation("v5litepod", "v5e", "default", 2, 1, 1, (1, 4, 8, 16, 32, 64, 128, 256),
                   15.75, 197e12, 16),
        Generation("v6e", "v6e", "default", 2, 1, 1, (1, 4, 8, 16, 32, 64, 128, 256),
                   31.25, 918e12, 32),
    )
}  # fmt: skip


# JAX's `device_kind` of each generation's devices (compile-only devices included).
DEVICE_KINDS = {
    "TPU v2": "v2", "TPU v3": "v3", "TPU v4": "v4", "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v5 lite": "v5litepod", "TPU v5e": "v5litepod", "TPU v6 lite": "v6e", "TPU v6e": "v6e",
}  # fmt: skip


def usable_hbm_bytes(device_kind: str) -> float | None:
    """The HBM the TPU compiler lets one device of `device_kind` use (None: not a known TPU).
    What `mesh.auto` plans with on compile-only devices, which report no memory."""
    prefix = DEVICE_KINDS.get(device_kind)
    return None if prefix is None else GENERATIONS[prefix].usable_hbm_gib * 2**30


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """One slice of `generation`: `name` as gcloud spells it, its chip grid `shape`."""

    name: str
    generation: Generation
    shape: tuple[int, ...]  # chips along each torus axis

    @property
    def chips(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def num_devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def topology_name(self) -> str:
        return f"{self.generation.topology_prefix}:" + "x".join(map(str, self.shape))

    @property
    def usable_hbm_gib(self) -> float:
        return self.generation.usable_hbm_gib

    @property
    def hbm_gib_per_device(self) -> float:
        return self.generation.hbm_gib_per_chip / self.generation.devices_per_chip

    @property
    def peak_bf16_per_device(self) -> float:
        return self.generation.peak_bf16_per_chip / self.generation.devices_per_chip

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Wraparound links per axis, as Cloud TPU wires the slice (MaxText's table): v4 / v5p
        from a full 4x4x4 cube; v5e / v6e on the 16-chip-long axes of 8x16 and 16x16. v2 / v3:
        libtpu's default (all False)."""
        if self.generation.dims == 3:
            return (min(self.shape) >= 4,) * 3
        if self.generation.prefix in ("v5litepod", "v6e"):
            return (self.shape[0] == 16, self.shape[1] == 16, False)
        return (False, False, False)


def valid_forms() -> str:
    """Every accepted name, one generation a line (for error messages and --help)."""
    return "; ".join(
        f"{g.prefix}-N with N in {{{', '.join(map(str, g.sizes))}}}" for g in GENERATIONS.values()
    )


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The torus of `chips` chips as Cloud TPU builds it: from 2x2 (2x2x1), doubling the
    smallest axis (the last among equals): 2x4, 4x4, 4x8 ... / 2x2x2, 2x2x4, 2x4x4, 4x4x4."""
    if chips == 1:
        return (1,) * dims
    shape = [2, 2] + [1] * (dims - 2)
    while shape[0] * shape[1] * (shape[2] if dims == 3 else 1) < chips:
        smallest = min(shape)
        i = max(j for j, s in enumerate(shape) if s == smallest)
        shape[i] *= 2
    return tuple(shape)


def slice_spec(name: str) -> SliceSpec:
    """The slice of a gcloud accelerator type ("v3-512", "v4-32", "v5litepod-16", "v6e-64").

    Raises:
      ValueError: listing the valid forms for an unknown name or size.
    """
    match = re.fullmatch(r"(v2|v3|v4|v5p|v5litepod|v6e)-(\d+)", name.strip())
    if match is None:
        raise ValueError(f"--tpu={name!r} is not a Cloud TPU accelerator type; valid forms: "
                         f"{valid_forms()}")  # fmt: skip
    generation, n = GENERATIONS[match.group(1)], int(match.group(2))
    if n not in generation.sizes:
        raise ValueError(
            f"--tpu={name!r}: {generation.prefix} slices have N in {generation.sizes}; valid "
            f"forms: {valid_forms()}"
        )
    chips = n // generation.cores_per_name_unit if generation.cores_per_name_unit > 1 else n
    return SliceSpec(name, generation, _grid(max(chips, 1), generation.dims))


def check_libtpu() -> str:
    """The installed libtpu's version, after checking it is the one the installed jax pins.

    Raises:
      RuntimeError: no libtpu, or another version than jax's `[tpu]` extra asks for (the
        compiler's figures and programs change between libtpu versions), with the fix.
    """
    fix = 'pip install -e ".[tpu]"  (jax[tpu] at the installed jax version)'
    try:
        installed = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the TPU compiler (libtpu) is not installed: {fix}") from None
    jax_version = importlib.metadata.version("jax")
    pins = [
        r.split(";")[0].replace("libtpu", "", 1).strip()
        for r in importlib.metadata.requires("jax") or []
        if r.startswith("libtpu") and 'extra == "tpu"' in r
    ]
    for pin in pins:  # e.g. "==0.0.42.*"
        wanted = pin.lstrip("=")
        prefix = wanted[:-2] if wanted.endswith(".*") else wanted
        if not (installed == prefix or installed.startswith(prefix + ".")):
            raise RuntimeError(
                f"libtpu {installed} is installed but jax {jax_version} was built with libtpu "
                f"{pin}: {fix}"
            )
    return installed


def target_devices(spec: SliceSpec, num_slices: int = 1) -> list[Any]:
    """Compile-only devices of `num_slices` slices of `spec` (libtpu; no TPU needed). With
    several slices each device has a `slice_index`."""
    check_libtpu()
    # libtpu warns about the host it cannot find without these; they change nothing compiled.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", spec.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compile-only: no chip is opened, so other processes compiling at the same time (a
    # training run on this TPU VM, parallel test workers) need not hold libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    bounds = (1, 1, 1) if spec.chips == 1 else (2, 2, 1)
    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=spec.topology_name,
        chip_config_name=spec.generation.chip_config,
        chips_per_host_bounds=bounds,
        num_slices=num_slices,
        wrap=spec.wrap,
    )
    return list(topology.devices)
