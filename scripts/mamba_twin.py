"""Train an independent PyTorch Mamba (the reference's model, written from `mamba_simple.py` and
`selective_scan_ref`) on rnnlab's MQAR batches with rnnlab's optimizer, to check rnnlab's Mamba rows.

    python scripts/mamba_twin.py --width 128 --lr 1e-3                 # eval accuracy at 500, 1000, ... steps
    python scripts/mamba_twin.py --width 64 --pairs 8 --steps 2000 --json twin.json

The data are `experiment=zoo_mqar`'s (64 symbols, 64 steps, batch 64, AdamW with 50 warm-up steps,
cosine to 0.1 lr, clipping 1.0: read from conf/ by Hydra), drawn from rnnlab's streams, so the twin sees
the batches a single-device `python train.py experiment=zoo_mqar` job sees. Nothing of rnnlab's model
is used: the model is MambaLMHeadModel's shape (embedding N(0, 0.02), blocks x + Mamba(RMSNorm(x)),
final RMSNorm, linear head without bias; out_proj rescaled by 1/sqrt(layers) as `_init_weights` does;
--embed-std, --no-rescale, --head-bias and --embed-bias change them; --from-rnnlab starts from the very parameters
`train.py` draws for the same config, to compare the two builds step by step), and Mamba's own init (Delta's bias the inverse softplus of
dt log-uniform in [1e-3, 0.1], A = -(1..N), D = 1, PyTorch's Linear and Conv1d defaults). The scan is the
reference's `selective_scan_ref`, one step at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (this directory: its Hydra composition of conf/)


class MambaMixer(nn.Module):
    """Mamba's layer (Gu & Dao 2023): in_proj -> causal depthwise conv + silu -> selective SSM -> gate -> out_proj."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4):
        super().__init__()
        d_inner, self.d_state = expand * d_model, d_state
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=True)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        bound = self.dt_rank ** -0.5  # the reference's dt_init="random", dt_scale=1
        nn.init.uniform_(self.dt_proj.weight, -bound, bound)
        dt = torch.exp(torch.rand(d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(bias) = dt
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u: [B, L, d_model] -> [B, L, d_model]."""
        return self.out_proj(self.mix(self.in_proj(u)))

    def mix(self, xz: torch.Tensor) -> torch.Tensor:
        """in_proj's output [B, L, 2 d_inner] -> the gated SSM output [B, L, d_inner] (before out_proj)."""
        length = xz.shape[1]
        x, z = xz.chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :length]).transpose(1, 2)
        dt, b, c = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(dt @ self.dt_proj.weight.T + self.dt_proj.bias)  # [B, L, D]
        return selective_scan_ref(x, delta, -torch.exp(self.A_log), b, c, self.D) * F.silu(z)


def selective_scan_ref(u, delta, a, b, c, d):
    """The reference's sequential selective scan: h_t = exp(delta_t a) h_{t-1} + delta_t b_t u_t, y_t = h_t c_t + d u_t.
    u, delta: [B, L, D]; a: [D, N]; b, c: [B, L, N]; d: [D] -> [B, L, D]."""
    decay = torch.exp(delta[..., None] * a).unbind(1)  # L x [B, D, N] (unbind: one backward for all steps)
    drive = ((delta * u)[..., None] * b[:, :, None, :]).unbind(1)
    h = u.new_zeros(u.shape[0], u.shape[2], a.shape[1])
    ys = []
    for decay_t, drive_t, c_t in zip(decay, drive, c.unbind(1)):
        h = decay_t * h + drive_t
        ys.append(torch.einsum("bdn,bn->bd", h, c_t))
    return torch.stack(ys, dim=1) + u * d


class MambaModel(nn.Module):
    """MambaLMHeadModel's shape: embedding, blocks x + Mamba(RMSNorm(x)) (no MLP), final RMSNorm, linear head."""

    def __init__(self, vocab: int, outputs: int, width: int, depth: int, rescale: bool = True,
                 embed_std: float = 0.02, head_bias: bool = False, embed_bias: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        nn.init.normal_(self.embedding.weight, std=embed_std)
        self.embed_bias = nn.Parameter(torch.zeros(width)) if embed_bias else None  # rnnlab's input projection has one
        self.norms = nn.ModuleList(nn.RMSNorm(width, eps=norm_eps) for _ in range(depth))
        self.mixers = nn.ModuleList(MambaMixer(width) for _ in range(depth))
        if rescale:  # `_init_weights(rescale_prenorm_residual=True)`, one residual per block
            with torch.no_grad():
                for mixer in self.mixers:
                    mixer.out_proj.weight /= math.sqrt(depth)
        self.norm_f = nn.RMSNorm(width, eps=norm_eps)
        self.head = nn.Linear(width, outputs, bias=head_bias)
        if head_bias:  # as rnnlab's readout, Flax's Dense: lecun_normal kernel, zero bias
            nn.init.trunc_normal_(self.head.weight, std=width ** -0.5 / 0.87962566, a=-2 * width ** -0.5 / 0.87962566,
                                  b=2 * width ** -0.5 / 0.87962566)
            nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        if self.embed_bias is not None:
            x = x + self.embed_bias
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(self.norm_f(x))


def rnnlab_initial_params(config, task) -> dict:
    """The parameters `train.py` starts `config` from (its model, its key): a nested dict of arrays."""
    import jax

    from rnnlab import models, steps

    net = models.build_model(config.model, task.output_dim, "cpu", task.input_dim)
    key = jax.random.fold_in(jax.random.key(config.seed), steps.PARAMS_STREAM)
    return jax.jit(net.init)(key, task.example_inputs(config.batch_size))["params"]


def load_rnnlab_params(model: MambaModel, params: dict) -> None:
    """Copy rnnlab's Mamba parameters into `model` (built with embed_bias, head_bias and rnnlab's norm eps):
    rnnlab's [in, out] kernels become PyTorch's [out, in] weights; its padding id's embedding row is zero."""
    def t(a):
        return torch.from_numpy(np.array(a, np.float32))

    import jax

    stack = params["stack"]
    layers = [stack["layer_0"]] + [jax.tree_util.tree_map(lambda v: v[i], stack["layers"])  # noqa: B023
                                   for i in range(len(model.mixers) - 1)]
    with torch.no_grad():
        kernel = t(params["input_proj"]["kernel"])
        model.embedding.weight.zero_()
        model.embedding.weight[: kernel.shape[0]] = kernel
        model.embed_bias.copy_(t(params["input_proj"]["bias"]))
        for norm, mixer, layer in zip(model.norms, model.mixers, layers):
            cell = layer["recurrence"]["cell"]
            norm.weight.copy_(t(layer["norm_0"]["scale"]))
            mixer.in_proj.weight.copy_(t(layer["recurrence"]["W_xh"]).T)
            mixer.conv1d.weight.copy_(t(cell["conv_w"]).T[:, None, :])  # rnnlab's w_k multiplies x_{t-K+1+k}
            mixer.conv1d.bias.copy_(t(cell["conv_b"]))
            mixer.x_proj.weight.copy_(t(cell["W_x"]).T)
            mixer.dt_proj.weight.copy_(t(cell["W_dt"]).T)
            mixer.dt_proj.bias.copy_(t(cell["dt_bias"]))
            mixer.A_log.copy_(t(cell["A_log"]))
            mixer.D.copy_(t(cell["D"]))
            mixer.out_proj.weight.copy_(t(cell["W_out"]).T)
        model.norm_f.weight.copy_(t(params["final_norm"]["scale"]))
        model.head.weight.copy_(t(params["readout"]["kernel"]).T)
        model.head.bias.copy_(t(params["readout"]["bias"]))


def build_twin(config, task, args) -> MambaModel:
    """The twin for `config`: the reference's init as the flags adjust it, or rnnlab's initial parameters."""
    if args.from_rnnlab:  # rnnlab's outer model: embedding bias, head bias, Flax's RMSNorm eps
        model = MambaModel(task.input_dim + 1, task.output_dim, config.hidden_dim, config.num_layers, rescale=False,
                           head_bias=True, embed_bias=True, norm_eps=1e-6)
        load_rnnlab_params(model, rnnlab_initial_params(config, task))
        return model
    return MambaModel(task.input_dim + 1, task.output_dim, config.hidden_dim, config.num_layers,
                      rescale=not args.no_rescale, embed_std=args.embed_std, head_bias=args.head_bias,
                      embed_bias=args.embed_bias)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64, help="hidden_dim (the model width)")
    parser.add_argument("--pairs", type=int, default=8, help="data.num_pairs")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="rnnlab's data seed and the twin's torch seed")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-rescale", action="store_true", help="leave out_proj at PyTorch's default init")
    parser.add_argument("--embed-std", type=float, default=0.02,
                        help="the embedding's init std (the reference's 0.02; rnnlab's token embedding: 1/sqrt(symbols))")
    parser.add_argument("--head-bias", action="store_true",
                        help="a head with a bias, initialised as rnnlab's readout (Flax's Dense) rather than PyTorch's Linear")
    parser.add_argument("--embed-bias", action="store_true",
                        help="a trainable bias (zero at init) added to the embedding, as rnnlab's input projection has")
    parser.add_argument("--from-rnnlab", action="store_true",
                        help="start from the parameters train.py draws for this config (and rnnlab's embedding bias, "
                             "head bias and norm eps), instead of the twin's own init")
    parser.add_argument("--json", help="write the curve here")
    args = parser.parse_args(argv)

    import jax

    from rnnlab import steps, tasks

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = benchmark.compose_overrides(["experiment=zoo_mqar", "model=mamba", f"hidden_dim={args.width}", f"data.num_pairs={args.pairs}",
                      f"optimizer.lr={args.lr}", f"steps={args.steps}", f"seed={args.seed}"])
    task, opt = tasks.make_task(config.data), config.optimizer
    model = build_twin(config, task, args)
    adamw = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2), eps=1e-8,
                              weight_decay=opt.weight_decay)
    _, schedule = steps.make_optimizer(opt, config.steps)  # rnnlab's lr of update s: warm-up, then cosine
    train_stream = tasks.stream_key(config.seed, tasks.TRAIN_STREAM)
    eval_stream = tasks.stream_key(config.seed, tasks.EVAL_STREAM)
    sample = jax.jit(lambda stream, step: tasks.sample_batch(task, stream, step, 0, config.batch_size))

    def batch(stream, step):
        b = sample(stream, step)
        return torch.from_numpy(np.asarray(b.inputs, np.int64)), torch.from_numpy(np.asarray(b.targets, np.int64))

    def loss_and_accuracy(ids, targets):
        logits = model(ids)
        scored = targets != tasks.IGNORE
        loss = F.cross_entropy(logits[scored], targets[scored])
        return loss, (logits[scored].argmax(-1) == targets[scored]).float().mean()

    curve, start = {}, time.perf_counter()
    for step in range(1, config.steps + 1):
        for group in adamw.param_groups:
            group["lr"] = float(schedule(step))
        loss, _ = loss_and_accuracy(*batch(train_stream, step - 1))  # rnnlab's update s reads batch s - 1
        adamw.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_norm)
        adamw.step()
        if step % args.eval_every == 0 or step == config.steps:
            with torch.no_grad():
                accuracy = np.mean([float(loss_and_accuracy(*batch(eval_stream, i))[1])
                                    for i in range(config.eval_batches)])
            curve[step] = round(float(accuracy), 4)
            print(json.dumps({"step": step, "train_loss": round(loss.item(), 4), "eval_accuracy": curve[step],
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    result = {"width": args.width, "pairs": args.pairs, "lr": args.lr, "steps": config.steps, "seed": args.seed,
              "rescale": not args.no_rescale, "embed_std": args.embed_std, "head_bias": args.head_bias,
              "embed_bias": args.embed_bias, "from_rnnlab": args.from_rnnlab, "eval_accuracy": curve}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
