"""Preemption: a SIGTERM (or a TPU preemption notice) turns into a checkpoint at a step
boundary, then a clean exit, so that starting the same command again resumes.

On TPU pods (and any multi-process job) JAX's preemption service turns the scheduler's SIGTERM
into a synchronized "save now" step that Orbax's `PreemptionCheckpointingPolicy` sees
(`checkpointing.Checkpointer.reached_preemption`). A single process has no such service, so
`PreemptionSignal` catches SIGTERM itself; the loop then saves at the next step boundary, waits
for the save and returns normally.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import jax
from absl import logging

# JAX's preemption service polls for SIGTERM once a second; this wait covers that poll and the
# notice's trip through the coordination service.
NOTICE_PROPAGATION_S = 3.0


def send_preemption_notice() -> None:
    """Debugging hook (`debug.sigterm_after_step`): SIGTERM to process 0 only, as a scheduler
    sends to one host before a preemption.

    With several processes, every process then waits `NOTICE_PROPAGATION_S` for JAX's
    preemption service to pass the notice on to all of them, so that they agree on the step
    they are at: the save step is `sigterm_after_step` itself, not whichever later step the
    notice happened to reach.
    """
    if jax.process_index() == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    if jax.process_count() > 1:
        time.sleep(NOTICE_PROPAGATION_S)


class PreemptionSignal:
    """Turns SIGTERM into a flag that the training loop polls at step boundaries.

    Install it only in single-process runs: with `jax.distributed`, JAX's own preemption
    service owns SIGTERM and Orbax's `reached_preemption` reports the agreed step. Use as a
    context manager; the previous handler is restored on exit.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        logging.warning(
            "received signal %d: saving a checkpoint at the next step boundary, then exiting",
            signum,
        )
        self._event.set()

    def __enter__(self) -> PreemptionSignal:
        # Signal handlers can only be set from the main thread; elsewhere (e.g. a notebook
        # worker thread) the run simply has no SIGTERM handling.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)
            self._installed = False


@dataclasses.dataclass(frozen=True)
class DebugHooks:
    """What the tests do to a run at a step (`config.debug.*`; 0: never): a preemption notice
    after `sigterm_after_step` (process 0 gets SIGTERM, as one host of a pod), the process
    killed right after the save of `sigkill_after_save_at_step` starts or after the one of
    `sigkill_after_commit_at_step` commits, NaN weights in the batch of `nan_at_step` (so that
    the loss diverges there; pretraining's data half applies it)."""

    sigterm_after_step: int = 0
    sigkill_after_save_at_step: int = 0
    sigkill_after_commit_at_step: int = 0
    nan_at_step: int = 0

    def after_step(self, step: int) -> None:
        if step == self.sigterm_after_step:
            send_preemption_notice()

    def after_save(self, step: int, checkpointer: Any) -> None:
        """`checkpointer`: the loop's `checkpointing.Checkpointer`."""
        if step == self.sigkill_after_save_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.sigkill_after_commit_at_step:
            checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)
