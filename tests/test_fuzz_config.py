"""A property-based fuzzer over the whole config surface: bad input exits 2 with one line naming the key.

The keys come from the real conf/ as Hydra composes it, for every option of every group (every cell's
and every task's own keys included), so a key added to a yaml is fuzzed without editing this file.
Each example is a list of overrides drawn for one composition: valid values, wrong types, numbers out
of range, huge sizes, NaN/inf, empty and odd strings, unknown keys. The property is train.py's, checked
in process up to where JAX would start (`train.config_exit`): exit 0 or 2, and a 2 is one line that
names a key of the command line. A few examples run in the fast tier; `pytest --full` runs many more
with a fixed seed, and a handful through `python train.py` itself (no traceback, no hang, nothing
written outside its run dir). Each failure found is fixed and kept as an `@example`.

Beside the random draws, boundary draws: every key whose range or choices are declared on its field
(`rnnlab.options.allowed`: the Config's, every cell's and every task's) gets the values at and just
past each end, each choice and a near miss, null, and the divisors and minimums its declaration
names. Whether a draw is inside is worked out here from the declared numbers, not by the checks, so
a check that drifts from its declaration fails: a value outside must exit 2 naming its key, a value
inside must pass (or be refused by a check across keys) and its model must initialise by shape.
"""

import dataclasses
import functools
import math
import re
import sys
import typing

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, example, given, settings  # the test extra installs it: never skipped
from hypothesis import strategies as st

from conftest import CONF_DIR, ROOT, run_train
from rnnlab.options import declaration

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
    dataclass takes beyond those (set with `+model.<key>=`), so a key added anywhere is fuzzed. (The same
    cells' keys under `model.pattern_keys.<cell>`, empty by default, are checked by the same declarations:
    tests/test_hybrid.py.)"""
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
                        # No subnormals: a test beside this one in the same worker may leave the CPU flushing them
                        # (scripts/benchmark.py's torch.set_flush_denormal), and Hypothesis then refuses to draw them.
                        st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False, width=64))
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


@pytest.mark.slow("long")
@settings(max_examples=150, **SETTINGS)
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
    assert {"seed", "steps", "optimizer.lr", "device.num_devices", "checkpoint.every", "log.histograms_every"} <= keys


BOUNDED_VALUES = ["steps=2", "eval_batches=1"]
BOUNDED = tuple(v.split("=")[0] for v in BOUNDED_VALUES)


@pytest.mark.slow("end-to-end")
@settings(max_examples=6, **SETTINGS)
# By name: a positional strategy fills the rightmost argument (the fixture). A command line cannot carry a NUL byte
# (execve refuses it before train.py starts; CI drew `batch_size='\x00'`): the in-process fuzzers above keep them.
@given(overrides=override_lists().filter(lambda overrides: not any("\x00" in o for o in overrides)))
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


# Boundary draws, from the declarations the checks read (module docstring).

class Boundary(typing.NamedTuple):
    """One boundary draw: the overrides (a group choice, then the key's value), the key, and whether the
    value is inside the key's declaration."""

    overrides: tuple[str, ...]
    key: str
    inside: bool


def leaf_fields(cls, prefix=""):
    """{dotted key: (type, field)} of the fields of `cls` and of its nested config groups (`options` aside)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            found |= leaf_fields(hints[field.name], f"{prefix}{field.name}.")
        elif field.name != "options":
            found[prefix + field.name] = (hints[field.name], field)
    return found


def declared_fields(cls, prefix=""):
    """{dotted key: (type, Allowed)} of the declared fields of `cls` and of its nested config groups."""
    return {key: (tp, declaration(field)) for key, (tp, field) in leaf_fields(cls, prefix).items()
            if declaration(field)}


def inside(rule, value, owner):
    """Whether `value` is allowed by `rule`, worked out from its declared numbers (not by its `problem`, the
    check under test); a `divides` or `at_least` boundary is read off `owner`, the cell or task it belongs to."""
    if value is None:
        return rule.null
    if rule.allowed_choices() is not None:
        return value in rule.allowed_choices()
    above = rule.low is None or (value > rule.low if rule.low_open else value >= rule.low)
    below = rule.high is None or (value < rule.high if rule.high_open else value <= rule.high)
    divides = rule.divides is None or (value >= 1 and getattr(owner, rule.divides) % value == 0)
    reaches = rule.at_least is None or value >= getattr(owner, rule.at_least)
    return above and below and divides and reaches


def edge_values(tp, rule, owner):
    """The values drawn for a declared key of type `tp`: null, each choice and a near miss, each end and the
    next value of the type either side of it, and the divisors and minimums the declaration names."""
    kind = next(a for a in (*typing.get_args(tp), tp) if a in (int, float, str))
    values = [None]
    if rule.allowed_choices() is not None:
        return values + [*rule.allowed_choices(), rule.allowed_choices()[0] + "x"]
    for end in (rule.low, rule.high):
        if end is not None:
            end = kind(end)
            values += [end - 1, end, end + 1] if kind is int else [math.nextafter(end, -math.inf), end,
                                                                    math.nextafter(end, math.inf)]
    if rule.divides:
        width = getattr(owner, rule.divides)
        values += [0, 1, next((k for k in range(2, width) if width % k), width + 1), width]
    if rule.at_least:
        least = getattr(owner, rule.at_least)
        values += [least - 1, least, least + 1]
    return list(dict.fromkeys(values))


def option_owner(group, option):
    """(class, default instance) of the cell or task that `group=option` chooses: what a `divides` or
    `at_least` boundary is read from."""
    from rnnlab import cells, tasks

    values = {k.lstrip("+"): v for k, v in option_keys(group, option).items()}
    if group == "model":
        cls = cells.get_cell(values["model.cell"])
        base = {f.name for f in dataclasses.fields(cells.Cell)}
        own = {f.name: values[f"model.{f.name}"] for f in dataclasses.fields(cls) if f.name not in base}
        return cls, cls(values["model.hidden_dim"], **own)
    cls = tasks.get_task(values["data.task"])
    return cls, cls(values["data.seq_len"], **{name: values[f"data.{name}"] for name in tasks.option_fields(cls)})


@functools.lru_cache(maxsize=None)
def boundaries():
    """Every boundary draw: the Config's declared keys in the base composition, and each cell's and task's
    declared keys under every option of its group."""
    from rnnlab.config import Config

    draws = [Boundary((f"{key}={render(v)}",), key, inside(rule, v, None))
             for key, (tp, rule) in declared_fields(Config).items() for v in edge_values(tp, rule, None)]
    for group in ("model", "data"):
        for option in group_options(group):
            cls, owner = option_owner(group, option)
            overridden = {k.lstrip("+"): k for k in option_keys(group, option)}
            draws += [Boundary((f"{group}={option}", f"{overridden[key]}={render(v)}"), key,
                               inside(rule, v, owner))
                      for key, (tp, rule) in declared_fields(cls, f"{group}.").items()
                      for v in edge_values(tp, rule, owner)]
    return tuple(draws)


_INIT_PROBLEMS = {}


def init_problem(config, overrides):
    """Why the model of an accepted config (composed from `overrides`) does not initialise, or None: built and
    initialised by shape (`jax.eval_shape`, nothing allocated) on one example, so that a value the checks let
    through but the model cannot take fails here rather than in a user's run after its compile. Built as for a
    GPU: the recurrence resolves to XLA's, so no oneDNN kernel is built."""
    import jax

    from rnnlab import tasks
    from rnnlab.models import build_model

    task = tasks.make_task(config.data)
    shape = (config.model, task.input_spec(1), task.output_dim)
    if shape not in _INIT_PROBLEMS:
        model = build_model(config.model, task.output_dim, "gpu", task.input_dim)
        try:
            jax.eval_shape(model.init, jax.random.key(0), task.input_spec(1))
            _INIT_PROBLEMS[shape] = None
        except Exception as e:  # noqa: BLE001 - any failure to initialise is the finding
            _INIT_PROBLEMS[shape] = f"{overrides}: accepted, but the model does not initialise: {type(e).__name__}: {e}"
    return _INIT_PROBLEMS[shape]


# Keys whose values inside the declaration a check across keys may still refuse by the key's own name.
REFUSED_ACROSS_KEYS = {
    "model.recurrence": "custom_vjp needs the cell's hand-written backward, onednn and auto its oneDNN kernel",
}
SHAPING_KEYS = ("model.", "data.", "hidden_dim", "num_layers")  # the keys whose draws may change the model


def violation(draw):
    """What is wrong with how the config takes a boundary draw, or None: a value outside its declaration
    must exit 2 with a line naming its key; one inside must pass (and, for a key that shapes the model,
    initialise), or be refused by a check across keys (a line naming another key)."""
    code, message, config = train.checked_config(list(draw.overrides))
    if not draw.inside:
        if code == 2 and f"'{draw.key}'" in message:
            return None
        return f"{list(draw.overrides)}: outside the declaration of {draw.key}, but exit {code}: {message!r}"
    if code == 0:
        return init_problem(config, draw.overrides) if draw.key.startswith(SHAPING_KEYS) else None
    named = re.match(r"keys? '([^']+)'", message)
    if code != 2 or "\n" in message or not named or (named[1] == draw.key and draw.key not in REFUSED_ACROSS_KEYS):
        return f"{list(draw.overrides)}: inside the declaration of {draw.key}, but exit {code}: {message!r}"
    return None


@settings(max_examples=6, **SETTINGS)
@given(st.deferred(lambda: st.sampled_from(boundaries())))
# Planted bugs the random draws missed (test_the_boundary_draws_catch_*), kept as examples:
@example(Boundary(("model=attention", "model.num_heads=3"), "model.num_heads", False))
@example(Boundary(("device.steps_per_dispatch=9",), "device.steps_per_dispatch", False))
def test_boundary_draws_fast(draw):
    """A few boundary draws in every run, so that a check drifting from its declaration shows at once."""
    assert violation(draw) is None


@pytest.mark.slow("long")
def test_every_boundary_draw():
    """Every boundary draw, all failures listed at once: each is a check that disagrees with a declaration."""
    failures = [problem for problem in map(violation, boundaries()) if problem]
    assert not failures, "\n".join(failures)


# Numeric keys without a declaration: each is checked across keys, in code, for the reason given.
CHECKED_ACROSS_KEYS = {
    "model.hidden_dim": "equals the top-level hidden_dim (one source)",
    "model.num_layers": "equals the top-level num_layers (one source)",
    "model.forget_bias": "any finite number",
    "model.r_min": "0 <= r_min < r_max < 1 (lru)",
    "model.r_max": "0 <= r_min < r_max < 1 (lru)",
    "model.proj_factor": "in (0, MAX_PROJ_FACTOR] with an inner width >= 1 (mlstm)",
    "data.seq_len": "declared on Task.seq_len: at least the task's minimum",
    "data.min_seq_len": "null or the task's minimum .. data.seq_len",
    "data.vocab_size": "even and >= 2 x data.num_pairs (mqar; selective_copy's is declared)",
    "data.eval_seq_lens": "distinct lengths, each at least the task's minimum",
    "data.eval_segment_len": "null or >= 1, and only for a task with sample_segment",
    "distributed.process_id": "below distributed.num_processes",
}


def test_every_number_key_is_declared_or_checked_across_keys():
    """A new numeric key gets boundary draws only through a declaration: one without is named here."""
    from rnnlab import cells, tasks
    from rnnlab.config import Config

    classes = [(Config, ""), *((cells.get_cell(n), "model.") for n in cells.cell_names()),
               *((tasks.get_task(n), "data.") for n in tasks.task_names())]
    undeclared, wrong_null = set(), set()
    for cls, prefix in classes:
        declared = declared_fields(cls, prefix)
        for key, (tp, _) in leaf_fields(cls, prefix).items():
            number = {int, float} & {tp, *typing.get_args(tp)}
            if number and key not in declared and key not in CHECKED_ACROSS_KEYS:
                undeclared.add(key)
            if key in declared and declared[key][1].null != (type(None) in typing.get_args(tp)):
                wrong_null.add(key)
    assert not undeclared and not wrong_null, (undeclared, wrong_null)


@pytest.mark.slow("long")
def test_the_boundary_draws_catch_a_missing_divisor_check(monkeypatch):
    """Planted bug: the declarations' divisor check (`Allowed.divides`) dropped, so `model=attention
    model.num_heads=3` (hidden_dim 64) passes the config and would fail in the model's reshape after a
    user's run started.
    Attention's boundary draws find it (and the init by shape does too). Of 300 random draws
    (`override_lists`, the fuzz tests' settings), measured once: none ran differently under the bug (none
    set model.num_heads with model=attention), and none could have failed the random property, which
    allows exit 0."""
    from rnnlab import options

    checked = options.Allowed.problem
    monkeypatch.setattr(options.Allowed, "problem", lambda rule, key, value, owner=None: checked(rule, key, value))
    found = [draw for draw in boundaries() if draw.overrides[0] == "model=attention" and violation(draw)]
    assert {draw.key for draw in found} == {"model.num_heads"}
    overrides = ("model=attention", "model.num_heads=3")
    code, _, config = train.checked_config(list(overrides))
    assert code == 0 and init_problem(config, overrides)


@pytest.mark.slow("long")
def test_the_boundary_draws_catch_an_off_by_one_at_a_closed_upper_end(monkeypatch):
    """Planted bug: the range check lets through the first integer past a closed upper end (`value > high`
    written `value > high + 1`), so device.steps_per_dispatch=9, device.num_devices=65 and seed=2^32 pass.
    The boundary draws of the Config's keys find all three. Of 300 random draws, measured once: none ran
    differently under the bug (11 set device.steps_per_dispatch or device.num_devices, none to 9 or 65;
    the seeds drawn skip 2^32), and none failed the random property."""
    from rnnlab import options

    checked = options.Allowed.problem

    def off_by_one(rule, key, value, owner=None):
        if rule.high is not None and not rule.high_open and value == rule.high + 1:
            return None
        return checked(rule, key, value, owner)

    monkeypatch.setattr(options.Allowed, "problem", off_by_one)
    found = [draw for draw in boundaries() if len(draw.overrides) == 1 and violation(draw)]  # the Config's keys
    assert {draw.overrides for draw in found} == {("device.num_devices=65",), ("device.steps_per_dispatch=9",),
                                                  ("seed=4294967296",)}
