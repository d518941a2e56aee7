"""selective_copy, mqar and parity: their generators' statistics against NumPy, their baselines
against an independent estimate, variable lengths (padding never changes a result), their config
refusals, and that parity is learnt."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first, tiny_config
from rnnlab import config as cfg
from rnnlab import tasks
from rnnlab.models import build_model
from rnnlab.rundir import resume_changes, task_widths
from rnnlab.tasks import IGNORE
from rnnlab.tasks.mqar import MQARTask
from rnnlab.tasks.parity import ParityTask
from rnnlab.tasks.selective_copy import SelectiveCopyTask

N = 4000  # examples per statistic: standard errors of a frequency ~0.008 or less
sample_batch = jax.jit(tasks.sample_batch, static_argnums=(0, 4, 5))


def draw(task, n=N, min_len=None, step=0):
    batch = sample_batch(task, tasks.stream_key(0, 0), jnp.int32(step), jnp.int32(0), n, min_len)
    inputs = np.asarray(batch.inputs)  # token ids, task.padding_id at a padded step
    tokens = np.where(inputs == task.padding_id, -1, inputs)  # -1: a padding step
    return inputs, tokens, np.asarray(batch.targets)


def conditional_entropy(condition, outcome):
    """The plug-in H(outcome | condition) in nats: the loss of the best predictor that sees only `condition`."""
    total, h = len(outcome), 0.0
    for c in np.unique(condition):
        _, counts = np.unique(outcome[condition == c], return_counts=True)
        p = counts / counts.sum()
        h -= counts.sum() / total * (p * np.log(p)).sum()
    return h


# Selective copying.

def test_selective_copy_structure_and_statistics():
    task = SelectiveCopyTask(seq_len=12, num_tokens=4, vocab_size=8)
    inputs, tokens, targets = draw(task)
    assert inputs.shape == targets.shape == (N, 17) and inputs.dtype == np.int32 and (inputs < 10).all()
    data = tokens[:, :12] < 8
    assert (data.sum(1) == 4).all()  # 4 data tokens at distinct positions, noise elsewhere
    assert (tokens[:, :12][~data] == task.noise).all()
    assert (tokens[:, 12] == task.delimiter).all() and (tokens[:, 13:] == task.noise).all()
    assert (targets[:, :13] == IGNORE).all()
    recalled = tokens[:, :12][data].reshape(N, 4)  # row-major: in the order of their positions
    np.testing.assert_array_equal(targets[:, 13:], recalled)
    np.testing.assert_allclose(data.mean(0), 4 / 12, atol=0.04)  # every position equally likely
    np.testing.assert_allclose(np.bincount(recalled.ravel(), minlength=8) / recalled.size, 1 / 8, atol=0.015)


def test_selective_copy_baseline():
    task = SelectiveCopyTask(seq_len=12, num_tokens=4, vocab_size=8)
    _, _, targets = draw(task)
    # The best predictor without memory knows only the step: the entropy of each recalled symbol.
    recall = targets[:, 13:]
    estimate = np.mean([conditional_entropy(np.zeros(N), recall[:, j]) for j in range(4)])
    assert task.baseline_loss == pytest.approx(math.log(8)) and estimate == pytest.approx(math.log(8), abs=0.02)
    uniform = jnp.zeros((N, 17, 8))
    loss, metrics = task.loss_and_metrics(uniform, jnp.asarray(targets))
    assert float(loss) == pytest.approx(task.baseline_loss, rel=1e-6)  # only the recalled steps count
    assert task.metric_names == ("accuracy",)


def test_selective_copy_variable_lengths():
    task = SelectiveCopyTask(seq_len=12, num_tokens=4, vocab_size=8)
    inputs, tokens, targets = draw(task, min_len=4)
    lengths = (tokens == task.delimiter).argmax(1)
    assert ((tokens == task.delimiter).sum(1) == 1).all()
    np.testing.assert_allclose(np.bincount(lengths, minlength=13)[4:] / N, 1 / 9, atol=0.025)
    assert lengths.min() == 4 and lengths.max() == 12
    steps = np.arange(17)
    valid = steps[None] <= (lengths + 4)[:, None]
    assert ((tokens >= 0) == valid).all()  # padding after the last recall step
    before = steps[None] < lengths[:, None]
    assert ((tokens < 8) & before).sum(1).tolist() == [4] * N and not ((tokens < 8) & ~before & valid).any()
    for row in range(50):
        n = lengths[row]
        np.testing.assert_array_equal(targets[row, n + 1 : n + 5], tokens[row, :n][tokens[row, :n] < 8])
        assert (np.delete(targets[row], np.arange(n + 1, n + 5)) == IGNORE).all()


# Multi-query associative recall.

def test_mqar_structure_and_statistics():
    task = MQARTask(seq_len=20, vocab_size=16, num_pairs=3, power_a=0.01)
    inputs, tokens, targets = draw(task)
    assert inputs.shape == targets.shape == (N, 20) and inputs.dtype == np.int32 and (inputs < 17).all()
    keys, values = tokens[:, 0:6:2], tokens[:, 1:6:2]
    assert ((keys >= 0) & (keys < 8)).all() and ((values >= 8) & (values < 16)).all()
    assert all(len(set(k)) == 3 for k in keys) and all(len(set(v)) == 3 for v in values)
    rest = tokens[:, 6:]
    is_query = rest != task.vocab_size
    assert (is_query.sum(1) == 3).all() and not is_query[:, 1::2].any()  # queries at even offsets only
    scored = targets != IGNORE
    assert (scored.sum(1) == 3).all() and not scored[:, :6].any() and (scored[:, 6:] == is_query).all()
    for row in range(N):  # each key queried once; its target the value it was paired with
        pairs = dict(zip(keys[row], values[row]))
        queried = rest[row][is_query[row]]
        assert sorted(queried) == sorted(keys[row])
        assert [pairs[k] for k in queried] == targets[row, 6:][is_query[row]].tolist()
    # The first key's query slot is one draw from weights (slot + 1)^(power_a - 1) (Gumbel-max).
    slots = np.array([np.flatnonzero(rest[row] == keys[row, 0])[0] // 2 for row in range(N)])
    weights = np.arange(1, 8) ** (0.01 - 1)
    np.testing.assert_allclose(np.bincount(slots, minlength=7) / N, weights / weights.sum(), atol=0.03)
    assert np.bincount(keys.ravel(), minlength=8).min() > 0.1 * 3 * N / 8


def test_mqar_baseline():
    task = MQARTask(seq_len=20, vocab_size=16, num_pairs=3)
    _, tokens, targets = draw(task)
    scored = targets != IGNORE
    # The best predictor without memory sees the query key (the current input) but not the pairs.
    estimate = conditional_entropy(tokens[scored], targets[scored])
    assert task.baseline_loss == pytest.approx(math.log(8)) and estimate == pytest.approx(math.log(8), abs=0.02)
    uniform_values = jnp.where(jnp.arange(16) >= 8, 0.0, -1e4) * jnp.ones((N, 20, 16))
    loss, _ = task.loss_and_metrics(uniform_values, jnp.asarray(targets))
    assert float(loss) == pytest.approx(task.baseline_loss, rel=1e-5)


def test_mqar_variable_lengths():
    task = MQARTask(seq_len=20, vocab_size=16, num_pairs=3, power_a=1.0)
    _, tokens, targets = draw(task, min_len=12)
    lengths = (tokens >= 0).sum(1)
    assert ((tokens >= 0) == (np.arange(20)[None] < lengths[:, None])).all()  # padding from step L on
    np.testing.assert_allclose(np.bincount(lengths, minlength=21)[12:] / N, 1 / 9, atol=0.025)
    scored = targets != IGNORE
    assert (scored.sum(1) == 3).all()
    assert (np.argmax(np.where(scored, np.arange(20), -1), 1) < lengths).all()  # every query inside the example


# Parity.

def test_parity_labels_and_baseline():
    task = ParityTask(seq_len=10)
    inputs, bits, targets = draw(task)
    assert inputs.shape == (N, 10) and ((bits == 0) | (bits == 1)).all()
    np.testing.assert_array_equal(targets[:, -1], bits.sum(1) % 2)
    assert (targets[:, :-1] == IGNORE).all()
    assert bits.mean() == pytest.approx(0.5, abs=0.01) and targets[:, -1].mean() == pytest.approx(0.5, abs=0.03)
    # Without memory of the earlier bits the label is a coin flip, whatever the last bit.
    assert conditional_entropy(bits[:, -1], targets[:, -1]) == pytest.approx(math.log(2), abs=0.01)
    loss, metrics = task.loss_and_metrics(jnp.zeros((N, 10, 2)), jnp.asarray(targets))
    assert task.baseline_loss == pytest.approx(math.log(2)) and float(loss) == pytest.approx(math.log(2), rel=1e-6)


def test_parity_variable_lengths():
    task = ParityTask(seq_len=10)
    _, bits, targets = draw(task, min_len=1)
    lengths = (bits >= 0).sum(1)
    assert ((bits >= 0) == (np.arange(10)[None] < lengths[:, None])).all()
    np.testing.assert_allclose(np.bincount(lengths, minlength=11)[1:] / N, 1 / 10, atol=0.025)
    rows = np.arange(N)
    np.testing.assert_array_equal(targets[rows, lengths - 1], np.where(bits >= 0, bits, 0).sum(1) % 2)
    assert ((targets != IGNORE).sum(1) == 1).all()


# Variable lengths, whatever the task.

VARIABLE = [SelectiveCopyTask(12, num_tokens=3, vocab_size=5), MQARTask(20, vocab_size=12, num_pairs=3), ParityTask(9)]


@pytest.mark.parametrize("task", fast_first([VARIABLE[1], VARIABLE[0], VARIABLE[2]], why="cross-product",
                                            first_why="long"), ids=lambda t: t.name)
def test_a_padded_example_is_the_shorter_example_then_padding(task):
    key = jax.random.key(7)
    for length in (task.min_seq_len, task.seq_len - 1, task.seq_len):
        short = task.with_seq_len(length)
        inputs, targets = jax.jit(task.sample_padded)(key, jnp.int32(length))
        want_inputs, want_targets = jax.jit(short.sample_one)(key)
        n = short.total_len
        np.testing.assert_array_equal(inputs[:n], want_inputs)
        np.testing.assert_array_equal(targets[:n], want_targets)
        assert (np.asarray(inputs[n:]) == task.padding_id).all() and (np.asarray(targets[n:]) == IGNORE).all()


@pytest.mark.parametrize("task", fast_first([VARIABLE[1], VARIABLE[0], VARIABLE[2]], why="cross-product",
                                            first_why="long"), ids=lambda t: t.name)
def test_padding_never_changes_a_result(task):
    """A batch of padded examples scores what each example scores unpadded, through a real (causal) model."""
    config = tiny_config("model=gru", "num_layers=1")
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    inputs, _, targets = draw(task, n=4, min_len=task.min_seq_len, step=3)
    params = jax.jit(model.init)(jax.random.key(0), inputs)
    apply, score = jax.jit(model.apply), jax.jit(task.loss_and_metrics)
    outputs = apply(params, inputs)
    loss, metrics = score(outputs, targets)
    unpadded, lengths = [], set()
    for i in range(4):
        n = int((inputs[i] != task.padding_id).sum())  # the example's own steps
        lengths.add(n)
        assert (inputs[i, n:] == task.padding_id).all()
        alone = score(outputs[i : i + 1], targets[i : i + 1])
        short = apply(params, inputs[i : i + 1, :n])
        unpadded.append(score(short, targets[i : i + 1, :n]))
        np.testing.assert_allclose(alone[0], unpadded[-1][0], rtol=1e-5)
        assert float(alone[1]["accuracy"]) == float(unpadded[-1][1]["accuracy"])
    assert len(lengths) > 1
    np.testing.assert_allclose(loss, np.mean([u[0] for u in unpadded]), rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], np.mean([u[1]["accuracy"] for u in unpadded]), rtol=1e-6)


def test_fixed_length_tasks_have_no_variable_lengths():
    package = [t for t in tasks.task_names() if tasks.get_task(t).__module__.startswith("rnnlab.")]  # not tests' own
    assert [t for t in package if not tasks.get_task(t).variable_length()] == ["adding", "copy", "text"]


# The config: options, refusals, resume.

def test_task_options_come_from_the_data_group():
    config = tiny_config("data=mqar", "data.seq_len=24", "data.num_pairs=2")
    assert dict(config.data.options) == {"vocab_size": 32, "num_pairs": 2, "power_a": 0.01}
    task = tasks.make_task(config.data)
    assert (task.num_pairs, task.input_dim, task.output_dim, task.min_seq_len) == (2, 33, 32, 8)
    flat = cfg.flatten(config)
    assert flat["data.num_pairs"] == 2 and flat["data.vocab_size"] == 32 and "data.options" not in flat
    assert cfg.replace(config, **{"data.vocab_size": 8}).data.options[0] == ("vocab_size", 8)
    assert tiny_config("data=parity").data.options == ()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data=parity", "+data.vocab_size=4"], "unknown key 'data.vocab_size' (allowed in data: task, seq_len, "
                                                "min_seq_len, eval_seq_lens, eval_segment_len)"),
        (["data=mqar", "+data.num_tokens=4"], "unknown key 'data.num_tokens' (allowed in data: task, seq_len, "
                                              "min_seq_len, eval_seq_lens, eval_segment_len, vocab_size, num_pairs, power_a)"),
        (["data=mqar", "data.vocab_size=abc"], "key 'data.vocab_size': got 'abc', expected an integer"),
        (["data=mqar", "data.vocab_size=7"], "key 'data.vocab_size': got 7, must be even and >= 2 x data.num_pairs"),
        (["data=mqar", "data.num_pairs=20"], "key 'data.vocab_size': got 32, must be even and >= 2 x data.num_pairs = 40"),
        (["data=mqar", "data.power_a=0"], "key 'data.power_a': got 0.0, must be in (0, 1]"),
        (["data=mqar", "data.seq_len=15"], "key 'data.seq_len': got 15, the mqar task needs >= 16"),
        (["data=selective_copy", "data.num_tokens=0"], "key 'data.num_tokens': got 0, must be >= 1"),
        (["data=selective_copy", "data.seq_len=3"], "key 'data.seq_len': got 3, the selective_copy task needs >= 4"),
        (["data=adding", "data.min_seq_len=3"], "key 'data.min_seq_len': got 3, but every adding example has"),
        (["data=copy", "data.min_seq_len=12"], "allowed: null"),
        (["data=parity", "data.seq_len=8", "data.min_seq_len=9"], "key 'data.min_seq_len': got 9, allowed: null or 1 .. 8"),
        (["data=parity", "data.min_seq_len=0"], "allowed: null or 1 .. 12"),
        (["data=mqar", "data.min_seq_len=8"], "key 'data.min_seq_len': got 8, allowed: null or 16 .. 32"),
        (["data=selective_copy", "data.min_seq_len=2"], "allowed: null or 4 .. 32"),
    ],
)
def test_bad_data_keys_name_the_key_and_what_is_allowed(overrides, message):
    from conftest import compose_config

    with pytest.raises(cfg.ConfigError) as info:
        compose_config(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_resume_refuses_an_option_that_changes_the_widths_and_accepts_the_others():
    def record(*overrides):
        config = tiny_config("data=selective_copy", *overrides)
        return {**cfg.flatten(config), **task_widths(tasks.make_task(config.data))}

    saved = record()
    with pytest.raises(cfg.ConfigError, match=r"key 'data.vocab_size': this run dir was trained with task.input_dim=10, "
                                              r"now 18, data.vocab_size 8 -> 16: the parameter shapes differ"):
        resume_changes(saved, record("data.vocab_size=16"), allowed=["data.vocab_size"])
    assert resume_changes(saved, record("data.num_tokens=3"), ["data.num_tokens"]) == {"data.num_tokens": [4, 3]}
    with pytest.raises(cfg.ConfigError, match="checkpoint.allow_changes=\\[data.min_seq_len\\]"):
        resume_changes(saved, record("data.min_seq_len=5"), [])
    assert resume_changes(saved, record("data.eval_seq_lens=[40]"), []) == {}  # an eval key: free
    old = {k: v for k, v in saved.items() if not k.startswith("task.") and k != "data.eval_seq_lens"}
    assert resume_changes(old, saved, []) == {}  # a record from before these keys existed


@pytest.mark.slow("long")
def test_resuming_with_another_vocabulary_is_refused_before_compiling(tmp_path):
    from rnnlab.trainer import train_and_evaluate

    train_and_evaluate(tiny_config("data=selective_copy", "steps=2", "eval_every=2", "checkpoint.every=2"), tmp_path)
    saved = json.loads((tmp_path / "checkpoints" / "run_config.json").read_text())
    assert (saved["task.input_dim"], saved["task.output_dim"], saved["data.vocab_size"]) == (10, 8, 8)
    changed = tiny_config("data=selective_copy", "steps=4", "data.vocab_size=16",
                          "checkpoint.allow_changes=[steps,data.vocab_size]")
    with pytest.raises(cfg.ConfigError, match="key 'data.vocab_size': this run dir was trained with task.input_dim=10"):
        train_and_evaluate(changed, tmp_path)


@pytest.mark.slow("long")
def test_parity_is_learnt_by_a_small_gru(tmp_path):
    from rnnlab.trainer import train_and_evaluate

    # Strings of 1 .. 8 bits (data.min_seq_len=1): the short ones get the count of ones started.
    config = tiny_config("data=parity", "data.seq_len=8", "data.min_seq_len=1", "model=gru", "hidden_dim=16",
                         "num_layers=1", "batch_size=64", "steps=200", "log_every=100", "eval_every=200",
                         "eval_batches=2", "checkpoint.enabled=false", "optimizer.lr=0.01", "optimizer.warmup_steps=0")
    results = train_and_evaluate(config, tmp_path)
    assert results["eval_metric_name"] == "accuracy" and results["eval_metric"] > 0.9
    assert results["eval_loss"] < 0.3 * results["baseline_loss"]
