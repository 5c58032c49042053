"""A restarted run does not compile again: JAX's persistent compilation cache, beside the run.

Every start of a run (a spot restart of `launch/tpu_pod.sh run --restart`, a resume after a
crash) used to compile its step again: tens of seconds for the large models, on every host.
JAX keeps compiled programs in a persistent cache when `jax_compilation_cache_dir` is set;
`use_for_run` sets it to WORKDIR/compilation_cache unless the config or the environment
(`JAX_COMPILATION_CACHE_DIR`) names another place, so a restart of the same config finds its
programs there. A `gs://` workdir keeps its cache in the bucket too (JAX writes it through
etils' epath), where every host of a restarted pod finds it.

`CompileClock` adds up the compile time a process spends (`/jax/core/compile/...` events:
a program read from the cache counts its retrieval time) and the cache hits, for the loop's
log line after the first step.
"""

from __future__ import annotations

import threading
from typing import Any

from absl import logging

from albert_jax import files

CACHE_DIR = "compilation_cache"  # WORKDIR/compilation_cache
OFF = "none"
# Programs compiled faster than this are not written (tiny ones: reading them back would cost
# about what compiling them does). JAX's default is 1 s; the step of a small model on a CPU
# host compiles in about that, so the cache would miss exactly the program a restart needs.
MIN_COMPILE_TIME_S = 0.2


def use_for_run(setting: str | None, workdir: str) -> str | None:
    """Points JAX's persistent compilation cache at the run's place and returns it (None: off).

    `setting` is `config.compilation_cache_dir`: "" for WORKDIR/compilation_cache (unless
    `JAX_COMPILATION_CACHE_DIR` or an earlier run of this process chose a place: the cache's
    place is fixed at a process's first compilation), a path (local or gs://), or "none".
    """
    import jax

    CompileClock.get()  # listening before the run's first compilation
    setting = (setting or "").strip()
    if setting.lower() == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        logging.info("persistent compilation cache: off (config.compilation_cache_dir=none)")
        return None
    current = jax.config.jax_compilation_cache_dir
    wanted = files.absolute(setting) if setting else None
    if wanted is None and current:
        logging.info("persistent compilation cache: %s (set before this run)", current)
        return current
    place = wanted or str(files.as_path(workdir) / CACHE_DIR)
    jax.config.update("jax_compilation_cache_dir", place)
    if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_TIME_S:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    logging.info("persistent compilation cache: %s", place)
    return place


class CompileClock:
    """Seconds this process has spent compiling (reading from the persistent cache counts as
    compiling: it is what a start waits for) and the persistent cache's hits. One listener per
    process (JAX's listeners cannot be removed); read `seconds` / `hits` / `programs`."""

    _instance: CompileClock | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.seconds = 0.0
        self.programs = 0
        self.hits = 0

    @classmethod
    def get(cls) -> CompileClock:
        with cls._lock:
            if cls._instance is None:
                import jax

                clock = cls()
                jax.monitoring.register_event_duration_secs_listener(clock._on_duration)
                jax.monitoring.register_event_listener(clock._on_event)
                cls._instance = clock
            return cls._instance

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds += duration
            self.programs += 1

    def _on_event(self, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
