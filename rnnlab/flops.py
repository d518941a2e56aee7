"""Analytic FLOP count of a training step.

Counted: matrix multiplications only, 2 FLOPs per multiply-add. For one example and
one time step the forward pass costs

    input projection   2 * I * H
    per layer          2 * H * H   (W_xh, hoisted out of the time scan)
                     + 2 * H * H   (W_hh, inside the scan)
    readout            2 * H * O

and the backward pass twice that (a gradient for the activations and one for the
weights of every matmul), so a training step is 3x forward. Not counted: bias adds,
activations, the loss and the optimizer update (each O(H) per token against O(H^2)
for the matmuls: under 1% at H >= 64), and the input gradient of the input projection
that backward never computes (a slight overcount of 2*I*H per token).
"""

from __future__ import annotations

from rnnlab.config import ModelConfig


def forward_flops_per_token(model: ModelConfig, input_dim: int, output_dim: int) -> int:
    h = model.hidden_dim
    per_layer = 2 * h * h + 2 * h * h
    return 2 * input_dim * h + model.num_layers * per_layer + 2 * h * output_dim


def train_step_flops(model: ModelConfig, input_dim: int, output_dim: int, tokens_per_step: int) -> int:
    """FLOPs of one forward + backward pass over `tokens_per_step` = global batch x sequence length."""
    return 3 * forward_flops_per_token(model, input_dim, output_dim) * tokens_per_step
