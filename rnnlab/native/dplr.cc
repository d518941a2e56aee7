// The diagonal-plus-low-rank (DPLR) delta rule, RWKV-7's recurrence, forward and backward, as one fused loop per
// batch row and head, exposed to XLA as FFI custom calls. Built on first use by rnnlab/fused.py.
//
// Per row and head, S: [dk, dv] float32 (rnnlab.cells.dplr_forms's row convention); step t has q, k, a, b, w [dk]
// (w the decays as values, exp(log_w)) and v [dv]:
//
//     u_t = a_t S_{t-1},    S_t = diag(w_t) S_{t-1} + b_t^T u_t + k_t^T v_t,    o_t = q_t S_t
//
// Two passes over S a step forward (the read u, then the update with the output). The forward writes S at the
// start of every block of `block` steps; the backward recomputes a block's states (and each step's u) from its
// checkpoint into a buffer of its own and runs the block in reverse. Rows and heads are shared out over XLA's thread
// pool (parallel_for.h).
//
// Layouts (time-major): q, k, a, b, w [T, B, h, dk], v [T, B, h, dv], s0 / s_last [B, h, dk, dv],
// o [T, B, h, dv], checkpoints [ceil(T / block), B, h, dk, dv].

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using rnnlab::ParallelFor;

namespace {

struct Dims {
  int64_t t, b, h, dk, dv, block;
  int64_t items() const { return b * h; }
  int64_t blocks() const { return (t + block - 1) / block; }
  int64_t state() const { return dk * dv; }
  int64_t key(int64_t t_, int64_t item) const { return (t_ * items() + item) * dk; }
  int64_t value(int64_t t_, int64_t item) const { return (t_ * items() + item) * dv; }
  int64_t s(int64_t blk, int64_t item) const { return (blk * items() + item) * state(); }
};

struct Step {  // one step's inputs for one item
  const float *q, *k, *a, *b, *w, *v;
};

Step At(const Dims& d, int64_t t, int64_t item, const float* q, const float* k, const float* a, const float* b,
        const float* w, const float* v) {
  const int64_t x = d.key(t, item);
  return Step{q + x, k + x, a + x, b + x, w + x, v + d.value(t, item)};
}

// u = a S; S = diag(w) S + b^T u + k^T v in place; o (if given) = q S after.
inline void Update(float* __restrict s, const Step& x, float* __restrict u, float* __restrict o, const Dims& d) {
  for (int64_t c = 0; c < d.dv; ++c) u[c] = 0.0f;
  for (int64_t r = 0; r < d.dk; ++r) {
    const float* row = s + r * d.dv;
    const float ar = x.a[r];
    for (int64_t c = 0; c < d.dv; ++c) u[c] += ar * row[c];
  }
  if (o)
    for (int64_t c = 0; c < d.dv; ++c) o[c] = 0.0f;
  for (int64_t r = 0; r < d.dk; ++r) {
    float* row = s + r * d.dv;
    const float wr = x.w[r], br = x.b[r], kr = x.k[r], qr = x.q[r];
    for (int64_t c = 0; c < d.dv; ++c) row[c] = wr * row[c] + br * u[c] + kr * x.v[c];
    if (o)
      for (int64_t c = 0; c < d.dv; ++c) o[c] += qr * row[c];
  }
}

void ForwardItem(const Dims& d, int64_t item, const float* q, const float* k, const float* a, const float* b,
                 const float* w, const float* v, const float* s0, float* o, float* s_last, float* checkpoints) {
  std::vector<float> state(s0 + item * d.state(), s0 + (item + 1) * d.state()), u(d.dv);
  for (int64_t t = 0; t < d.t; ++t) {
    if (t % d.block == 0) std::memcpy(checkpoints + d.s(t / d.block, item), state.data(), d.state() * sizeof(float));
    Update(state.data(), At(d, t, item, q, k, a, b, w, v), u.data(), o + d.value(t, item), d);
  }
  std::memcpy(s_last + item * d.state(), state.data(), d.state() * sizeof(float));
}

struct Grads {
  float *dq, *dk, *da, *db, *dw, *dv;
};

void BackwardItem(const Dims& d, int64_t item, const float* q, const float* k, const float* a, const float* b,
                  const float* w, const float* v, const float* checkpoints, const float* d_o, const float* ds_last,
                  const Grads& out, float* ds0) {
  const int64_t size = d.state(), dk = d.dk, dv = d.dv;
  std::vector<float> states((d.block + 1) * size), reads(d.block * dv);  // S before step t0 + i; u of each step
  std::vector<float> grad(ds_last + item * size, ds_last + (item + 1) * size), du(dv);  // dL/dS_t
  float* g = grad.data();
  for (int64_t blk = d.blocks() - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * d.block, t1 = std::min(d.t, t0 + d.block);
    std::memcpy(states.data(), checkpoints + d.s(blk, item), size * sizeof(float));
    for (int64_t t = t0; t < t1; ++t) {
      float* next = states.data() + (t - t0 + 1) * size;
      std::memcpy(next, next - size, size * sizeof(float));
      Update(next, At(d, t, item, q, k, a, b, w, v), reads.data() + (t - t0) * dv, nullptr, d);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* before = states.data() + (t - t0) * size;
      const float* after = before + size;
      const float* u = reads.data() + (t - t0) * dv;
      const Step x = At(d, t, item, q, k, a, b, w, v);
      const float* dot = d_o + d.value(t, item);
      const int64_t kx = d.key(t, item);
      float *dvt = out.dv + d.value(t, item);
      for (int64_t c = 0; c < dv; ++c) {
        du[c] = 0.0f;
        dvt[c] = 0.0f;
      }
      // Pass A: dS_t += q^T do; dq = S_t do; dk = dS_t v; db = dS_t u; dw = <dS_t, S_{t-1}> per row; du, dv.
      for (int64_t r = 0; r < dk; ++r) {
        const float* row_after = after + r * dv;
        const float* row_before = before + r * dv;
        float* grow = g + r * dv;
        const float qr = x.q[r], kr = x.k[r], br = x.b[r];
        float acc_q = 0.0f, acc_k = 0.0f, acc_b = 0.0f, acc_w = 0.0f;
        for (int64_t c = 0; c < dv; ++c) {
          acc_q += row_after[c] * dot[c];
          const float gc = grow[c] + qr * dot[c];
          grow[c] = gc;
          acc_k += gc * x.v[c];
          acc_b += gc * u[c];
          acc_w += gc * row_before[c];
          du[c] += br * gc;
          dvt[c] += kr * gc;
        }
        out.dq[kx + r] = acc_q;
        out.dk[kx + r] = acc_k;
        out.db[kx + r] = acc_b;
        out.dw[kx + r] = acc_w;
      }
      // Pass B: u = a S_{t-1}: da = S_{t-1} du; dS_{t-1} = diag(w) dS_t + a^T du.
      for (int64_t r = 0; r < dk; ++r) {
        const float* row_before = before + r * dv;
        float* grow = g + r * dv;
        const float wr = x.w[r], ar = x.a[r];
        float acc_a = 0.0f;
        for (int64_t c = 0; c < dv; ++c) {
          acc_a += row_before[c] * du[c];
          grow[c] = wr * grow[c] + ar * du[c];
        }
        out.da[kx + r] = acc_a;
      }
    }
  }
  std::memcpy(ds0 + item * size, g, size * sizeof(float));
}

using Buf = ffi::Buffer<ffi::F32>;
using Out = ffi::Result<ffi::Buffer<ffi::F32>>;

Dims DimsOf(Buf& q, Buf& v, int64_t block) {
  auto qd = q.dimensions();
  return Dims{qd[0], qd[1], qd[2], qd[3], v.dimensions()[3], std::max<int64_t>(1, block)};
}

ffi::Error Forward(ffi::ThreadPool pool, Buf q, Buf k, Buf a, Buf b, Buf w, Buf v, Buf s0, Out o, Out s_last,
                   Out checkpoints, int64_t block) {
  const Dims d = DimsOf(q, v, block);
  ParallelFor(&pool, d.items(), [&](int64_t item) {
    ForwardItem(d, item, q.typed_data(), k.typed_data(), a.typed_data(), b.typed_data(), w.typed_data(),
                v.typed_data(), s0.typed_data(), o->typed_data(), s_last->typed_data(), checkpoints->typed_data());
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, Buf q, Buf k, Buf a, Buf b, Buf w, Buf v, Buf checkpoints, Buf d_o,
                    Buf ds_last, Out dq, Out dk, Out da, Out db, Out dw, Out dv, Out ds0, int64_t block) {
  const Dims d = DimsOf(q, v, block);
  const Grads out{dq->typed_data(), dk->typed_data(), da->typed_data(), db->typed_data(), dw->typed_data(),
                  dv->typed_data()};
  ParallelFor(&pool, d.items(), [&](int64_t item) {
    BackwardItem(d, item, q.typed_data(), k.typed_data(), a.typed_data(), b.typed_data(), w.typed_data(),
                 v.typed_data(), checkpoints.typed_data(), d_o.typed_data(), ds_last.typed_data(), out,
                 ds0->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabDplrForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>()  // q
                                  .Arg<Buf>()  // k
                                  .Arg<Buf>()  // a
                                  .Arg<Buf>()  // b
                                  .Arg<Buf>()  // w
                                  .Arg<Buf>()  // v
                                  .Arg<Buf>()  // s0
                                  .Ret<Buf>()  // o
                                  .Ret<Buf>()  // s_last
                                  .Ret<Buf>()  // checkpoints
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabDplrBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>()  // q
                                  .Arg<Buf>()  // k
                                  .Arg<Buf>()  // a
                                  .Arg<Buf>()  // b
                                  .Arg<Buf>()  // w
                                  .Arg<Buf>()  // v
                                  .Arg<Buf>()  // checkpoints
                                  .Arg<Buf>()  // do
                                  .Arg<Buf>()  // ds_last
                                  .Ret<Buf>()  // dq
                                  .Ret<Buf>()  // dk
                                  .Ret<Buf>()  // da
                                  .Ret<Buf>()  // db
                                  .Ret<Buf>()  // dw
                                  .Ret<Buf>()  // dv
                                  .Ret<Buf>()  // ds0
                                  .Attr<int64_t>("block"));
