"""Shared fixtures and the two tiers. Four simulated CPU devices, set before JAX starts, so that
tests can pmap over 1, 2 or 4 devices in this process; runs that need a fresh JAX use subprocesses.

`pytest` runs the fast tier; tests marked `slow("<reason>")`, each for one reason of `SLOW_BECAUSE`
below, run with `pytest --full`, or alone with `pytest -m slow`. Compiled programs persist across test
sessions in JAX's compilation cache under `.pytest_cache/` (never the user's cache): a rerun skips XLA's work.
"""

import contextlib
import functools
import importlib
import os
import random
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests check what a program computes, not how fast it runs, and XLA's optimisation passes are most of a
# tiny program's compile: without them (this process and its train.py subprocesses) the fast tier takes
# 246 s instead of 409 from an empty cache (docs/benchmarks.md). The benchmarks and asv compile as users
# do. JAX_DISABLE_MOST_OPTIMIZATIONS=0 pytest runs the suite on optimised programs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
ROOT = Path(__file__).resolve().parents[1]
# train.py sits at the root, outside the package: any test may `import train` (its config_exit, in process)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# JAX's persistent compilation cache for this process and its train.py subprocesses, every
# program kept (the defaults keep only those that took a second to compile).
# RNNLAB_TEST_COMPILE_CACHE=0 runs without it, train.py's own cache off too (CI does: jax-ml/jax#28908).
if os.environ.get("RNNLAB_TEST_COMPILE_CACHE", "1") == "0":
    os.environ["RNNLAB_COMPILE_CACHE"] = "0"
else:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax-compilation-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # Tests SIGKILL train.py at random moments, compiling included: the crash guard would move this shared cache
    # aside after each such kill (rnnlab.compile_cache; tests/test_compile_cache.py tests the guard itself).
    os.environ.setdefault("RNNLAB_COMPILE_CACHE_GUARD", "0")
# rnnlab's caches (measured peak FLOP/s, measured CPU device counts) in a fresh dir for the
# session, shared with the subprocesses: tests neither read nor write the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="rnnlab-test-cache-")
# Except the compiled C++ kernels (rnnlab.native_build: named by a hash of what built them, so never stale), which
# the pytest workers and later runs share instead of each compiling all of them (about 3 s of g++ each).
(ROOT / ".pytest_cache" / "native").mkdir(parents=True, exist_ok=True)
(Path(os.environ["XDG_CACHE_HOME"]) / "rnnlab").mkdir()
(Path(os.environ["XDG_CACHE_HOME"]) / "rnnlab" / "native").symlink_to(ROOT / ".pytest_cache" / "native")
# No test fetches a corpus (data=text): the tests read tests/data/text_fixture (data.corpus=file), and a corpus
# not prepared is refused at once (rnnlab.corpora.OFFLINE_ENV).
os.environ["RNNLAB_OFFLINE"] = "1"
# data=text on the fixture corpus, tiny (tests/test_text_training.py, tests/tasks/test_token_inputs.py)
TEXT_FIXTURE_DATA = ["data=text", "data.corpus=file", f"data.corpus_dir={ROOT / 'tests' / 'data' / 'text_fixture'}",
                     "data.valid_docs=[the_ferryman]", "data.test_docs=[a_winter_road]"]

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# CI (`CI` set, as CI services set it) draws Hypothesis's examples from a fixed seed, a hash of each test: a CI run
# fails on what the one before would have failed on, and `CI=true pytest ...` at home draws the same examples. Without
# CI the draws stay random (a failure's example is kept in .hypothesis/). Loaded here, before the test modules are
# imported, so that a test's own @settings take the rest from it (tests/test_suite_config.py checks that they do).
# Recent Hypothesis loads a "ci" profile of its own under CI; this one does so on every version the test extra allows.
hypothesis_settings.register_profile("rnnlab-ci", derandomize=True, database=None, deadline=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("rnnlab-ci")

from rnnlab.cpu import set_cpu_xla_flags  # noqa: E402

# As train.py does before JAX starts: this process and its train.py subprocesses compile alike,
# whichever test happens to start JAX first.
set_cpu_xla_flags()

import shared_programs  # noqa: E402

shared_programs.install()  # one XLA executable per distinct program in this process (tests/shared_programs.py)

CONF_DIR = str(ROOT / "conf")

def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the full suite: the fast tier and the tests marked slow")


# Why a test runs in the full tier only: `@pytest.mark.slow("<reason>")` on a test (`pytestmark = ...` on a module,
# `pytest.param(..., marks=pytest.mark.slow("<reason>"))` on one case, `fast_first(..., why="<reason>")` on the cases
# after the first) names one of these; collection refuses a `slow` mark without one. The fast tier must finish within
# 5 minutes on 2 cores: a test that took 6.5 s or more there (`pytest --durations`, 2-core VM, 2026-12-01) moved here,
# as `long`, or as `cross-product` where a case of its grid stays in the fast tier.
SLOW_BECAUSE = {
    "end-to-end": "runs train.py, a script, the zoo or pytest itself whole, as a user does, most in fresh processes "
                  "that each start JAX and compile anew.",
    "cross-product": "is another case of a grid (cells x forms x options) whose shared code the test's first case, "
                     "or a fast test beside it, already runs.",
    "long": "trains, evaluates or compiles more than the fast tier has time for (whole runs in this process, several "
            "forms' gradients, long sequences, many steps or draws).",
    "extra": "needs what CI installs for the full tier only: torch, xlstm, mlstm-kernels or flash-linear-attention "
             "(an independent implementation to check against), or oneDNN's library.",
    "cluster": "starts processes that work together: JAX processes over loopback, or a SLURM of its own (as root).",
}


def slow_mark_problem(item) -> str | None:
    """Why `item`'s `slow` marks are refused (the one line collection fails with), or None: each names one reason."""
    for mark in item.iter_markers("slow"):
        if len(mark.args) != 1 or mark.kwargs or mark.args[0] not in SLOW_BECAUSE:
            given = ", ".join([*map(repr, mark.args), *(f"{k}={v!r}" for k, v in mark.kwargs.items())])
            return (f"{item.nodeid}: slow({given}) needs one reason, slow(\"<reason>\"), of tests/conftest.py's "
                    f"SLOW_BECAUSE: {', '.join(SLOW_BECAUSE)}")
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """In a pytest-xdist worker (`pytest`'s -n auto) a UsageError raised at collection ends the run with an internal
    error that drops its message: there, a refused `slow` mark fails its module's collection, message shown."""
    report = yield
    if hasattr(collector.config, "workerinput") and report.passed:
        problems = [p for node in report.result if isinstance(node, pytest.Item) and (p := slow_mark_problem(node))]
        if problems:
            report.outcome, report.longrepr, report.result = "failed", "\n".join(problems), []
    return report


def pytest_collection_modifyitems(config, items):
    """Every `slow` mark names one reason of SLOW_BECAUSE (else a UsageError); without --full or a -m expression of
    one's own, the slow tests are deselected (not skipped)."""
    problem = next(filter(None, map(slow_mark_problem, items)), None)
    if problem:
        raise pytest.UsageError(problem)
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


# Small enough to compile and run in seconds on a 2-core CPU.
TINY = [
    "steps=6",
    "batch_size=8",
    "hidden_dim=8",
    "num_layers=2",
    "data.seq_len=6",
    "log_every=2",
    "eval_every=3",
    "eval_batches=1",
    "checkpoint.every=3",
    "device=cpu",
    "device.num_devices=1",
]


def require(module: str):
    """`module` imported, or the test skipped where it is not installed; under CI (`CI` set) a
    missing module fails the test instead: a test skipped in CI tests nothing."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def fast_first(values, keep=1, *, why, first_why=None):
    """Parametrize values of which the first `keep` run in the fast tier, the rest in the full tier only, for the
    reason `why` (a key of SLOW_BECAUSE). `first_why`: the first `keep` run in the full tier too, for that reason.
    A tuple holds the values of several argument names (one argument taking a tuple: wrap it, `(t,)`)."""
    first = () if first_why is None else pytest.mark.slow(first_why)
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=first if i < keep else pytest.mark.slow(why))
            for i, v in enumerate(values)]


def compose_config(overrides=()):
    """The real conf/ composed by Hydra with `overrides`, as a validated Config. A Config is frozen and conf/ does
    not change while the tests run, so each list of overrides is composed once a process (a composition takes
    Hydra 0.1-0.2 s; the suite asks for the same ones many times). A refusal is not kept: it is raised each time."""
    return _composed(tuple(overrides))


@functools.lru_cache(maxsize=None)
def _composed(overrides):
    from rnnlab.config import from_omegaconf

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return from_omegaconf(compose(config_name="config", overrides=list(overrides)))


def tiny_config(*overrides):
    return compose_config([*TINY, *overrides])


def run_train(args, cwd, env_extra=None, timeout=300):
    """`python train.py ARGS` in a fresh process; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd, env=train_env(env_extra), capture_output=True, text=True, timeout=timeout,
    )


def train_env(extra=None):
    """The environment of a `train.py` subprocess: ours, less the simulated device count of this
    test process (the command line decides it; the count also changes XLA's CPU threading, so
    runs compared bit for bit must agree on it)."""
    env = {**os.environ, **(extra or {})}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def saved_state(workdir, step):
    """Read a checkpoint back with Orbax alone (no rnnlab code), as a plain tree of arrays."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager((Path(workdir) / "checkpoints").absolute()) as manager:
        return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


def saved_record(workdir, step):
    """The run record (config, accepted changes) a checkpoint carries, read with Orbax alone."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager((Path(workdir) / "checkpoints").absolute()) as manager:
        return manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


@contextlib.contextmanager
def xla_optimizations():
    """XLA's optimisation passes on in this process, as users compile, for a test that holds two differently built
    programs bit-identical: unoptimised, they are not always (the step inside a fori_loop and the same step alone
    round one value of 40 steps' parameters 1 ulp apart for one initialisation), optimised they are."""
    import jax

    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


def assert_same_tree(a, b):
    """Bit-identical leaves."""
    import jax
    import numpy as np

    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture
def seeded_random(request):
    """A `random.Random` seeded from the test's name (parameters included): a test that stops a process at a random
    moment draws the same moments on every run and every machine, so a failure reproduces."""
    return random.Random(zlib.crc32(request.node.name.encode()))
