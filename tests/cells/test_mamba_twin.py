"""scripts/mamba_twin.py, the independent PyTorch Mamba that checks rnnlab's Mamba rows: its layer against the
NumPy loop of the paper's equations, its init against the reference's values. torch comes with the full tier."""

import numpy as np
import pytest

from conftest import require
from test_attention_mamba import numpy_mamba
from test_scripts import load_script

pytestmark = pytest.mark.slow("extra")


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


def _twin_as_rnnlab(model, grads: bool = False) -> dict:
    """The twin's parameters (or their gradients) in rnnlab's layout: [in, out] kernels, layers 1.. stacked."""
    def a(p):
        return (p.grad if grads else p).detach().numpy().astype(np.float64)

    layers = [{"norm_0": {"scale": a(norm.weight)}, "recurrence": {"W_xh": a(mixer.in_proj.weight).T, "cell": {
        "conv_w": a(mixer.conv1d.weight)[:, 0, :].T, "conv_b": a(mixer.conv1d.bias), "W_x": a(mixer.x_proj.weight).T,
        "W_dt": a(mixer.dt_proj.weight).T, "dt_bias": a(mixer.dt_proj.bias), "A_log": a(mixer.A_log), "D": a(mixer.D),
        "W_out": a(mixer.out_proj.weight).T}}} for norm, mixer in zip(model.norms, model.mixers)]
    rows = model.embedding.num_embeddings - 1  # rnnlab has no row for the padding id
    import jax
    return {"input_proj": {"kernel": a(model.embedding.weight)[:rows], "bias": a(model.embed_bias)},
            "stack": {"layer_0": layers[0], "layers": jax.tree_util.tree_map(lambda *x: np.stack(x), *layers[1:])},
            "final_norm": {"scale": a(model.norm_f.weight)},
            "readout": {"kernel": a(model.head.weight).T, "bias": a(model.head.bias)}}


def test_twin_from_rnnlabs_params_trains_as_rnnlab(twin):
    """--from-rnnlab: the twin holds train.py's initial parameters, and its loss, every gradient and three AdamW
    updates (rnnlab's schedule, clipping, weight decay) equal rnnlab's model and optimizer on the same batches.
    So the two builds differ only in the random draws of their init, where they do not start from one draw."""
    import jax
    import optax
    import torch

    from rnnlab import models, steps, tasks

    config = twin.benchmark.compose_overrides(["experiment=zoo_mqar", "model=mamba", "hidden_dim=16", "batch_size=4", "steps=3",
                                               "optimizer.lr=1e-2"])
    task = tasks.make_task(config.data)
    model = twin.build_twin(config, task, twin.argparse.Namespace(from_rnnlab=True))
    net = models.build_model(config.model, task.output_dim, "cpu", task.input_dim)
    params = twin.rnnlab_initial_params(config, task)
    tx, schedule = steps.make_optimizer(config.optimizer, config.steps)
    opt_state = tx.init(params)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(config.optimizer.b1, config.optimizer.b2),
                              eps=1e-8, weight_decay=config.optimizer.weight_decay)

    def rnnlab_loss(p, batch):
        return task.loss_and_metrics(net.apply({"params": p}, batch.inputs), batch.targets)[0]

    stream = tasks.stream_key(config.seed, tasks.TRAIN_STREAM)
    for step in range(config.steps):
        batch = tasks.sample_batch(task, stream, step, 0, config.batch_size)
        ids, targets = (torch.from_numpy(np.asarray(x, np.int64)) for x in (batch.inputs, batch.targets))
        logits = model(ids)
        np.testing.assert_allclose(logits.detach().numpy(), net.apply({"params": params}, batch.inputs),
                                   rtol=1e-4, atol=1e-5)
        scored = targets != tasks.IGNORE
        loss = torch.nn.functional.cross_entropy(logits[scored], targets[scored])
        expected_loss, grads = jax.value_and_grad(rnnlab_loss)(params, batch)
        np.testing.assert_allclose(loss.item(), expected_loss, rtol=1e-5)
        adamw.zero_grad()
        loss.backward()
        jax.tree_util.tree_map(lambda t, j: np.testing.assert_allclose(t, j, rtol=2e-3, atol=2e-6),
                               _twin_as_rnnlab(model, grads=True), grads)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_norm)
        for group in adamw.param_groups:
            group["lr"] = float(schedule(step + 1))
        adamw.step()
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    jax.tree_util.tree_map(lambda t, j: np.testing.assert_allclose(t, j, rtol=1e-4, atol=1e-5),
                           _twin_as_rnnlab(model), params)
