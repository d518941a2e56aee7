"""scripts/mamba_twin.py, the independent PyTorch Mamba that checks rnnlab's Mamba rows: its layer against the
NumPy loop of the paper's equations, its init against the reference's values. torch comes with the full tier."""

import numpy as np
import pytest

from conftest import require
from test_attention_mamba import numpy_mamba
from test_scripts import load_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def twin():
    require("torch")
    return load_script("mamba_twin")


def test_twin_layer_matches_the_numpy_equations(twin):
    """Every weight random (float64): the twin's layer, from in_proj's input to out_proj's output, is Algorithm 2."""
    import torch

    width, state, conv, batch, length = 8, 4, 3, 2, 7
    layer = twin.MambaMixer(width, d_state=state, d_conv=conv).double()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape)) * (0.5 if p.ndim == 1 else p.shape[-1] ** -0.5)))
        layer.A_log.copy_(torch.log(torch.arange(1, state + 1, dtype=torch.float64)) + 0.2 * torch.rand(layer.A_log.shape))
    x = rng.normal(size=(batch, length, width))
    params = {"W_xh": layer.in_proj.weight.detach().numpy().T, "cell": {
        "conv_w": layer.conv1d.weight.detach().numpy()[:, 0, :].T,  # [D, 1, K] -> [K, D]
        "conv_b": layer.conv1d.bias.detach().numpy(), "W_x": layer.x_proj.weight.detach().numpy().T,
        "W_dt": layer.dt_proj.weight.detach().numpy().T, "dt_bias": layer.dt_proj.bias.detach().numpy(),
        "A_log": layer.A_log.detach().numpy(), "D": layer.D.detach().numpy(),
        "W_out": layer.out_proj.weight.detach().numpy().T}}
    expected = numpy_mamba(x, params, state_size=state, conv_size=conv, dt_rank=layer.dt_rank)
    np.testing.assert_allclose(layer(torch.from_numpy(x)).detach().numpy(), expected, rtol=1e-9, atol=1e-9)


def test_twin_init_is_the_references(twin):
    """softplus(dt bias) log-uniform in [1e-3, 0.1], A = -(1..N) per channel, D = 1, out_proj / sqrt(layers)."""
    import torch

    torch.manual_seed(0)
    model = twin.MambaModel(vocab=10, outputs=5, width=64, depth=2)
    layer = model.mixers[0]
    dt = torch.nn.functional.softplus(layer.dt_proj.bias).detach().numpy()
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert np.log(dt).std() == pytest.approx((np.log(0.1) - np.log(1e-3)) / np.sqrt(12), rel=0.15)  # log-uniform
    np.testing.assert_allclose(-torch.exp(layer.A_log).detach().numpy(), -np.tile(np.arange(1, 17), (128, 1)), rtol=1e-6)
    np.testing.assert_array_equal(layer.D.detach().numpy(), 1)
    assert layer.dt_rank == 4 and layer.in_proj.bias is None and layer.out_proj.bias is None
    bound = 128 ** -0.5 / np.sqrt(2)  # PyTorch's Linear default U(+-fan_in^-1/2), rescaled
    weight = layer.out_proj.weight.detach().numpy()
    assert np.abs(weight).max() <= bound and np.abs(weight).max() > 0.95 * bound


def test_twin_trains_on_rnnlabs_batches(twin, tmp_path):
    result = twin.main(["--width", "8", "--steps", "3", "--eval-every", "2", "--json", str(tmp_path / "t.json")])
    assert sorted(result["eval_accuracy"]) == [2, 3] and (tmp_path / "t.json").exists()
    assert all(0 <= a <= 1 for a in result["eval_accuracy"].values())
