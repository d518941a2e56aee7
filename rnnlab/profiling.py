"""Optional jax.profiler capture of a window of training steps (config group `profile`).

    python train.py profile.start_step=20 profile.num_steps=5 profile.memory=true

traces steps 20..24 (the loop's step numbers: updates done after the step) into the
run's `tensorboard/` dir, where TensorBoard's profile plugin finds it
(`tensorboard/plugins/profile/<timestamp>/*.xplane.pb`; `pip install tensorboard-plugin-profile`
to view it), and with `memory=true` writes `jax.profiler.save_device_memory_profile`
output for the last traced step beside it as `tensorboard/memory_step<N>.prof`
(view with `pprof`). Only the window's last step waits for the device (so the trace
holds the steps' execution, not just their dispatch); outside the window this does nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

from rnnlab.config import ProfileConfig

log = logging.getLogger(__name__)


class StepProfiler:
    """Call `begin(step)` before dispatching a step and `end(step, outputs)` after it."""

    def __init__(self, config: ProfileConfig, logdir: Path):
        self.first = config.start_step
        self.last = config.start_step + config.num_steps - 1
        self.enabled = config.num_steps > 0
        self.memory = config.memory
        self.logdir = Path(logdir)
        self.tracing = False

    def begin(self, step: int) -> None:
        if self.enabled and not self.tracing and self.first <= step <= self.last:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir))
            self.tracing = True
            log.info("profiling steps %d-%d into %s", step, self.last, self.logdir)

    def end(self, step: int, outputs: Any) -> None:
        if self.tracing and step >= self.last:
            jax.block_until_ready(outputs)
            self.stop(step)

    def stop(self, step: int | None = None) -> None:
        """Finish the trace (also on an early exit); idempotent."""
        if not self.tracing:
            return
        self.tracing = False
        jax.profiler.stop_trace()
        if self.memory:
            path = self.logdir / f"memory_step{step if step is not None else 'last'}.prof"
            jax.profiler.save_device_memory_profile(str(path))
            log.info("device memory profile: %s", path)
