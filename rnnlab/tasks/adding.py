"""Adding problem (Le, Jaitly & Hinton 2015, after Hochreiter & Schmidhuber 1997)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rnnlab.tasks.registry import Task, register_task


@register_task
@dataclasses.dataclass(frozen=True)
class AddingTask(Task):
    """Input f32[T, 2]: channel 0 values ~ U[0, 1], channel 1 a marker that is 1 at exactly
    two steps, one in the first half and one in the second. Target: the sum of the two
    marked values, read from the output at the last step; loss and metric are the MSE.
    The sum has variance 2/12, so always predicting its mean 1 scores 1/6.
    """

    name = "adding"
    input_dim = 2
    output_dim = 1
    min_seq_len = 2  # room for the two markers

    @property
    def baseline_loss(self) -> float:
        return 1.0 / 6.0

    def sample_one(self, key):
        """-> (inputs f32[T, 2], target f32[])."""
        k_val, k_first, k_second = jax.random.split(key, 3)
        half = self.seq_len // 2
        values = jax.random.uniform(k_val, (self.seq_len,))
        first = jax.random.randint(k_first, (), 0, half)
        second = jax.random.randint(k_second, (), half, self.seq_len)
        markers = jnp.zeros((self.seq_len,)).at[first].set(1.0).at[second].set(1.0)
        return jnp.stack([values, markers], axis=-1), values[first] + values[second]

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T, 1], targets: f32[B] -> (mse, {mse})."""
        mse = jnp.mean((outputs[:, -1, 0] - targets) ** 2)
        return mse, {"mse": mse}
