"""The zoo's protocol (Zoology's): each model at its best learning rate from a grid, chosen on the
training-length eval only, with the mean and spread over seeds.

A *setting* is one combination of the sweep's other overrides (model, data.num_pairs, hidden_dim...);
its jobs differ only in `optimizer.lr` and `seed`. For each lr the score is the mean, over seeds, of
the task's headline metric at the training length (results.json's `eval_metrics`, the run's own eval
at `data.seq_len`; never `eval_by_len`'s longer lengths). An lr is a candidate only if every one of its
seeds completed with a finite score: a diverged or failed job fails its lr, not the setting. The best
candidate wins (highest for a metric, lowest for a loss or error; the smaller lr on a tie), and its
jobs' results at every length are what the tables report. Where the lrs have different seeds (the grid
on seed 0, then more seeds at the lr it chose: scripts/zoo_queue.py), the means compared are over the
seeds every lr has, so the extra seeds report the choice and do not change it. Used by summarize.py;
no plotting here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Sequence

LR_KEY = "optimizer.lr"
SEED_KEY = "seed"
PROTOCOL_KEYS = (LR_KEY, SEED_KEY)
OK = "completed"


def lower_is_better(metric: str) -> bool:
    """Losses and errors are minimised; anything else (accuracy) is maximised."""
    return metric == "loss" or metric.endswith(("loss", "error", "mse"))


def training_length_score(results: dict[str, Any], metric: str) -> float | None:
    """The job's headline metric at its training length, or None if it did not complete with a finite one."""
    if results.get("status") != OK:
        return None
    value = results.get("eval_loss") if metric == "loss" else (results.get("eval_metrics") or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclasses.dataclass
class LrResult:
    """One learning rate of a setting: its jobs (indices into the sweep) and their training-length scores."""

    lr: float
    jobs: list[int]
    scores: list[float | None]  # per job, None where the job failed or diverged

    @property
    def failed(self) -> list[int]:
        return [j for j, s in zip(self.jobs, self.scores) if s is None]

    @property
    def mean(self) -> float | None:
        """Mean score over seeds; None if any seed failed (the lr is not a candidate)."""
        return None if self.failed or not self.scores else statistics.fmean(self.scores)


@dataclasses.dataclass
class Choice:
    """The protocol's outcome for one setting."""

    setting: tuple[tuple[str, str], ...]  # (key, value) of the sweep's other overrides
    grid: list[LrResult]  # every lr tried, ascending
    best: LrResult | None  # None: every lr failed

    @property
    def lr(self) -> float | None:
        return self.best.lr if self.best else None


def choose(grid: Sequence[LrResult], metric: str) -> LrResult | None:
    """The best lr of a setting by its mean training-length score; None if no lr completed on every seed."""
    candidates = [g for g in sorted(grid, key=lambda g: g.lr) if g.mean is not None]
    if not candidates:
        return None
    sign = 1.0 if lower_is_better(metric) else -1.0
    return min(candidates, key=lambda g: sign * g.mean)  # min keeps the first (smaller lr) on a tie


def settings(overrides: Sequence[dict[str, str]], results: Sequence[dict[str, Any]], default_lrs: Sequence[float],
             swept: Sequence[str], metric: str) -> list[Choice]:
    """Group jobs by their non-protocol swept overrides (in first-seen order) and choose each group's lr.
    `default_lrs`: each job's lr where it is not an override (its config's optimizer.lr)."""
    keys = [k for k in swept if k not in PROTOCOL_KEYS]
    groups: dict[tuple, dict[float, list[int]]] = {}
    for i, o in enumerate(overrides):
        setting = tuple((k, o.get(k, "")) for k in keys)
        lr = float(o[LR_KEY]) if LR_KEY in o else default_lrs[i]
        groups.setdefault(setting, {}).setdefault(lr, []).append(i)
    choices = []
    for setting, by_lr in groups.items():
        grid = [LrResult(lr, jobs, [training_length_score(results[j], metric) for j in jobs])
                for lr, jobs in sorted(by_lr.items())]
        seeds = [{overrides[j].get(SEED_KEY) for j in g.jobs} for g in grid]
        shared = set.intersection(*seeds) if grid else set()
        # Compared on the shared seeds; an lr any of whose seeds failed is still no candidate.
        compared = [LrResult(g.lr, g.jobs, g.scores) if not shared or g.mean is None else
                    LrResult(g.lr, *map(list, zip(*[(j, s) for j, s in zip(g.jobs, g.scores)
                                                    if overrides[j].get(SEED_KEY) in shared])))
                    for g in grid]
        best = choose(compared, metric)
        choices.append(Choice(setting, grid, grid[compared.index(best)] if best else None))
    return choices


def mean_and_spread(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation) of the values present; spread None with fewer than two."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None
