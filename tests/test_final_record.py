"""A finished run's record is final (issue 72): rerunning it with the same config writes nothing and reports the
record as it stands; a rerun that evaluates again (other eval keys) keeps the training's own figures; and every
results.json carries its provenance."""

import json
import os

import pytest

from conftest import tiny_config
from rnnlab import config as cfg
from rnnlab.trainer import train_and_evaluate


def snapshot(folder):
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.rglob("*") if p.is_file()}


def test_rerunning_a_finished_run_writes_nothing_and_returns_its_record(tmp_path):
    config = tiny_config("steps=6", "log_every=3", "eval_every=6")
    first = train_and_evaluate(config, tmp_path)
    assert first["train_loss"] is not None and first["tokens_per_sec"] is not None
    before = snapshot(tmp_path)
    record = (tmp_path / "results.json").read_bytes()
    again = train_and_evaluate(tiny_config("steps=6", "log_every=3", "eval_every=6", "log.histograms_every=0",
                                           "device.compile_cache=false"), tmp_path)
    assert snapshot(tmp_path) == before and (tmp_path / "results.json").read_bytes() == record
    assert again == json.loads(record)


@pytest.mark.slow("long")
def test_a_rerun_that_evaluates_again_keeps_the_trainings_figures(tmp_path):
    first = train_and_evaluate(tiny_config("steps=6", "log_every=3", "eval_every=6"), tmp_path)
    again = train_and_evaluate(tiny_config("steps=6", "log_every=3", "eval_every=6", "eval_batches=3"), tmp_path)
    for key in ("train_loss", "tokens_per_sec", "flops_per_sec", "mfu", "compile_seconds", "wall_seconds"):
        assert again[key] == first[key], key
    assert again["config"]["eval_batches"] == 3 and again["status"] == "completed"


def nested(flat):
    """{'model.cell': 'rnn', ...} -> {'model': {'cell': 'rnn'}, ...}: the nested dict `config.from_dict` reads."""
    tree = {}
    for dotted, value in flat.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def test_results_json_records_the_config_and_provenance(tmp_path):
    config = tiny_config("steps=2", "log_every=1", "eval_every=2")
    results = train_and_evaluate(config, tmp_path)
    recorded = results["config"]
    assert recorded == json.loads((tmp_path / "results.json").read_text())["config"]
    assert recorded["steps"] == 2 and recorded["model.cell"] == config.model.cell == "rnn"
    assert (recorded["model.hidden_dim"], recorded["batch_size"], recorded["data.seq_len"]) == (8, 8, 6)  # TINY's
    assert cfg.from_dict(nested(recorded)) == config  # the whole config, read back from the record alone
    prov = results["provenance"]
    assert len(prov["commit"]) == 40 and isinstance(prov["dirty"], bool)
    assert prov["machine"]["platform"] == "cpu" and prov["machine"]["cpu_cores"] == os.cpu_count()
    assert prov["machine"]["cpu"]
    assert set(prov["versions"]) == {"python", "jax", "jaxlib", "flax", "optax"} and all(prov["versions"].values())
    assert prov["started_utc"] <= prov["ended_utc"] and prov["ended_utc"].endswith("Z")
