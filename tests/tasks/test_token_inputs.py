"""Token inputs: the symbol tasks feed token ids, which the model embeds. Same parameters, same
results as the one-hot encoding fed as floats (the path before ids), folded or not; the padding id
embeds as zero; the fold rule for ids; an 8,192-symbol MQAR trains with no one-hot in its step."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TEXT_FIXTURE_DATA, fast_first, tiny_config
from rnnlab import memory, models, parallel, tasks, trainer
from rnnlab.models import build_model
from rnnlab.steps import create_train_state, make_dispatch, make_optimizer, train_step
from rnnlab.tasks.mqar import MQARTask

TOKEN_TASKS = {  # data overrides: tiny, with padded (variable-length) examples where the task has them
    "copy": ["data=copy", "data.seq_len=11"],
    "selective_copy": ["data=selective_copy", "data.seq_len=8", "data.min_seq_len=4"],
    "mqar": ["data=mqar", "data.seq_len=12", "data.vocab_size=16", "data.num_pairs=2", "data.min_seq_len=9"],
    "parity": ["data=parity", "data.seq_len=6", "data.min_seq_len=1"],
    "word_problem": ["data=word_problem", "data.seq_len=6", "data.group=s3", "data.min_seq_len=1"],
    "modular_arithmetic": ["data=modular_arithmetic", "data.seq_len=7", "data.min_seq_len=1"],
    "text": [*TEXT_FIXTURE_DATA, "data.seq_len=6"],
}
# (model overrides, the first layer's fold forced for both encodings: True, False, or None for the rule)
MODELS = {
    "folded": (["model=gru", "hidden_dim=16"], True),
    "unfolded": (["model=gru", "hidden_dim=4"], False),
    "residual": (["model=gru", "hidden_dim=8", "model.block=residual"], None),
}
# Each way a layer forms its input term from the ids, on one task.
PATHS = {
    "autodiff-folded": (["model=gru", "model.recurrence=autodiff"], True),
    "autodiff-unfolded": (["model=gru", "model.recurrence=autodiff"], False),
    "mingru-folded": (["model=mingru", "model.block=plain"], True),
    "lru": (["model=lru"], None),  # reads x P + c itself: never folded
}


def test_token_tasks_say_so():
    assert sorted(t for t in tasks.task_names() if tasks.get_task(t).token_inputs) == sorted(TOKEN_TASKS)
    assert not tasks.get_task("adding").token_inputs


def assert_close(got, want, rtol):
    """Within `rtol` of each leaf's largest magnitude (float32 noise, not a change)."""
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()))


def outputs_and_gradients(task, model_overrides, fold, monkeypatch):
    """(ids path, one-hot path): the outputs and the loss gradients of the same parameters on one batch."""
    if fold is not None:
        monkeypatch.setattr(models, "folds_projection", lambda input_dim, hidden_dim, tokens=None: fold)
    config = tiny_config(*TOKEN_TASKS[task], "num_layers=1", *model_overrides)
    task = tasks.make_task(config.data)
    batch = tasks.sample_batch(task, tasks.stream_key(0, 0), 0, 0, 4, config.data.min_seq_len)
    assert batch.inputs.dtype == jnp.int32 and batch.inputs.shape == (4, task.total_len)
    if task.variable_length():
        assert (batch.inputs == task.padding_id).any()  # padded steps are compared too
    one_hot = jax.nn.one_hot(batch.inputs, task.input_dim)  # the encoding before ids: zero at a padded step
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    params = jax.jit(model.init)(jax.random.key(1), batch.inputs)["params"]

    @jax.jit
    def run(params, inputs):
        def loss(p):
            outputs = model.apply({"params": p}, inputs)
            return task.loss_and_metrics(outputs, batch.targets)[0], outputs

        (_, outputs), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return outputs, grads

    return run(params, batch.inputs), run(params, one_hot)


# The fast tier: the first task with every model, and one variable-length task (the ids' padding) with the first;
# the full tier every task with every model.
PAIRS = sorted([(t, h) for t in TOKEN_TASKS for h in MODELS],
               key=lambda pair: (pair[0] != next(iter(TOKEN_TASKS)), pair != ("mqar", next(iter(MODELS)))))


@pytest.mark.parametrize("task, how", fast_first(PAIRS, keep=len(MODELS) + 1, why="cross-product", first_why="long"))
def test_ids_give_the_results_of_their_one_hot(task, how, monkeypatch):
    overrides, fold = MODELS[how]
    ids, one_hot = outputs_and_gradients(task, overrides, fold, monkeypatch)
    assert_close(ids[0], one_hot[0], rtol=1e-6)
    assert_close(ids[1], one_hot[1], rtol=1e-5)


@pytest.mark.parametrize("path", fast_first(list(PATHS), why="cross-product"))
def test_every_input_term_path_gives_the_results_of_the_one_hot(path, monkeypatch):
    overrides, fold = PATHS[path]
    ids, one_hot = outputs_and_gradients("mqar", overrides, fold, monkeypatch)
    assert_close(ids[0], one_hot[0], rtol=1e-6)
    assert_close(ids[1], one_hot[1], rtol=1e-5)


def test_the_padding_id_embeds_as_zero():
    table = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.array([[2, 4], [4, 0]])  # 4 = the padding id of 4 symbols
    np.testing.assert_array_equal(models.embed(ids, table), jax.nn.one_hot(ids, 4) @ table)
    np.testing.assert_array_equal(models.embed(ids, table)[1, 0], 0.0)
    grad = jax.grad(lambda t: models.embed(ids, t).sum())(table)  # a padded step reaches no row
    np.testing.assert_array_equal(grad, np.array([[1.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]))
    for name, overrides in TOKEN_TASKS.items():
        task = tasks.make_task(tiny_config(*overrides).data)
        assert task.padding_id == task.input_dim and not jax.nn.one_hot(task.padding_id, task.input_dim).any()


def test_the_fold_rule_for_ids_is_by_cost():
    """Folded, ids gather from P W_xh, formed each step ((I + 1) [H, G*H] products); not, they gather
    P's rows and the layer multiplies each token by W_xh: fold where I + 1 < the step's ids."""
    assert models.folds_projection(10, 4, tokens=128)  # copy at H=4: floats would not fold (I >= 2H)
    assert not models.folds_projection(10, 4)
    assert not models.folds_projection(8193, 64, tokens=64 * 32)  # Zoology's vocabulary at B=32, T=64
    assert models.folds_projection(8193, 64, tokens=8195) and not models.folds_projection(8193, 64, tokens=8194)


def test_examples_text_shows_ids_and_padding():
    task = tasks.make_task(tiny_config(*TOKEN_TASKS["parity"]).data)
    inputs = np.array([[1, 0, 1, 2, 2, 2]])  # 3 bits, then padding (id 2)
    targets = np.array([[-1, -1, 0, -1, -1, -1]])
    table = task.describe_examples(inputs, targets, np.eye(2)[[0, 0, 0, 0, 0, 0]][None])
    assert table.splitlines()[2] == "| `1 0 1 . . .` | `0` | `0` | 1/1 |"


# Zoology's vocabulary: 8,192 symbols.

@dataclasses.dataclass(frozen=True)
class OneHotMQAR(MQARTask):
    """MQAR as it was before token inputs: the one-hot of its ids, f32[T, V+1] (not registered)."""

    token_inputs = False

    def sample_padded(self, key, length):
        ids, targets = super().sample_padded(key, length)
        return jax.nn.one_hot(ids, self.input_dim), targets


def largest_array_with_a_dim(hlo: str, size: int) -> int:
    """Elements of the largest array in an HLO module's text that has a dimension of `size`."""
    shapes = (tuple(map(int, dims.split(","))) for dims in re.findall(r"[a-z]+\d*\[([\d,]+)\]", hlo))
    return max((int(np.prod(s)) for s in shapes if size in s), default=0)


def compiled_step_text(config, task):
    """The HLO text of one compiled train step that draws its batch, as the training loop's does."""
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    state = jax.eval_shape(lambda x: create_train_state(jax.random.key(0), model, x, tx), task.input_spec(1))

    def step(state):
        batch = tasks.sample_batch(task, tasks.stream_key(0, 0), state.step, 0, config.batch_size)
        return train_step(state, batch, task, schedule)

    mapped = jax.vmap(step, axis_name=parallel.AXIS, axis_size=1, in_axes=None)
    return jax.jit(mapped).lower(state).compile().as_text()


@pytest.mark.slow("long")  # compiles a wide embedding step; the fast tier keeps the id-vs-one-hot equalities
def test_an_8192_symbol_mqar_trains_with_no_one_hot_in_its_step(tmp_path, monkeypatch):
    overrides = ["data=mqar", "data.vocab_size=8192", "data.num_pairs=2", "data.seq_len=8", "hidden_dim=8",
                 "num_layers=1", "model=gru", "checkpoint.enabled=false", "device.steps_per_dispatch=1"]
    config = tiny_config(*overrides)
    task = tasks.make_task(config.data)
    batch = jax.eval_shape(lambda: tasks.sample_batch(task, tasks.stream_key(0, 0), 0, 0, config.batch_size))
    assert (batch.inputs.dtype, batch.inputs.shape) == (jnp.int32, (config.batch_size, task.total_len))
    one_hot_bytes = config.batch_size * task.total_len * task.input_dim * 4

    analyses, check = [], memory.check_step_fits

    def keep_analysis(stats, *args):
        analyses.append(stats)
        check(stats, *args)

    monkeypatch.setattr(memory, "check_step_fits", keep_analysis)
    results = trainer.train_and_evaluate(config, tmp_path)
    assert results["status"] == "completed" and np.isfinite(results["train_loss"]) and analyses

    # XLA's memory analysis of the step train.py compiled, against the same step on the one-hot.
    old = OneHotMQAR(**{f.name: getattr(task, f.name) for f in dataclasses.fields(task)})
    dp = parallel.DataParallel(jax.devices()[:1], "pmap")
    tx, _ = make_optimizer(config.optimizer, config.steps)
    model = build_model(config.model, old.output_dim, "cpu")
    state = dp.replicate(create_train_state(jax.random.key(0), model, old.example_inputs(1), tx))
    one_hot_step = make_dispatch(config, old, dp, config.batch_size, 1).compile(state)
    saved = memory.compiled_bytes(one_hot_step) - memory.compiled_bytes(analyses[-1])
    assert saved > 0.9 * one_hot_bytes, f"{saved} bytes less than the one-hot step; the one-hot is {one_hot_bytes}"

    # No array of the step has a V+1-sized dimension beyond the [V+1, H] kernel's (and its gradient's,
    # Adam's moments'); the one-hot step's does, which shows the check finds a one-hot input.
    kernel = task.input_dim * config.hidden_dim
    assert largest_array_with_a_dim(compiled_step_text(config, task), task.input_dim) == kernel
    assert largest_array_with_a_dim(compiled_step_text(config, old), task.input_dim) >= one_hot_bytes // 4
