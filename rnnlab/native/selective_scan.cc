// Mamba's selective scan, forward and backward, as one fused loop per batch row, exposed to XLA as FFI custom calls.
// Built on first use by rnnlab/fused.py.
//
// Per row, h: [D, N] float32 (rnnlab.cells.mamba's `selective_ssm`); step t has Delta_t, x_t [D] and B_t, C_t [N]:
//
//     h_t = dec(Delta_t A) * h_{t-1} + (Delta_t x_t) B_t,    y_t = h_t C_t   (per channel: sum over N)
//
// with dec(z) = exp(z), or with `negative` Grazzi et al.'s 2 exp(z) - 1. The forward writes h at the start of every
// block of `block` steps; the backward recomputes a block's states from its checkpoint into a buffer of its own and
// runs the block in reverse. dA is summed per row (the caller sums the rows). Rows are shared out over XLA's thread
// pool (parallel_for.h).
//
// Layouts (time-major): delta, x [T, B, D], b, c [T, B, N], a [D, N], h0 / h_last [B, D, N], y [T, B, D],
// checkpoints [ceil(T / block), B, N, D] (h^T, opaque to the caller); the backward's da: [B, D, N] (one per row).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using rnnlab::ParallelFor;

namespace {

struct Dims {
  int64_t t, b, d, n, block;
  bool negative;
  int64_t blocks() const { return (t + block - 1) / block; }
  int64_t state() const { return d * n; }
  int64_t channel(int64_t t_, int64_t row) const { return (t_ * b + row) * d; }
  int64_t key(int64_t t_, int64_t row) const { return (t_ * b + row) * n; }
  int64_t s(int64_t blk, int64_t row) const { return (blk * b + row) * state(); }
};

// Inside the kernel a row's state is kept [N, D] (h^T), so that every loop runs over the D channels: contiguous,
// long enough to vectorise (N is 16 in Mamba), the exp of each element included.

// h^T = dec(Delta A)^T h^T + B (Delta x)^T, one pass over [N, D]; y (if given) = h C per channel. aT: A^T [N, D].
// `exps` (if given) receives exp(Delta A)^T, which the backward reuses.
inline void Step(float* __restrict h, const float* __restrict delta, const float* __restrict x,
                 const float* __restrict bt, const float* __restrict ct, const float* __restrict aT,
                 float* __restrict y, float* __restrict exps, const Dims& d) {
  if (y)
    for (int64_t ch = 0; ch < d.d; ++ch) y[ch] = 0.0f;
  for (int64_t i = 0; i < d.n; ++i) {
    float* hi = h + i * d.d;
    const float* ai = aT + i * d.d;
    const float bi = bt[i], ci = ct[i];
    for (int64_t ch = 0; ch < d.d; ++ch) {
      const float e = std::exp(delta[ch] * ai[ch]);
      if (exps) exps[i * d.d + ch] = e;
      hi[ch] = (d.negative ? 2.0f * e - 1.0f : e) * hi[ch] + delta[ch] * x[ch] * bi;
    }
    if (y)
      for (int64_t ch = 0; ch < d.d; ++ch) y[ch] += ci * hi[ch];
  }
}

// [D, N] -> [N, D] and back.
void Transpose(const float* src, float* dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

void ForwardItem(const Dims& d, int64_t row, const float* delta, const float* x, const float* b, const float* c,
                 const float* aT, const float* h0, float* y, float* h_last, float* checkpoints) {
  std::vector<float> h(d.state());
  Transpose(h0 + row * d.state(), h.data(), d.d, d.n);
  for (int64_t t = 0; t < d.t; ++t) {
    if (t % d.block == 0) std::memcpy(checkpoints + d.s(t / d.block, row), h.data(), d.state() * sizeof(float));
    Step(h.data(), delta + d.channel(t, row), x + d.channel(t, row), b + d.key(t, row), c + d.key(t, row), aT,
         y + d.channel(t, row), nullptr, d);
  }
  Transpose(h.data(), h_last + row * d.state(), d.n, d.d);
}

struct Grads {
  float *d_delta, *dx, *db, *dc, *da, *dh0;
};

void BackwardItem(const Dims& d, int64_t row, const float* delta, const float* x, const float* b, const float* c,
                  const float* aT, const float* checkpoints, const float* dy, const float* dh_last, const Grads& out) {
  const int64_t size = d.state(), dd = d.d;
  std::vector<float> states((d.block + 1) * size), exps(d.block * size);  // h^T before step t0 + i; its exp(Delta A)^T
  std::vector<float> grad(size), da(size, 0.0f), gb(dd), sa(dd);  // dL/dh_t^T; dL/dA^T of this row
  Transpose(dh_last + row * size, grad.data(), d.d, d.n);
  float* g = grad.data();
  for (int64_t blk = d.blocks() - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * d.block, t1 = std::min(d.t, t0 + d.block);
    std::memcpy(states.data(), checkpoints + d.s(blk, row), size * sizeof(float));
    for (int64_t t = t0; t < t1; ++t) {
      float* next = states.data() + (t - t0 + 1) * size;
      std::memcpy(next, next - size, size * sizeof(float));
      Step(next, delta + d.channel(t, row), x + d.channel(t, row), b + d.key(t, row), c + d.key(t, row), aT, nullptr,
           exps.data() + (t - t0) * size, d);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* before = states.data() + (t - t0) * size;
      const float* after = before + size;
      const float *dt = delta + d.channel(t, row), *xt = x + d.channel(t, row), *dyt = dy + d.channel(t, row);
      const float *bt = b + d.key(t, row), *ct = c + d.key(t, row);
      for (int64_t ch = 0; ch < dd; ++ch) gb[ch] = sa[ch] = 0.0f;
      for (int64_t i = 0; i < d.n; ++i) {
        const float *ai = aT + i * dd, *hp = before + i * dd, *ha = after + i * dd;
        const float* ei = exps.data() + (t - t0) * size + i * dd;
        float *gi = g + i * dd, *dai = da.data() + i * dd;
        const float bi = bt[i], ci = ct[i];
        float acc_b = 0.0f, acc_c = 0.0f;
        for (int64_t ch = 0; ch < dd; ++ch) {
          const float gc = gi[ch] + dyt[ch] * ci;  // dL/dh_t, with y_t = h_t C_t's part
          const float e = ei[ch];
          const float s = gc * hp[ch] * (d.negative ? 2.0f * e : e);  // dL/d(Delta A)
          gb[ch] += gc * bi;
          sa[ch] += s * ai[ch];
          acc_b += gc * dt[ch] * xt[ch];
          acc_c += dyt[ch] * ha[ch];
          dai[ch] += s * dt[ch];
          gi[ch] = gc * (d.negative ? 2.0f * e - 1.0f : e);
        }
        out.db[d.key(t, row) + i] = acc_b;
        out.dc[d.key(t, row) + i] = acc_c;
      }
      float *ddt = out.d_delta + d.channel(t, row), *dxt = out.dx + d.channel(t, row);
      for (int64_t ch = 0; ch < dd; ++ch) {
        ddt[ch] = sa[ch] + xt[ch] * gb[ch];
        dxt[ch] = dt[ch] * gb[ch];
      }
    }
  }
  Transpose(g, out.dh0 + row * size, d.n, d.d);
  Transpose(da.data(), out.da + row * size, d.n, d.d);
}

using Buf = ffi::Buffer<ffi::F32>;
using Out = ffi::Result<ffi::Buffer<ffi::F32>>;

Dims DimsOf(Buf& delta, Buf& b, int64_t block, bool negative) {
  auto dd = delta.dimensions();
  return Dims{dd[0], dd[1], dd[2], b.dimensions()[2], std::max<int64_t>(1, block), negative};
}

ffi::Error Forward(ffi::ThreadPool pool, Buf delta, Buf x, Buf b, Buf c, Buf a, Buf h0, Out y, Out h_last,
                   Out checkpoints, int64_t block, bool negative) {
  const Dims d = DimsOf(delta, b, block, negative);
  std::vector<float> aT(d.state());
  Transpose(a.typed_data(), aT.data(), d.d, d.n);
  ParallelFor(&pool, d.b, [&](int64_t row) {
    ForwardItem(d, row, delta.typed_data(), x.typed_data(), b.typed_data(), c.typed_data(), aT.data(),
                h0.typed_data(), y->typed_data(), h_last->typed_data(), checkpoints->typed_data());
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, Buf delta, Buf x, Buf b, Buf c, Buf a, Buf checkpoints, Buf dy,
                    Buf dh_last, Out d_delta, Out dx, Out db, Out dc, Out da, Out dh0, int64_t block, bool negative) {
  const Dims d = DimsOf(delta, b, block, negative);
  const Grads out{d_delta->typed_data(), dx->typed_data(), db->typed_data(), dc->typed_data(), da->typed_data(),
                  dh0->typed_data()};
  std::vector<float> aT(d.state());
  Transpose(a.typed_data(), aT.data(), d.d, d.n);
  ParallelFor(&pool, d.b, [&](int64_t row) {
    BackwardItem(d, row, delta.typed_data(), x.typed_data(), b.typed_data(), c.typed_data(), aT.data(),
                 checkpoints.typed_data(), dy.typed_data(), dh_last.typed_data(), out);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabSelectiveScanForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>()  // delta
                                  .Arg<Buf>()  // x
                                  .Arg<Buf>()  // b
                                  .Arg<Buf>()  // c
                                  .Arg<Buf>()  // a
                                  .Arg<Buf>()  // h0
                                  .Ret<Buf>()  // y
                                  .Ret<Buf>()  // h_last
                                  .Ret<Buf>()  // checkpoints
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("negative"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabSelectiveScanBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>()  // delta
                                  .Arg<Buf>()  // x
                                  .Arg<Buf>()  // b
                                  .Arg<Buf>()  // c
                                  .Arg<Buf>()  // a
                                  .Arg<Buf>()  // checkpoints
                                  .Arg<Buf>()  // dy
                                  .Arg<Buf>()  // dh_last
                                  .Ret<Buf>()  // d_delta
                                  .Ret<Buf>()  // dx
                                  .Ret<Buf>()  // db
                                  .Ret<Buf>()  // dc
                                  .Ret<Buf>()  // da (per row)
                                  .Ret<Buf>()  // dh0
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("negative"));
