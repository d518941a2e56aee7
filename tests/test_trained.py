"""rnnlab.trained.load_run: a run dir loaded into its config, task, model and the state of a checkpoint, against
Orbax's own read of that checkpoint (conftest.saved_state: no rnnlab code), bit for bit; and its one-line refusals.
(A data=text run's carried state: tests/test_text_training.py.)"""

import json

import jax
import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import assert_same_tree, saved_state, tiny_config
from rnnlab import config as cfg
from rnnlab.trained import RunError, load_run
from rnnlab.trainer import train_and_evaluate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny parity run trained in process with checkpoints at steps 1 and 2, and the .hydra/config.yaml that
    train.py's Hydra writes."""
    config = tiny_config("data=parity", "model=gru", "steps=2", "eval_every=2", "checkpoint.every=1",
                         "checkpoint.keep=2")
    run = tmp_path_factory.mktemp("trained") / "run"
    train_and_evaluate(config, run)
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(json.loads(json.dumps(cfg.to_dict(config)))), run / ".hydra" / "config.yaml")
    return run, config


def test_load_run_restores_the_newest_checkpoint_or_a_given_step_as_orbax_reads_it(run):
    run, config = run
    loaded = load_run(run)
    assert loaded.step == 2 and loaded.run_dir == run and loaded.warnings == ()
    assert cfg.to_dict(loaded.config) == cfg.to_dict(config) and loaded.task.name == "parity"
    saved = saved_state(run, 2)
    assert_same_tree(loaded.params, saved["params"])
    assert_same_tree(loaded.state.opt_state, saved["opt_state"])
    assert int(loaded.state.step) == 2 and loaded.record["run_config"]
    older = load_run(run, step=1)
    assert older.step == 1
    assert_same_tree(older.params, saved_state(run, 1)["params"])
    leaves = [jax.tree_util.tree_leaves(r.params) for r in (older, loaded)]
    assert any(not np.array_equal(a, b) for a, b in zip(*leaves))  # another step's parameters
    with pytest.raises(RunError) as info:
        load_run(run, step=5)
    assert str(info.value) == f"no checkpoint of step 5 under {run / 'checkpoints'}; allowed: a saved step (1, 2)"


def test_load_run_refuses_a_dir_without_a_checkpoint_and_a_dir_that_is_no_run_in_one_line(run, tmp_path):
    run, _ = run
    bare = tmp_path / "bare"
    (bare / ".hydra").mkdir(parents=True)
    (bare / ".hydra" / "config.yaml").write_text((run / ".hydra" / "config.yaml").read_text())
    with pytest.raises(RunError) as info:
        load_run(bare)
    assert str(info.value) == f"no checkpoint under {bare / 'checkpoints'}"
    with pytest.raises(RunError) as info:
        load_run(tmp_path / "nothing")
    assert str(info.value) == (f"'{tmp_path / 'nothing'}' is not a run dir of train.py (allowed: a dir holding "
                               f".hydra/config.yaml and checkpoints/)")
    (bare / ".hydra" / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(RunError) as info:
        load_run(bare)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"cannot read {bare / '.hydra' / 'config.yaml'} (")


def test_a_loaded_run_evaluates_as_its_training_did_and_in_segments_as_whole(run):
    """`TrainedRun.evaluate`: at the trained length, the metrics the run's own last evaluation wrote (the same eval
    stream, one batch); at a longer length, the same metrics whether run whole or in segments with the state carried."""
    run, config = run
    loaded = load_run(run)
    results = json.loads((run / "results.json").read_text())
    written = {"loss": results["eval_loss"], **results["eval_metrics"]}
    got = loaded.evaluate(config.data.seq_len)
    assert got.keys() == written.keys()
    np.testing.assert_allclose([got[k] for k in written], [written[k] for k in written], rtol=1e-5, atol=1e-6)
    whole, segmented = loaded.evaluate(24, segment_len=64), loaded.evaluate(24, segment_len=8)
    assert whole.keys() == segmented.keys() and whole != got
    np.testing.assert_allclose([segmented[k] for k in whole], [whole[k] for k in whole], rtol=1e-5, atol=1e-6)
