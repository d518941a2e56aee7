"""`python -m rnnlab.zoo`: plan, run, collect and publish the zoo's protocol (`rnnlab.zoo.protocol`).

    python -m rnnlab.zoo plan core                     # the jobs, what is recorded, the predicted time here
    python -m rnnlab.zoo run core --deadline 3h        # run what is left, at the suite's commit; resumable
    python -m rnnlab.zoo run core --executor population --parallel 1   # a GPU: each grid, then each seed set, as one program
    python -m rnnlab.zoo run core --executor slurm --partition gpu --gpus-per-node 1   # each job a SLURM job
    python -m rnnlab.zoo collect                       # run dirs -> docs/zoo/records/<table>.jsonl
    python -m rnnlab.zoo page                          # docs/results.md and its plots, from the records alone
    python -m rnnlab.zoo run core --cell mycell -- imports=[mycells] hydra.searchpath=[file://conf_extra]

Exit codes: 0 done, 1 a job ended without a final status, 2 bad input (a damaged records line too), 74 a folder
it must write (--out, --docs) cannot be written, 75 stopped at the deadline or by a signal, or SLURM's squeue not
answering (run again; SLURM jobs stay queued), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from rnnlab import exit_codes
from rnnlab.zoo import protocol, records, runner, slurm
from rnnlab.zoo.protocol import Table
from rnnlab.zoo.runner import ZooError, ZooUnwritable
from rnnlab.zoo.slurm import ProbeWaiting, QueueUnavailable

DEFAULT_OUT = Path("zoo_runs")
EXIT_BAD_INPUT, EXIT_CANNOT_WRITE, EXIT_ABORTED = exit_codes.BAD_INPUT, exit_codes.CANNOT_WRITE, exit_codes.ABORTED


def duration_seconds(text: str) -> float:
    """`90`, `90s`, `45m`, `3h`, `1h30m` -> seconds (argparse type: bad text exits 2 naming the option)."""
    match = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip())
    if not text.strip() or not match or not any(match.groups()):
        raise argparse.ArgumentTypeError(f"got {text!r}, allowed: a duration such as 600, 45m, 3h or 1h30m")
    h, m, s = (float(g) if g else 0.0 for g in match.groups())
    value = h * 3600 + m * 60 + s
    if value <= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}, allowed: a duration above 0")
    return value


def number_at_least(kind: type, low: float, strict: bool = False, allowed: str = ""):
    """An argparse type: a `kind` (int or float) >= low (> low with `strict`); bad text exits 2 naming the option."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < low or (strict and not value > low):
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {allowed}")
        return value

    return parse


positive_int = number_at_least(int, 1, allowed="an integer >= 1")
non_negative_int = number_at_least(int, 0, allowed="an integer >= 0")
positive_float = number_at_least(float, 0.0, strict=True, allowed="a number above 0")


SLURM_FLAGS = ("partition", "timeout_min", "cpus_per_task", "gpus_per_node", "mem_gb", "account", "qos")


def slurm_resources(args: argparse.Namespace) -> "slurm.Resources | None":
    """--executor slurm's SLURM request; None for the other executors (which refuse a SLURM flag)."""
    given = {key: getattr(args, key) for key in SLURM_FLAGS}
    if args.executor != "slurm":
        flags = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if flags:
            raise ZooError(f"option '{flags[0]}' belongs to --executor slurm (got --executor {args.executor})")
        return None
    return slurm.Resources(**{k: v for k, v in given.items() if v is not None})


def machine(args: argparse.Namespace, resources: "slurm.Resources | None", deadline: float) -> tuple[str, str]:
    """The kind of device and the machine the jobs run on: this one's, or with --executor slurm the nodes' (one
    SLURM job asks, once per out dir and resources; `plan` does not submit it, and goes by this machine until then)."""
    if resources is None:
        return runner.this_machine()
    found = slurm.machine(args.out, resources, deadline, ask=args.command == "run")
    if found is None:
        print("zoo: note: no SLURM job has said yet which device the jobs run on (the first `run` asks one); "
              "the plan goes by this machine's", file=sys.stderr)
        return runner.this_machine()
    return found


def commit_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("got '', allowed: a commit (a sha, branch or tag); leave the option out for "
                                         "the suite's recorded commit")
    return text.strip()


EPILOG_OVERRIDES = ("Overrides for every job go after --: keys the protocol leaves free (imports, hydra.searchpath, "
                    "checkpoint.*, device.*).")


def parser(tables: Mapping[str, Table], suites: Mapping[str, Sequence[str]]) -> argparse.ArgumentParser:
    names = list(dict.fromkeys([*suites, *tables]))  # a suite of one table shares its name ("text")
    p = argparse.ArgumentParser(prog="python -m rnnlab.zoo", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(s: argparse.ArgumentParser, suite: bool = True) -> None:
        if suite:
            s.add_argument("suite", choices=names, metavar="SUITE", help=f"a suite or one table: {', '.join(names)}")
        s.add_argument("--docs", type=Path, default=Path("docs"), help="where records/ and results.md live (docs)")
        s.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the run dirs ({DEFAULT_OUT})")

    def running(s: argparse.ArgumentParser) -> None:
        s.add_argument("--commit", type=commit_text, help="the commit to run (default: the suite's recorded commit, else HEAD)")
        s.add_argument("--parallel", type=positive_int, help="units side by side (default: one per core on a CPU "
                       "with the processes executor, else 1)")
        s.add_argument("--executor", choices=("processes", "population", "slurm"), default="processes",
                       help="processes (default), population, or slurm: each job a SLURM job through submitit "
                       "(--parallel: jobs in the queue at once, default all that are ready)")
        s.add_argument("--cell", action="append", default=[], help="only this cell's settings; a cell the protocol "
                       "does not list joins every table with its default setting (repeat the flag for more)")
        cluster = s.add_argument_group("SLURM (--executor slurm; named as hydra's submitit launcher names them)")
        cluster.add_argument("--partition", help="the partition (default: the cluster's)")
        cluster.add_argument("--timeout-min", type=positive_int, help="each job's time limit in minutes (60); a job "
                             "that reaches it saves, is requeued and resumes")
        cluster.add_argument("--cpus-per-task", type=positive_int)
        cluster.add_argument("--gpus-per-node", type=non_negative_int)
        cluster.add_argument("--mem-gb", type=positive_float)
        cluster.add_argument("--account")
        cluster.add_argument("--qos")

    plan = sub.add_parser("plan", help="the jobs, what is recorded, the predicted wall time on this machine",
                          epilog=EPILOG_OVERRIDES)
    common(plan)
    running(plan)
    plan.add_argument("--probe", action="store_true", help="time one short job per table where no record says")
    run = sub.add_parser("run", help="run the protocol's jobs that are left, resumably, at one commit",
                         epilog=EPILOG_OVERRIDES)
    common(run)
    running(run)
    run.add_argument("--deadline", type=duration_seconds, help="stop after this long (600, 45m, 3h); a job starts only if the records predict it ends by then "
                     "(--executor slurm: submitting stops there, and the queue is left as it is)")
    run.add_argument("--grace", type=duration_seconds, default=60.0, help="seconds between SIGTERM and SIGKILL (60)")
    collect = sub.add_parser("collect", help="run dirs -> docs/zoo/records/<table>.jsonl")
    common(collect, suite=False)
    collect.add_argument("suite", nargs="?", choices=names, metavar="SUITE", help="default: every table")
    page = sub.add_parser("page", help="docs/results.md and its plots from the records")
    common(page, suite=False)
    page.add_argument("--no-plots", action="store_true")
    return p


def selected(args: argparse.Namespace, tables: Mapping[str, Table], suites: Mapping[str, Sequence[str]]) -> list[Table]:
    chosen = [tables[k] for k in suites[args.suite]] if args.suite in suites else [tables[args.suite]]
    if getattr(args, "cell", None):
        chosen = [protocol.with_cells(t, list(dict.fromkeys(args.cell))) for t in chosen]
    return chosen


def pinned_commit(root: Path, docs: Path, tables: Sequence[Table], kind: str, ref: str | None) -> str:
    """--commit, else the commit most of the suite's records on this kind of machine were made at, else HEAD."""
    if ref:
        return runner.resolve_commit(root, ref)
    commits = collections.Counter(records.commit_of(r) for t in tables for r in records.read_table(docs, t.key)
                                  if records.kind_of(r) == kind and records.commit_of(r))
    if not commits:
        return runner.resolve_commit(root, "HEAD")
    recorded = commits.most_common(1)[0][0]
    try:
        return runner.resolve_commit(root, recorded)
    except ZooError:
        raise ZooError(f"the suite's records were made at commit {recorded[:12]}, which {root} does not hold (a "
                       "shallow clone?): `git fetch --unshallow` to go on with it, or --commit HEAD to start the "
                       "tables again at another commit") from None


def check_docs(docs: Path) -> None:
    if not Path(docs).is_dir():
        raise ZooError(f"option '--docs': {docs} is not a folder; allowed: the folder that holds zoo/records/ (run "
                       "from the repository's root, or pass --docs PATH/docs)")


def warn_if_dirty(root: Path, commit: str) -> None:
    """The jobs run the pinned commit from its worktree: say so when the checkout has changes they will not see."""
    changed = runner.git(root, "status", "--porcelain", "--untracked-files=no")
    if changed:
        print(f"zoo: note: {root} has uncommitted changes; the jobs run commit {commit[:12]} from its worktree, "
              "without them (commit them and pass --commit HEAD to run them)", file=sys.stderr)


def main(argv: Sequence[str] | None = None, tables: Mapping[str, Table] | None = None,
         suites: Mapping[str, Sequence[str]] | None = None) -> int:
    """The CLI; tests hand in `tables` and `suites` of their own (tiny ones)."""
    tables = dict(protocol.TABLES if tables is None else tables)
    suites = dict(protocol.SUITES if suites is None else suites)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # overrides for every job, after --
    args = parser(tables, suites).parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.overrides = extra
    if extra and args.command not in ("plan", "run"):
        print(f"zoo: error: overrides after -- belong to plan and run, not {args.command}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        check_docs(args.docs)
        if args.command == "page":
            from rnnlab.zoo import page

            written = page.write(args.docs, tables, plots=not args.no_plots)
            print(f"zoo: {', '.join(str(p) for p in written)}")
            return exit_codes.OK
        if args.command == "collect":
            chosen = selected(args, tables, suites) if args.suite else list(tables.values())
            changed = collect(args.out, args.docs, chosen)
            print(f"zoo: {changed} record(s) written under {records.records_dir(args.docs)}")
            return exit_codes.OK
        runner.check_extra(args.overrides)
        chosen = selected(args, tables, suites)
        alone = [t.key for t in chosen if not t.population]
        if args.command == "run" and args.executor == "population" and alone:
            raise ZooError(f"--executor population: {', '.join(alone)} trains on text streams, which the population "
                           f"launcher does not carry; allowed: --executor processes for it")
        root = runner.repo_root()
        resources = slurm_resources(args)
        with contextlib.ExitStack() as held:
            if args.command == "run":
                held.enter_context(runner.RunnerLock(args.out))  # before the worktree: one runner makes it
            deadline = time.time() + args.deadline if getattr(args, "deadline", None) else float("inf")
            kind, name = machine(args, resources, deadline)
            commit = pinned_commit(root, args.docs, chosen, kind, args.commit)
            code = runner.worktree(root, commit, args.out)
            runner.check_configs(code, chosen, args.overrides)
            ledger = runner.Ledger(chosen, args.out, args.docs, commit, kind, name)
            cpu = kind.startswith("CPU")
            if args.executor == "slurm":  # the cluster decides how many run at once
                parallel = args.parallel or sum(len(t.settings) * t.jobs_per_setting() for t in chosen)
            else:
                parallel = args.parallel or ((os.cpu_count() or 1) if cpu and args.executor == "processes" else 1)
            if args.command == "plan":
                if args.probe:
                    probe(code, chosen, args.out, ledger, args.overrides)
                runner.print_plan(ledger, chosen, parallel)
                return exit_codes.OK
            warn_if_dirty(root, commit)
            if args.executor == "slurm":
                executor = slurm.SlurmExecutor(code, args.out, args.overrides, resources)
            else:
                executor_class = runner.PopulationExecutor if args.executor == "population" else runner.Executor
                executor = executor_class(code, args.out, args.overrides, pin=cpu and args.executor == "processes")

            def ours(record: dict) -> bool:
                return records.commit_of(record) == commit and records.kind_of(record) == kind

            def record(done: list[dict]) -> None:
                for table in chosen:
                    mine = [r for r in done if r["table"] == table.key]
                    if mine:
                        records.merge(args.docs, table, mine)

            # Jobs that reached a final status with no runner there to record them (a runner killed, or a records
            # write that failed): recorded before anything starts, and again at the end.
            added = collect(args.out, args.docs, chosen, keep=ours)
            if added:
                print(f"zoo: {added} record(s) of jobs that ended after their runner was gone, now recorded")
            runner.print_plan(ledger, chosen, parallel)
            try:
                return runner.run(ledger, chosen, executor, parallel, deadline, args.grace, on_done=record)
            finally:
                collect(args.out, args.docs, chosen, keep=ours)
    except ZooError as e:
        print(f"zoo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ProbeWaiting as e:
        print(f"zoo: deadline: SLURM job {e} that asks which device the jobs run on is still queued; nothing else "
              "was submitted: run again", file=sys.stderr)
        return exit_codes.PREEMPTED
    except QueueUnavailable as e:
        print(f"zoo: {e}", file=sys.stderr)
        return exit_codes.PREEMPTED
    except records.RecordsError as e:
        print(f"zoo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ZooUnwritable, records.RecordsUnwritable) as e:
        print(f"zoo: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_WRITE
    except OSError as e:  # a file the command writes (the page, its plots) in a folder it may not write
        print(f"zoo: error: cannot write {e.filename or ''} ({e.strerror or e})", file=sys.stderr)
        return EXIT_CANNOT_WRITE
    except KeyboardInterrupt:
        print("zoo: interrupted; run the same command to go on", file=sys.stderr)
        return EXIT_ABORTED


def collect(out: Path, docs: Path, tables: Sequence[Table], keep: Callable[[dict], bool] | None = None) -> int:
    """Every run dir under `out` with a final status (those `keep` accepts, if given), as records, merged into the
    tables' files."""
    changed = 0
    for table in tables:
        found = []
        for setting in table.settings:
            folder = Path(out) / table.key / setting.slug
            for results_path in sorted(folder.glob("lr*_seed*/results.json")):
                match = re.fullmatch(r"lr([0-9.e+-]+)_seed(\d+)", results_path.parent.name)
                results = records.results_of(results_path.parent)
                if match and results.get("status") in records.FINAL:
                    record = records.record_from_results(table, setting, float(match.group(1)), int(match.group(2)),
                                                         results, f"{table.key}/{setting.slug}/{results_path.parent.name}")
                    if keep is None or keep(record):
                        found.append(record)
        changed += records.merge(docs, table, found)
    return changed


def probe(code: Path, tables: Sequence[Table], out: Path, ledger: runner.Ledger, extra: Sequence[str] = ()) -> None:
    """One short job per table with no record on this machine, recorded as a planning hint (not a result)."""
    for table in tables:
        if any(records.machine_of(r) == ledger.machine for r in records.read_table(ledger.docs, table.key)):
            continue
        seconds = runner.probe_seconds(code, table, out, extra)
        print(f"probe {table.key}: about {seconds:.0f} s a job ({table.settings[0].name}, {table.steps} steps)")
