"""Parity: is the number of ones in a binary string odd?"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab.tasks.registry import IGNORE, Task, masked_cross_entropy, per_position_uniform, register_task


@register_task
@dataclasses.dataclass(frozen=True)
class ParityTask(Task):
    """Input int32[T]: T = `seq_len` random bits, as token ids. Target int32[T]: at the last step the
    parity of the ones (1 if their count is odd), IGNORE elsewhere. Loss: cross-entropy at the
    last step only; metric: accuracy there (chance 50%).

    Baseline ln 2: the label is a fair coin independent of any strict subset of the bits (the
    last bit alone included), so a model that does not remember the earlier bits can do no
    better than predicting 1/2. With `data.min_seq_len` each example has its own length L, its
    label at step L-1 and padding (`padding_id`) after it.
    """

    name = "parity"
    input_dim = 2
    output_dim = 2
    min_seq_len = 1
    token_inputs = True

    @property
    def baseline_loss(self) -> float:
        return math.log(2)

    def sample_padded(self, key, length):
        """-> (inputs int32[T] bits, padding from step `length` on; targets int32[T])."""
        steps = jnp.arange(self.seq_len)
        valid = steps < length
        bits = ((per_position_uniform(key, self.seq_len) < 0.5) & valid).astype(jnp.int32)
        inputs = jnp.where(valid, bits, self.padding_id)
        targets = jnp.where(steps == length - 1, bits.sum() % 2, IGNORE)
        return inputs, targets

    def sample_segment(self, key, carry, start, length):
        """carry: the parity of the ones before `start`."""
        steps = start + jnp.arange(length)
        bits = (jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(steps) < 0.5).astype(jnp.int32)
        parity = (carry + jnp.cumsum(bits)) % 2
        return bits, jnp.where(steps == self.seq_len - 1, parity, IGNORE), parity[-1]

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T, 2] logits, targets: int32[B, T] -> (cross-entropy at the last step, {accuracy})."""
        loss, accuracy = masked_cross_entropy(outputs, targets)
        return loss, {"accuracy": accuracy}
