"""The word problem of a finite group (Merrill, Petty & Sabharwal 2024, "The Illusion of State in
State-Space Models"; Grazzi et al. 2025; Siems et al. 2025, "DeltaProduct"): after each element of a
sequence, the product of the elements so far.

The groups and their enumeration follow Merrill et al.'s data (github.com/jopetty/word-problem,
`src/generate_data.py`, whose groups come from their fork of abstract_algebra): `s<n>` lists the
permutations of (0 .. n-1) in `itertools.permutations` order (lexicographic, the identity first), `a<n>`
the even ones in that order, `z<n>` the residues 0 .. n-1, and a direct product `g1_x_g2` the pairs in
`itertools.product` order (the first factor's index the most significant). The product of permutations
p and q is their composition `(p q)[i] = p[q[i]]`, as abstract_algebra's `Perm.__mul__`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rnnlab.tasks.registry import IGNORE, OptionError, Task, register_task

MAX_ORDER = 1024  # the largest group: its multiplication table is a [|G|, |G|] constant of the sampler
# (factor kind: (smallest n, largest n)); past these bounds the order exceeds MAX_ORDER or the group is trivial.
FACTOR_RANGE = {"s": (2, 6), "a": (3, 6), "z": (2, MAX_ORDER)}
ALLOWED = ("s<n> (n = 2 .. 6), a<n> (n = 3 .. 6), z<n> (n >= 2), or their direct product joined by _x_ "
           f"(e.g. a4_x_z5), of at most {MAX_ORDER} elements")


def parse_group(group: str) -> tuple[tuple[str, int], ...]:
    """'a4_x_z5' -> (('a', 4), ('z', 5)); OptionError naming `data.group` for anything else."""
    factors = []
    for part in group.split("_x_"):
        match = re.fullmatch(r"([saz])([1-9][0-9]{0,5})", part)
        if not match or not FACTOR_RANGE[match[1]][0] <= int(match[2]) <= FACTOR_RANGE[match[1]][1]:
            raise OptionError(f"key 'data.group': got {group!r}, allowed: {ALLOWED}")
        factors.append((match[1], int(match[2])))
    if math.prod(factor_order(kind, n) for kind, n in factors) > MAX_ORDER:
        raise OptionError(f"key 'data.group': got {group!r}, allowed: {ALLOWED}")
    return tuple(factors)


def factor_order(kind: str, n: int) -> int:
    return {"s": math.factorial(n), "a": math.factorial(n) // 2, "z": n}[kind]


def permutations(kind: str, n: int) -> np.ndarray:
    """int32[|G|, n]: the elements of S_n (kind 's') or A_n ('a'), in Merrill et al.'s order."""
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int32)
    if kind == "a":
        inversions = np.triu(perms[:, :, None] > perms[:, None, :], k=1).sum((1, 2))
        perms = perms[inversions % 2 == 0]
    return perms


def factor_table(kind: str, n: int) -> np.ndarray:
    """int32[|G|, |G|]: `table[a, b]` the index of the product of elements a and b."""
    if kind == "z":
        return (np.arange(n)[:, None] + np.arange(n)[None, :]).astype(np.int32) % n
    perms = permutations(kind, n)
    composed = perms[:, perms]  # composed[a, b, i] = perms[a, perms[b, i]]
    codes = perms @ (n ** np.arange(n - 1, -1, -1))  # lexicographic order = increasing base-n code
    return np.searchsorted(codes, composed @ (n ** np.arange(n - 1, -1, -1))).astype(np.int32)


@functools.lru_cache(maxsize=None)
def multiplication_table(group: str) -> np.ndarray:
    """int32[|G|, |G|] of `data.group` (built once per group); element 0 is the identity."""
    table = np.zeros((1, 1), np.int32)  # the trivial group, the unit of the direct product
    for kind, n in parse_group(group):
        factor = factor_table(kind, n)
        size = len(factor)
        table = (table[:, None, :, None] * size + factor[None, :, None, :]).reshape(len(table) * size, -1)
    table.flags.writeable = False
    return table


@register_task
@dataclasses.dataclass(frozen=True)
class WordProblemTask(Task):
    """Input int32[T]: T = `seq_len` elements g_1 .. g_T of the group G = `data.group`, each uniform, as
    token ids (the element's index, `multiplication_table`). Target int32[T]: at step t the index of
    the prefix product g_1 g_2 ... g_t (the product of Merrill et al.'s data, left to right: target_t =
    table[target_{t-1}, g_t], the first target g_1 itself). Loss: cross-entropy at every step, averaged
    per example then over examples; metrics: `accuracy` (of the steps) and `sequence_accuracy`
    (examples with every step right).

    Why `sequence_accuracy` is the headline past the training length (the zoo's S3 table, the presets'
    comments): at an eval length L past the training length T the per-step mean counts the first T steps,
    which lie inside the training range, and guesses right 1/|G| of the rest, so a model that tracks the
    state to T and no further scores T/L + (1 - T/L)/|G| (0.27 for S3 at 8x), a curve that falls smoothly
    like partial generalisation where there is none. Sequence accuracy is the fraction of sequences whose
    state was tracked through all L steps, chance about |G|^-(L-1): the question parity and modular
    arithmetic ask of their one target.

    Baseline (1 - 1/T) ln |G|: a model that does not remember the earlier elements sees only g_t; from
    the second step on the prefix product is uniform whatever g_t (the product so far is uniform and
    independent of it), the first target is g_1 itself. With `data.min_seq_len` an example of length L
    has padding (`padding_id`) from step L on and its L targets before it; each example weighs the same
    whatever its length, so a padded example scores what it scores unpadded.

    The prefix products are an associative scan of the table lookup (the group law is associative),
    O(log T) deep, on device.
    """

    group: str = "s3"  # s<n>, a<n>, z<n>, or a direct product joined by _x_ (ALLOWED)

    name = "word_problem"
    min_seq_len = 1
    token_inputs = True

    @property
    def order(self) -> int:
        """|G|: the number of elements."""
        return math.prod(factor_order(kind, n) for kind, n in parse_group(self.group))

    @property
    def input_dim(self) -> int:
        return self.order

    @property
    def output_dim(self) -> int:
        return self.order

    @property
    def baseline_loss(self) -> float:
        return (1 - 1 / self.seq_len) * math.log(self.order)

    def check(self) -> None:
        super().check()
        parse_group(self.group)

    def sample_padded(self, key, length):
        """-> (inputs int32[T] element ids, padding from step `length` on; targets int32[T] prefix products)."""
        table = jnp.asarray(multiplication_table(self.group))
        steps = jnp.arange(self.seq_len)
        # One draw per step from its own key: a longer example extends a shorter one.
        elements = jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(key, i), (), 0, self.order))(steps)
        products = jax.lax.associative_scan(lambda a, b: table[a, b], elements)
        valid = steps < length
        return jnp.where(valid, elements, self.padding_id), jnp.where(valid, products, IGNORE)

    def sample_segment(self, key, carry, start, length):
        """carry: the index of the product of the elements before `start` (0, the identity, at 0)."""
        table = jnp.asarray(multiplication_table(self.group))
        steps = start + jnp.arange(length)
        elements = jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(key, i), (), 0, self.order))(steps)
        products = table[carry, jax.lax.associative_scan(lambda a, b: table[a, b], elements)]
        return elements, products, products[-1]

    def metrics_from_totals(self, totals):
        count = jnp.maximum(totals["scored"], 1)
        return (totals["loss"] / count).mean(), {"accuracy": (totals["right"] / count).mean(),
                                                 "sequence_accuracy": (totals["right"] == totals["scored"]).mean()}

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T, |G|] logits, targets: int32[B, T] -> (cross-entropy, {accuracy, sequence_accuracy})."""
        scored = targets != IGNORE
        labels = jnp.where(scored, targets, 0)
        count = jnp.maximum(scored.sum(-1), 1)
        losses = jnp.where(scored, optax.softmax_cross_entropy_with_integer_labels(outputs, labels), 0.0)
        right = scored & (outputs.argmax(-1) == labels)
        return (losses.sum(-1) / count).mean(), {"accuracy": (right.sum(-1) / count).mean(),
                                                 "sequence_accuracy": (right == scored).all(-1).mean()}
