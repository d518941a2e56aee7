"""Copy memory task (Arjovsky, Shah & Bengio 2016)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rnnlab.tasks.registry import Task, register_task


@register_task
@dataclasses.dataclass(frozen=True)
class CopyTask(Task):
    """Delay T = `seq_len`. Symbols 0..7 are data, 8 is blank, 9 the delimiter. Input
    (token ids of 10 symbols): 10 random data symbols, T-1 blanks, the delimiter, 10 blanks
    (T+20 steps). Target: T+10 blanks, then the 10 data symbols. Loss: cross-entropy
    averaged over all T+20 steps; metric: accuracy on the 10 recalled symbols. A memoryless
    model that emits blanks and then guesses uniformly scores 10 ln 8 / (T+20).
    """

    name = "copy"
    input_dim = 10
    output_dim = 10
    min_seq_len = 11  # the delay must be longer than the 10 symbols it recalls
    token_inputs = True
    num_symbols: ClassVar[int] = 8
    copy_len: ClassVar[int] = 10
    BLANK: ClassVar[int] = 8
    DELIMITER: ClassVar[int] = 9

    @property
    def total_len(self) -> int:
        return self.seq_len + 2 * self.copy_len

    @property
    def baseline_loss(self) -> float:
        return self.copy_len * math.log(self.num_symbols) / self.total_len

    def sample_one(self, key):
        """-> (inputs int32[T+20] token ids, targets int32[T+20])."""
        symbols = jax.random.randint(key, (self.copy_len,), 0, self.num_symbols)
        blanks = lambda n: jnp.full((n,), self.BLANK, jnp.int32)  # noqa: E731
        tokens = jnp.concatenate(
            [symbols, blanks(self.seq_len - 1), jnp.array([self.DELIMITER]), blanks(self.copy_len)]
        )
        targets = jnp.concatenate([blanks(self.seq_len + self.copy_len), symbols])
        return tokens.astype(jnp.int32), targets

    def symbol_names(self):
        return {self.BLANK: "_", self.DELIMITER: ">"}

    def scored(self, targets):
        return np.arange(targets.shape[1])[None, :] >= targets.shape[1] - self.copy_len  # the recalled symbols

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T+20, 10] logits, targets: int32[B, T+20] -> (cross-entropy, {recall accuracy})."""
        loss = optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()
        recalled = outputs[:, -self.copy_len :].argmax(-1) == targets[:, -self.copy_len :]
        return loss, {"accuracy": recalled.mean()}
