"""Order-preserving parallel map over worker processes, with a bounded window.

`multiprocessing.Pool.imap` drains its input iterator eagerly (its feeder thread reads ahead
without limit), which would load a whole corpus into memory; here at most `window` items are in
flight. Workers are started with "spawn" (forking a process that runs JAX threads is unsafe) and
never import JAX. Results come back in input order, so outputs never depend on the worker count.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_STATE: dict[str, Any] = {}


def _init(fn: Callable) -> None:
    _STATE["fn"] = fn


def _call(item: Any) -> Any:
    return _STATE["fn"](item)


class WorkerPool:
    """`num_workers` spawned processes that each hold one pickled copy of `fn`."""

    def __init__(self, fn: Callable[[Any], Any], num_workers: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (got {num_workers})")
        ctx = multiprocessing.get_context("spawn")
        self._pool = ctx.Pool(num_workers, initializer=_init, initargs=(fn,))
        self.num_workers = num_workers

    def submit(self, item: Any):
        return self._pool.apply_async(_call, (item,))

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()


def ordered_map(
    fn: Callable[[Any], Any], items: Iterable, *, num_workers: int = 0, window: int | None = None
) -> Iterator:
    """`map(fn, items)` on `num_workers` processes (0 = in this process), in input order."""
    if num_workers <= 0:
        yield from map(fn, items)
        return
    pool = WorkerPool(fn, num_workers)
    window = window or 4 * num_workers
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(item))
            if len(pending) >= window:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.close()
