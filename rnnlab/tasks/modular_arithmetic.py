"""Modular arithmetic without brackets (Deletang et al. 2023, "Neural Networks and the Chomsky
Hierarchy"; as Grazzi et al. 2025 train it): the value of `n0 o1 n1 o2 n2 ...` modulo m.

As both references compute it (Deletang's `tasks/regular/modular_arithmetic.py`, Grazzi's
`xlstm/experiments/data/formal_language/tasks/modular_arithmetic.py`): residues uniform in [0, m),
operators uniform in {+, -, *}, evaluated with the usual precedence (the products first, then the
sums and differences left to right), the result taken in [0, m). Deletang's examples, modulo 5:
`1 + 2 * 3 = 2`, `1 - 1 - 1 = 4`, `0 * 1 + 4 * 3 - 2 = 0`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rnnlab.options import allowed
from rnnlab.tasks.registry import IGNORE, Task, masked_cross_entropy, register_task

PLUS, MINUS, TIMES = 0, 1, 2  # operator codes; their token ids are modulus + code (Deletang's order)
MAX_MODULUS = 64  # the baseline's exact computation (`memoryless_entropy`) costs modulus^3 per term


def odd_length(length):
    """An expression has an odd number of tokens: an even length stands for the odd one below it."""
    return length - 1 + length % 2


def compose(first, then):
    """The map `then` after `first`. A map (u, v, w, z) takes the evaluation state (S, P), the sum of the
    finished terms and the signed product of the open one, to (S + u P + v, w P + z); all mod m."""
    u1, v1, w1, z1 = first
    u2, v2, w2, z2 = then
    return u1 + u2 * w1, v1 + u2 * z1 + v2, w2 * w1, w2 * z1 + z2


@functools.lru_cache(maxsize=None)
def memoryless_entropy(modulus: int, length: int) -> float:
    """H(value | last token) in nats for an expression of `length` (odd) tokens: the loss of the best
    prediction from the last residue alone, exact, by propagating the distribution of (S, P)."""
    if length < 3:
        return 0.0  # a lone residue is its own value
    m, r = modulus, np.arange(modulus)
    uniform = np.full(m, 1 / m)
    times = np.zeros((m, m))  # times[p, p'] = P(p * n = p') for n uniform
    np.add.at(times, (r[:, None], (r[:, None] * r[None, :]) % m), 1 / m)

    def sum_of(joint):  # the distribution of S + P
        return np.bincount(((r[:, None] + r[None, :]) % m).ravel(), joint.ravel(), m)

    joint = np.outer(np.eye(m)[0], uniform)  # after n0: S = 0, P = n0
    for _ in range((length - 1) // 2 - 1):  # every operator but the last; (S, P) soon stops changing
        new = 2 / 3 * np.outer(sum_of(joint), uniform) + joint @ times / 3
        converged = np.abs(new - joint).max() < 1e-15
        joint = new
        if converged:
            break
    entropy, total = 0.0, sum_of(joint)
    for n in range(m):  # the last residue n, after +, - or * with probability 1/3 each
        value = (np.roll(total, n) + np.roll(total, -n)
                 + np.bincount(((r[:, None] + r[None, :] * n) % m).ravel(), joint.ravel(), m)) / 3
        value = value[value > 0]
        entropy -= (value * np.log(value)).sum() / m
    return float(entropy)


@register_task
@dataclasses.dataclass(frozen=True)
class ModularArithmeticTask(Task):
    """Tokens 0 .. m-1 are residues (m = `modulus`), m, m+1, m+2 the operators +, -, *. Input int32[T']:
    an expression of T' tokens alternating residue and operator, starting and ending with a residue:
    T' = `seq_len`, or `seq_len` - 1 when it is even (as Deletang et al. do). Target int32[T']: at the
    last residue the expression's value mod m (precedence: `*` first; the module's docstring), IGNORE
    elsewhere. Loss: cross-entropy at that step; metric: accuracy there (chance about 1/m).

    Baseline: the loss of the best prediction from the last residue alone (`memoryless_entropy`),
    exact; ln m within 1.4e-5 from 15 tokens on (m = 5), 0 for a lone residue. With `data.min_seq_len`
    an example of length L has L' = L, or L - 1 when L is even, tokens, its target at step L' - 1, and
    padding (`padding_id`) after it. The value is computed on device by an associative scan of the
    affine maps that each `operator residue` pair applies to the evaluation state (`compose`).
    """

    # m: residues 0 .. m-1, and the value's range (Deletang et al.: 5)
    modulus: int = allowed(5, low=2, high=MAX_MODULUS)

    name = "modular_arithmetic"
    min_seq_len = 1
    token_inputs = True

    @property
    def input_dim(self) -> int:
        return self.modulus + 3  # residues, +, -, *

    @property
    def output_dim(self) -> int:
        return self.modulus

    @property
    def total_len(self) -> int:
        return odd_length(self.seq_len)

    @property
    def baseline_loss(self) -> float:
        return memoryless_entropy(self.modulus, self.total_len)

    def sample_padded(self, key, length):
        """-> (inputs int32[T'] token ids, padding after the expression; targets int32[T'])."""
        m, steps = self.modulus, jnp.arange(self.total_len)
        residue = steps % 2 == 0
        # One draw per step from its own key: a longer expression extends a shorter one.
        draws = jax.vmap(lambda i, n: jax.random.randint(jax.random.fold_in(key, i), (), 0, n))(
            steps, jnp.where(residue, m, 3))
        tokens = jnp.where(residue, draws, m + draws)
        numbers = tokens[0::2]
        ops = jnp.concatenate([jnp.array([PLUS]), tokens[1::2] - m])  # n0 is added to the empty sum
        # The pair (op, n) as a map of (S, P): + and - close the open term and open +n or -n; * scales it.
        adds = ops != TIMES
        signed = jnp.where(ops == MINUS, -numbers, numbers) % m
        maps = (adds.astype(jnp.int32), jnp.zeros_like(numbers),
                jnp.where(adds, 0, numbers), jnp.where(adds, signed, 0))
        _, v, _, z = jax.lax.associative_scan(lambda a, b: tuple(x % m for x in compose(a, b)), maps)
        values = (v + z) % m  # each prefix applied to (S, P) = (0, 0), then its open term closed
        end = odd_length(length)
        targets = jnp.where(steps == end - 1, values[(end - 1) // 2], IGNORE)
        return jnp.where(steps < end, tokens, self.padding_id).astype(jnp.int32), targets

    def initial_carry(self):
        """[u, v, w, z, the token before the segment]: the identity map of (S, P) and no token."""
        return jnp.array([0, 0, 1, 0, 0], jnp.int32)

    def sample_segment(self, key, carry, start, length):
        """carry: the composed map of the pairs before `start` (`compose`) and the token before it."""
        m, steps = self.modulus, start + jnp.arange(length)
        residue = steps % 2 == 0
        draws = jax.vmap(lambda i, n: jax.random.randint(jax.random.fold_in(key, i), (), 0, n))(
            steps, jnp.where(residue, m, 3))
        tokens = jnp.where(residue, draws, m + draws)
        ops = jnp.where(steps == 0, PLUS, jnp.concatenate([carry[4:], tokens[:-1]]) - m)  # a residue's operator
        adds = ops != TIMES
        signed = jnp.where(ops == MINUS, -tokens, tokens) % m
        zero = jnp.zeros_like(tokens)
        maps = (jnp.where(residue, adds, 0), zero, jnp.where(residue, jnp.where(adds, 0, tokens), 1),
                jnp.where(residue & adds, signed, 0))  # an operator's step: the identity
        mod = lambda a, b: tuple(x % m for x in compose(a, b))  # noqa: E731
        prefix = jax.lax.associative_scan(mod, maps)
        u, v, w, z = mod(tuple(carry[i] for i in range(4)), prefix)
        targets = jnp.where(steps == self.total_len - 1, (v + z) % m, IGNORE)
        return tokens.astype(jnp.int32), targets, jnp.stack([u[-1], v[-1], w[-1], z[-1], tokens[-1]]).astype(jnp.int32)

    def symbol_names(self):
        return {self.modulus + PLUS: "+", self.modulus + MINUS: "-", self.modulus + TIMES: "*"}

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T', m] logits, targets: int32[B, T'] -> (cross-entropy at the last residue, {accuracy})."""
        loss, accuracy = masked_cross_entropy(outputs, targets)
        return loss, {"accuracy": accuracy}
