"""The zoo presets: every job of each sweep composes and validates, and the sweep covers every cell."""

import pytest
import yaml

from conftest import CONF_DIR, compose_config
from rnnlab.cells import CELLS, SequenceCell

ZOOS = ["zoo_parity", "zoo_selective_copy", "zoo_mqar"]
PACKAGE_CELLS = sorted(name for name, cls in CELLS.items() if cls.__module__.startswith("rnnlab."))


def swept_models(zoo):
    preset = yaml.safe_load(open(f"{CONF_DIR}/experiment/{zoo}.yaml"))
    return preset["hydra"]["sweeper"]["params"]["model"].split(",")


@pytest.mark.parametrize("zoo", ZOOS)
def test_a_zoo_sweeps_every_cell_with_the_block_it_needs(zoo):
    assert sorted(swept_models(zoo)) == PACKAGE_CELLS
    for cell in swept_models(zoo):
        config = compose_config([f"experiment={zoo}", f"model={cell}"])
        assert config.data.task == zoo.removeprefix("zoo_") and config.model.cell == cell
        assert config.data.eval_seq_lens and max(config.data.eval_seq_lens) > config.data.seq_len
        whole_sequence = issubclass(CELLS[cell], SequenceCell)
        assert config.model.block == ("residual" if whole_sequence else "plain")
