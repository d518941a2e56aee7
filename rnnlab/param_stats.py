"""Parameters and gradients by layer, for TensorBoard: histograms and per-layer gradient norms
(`log.histograms_every`)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

STACK = "stack"  # rnnlab.models.RecurrentModel's LayerStack: layer_0/, then layers/ stacked on axis 0 (scanned)
STACKED = "layers"


def by_layer(params: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    """Host parameters (or gradients) -> {layer: {path within it: array}}, one layer per recurrent
    layer (`layer_0`, `layer_1`, ...: the scanned stack's leaves are split along their layer axis)
    and one per other top-level module (`input_proj`, `readout`, `final_norm`)."""
    layers: dict[str, dict[str, np.ndarray]] = {}
    for name, module in params.items():
        if name != STACK:
            layers[name] = _flat(module)
            continue
        for part, tree in module.items():
            if part != STACKED:
                layers[part] = _flat(tree)  # layer_0 (and layer_i with model.scan_layers=false)
                continue
            leaves = _flat(tree)
            for i in range(len(next(iter(leaves.values())))):
                layers[f"layer_{i + 1}"] = {path: leaf[i] for path, leaf in leaves.items()}
    return layers


def _flat(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    if not isinstance(tree, Mapping):
        return {prefix.rstrip("/"): np.asarray(tree)}
    return {path: leaf for key, sub in tree.items() for path, leaf in _flat(sub, f"{prefix}{key}/").items()}


def layer_norms(grads: Mapping[str, Any]) -> dict[str, float]:
    """{"grad_norm/<layer>": the L2 norm of that layer's gradients}, layers as in `by_layer`."""
    return {f"grad_norm/{layer}": float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in leaves.values())))
            for layer, leaves in by_layer(grads).items()}


def histograms(params: Mapping[str, Any], grads: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{"params/<layer>/<path>": values, "grads/<layer>/<path>": values}, layers as in `by_layer`."""
    return {f"{kind}/{layer}/{path}": leaf for kind, tree in (("params", params), ("grads", grads))
            for layer, leaves in by_layer(tree).items() for path, leaf in leaves.items()}
