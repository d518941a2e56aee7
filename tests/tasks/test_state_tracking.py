"""word_problem and modular_arithmetic against independent pure-Python references (permutations composed
in a loop, expressions evaluated by Python), their baselines, variable lengths (padding never changes a
result), their option refusals, both through train.py's debug=fast run, and the parity length-split preset."""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, compose_config, fast_first, run_train, tiny_config
from rnnlab import config as cfg
from rnnlab import tasks
from rnnlab.models import build_model
from rnnlab.tasks import IGNORE
from rnnlab.tasks.modular_arithmetic import ModularArithmeticTask, memoryless_entropy
from rnnlab.tasks.word_problem import WordProblemTask, multiplication_table
from test_selective_copy_mqar_parity import conditional_entropy

SETTINGS = dict(max_examples=25, deadline=None, derandomize=True, database=None)
N = 4000  # examples per statistic


sample_batch = jax.jit(tasks.sample_batch, static_argnums=(0, 4, 5))


def draw(task, n=N, min_len=None, step=0):
    batch = sample_batch(task, tasks.stream_key(0, 0), jnp.int32(step), jnp.int32(0), n, min_len)
    return np.asarray(batch.inputs), np.asarray(batch.targets)


# The reference group: elements as Python tuples, the product a loop. Merrill et al.'s data (jopetty/word-problem,
# via abstract_algebra): S_n in itertools.permutations order, A_n its even permutations in that order, Z_n the
# residues, a direct product the pairs in itertools.product order; (p q)[i] = p[q[i]].

def is_even(p):
    seen, transpositions = set(), 0
    for start in range(len(p)):
        length, i = 0, start
        while i not in seen:
            seen.add(i)
            i, length = p[i], length + 1
        transpositions += max(length - 1, 0)
    return transpositions % 2 == 0


def reference_group(name):
    """(elements, product function) of `name` ('a4_x_z5')."""
    factors = []
    for part in name.split("_x_"):
        kind, n = part[0], int(part[1:])
        if kind == "z":
            factors.append((list(range(n)), lambda a, b, n=n: (a + b) % n))
        else:
            perms = [p for p in itertools.permutations(range(n)) if kind == "s" or is_even(p)]
            factors.append((perms, lambda p, q: tuple(p[q[i]] for i in range(len(p)))))
    elements = list(itertools.product(*[f[0] for f in factors]))
    return elements, lambda a, b: tuple(op(x, y) for (_, op), x, y in zip(factors, a, b))


def reference_prefix_products(name, ids):
    elements, product = reference_group(name)
    index = {e: i for i, e in enumerate(elements)}
    out, acc = [], elements[0]  # the identity: every factor's first element
    for i in ids:
        acc = product(acc, elements[i])
        out.append(index[acc])
    return out


GROUPS = ["s3", "a5", "s4", "s5", "z60", "a4_x_z5", "z2_x_z2_x_z3", "s3_x_z2"]


@pytest.mark.parametrize("group", GROUPS)
def test_the_multiplication_table_is_the_references(group):
    elements, product = reference_group(group)
    index = {e: i for i, e in enumerate(elements)}
    want = np.array([[index[product(a, b)] for b in elements] for a in elements])
    np.testing.assert_array_equal(multiplication_table(group), want)
    assert WordProblemTask(4, group=group).order == len(elements)


@pytest.mark.parametrize("group", fast_first(["s5", "s3", "a4_x_z5"], why="cross-product"))
def test_word_problem_targets_are_the_prefix_products(group):
    task = WordProblemTask(seq_len=12, group=group)
    sample = jax.jit(task.sample_padded)

    @settings(**SETTINGS)
    @given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, 12))
    def check(seed, length):
        inputs, targets = map(np.asarray, sample(jax.random.key(seed), jnp.int32(length)))
        assert inputs.dtype == np.int32 and inputs.shape == targets.shape == (12,)
        ids = inputs[:length]
        assert ((ids >= 0) & (ids < task.order)).all() and (inputs[length:] == task.padding_id).all()
        assert targets[:length].tolist() == reference_prefix_products(group, ids.tolist())
        assert (targets[length:] == IGNORE).all()

    check()


def test_word_problem_statistics_and_baseline():
    task = WordProblemTask(seq_len=8, group="s3")
    inputs, targets = draw(task)
    assert np.bincount(inputs.ravel(), minlength=6) / inputs.size == pytest.approx(np.full(6, 1 / 6), abs=0.01)
    # The best predictor without memory sees the step and its element: the product is uniform from step 2 on.
    per_step = [conditional_entropy(inputs[:, t], targets[:, t]) for t in range(8)]
    assert per_step[0] == 0.0 and per_step[1:] == pytest.approx([math.log(6)] * 7, abs=0.02)
    assert task.baseline_loss == pytest.approx(7 / 8 * math.log(6))
    memoryless = jnp.where(jnp.arange(8)[None, :, None] == 0, jax.nn.one_hot(inputs, 6) * 1e4, 0.0)
    loss, metrics = task.loss_and_metrics(memoryless, jnp.asarray(targets))
    assert float(loss) == pytest.approx(task.baseline_loss, rel=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(1 / 8 + 7 / 8 / 6, abs=0.01)
    assert task.metric_names == ("accuracy", "sequence_accuracy")
    perfect = task.loss_and_metrics(jax.nn.one_hot(targets, 6) * 1e4, jnp.asarray(targets))
    assert float(perfect[0]) < 1e-6 and float(perfect[1]["sequence_accuracy"]) == 1.0


def test_sequence_accuracy_counts_examples_with_every_step_right():
    task = WordProblemTask(seq_len=3, group="z60")
    targets = jnp.array([[1, 2, 3], [4, 5, IGNORE], [6, IGNORE, IGNORE]])
    predicted = jnp.array([[1, 2, 3], [4, 0, 0], [6, 0, 0]])  # all right, one step wrong, all right (padding aside)
    loss, metrics = task.loss_and_metrics(jax.nn.one_hot(predicted, 60) * 1e4, targets)
    assert float(metrics["sequence_accuracy"]) == pytest.approx(2 / 3)
    assert float(metrics["accuracy"]) == pytest.approx((1 + 1 / 2 + 1) / 3)  # each example weighs the same


# Modular arithmetic: Python evaluates the expression (its precedence is Deletang et al.'s: * first).

def decode(task, ids):
    return " ".join({task.modulus: "+", task.modulus + 1: "-", task.modulus + 2: "*"}.get(int(i), str(int(i))) for i in ids)


@pytest.mark.parametrize("seq_len,modulus", fast_first([(16, 5), (9, 7), (21, 2)], why="cross-product"))
def test_modular_arithmetic_targets_are_pythons_value(seq_len, modulus):
    task = ModularArithmeticTask(seq_len=seq_len, modulus=modulus)
    assert task.total_len == seq_len - 1 + seq_len % 2
    sample = jax.jit(task.sample_padded)

    @settings(**SETTINGS)
    @given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, seq_len))
    def check(seed, length):
        inputs, targets = map(np.asarray, sample(jax.random.key(seed), jnp.int32(length)))
        end = length - 1 + length % 2  # an even length stands for the odd one below it
        tokens = inputs[:end]
        assert (tokens[0::2] < modulus).all() and ((tokens[1::2] >= modulus) & (tokens[1::2] < modulus + 3)).all()
        assert (inputs[end:] == task.padding_id).all()
        assert targets[end - 1] == eval(decode(task, tokens)) % modulus  # noqa: S307  (digits and + - * only)
        assert (np.delete(targets, end - 1) == IGNORE).all()

    check()


def scripted(monkeypatch, text, steps):
    """jax.random's draws, as the task's samplers make them (one per step, from `fold_in(key, step)`), replaced by
    the expression `text`: step i draws its i-th symbol (a residue, or the operator's code in `+-*`), residue 0 and
    `+` after its end."""
    symbols = [int(s) if s.isdigit() else "+-*".index(s) for s in text.split()]
    codes = jnp.array(symbols + [0] * (steps - len(symbols)), jnp.int32)
    monkeypatch.setattr(jax.random, "fold_in", lambda key, step: step)
    monkeypatch.setattr(jax.random, "randint", lambda step, shape, low, high: codes[step])


@pytest.mark.parametrize("text,value", [("1 + 2 * 3", 2), ("1 - 1 - 1", 4), ("0 * 1 + 4 * 3 - 2", 0)])
def test_deletangs_examples(text, value, monkeypatch):
    """The worked examples of Deletang et al. (modulo 5) as the task computes them: its own sampler, its draws
    scripted to be the example, padded in a longer example and cut into two segments carried across."""
    n = len(text.split())
    with monkeypatch.context() as patch:
        scripted(patch, text, 11)
        inputs, targets = map(np.asarray, ModularArithmeticTask(seq_len=11).sample_padded(jax.random.key(0), n))
        task = ModularArithmeticTask(seq_len=n)
        x1, y1, carry = task.sample_segment(jax.random.key(0), task.initial_carry(), jnp.int32(0), 2)
        x2, y2, _ = task.sample_segment(jax.random.key(0), carry, jnp.int32(2), n - 2)
    assert decode(task, inputs[:n]) == text and decode(task, np.concatenate([x1, x2])) == text
    assert targets[n - 1] == value and (np.delete(targets, n - 1) == IGNORE).all()
    assert np.concatenate([y1, y2])[-1] == value
    assert eval(decode(task, inputs[:n])) % 5 == value  # noqa: S307  (the reference the test below uses)


def test_modular_arithmetic_targets_are_pythons_value_at_seq_len_11():
    task = ModularArithmeticTask(seq_len=11)
    inputs, targets = draw(task, n=500)
    for row in range(500):
        assert targets[row, -1] == eval(decode(task, inputs[row])) % 5  # noqa: S307


def test_modular_arithmetic_statistics():
    task = ModularArithmeticTask(seq_len=9)
    inputs, targets = draw(task)
    assert inputs.shape == targets.shape == (N, 9) and (targets[:, :-1] == IGNORE).all()
    assert np.bincount(inputs[:, 0::2].ravel(), minlength=5) / inputs[:, 0::2].size == pytest.approx([0.2] * 5, abs=0.01)
    ops = inputs[:, 1::2].ravel() - 5
    assert np.bincount(ops, minlength=3) / ops.size == pytest.approx([1 / 3] * 3, abs=0.01)
    assert task.metric_names == ("accuracy",) and task.symbol_names() == {5: "+", 6: "-", 7: "*"}


@pytest.mark.parametrize("length,modulus", [(1, 5), (3, 5), (5, 5), (7, 5), (5, 4), (5, 6)])
def test_the_baseline_is_the_entropy_given_the_last_residue_by_enumeration(length, modulus):
    """Every expression of `length` tokens, evaluated by Python: H(value | last residue), exactly."""
    counts = np.zeros((modulus, modulus))
    k = (length + 1) // 2
    for numbers in itertools.product(range(modulus), repeat=k):
        for ops in itertools.product("+-*", repeat=k - 1):
            text = " ".join([str(numbers[0]), *(f"{o} {n}" for o, n in zip(ops, numbers[1:]))])
            counts[numbers[-1], eval(text) % modulus] += 1  # noqa: S307
    p = counts / counts.sum(1, keepdims=True)
    want = -np.nansum(p * np.log(np.where(p > 0, p, 1)), 1).mean()
    assert memoryless_entropy(modulus, length) == pytest.approx(want, abs=1e-12)
    even = ModularArithmeticTask(length + 1, modulus=modulus)  # an even length stands for the odd one below it
    assert even.baseline_loss == pytest.approx(want, abs=1e-12)


def test_the_baseline_approaches_ln_modulus_and_matches_a_sampled_estimate():
    assert memoryless_entropy(5, 15) == pytest.approx(math.log(5), abs=2e-5)
    assert memoryless_entropy(5, 255) == pytest.approx(math.log(5), abs=1e-12)
    assert memoryless_entropy(5, 3) < math.log(5) - 0.03  # short expressions say more
    task = ModularArithmeticTask(seq_len=3)
    inputs, targets = draw(task)
    assert conditional_entropy(inputs[:, -1], targets[:, -1]) == pytest.approx(task.baseline_loss, abs=0.01)


# Variable lengths, whatever the task.

VARIABLE = [WordProblemTask(9, group="a5"), ModularArithmeticTask(10, modulus=5)]


@pytest.mark.slow("long")
@pytest.mark.parametrize("task", VARIABLE, ids=lambda t: t.name)
def test_a_padded_example_is_the_shorter_example_then_padding(task):
    key = jax.random.key(3)
    for length in (task.min_seq_len, 2, task.seq_len - 1, task.seq_len):
        short = task.with_seq_len(length)
        inputs, targets = jax.jit(task.sample_padded)(key, jnp.int32(length))
        want_inputs, want_targets = jax.jit(short.sample_one)(key)
        n = short.total_len
        np.testing.assert_array_equal(inputs[:n], want_inputs)
        np.testing.assert_array_equal(targets[:n], want_targets)
        assert (np.asarray(inputs[n:]) == task.padding_id).all() and (np.asarray(targets[n:]) == IGNORE).all()


@pytest.mark.parametrize("task", fast_first(VARIABLE, why="cross-product", first_why="long"), ids=lambda t: t.name)
def test_padding_never_changes_a_result(task):
    """A batch of padded examples scores what each example scores unpadded, through a real (causal) model."""
    model = build_model(tiny_config("model=gru", "num_layers=1").model, task.output_dim, "cpu", task.input_dim)
    inputs, targets = draw(task, n=4, min_len=1, step=5)
    params = jax.jit(model.init)(jax.random.key(0), inputs)
    apply, score = jax.jit(model.apply), jax.jit(task.loss_and_metrics)
    loss, metrics = score(apply(params, inputs), targets)
    unpadded, lengths = [], set()
    for i in range(len(inputs)):
        n = int((inputs[i] != task.padding_id).sum())
        lengths.add(n)
        unpadded.append(score(apply(params, inputs[i : i + 1, :n]), targets[i : i + 1, :n]))
    assert len(lengths) > 1
    np.testing.assert_allclose(loss, np.mean([u[0] for u in unpadded]), rtol=1e-5)
    for name in task.metric_names:
        np.testing.assert_allclose(metrics[name], np.mean([u[1][name] for u in unpadded]), rtol=1e-6)


@pytest.mark.slow("long")
def test_variable_lengths_cover_the_range():
    _, targets = draw(WordProblemTask(10, group="s3"), n=2000, min_len=2)
    lengths = (targets != IGNORE).sum(1)
    np.testing.assert_allclose(np.bincount(lengths, minlength=11)[2:] / 2000, 1 / 9, atol=0.03)
    inputs, targets = draw(ModularArithmeticTask(10), n=200, min_len=1)
    ends = np.argmax(targets != IGNORE, 1)  # the last residue: even steps only
    assert (ends % 2 == 0).all() and set(ends) == {0, 2, 4, 6, 8}


# The config: options and refusals.

def test_options_come_from_the_data_group():
    task = tasks.make_task(tiny_config("data=word_problem", "data.group=a4_x_z5").data)
    assert (task.group, task.input_dim, task.output_dim, task.padding_id) == ("a4_x_z5", 60, 60, 60)
    task = tasks.make_task(tiny_config("data=modular_arithmetic", "data.modulus=7", "data.seq_len=8").data)
    assert (task.modulus, task.input_dim, task.output_dim, task.total_len) == (7, 10, 7, 7)
    assert dict(compose_config(["data=word_problem"]).data.options) == {"group": "s3"}
    assert dict(compose_config(["data=modular_arithmetic"]).data.options) == {"modulus": 5}


ALLOWED = ("allowed: s<n> (n = 2 .. 6), a<n> (n = 3 .. 6), z<n> (n >= 2), or their direct product joined by _x_ "
           "(e.g. a4_x_z5), of at most 1024 elements")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data=word_problem", "data.group=s7"], f"key 'data.group': got 's7', {ALLOWED}"),
        (["data=word_problem", "data.group=S5"], "key 'data.group': got 'S5', allowed: s<n>"),
        (["data=word_problem", "data.group=z1"], "key 'data.group': got 'z1', allowed"),
        (["data=word_problem", "data.group=z2000"], "key 'data.group': got 'z2000', allowed"),
        (["data=word_problem", "data.group=a4_x_"], "key 'data.group': got 'a4_x_', allowed"),
        (["data=word_problem", "data.group=s5_x_s4"], "key 'data.group': got 's5_x_s4', allowed"),  # 2880 elements
        (["data=word_problem", "data.group=z05"], "key 'data.group': got 'z05', allowed"),
        (["data=word_problem", "data.group=5"], "key 'data.group': got 5, expected a string"),
        (["data=word_problem", "data.seq_len=0"], "key 'data.seq_len': got 0, the word_problem task needs >= 1"),
        (["data=word_problem", "data.min_seq_len=20"], "key 'data.min_seq_len': got 20, allowed: null or 1 .. 16"),
        (["data=word_problem", "+data.modulus=5"], "unknown key 'data.modulus' (allowed in data: task, seq_len, "
                                                   "min_seq_len, eval_seq_lens, eval_segment_len, group)"),
        (["data=modular_arithmetic", "data.modulus=1"], "key 'data.modulus': got 1, allowed: 2 .. 64"),
        (["data=modular_arithmetic", "data.modulus=65"], "key 'data.modulus': got 65, allowed: 2 .. 64"),
        (["data=modular_arithmetic", "data.modulus=abc"], "key 'data.modulus': got 'abc', expected an integer"),
        (["data=modular_arithmetic", "data.eval_seq_lens=[0]"], "key 'data.eval_seq_lens': got [0], allowed"),
    ],
)
def test_bad_keys_exit_2_with_one_line_naming_the_key(overrides, message):
    import sys

    sys.path.insert(0, str(ROOT))
    import train  # train.py: the exit code a config gets, in process

    code, line = train.config_exit(overrides)
    assert code == 2 and message in line and "\n" not in line, line
    with pytest.raises(cfg.ConfigError):
        compose_config(overrides)


# End to end: the debug=fast run train.py composes, in process (fast) and as `python train.py` (full tier).

@pytest.mark.parametrize("data", fast_first([(["data=word_problem", "data.group=s3"],), (["data=modular_arithmetic"],)],
                                            why="cross-product", first_why="long"),
                         ids=lambda d: d[0])
def test_debug_fast_trains_and_evaluates(data, tmp_path):
    from rnnlab.trainer import train_and_evaluate

    config = compose_config(["debug=fast", *data, "device=cpu", "device.num_devices=1", "data.min_seq_len=3",
                             "data.eval_seq_lens=[24]"])
    results = train_and_evaluate(config, tmp_path)
    assert results["status"] == "completed" and results["step"] == 4 and math.isfinite(results["eval_loss"])
    task = tasks.make_task(config.data)
    assert set(results["eval_metrics"]) == set(task.metric_names) and results["baseline_loss"] == task.baseline_loss
    assert set(results["eval_by_len"]["24"]) == {"loss", *task.metric_names}


@pytest.mark.slow("end-to-end")
@pytest.mark.parametrize("data", [["data=word_problem", "data.group=s3"], ["data=modular_arithmetic"]], ids=lambda d: d[0])
def test_train_py_debug_fast(data, tmp_path):
    proc = run_train([*data, "debug=fast", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "completed" and results["eval_metric_name"] == "accuracy"



def test_the_parity_length_split_preset():
    """Grazzi et al.'s split in bits: train on 2 .. 39 (their lengths 3 .. 40 count the answer), evaluate up to 255."""
    config = compose_config(["experiment=parity_length_split", "model=lstm"])
    assert (config.data.task, config.data.seq_len, config.data.min_seq_len) == ("parity", 39, 2)
    assert config.data.eval_seq_lens == (39, 64, 128, 255) and config.model.cell == "lstm"
