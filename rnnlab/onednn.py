"""oneDNN's fused LSTM layer (the kernel behind torch's CPU `nn.LSTM`) as an XLA FFI call: `model.recurrence=onednn`.

XLA's CPU code generation runs an LSTM step as separate matmul and elementwise passes inside a
scan; oneDNN's RNN primitive runs the whole layer, GEMMs and gate math, in one call. The kernel
(`rnnlab/native/onednn_lstm.cc`) is compiled on first use with the C++ compiler against the
`onednn` extra's library and JAX's FFI headers, and cached per machine. Where it cannot be built
or loaded, `available()` is False with the reason, and the layer runs the XLA path
(`model.recurrence=custom_vjp`) after a one-line notice.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from rnnlab import native_build

SOURCE = Path(__file__).parent / "native" / "onednn_lstm.cc"
FORWARD, BACKWARD = "rnnlab_onednn_lstm_forward", "rnnlab_onednn_lstm_backward"
INSTALL_HINT = "pip install -e '.[onednn]' and a C++ compiler (g++)"


def library_prefix() -> Path | None:
    """The install prefix that holds oneDNN's headers and library (the `onednn` extra's wheels), or None."""
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix, "/usr/local", "/usr"]):
        p = Path(prefix)
        if (p / "include" / "oneapi" / "dnnl" / "dnnl.hpp").exists() and any((p / "lib").glob("libdnnl.so*")):
            return p
    return None


def build(prefix: Path) -> Path:
    """Compile the kernel once per source, compiler, oneDNN, jaxlib and CPU (`native_build.build`); its path."""
    return native_build.build(SOURCE, ["-O2", "-std=c++17", f"-I{prefix / 'include'}"],
                              [f"-L{prefix / 'lib'}", "-ldnnl", f"-Wl,-rpath,{prefix / 'lib'}"])


def _built() -> Path:
    prefix = library_prefix()
    if prefix is None:
        raise RuntimeError(f"oneDNN's headers and library are not installed ({INSTALL_HINT})")
    return build(prefix)


def _declare(lib: ctypes.CDLL) -> None:
    lib.rnnlab_lstm_workspace_bytes.restype = ctypes.c_int64
    lib.rnnlab_lstm_workspace_bytes.argtypes = [ctypes.c_int64] * 4


_loader = native_build.Loader(_built, {FORWARD: "RnnlabLstmForward", BACKWARD: "RnnlabLstmBackward"}, _declare)
_load = _loader.load


def available() -> tuple[bool, str]:
    """(True, "") where the oneDNN LSTM kernel is built and loaded, else (False, the reason)."""
    lib, why = _load()
    return lib is not None, why


# `model.recurrence=auto` runs oneDNN's layer from this width and batch (per device) up: below them
# the train step with XLA's scan was about as fast or faster on a 2-core Intel VM (docs/performance-notes.md).
MIN_HIDDEN, MIN_BATCH = 256, 32


def prefers(batch: int, hidden: int) -> bool:
    """Whether `model.recurrence=auto` runs oneDNN's layer for this batch (per device) and width."""
    return hidden >= MIN_HIDDEN and batch >= MIN_BATCH


def _workspace_bytes(t: int, b: int, i: int, h: int) -> int:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"model.recurrence=onednn: {why}")
    size = lib.rnnlab_lstm_workspace_bytes(t, b, i, h)
    if size < 0:
        raise RuntimeError(f"oneDNN has no LSTM for T={t}, B={b}, I={i}, H={h}")
    return size


def _forward(x, w_xh, w_hh, b):
    t, batch, i = x.shape
    h = w_hh.shape[0]
    outputs = (jax.ShapeDtypeStruct((t, batch, h), jnp.float32),
               jax.ShapeDtypeStruct((_workspace_bytes(t, batch, i, h),), jnp.uint8))
    return jax.ffi.ffi_call(FORWARD, outputs, vmap_method="sequential")(x, w_xh, w_hh, b)


@jax.custom_vjp
def lstm(x: jax.Array, w_xh: jax.Array, w_hh: jax.Array, b: jax.Array) -> jax.Array:
    """hs: f32[T, B, H] of an LSTM (rnnlab.cells.lstm's equations) from a zero state, for x: f32[T, B, I],
    W_xh: f32[I, 4H], W_hh: f32[H, 4H], b: f32[4H], computed and differentiated by oneDNN."""
    return _forward(x, w_xh, w_hh, b)[0]


def _lstm_fwd(x, w_xh, w_hh, b):
    hs, workspace = _forward(x, w_xh, w_hh, b)
    return hs, (x, w_xh, w_hh, b, hs, workspace)


def _lstm_bwd(saved, d_hs):
    x, w_xh, w_hh, b = saved[:4]
    outputs = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, w_xh, w_hh, b))
    return tuple(jax.ffi.ffi_call(BACKWARD, outputs, vmap_method="sequential")(*saved, d_hs))


lstm.defvjp(_lstm_fwd, _lstm_bwd)


def lstm_layer(x: jax.Array, w_xh: jax.Array, b: jax.Array, params: dict[str, jax.Array]) -> jax.Array:
    """`rnnlab.cells.LSTM`'s layer: x [T, B, I], its W_xh, b and recurrent parameters -> hs [T, B, H]."""
    return lstm(x, w_xh, params["W_hh"], b)


# A cell's `onednn_kernel` -> its layer (x, W_xh, b, the cell's parameters) -> hs.
KERNELS = {"lstm": lstm_layer}
