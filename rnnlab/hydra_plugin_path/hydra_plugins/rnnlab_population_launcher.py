"""The class Hydra instantiates for `hydra/launcher=population` (Hydra accepts plugins from the `hydra_plugins`
namespace only; train.py puts this folder on the path). The work is in `rnnlab.population_launch`, imported
when a sweep launches: Hydra imports this module at every start."""

from __future__ import annotations

from typing import Any, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


class PopulationLauncher(Launcher):
    """Jobs that differ only in `member_keys` train as one program with a member axis (`rnnlab.population`)."""

    def __init__(self, member_keys: Sequence[str] = ("optimizer.lr", "seed"), max_members: int | None = None) -> None:
        self.member_keys, self.max_members = list(member_keys), max_members
        self.config: Any = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from rnnlab.population_launch import launch

        return launch(self, job_overrides, initial_job_idx)
