"""A property-based fuzzer over the whole config surface: bad input exits 2 with one line naming the key.

The keys come from the real conf/ as Hydra composes it, for every option of every group (every cell's
and every task's own keys included), so a key added to a yaml is fuzzed without editing this file.
Each example is a list of overrides drawn for one composition: valid values, wrong types, numbers out
of range, huge sizes, NaN/inf, empty and odd strings, unknown keys. The property is train.py's, checked
in process up to where JAX would start (`train.config_exit`): exit 0 or 2, and a 2 is one line that
names a key of the command line. A few examples run in the fast tier; `pytest --full` runs many more
with a fixed seed, and a handful through `python train.py` itself (no traceback, no hang, nothing
written outside its run dir). Each failure found is fixed and kept as an `@example`.
"""

import functools
import math
import sys

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, example, given, settings  # the test extra installs it: never skipped
from hypothesis import strategies as st

from conftest import CONF_DIR, ROOT, run_train

sys.path.insert(0, str(ROOT))
import train  # noqa: E402  (train.py: the exit code a config gets, in process)

GROUPS = ("model", "data", "optimizer", "device")  # groups whose options bring keys of their own
SKIPPED = ("hydra", "imports", "distributed.enabled")  # imports runs code; distributed starts a coordinator


@functools.lru_cache(maxsize=None)
def group_options(group):
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return tuple(sorted(GlobalHydra.instance().config_loader().get_group_options(group, ObjectType.CONFIG)))


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@functools.lru_cache(maxsize=None)
def composed(choices=()):
    """{dotted key: default value} of the config composed with `choices` (group=option pairs)."""
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(choices))
    values = OmegaConf.to_container(cfg, resolve=True)
    return {k: v for k, v in _leaves(values) if not k.startswith(SKIPPED)}


@functools.lru_cache(maxsize=None)
def option_keys(group, option):
    """{key: default} a group's option brings: its yaml's keys, and for a cell or a task the keys its
    dataclass takes beyond those (set with `+model.<key>=`), so a key added anywhere is fuzzed."""
    import dataclasses

    from rnnlab import cells, tasks

    keys = {k: v for k, v in composed((f"{group}={option}",)).items() if k.startswith(group + ".")}
    if group == "model":
        cell = cells.get_cell(keys["model.cell"])
        base = {f.name for f in dataclasses.fields(cells.Cell)}
        own = {f.name: f.default for f in dataclasses.fields(cell) if f.name not in base}
    elif group == "data":
        own = {name: default for name, (_, default) in tasks.option_fields(tasks.get_task(keys["data.task"])).items()}
    else:
        own = {}
    return {**{f"+{group}.{k}": v for k, v in own.items() if f"{group}.{k}" not in keys}, **keys}


def schema(choices):
    """{key: default} of the config with `choices`: the base config's keys, each chosen group's replaced by its option's."""
    keys = dict(composed())
    for choice in choices:
        group, option = choice.split("=")
        keys = {k: v for k, v in keys.items() if not k.startswith(group + ".")} | option_keys(group, option)
    return dict(sorted(keys.items()))


def every_key():
    """Each key of every option of every group (what the fuzzer covers)."""
    keys = set(composed())
    for group in GROUPS:
        for option in group_options(group):
            keys |= {k.lstrip("+") for k in option_keys(group, option)}
    return keys


HUGE = [10**6, 2**31, 2**53 + 1, 10**18, 2**64, 10**30]
ODD_STRINGS = ["", " ", "null", "None", "true", "1e400", "-0", "ü", "a b", "a,b", "x" * 300, "\\", "${oops}",
               "${seed}", "[1,2]", "{a: 1}", "'", '"', "=", "model=rnn", "\t", "🙂", "0x10", "inf"]


def render(value):
    """`value` as a Hydra override's right-hand side."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def values_for(default):
    """Values to try for a key whose default is `default`: its own kind, near and far, and every other kind."""
    numbers = st.one_of(st.integers(-3, 3), st.sampled_from(HUGE), st.sampled_from([-x for x in HUGE]),
                        st.floats(allow_nan=True, allow_infinity=True, width=64))
    strings = st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=12))
    anything = st.one_of(numbers, strings, st.booleans(), st.none(), st.lists(st.integers(-2, 40), max_size=4))
    rendered = st.one_of(anything.map(render), st.sampled_from(ODD_STRINGS))  # raw text reaches Hydra's parser too
    if isinstance(default, bool):
        own = st.booleans().map(render)
    elif isinstance(default, (int, float)) or default is None:
        own = numbers.map(render)
    elif isinstance(default, list):
        own = st.lists(st.integers(-2, 300), max_size=5).map(render)
    else:
        own = st.sampled_from([render(default), render(default.upper()), render(default + "x")])
    return st.one_of(own, rendered)


@st.composite
def override_lists(draw):
    """Group choices, then 1-3 overrides of keys they compose (or a key no schema has)."""
    choices = tuple(f"{g}={draw(st.sampled_from(group_options(g)))}" for g in GROUPS if draw(st.booleans()))
    keys = schema(choices)
    overrides = list(choices)
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 9)) == 0:
            key = draw(st.sampled_from([*keys, "nokey", "model.nokey", "data.nokey"])) + draw(st.sampled_from(["", "x", ".y"]))
            default = None
        else:
            key = draw(st.sampled_from(sorted(keys)))
            default = keys[key]
        overrides.append(f"{key}={draw(values_for(default))}")
    return overrides


def key_of(override):
    return override.split("=", 1)[0].lstrip("+~")


def check(overrides):
    """The property, in process: exit 0 (the config is good) or 2 with one line naming a key."""
    code, message = train.config_exit(overrides)
    assert code in (0, 2), f"{overrides}: exit {code}: {message}"
    if code == 2:
        assert message and "\n" not in message and "Traceback" not in message, f"{overrides}: {message!r}"
        named = [key_of(o) for o in overrides]
        assert any(k in message or k.split(".")[0] in message for k in named), \
            f"{overrides}: the line names none of {named}: {message!r}"


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                database=None)


@settings(max_examples=12, **SETTINGS)
@given(override_lists())
# Found by this fuzzer, then fixed (each was exit 1 with a traceback):
@example(["checkpoint.allow_changes.y=0"])  # OmegaConf's int('y') for a key inside a list
@example(["model.cell=[]"])  # a TypeError: the list was looked up in the cell registry (a dict) before its type was checked
@example(["batch_size=${oops}"])
@example(["batch_size=model=rnn"])  # exit 2, but Hydra's parse error named no key  # exit 2, but its line named no key (an interpolation that does not resolve)
def test_fuzz_config_fast(overrides):
    check(overrides)


@pytest.mark.slow
@settings(max_examples=500, **SETTINGS)
@given(override_lists())
def test_fuzz_config_full(overrides):
    check(overrides)


def test_the_fuzzer_covers_every_cells_and_tasks_own_keys():
    import dataclasses

    from rnnlab import cells, tasks

    keys = every_key()
    base = {f.name for f in dataclasses.fields(cells.Cell)}
    for name in cells.cell_names():
        own = [f.name for f in dataclasses.fields(cells.get_cell(name)) if f.name not in base]
        assert all(f"model.{f}" in keys for f in own), (name, own)
    for name in tasks.task_names():
        assert all(f"data.{f}" in keys for f in tasks.option_fields(tasks.get_task(name))), name
    assert {"seed", "steps", "optimizer.lr", "device.num_devices", "checkpoint.every", "zoo.seeds"} <= keys


BOUNDED_VALUES = ["steps=2", "eval_batches=1"]
BOUNDED = tuple(v.split("=")[0] for v in BOUNDED_VALUES)


@pytest.mark.slow
@settings(max_examples=12, **SETTINGS)
@given(overrides=override_lists())  # by name: a positional strategy fills the rightmost argument (the fixture)
def test_fuzz_train_py_end_to_end(overrides, tmp_path_factory):
    """The same property through `python train.py`: exit 0 or 2, one `rnnlab: error:` line naming a key,
    no traceback on the console, and nothing written outside the run dir."""
    work = tmp_path_factory.mktemp("fuzz")
    tiny = ["debug=fast", "device=cpu", "device.num_devices=1"]
    # A run that may start is kept short: the keys that set its length are the tiny ones, not drawn.
    drawn = [o for o in overrides if key_of(o) not in BOUNDED]
    proc = run_train([*tiny, *drawn, *BOUNDED_VALUES, f"hydra.run.dir={work}/run"], cwd=work, timeout=300)
    assert proc.returncode in (0, 2), (overrides, proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, (overrides, proc.stderr[-2000:])
    if proc.returncode == 2:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("rnnlab: error:")]
        assert len(errors) == 1, (overrides, proc.stderr[-2000:])
    assert {p.name for p in work.iterdir()} <= {"run"}, (overrides, sorted(p.name for p in work.iterdir()))
