// Gated linear attention's recurrence (GLA, linear attention, Mamba-2's SSD one step at a time), forward and
// backward, as one fused loop per batch row and head, exposed to XLA as FFI custom calls. Built on first use by
// rnnlab/fused.py.
//
// Per row and head, S: [dk, dv] float32 (rnnlab.cells.gla_forms's row convention); step t has q_t, k_t [dk],
// v_t [dv] and a transition a_t, one per key row [dk] (GLA) or one for the head ([1]: Mamba-2, broadcast):
//
//     S_t = diag(a_t) S_{t-1} + k_t^T v_t,      o_t = q_t S_t
//
// a_t is the transition itself (the caller computes exp(log_alpha), or Grazzi et al.'s signed 2 exp(.) - 1), so its
// gradient chains back through the caller's JAX. One pass over S a step forward. The forward writes S at the start
// of every block of `block` steps; the backward recomputes a block's states from its checkpoint into a buffer of
// its own and runs the block in reverse. Rows and heads are shared out over XLA's thread pool (parallel_for.h).
//
// Layouts (time-major): q, k [T, B, h, dk], v [T, B, h, dv], a [T, B, h, dk or 1], s0 / s_last [B, h, dk, dv],
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
  int64_t t, b, h, dk, dv, da, block;  // da: a's last axis, dk or 1
  int64_t items() const { return b * h; }
  int64_t blocks() const { return (t + block - 1) / block; }
  int64_t state() const { return dk * dv; }
  int64_t qk(int64_t t_, int64_t item) const { return (t_ * items() + item) * dk; }
  int64_t vo(int64_t t_, int64_t item) const { return (t_ * items() + item) * dv; }
  int64_t a(int64_t t_, int64_t item) const { return (t_ * items() + item) * da; }
  int64_t s(int64_t blk, int64_t item) const { return (blk * items() + item) * state(); }
};

// S = diag(a) S + k^T v in place (a: dk values, or one where da == 1).
inline void Update(float* __restrict s, const float* __restrict a, const float* __restrict k, const float* __restrict v,
                   const Dims& d) {
  for (int64_t r = 0; r < d.dk; ++r) {
    float* row = s + r * d.dv;
    const float ar = a[d.da == 1 ? 0 : r], kr = k[r];
    for (int64_t c = 0; c < d.dv; ++c) row[c] = ar * row[c] + kr * v[c];
  }
}

void ForwardItem(const Dims& d, int64_t item, const float* q, const float* k, const float* v, const float* a,
                 const float* s0, float* o, float* s_last, float* checkpoints) {
  std::vector<float> state(s0 + item * d.state(), s0 + (item + 1) * d.state());
  float* s = state.data();
  for (int64_t t = 0; t < d.t; ++t) {
    if (t % d.block == 0) std::memcpy(checkpoints + d.s(t / d.block, item), s, d.state() * sizeof(float));
    const float *at = a + d.a(t, item), *kt = k + d.qk(t, item), *vt = v + d.vo(t, item), *qt = q + d.qk(t, item);
    float* ot = o + d.vo(t, item);
    for (int64_t c = 0; c < d.dv; ++c) ot[c] = 0.0f;
    for (int64_t r = 0; r < d.dk; ++r) {  // the update and the read in one pass
      float* row = s + r * d.dv;
      const float ar = at[d.da == 1 ? 0 : r], kr = kt[r], qr = qt[r];
      for (int64_t c = 0; c < d.dv; ++c) {
        row[c] = ar * row[c] + kr * vt[c];
        ot[c] += qr * row[c];
      }
    }
  }
  std::memcpy(s_last + item * d.state(), s, d.state() * sizeof(float));
}

void BackwardItem(const Dims& d, int64_t item, const float* q, const float* k, const float* v, const float* a,
                  const float* checkpoints, const float* d_o, const float* ds_last, float* dq, float* dk_out,
                  float* dv_out, float* da_out, float* ds0) {
  const int64_t size = d.state(), dk = d.dk, dv = d.dv;
  std::vector<float> states((d.block + 1) * size);  // states[i]: S before step t0 + i
  std::vector<float> grad(ds_last + item * size, ds_last + (item + 1) * size);  // dL/dS_t
  float* g = grad.data();
  for (int64_t blk = d.blocks() - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * d.block, t1 = std::min(d.t, t0 + d.block);
    std::memcpy(states.data(), checkpoints + d.s(blk, item), size * sizeof(float));
    for (int64_t t = t0; t < t1; ++t) {
      float* next = states.data() + (t - t0 + 1) * size;
      std::memcpy(next, next - size, size * sizeof(float));
      Update(next, a + d.a(t, item), k + d.qk(t, item), v + d.vo(t, item), d);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* before = states.data() + (t - t0) * size;
      const float* after = before + size;
      const float *at = a + d.a(t, item), *kt = k + d.qk(t, item), *vt = v + d.vo(t, item), *qt = q + d.qk(t, item);
      const float* dot = d_o + d.vo(t, item);
      float *dqt = dq + d.qk(t, item), *dkt = dk_out + d.qk(t, item), *dvt = dv_out + d.vo(t, item);
      float* dat = da_out + d.a(t, item);
      for (int64_t c = 0; c < dv; ++c) dvt[c] = 0.0f;
      if (d.da == 1) dat[0] = 0.0f;
      for (int64_t r = 0; r < dk; ++r) {
        const float* row_after = after + r * dv;
        const float* row_before = before + r * dv;
        float* grow = g + r * dv;
        const float ar = at[d.da == 1 ? 0 : r], kr = kt[r], qr = qt[r];
        float acc_q = 0.0f, acc_k = 0.0f, acc_a = 0.0f;
        for (int64_t c = 0; c < dv; ++c) {
          acc_q += row_after[c] * dot[c];  // dq = S_t do
          const float gc = grow[c] + qr * dot[c];  // dS_t, with o_t = q_t S_t's part
          acc_k += gc * vt[c];  // dk = dS_t v
          dvt[c] += kr * gc;  // dv = k dS_t
          acc_a += gc * row_before[c];  // da = <dS_t, S_{t-1}> per row
          grow[c] = ar * gc;  // dS_{t-1} = diag(a) dS_t
        }
        dqt[r] = acc_q;
        dkt[r] = acc_k;
        if (d.da == 1)
          dat[0] += acc_a;
        else
          dat[r] = acc_a;
      }
    }
  }
  std::memcpy(ds0 + item * size, g, size * sizeof(float));
}

Dims DimsOf(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::F32>& a, int64_t block) {
  auto qd = q.dimensions();
  return Dims{qd[0], qd[1], qd[2], qd[3], v.dimensions()[3], a.dimensions()[3], std::max<int64_t>(1, block)};
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> s0, ffi::Result<ffi::Buffer<ffi::F32>> o,
                   ffi::Result<ffi::Buffer<ffi::F32>> s_last, ffi::Result<ffi::Buffer<ffi::F32>> checkpoints,
                   int64_t block) {
  const Dims d = DimsOf(q, v, a, block);
  ParallelFor(&pool, d.items(), [&](int64_t item) {
    ForwardItem(d, item, q.typed_data(), k.typed_data(), v.typed_data(), a.typed_data(), s0.typed_data(),
                o->typed_data(), s_last->typed_data(), checkpoints->typed_data());
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> checkpoints, ffi::Buffer<ffi::F32> d_o,
                    ffi::Buffer<ffi::F32> ds_last, ffi::Result<ffi::Buffer<ffi::F32>> dq,
                    ffi::Result<ffi::Buffer<ffi::F32>> dk, ffi::Result<ffi::Buffer<ffi::F32>> dv,
                    ffi::Result<ffi::Buffer<ffi::F32>> da, ffi::Result<ffi::Buffer<ffi::F32>> ds0, int64_t block) {
  const Dims d = DimsOf(q, v, a, block);
  ParallelFor(&pool, d.items(), [&](int64_t item) {
    BackwardItem(d, item, q.typed_data(), k.typed_data(), v.typed_data(), a.typed_data(), checkpoints.typed_data(),
                 d_o.typed_data(), ds_last.typed_data(), dq->typed_data(), dk->typed_data(), dv->typed_data(),
                 da->typed_data(), ds0->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabGatedLinearForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s0
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // s_last
                                  .Ret<ffi::Buffer<ffi::F32>>()  // checkpoints
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabGatedLinearBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // checkpoints
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ds_last
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // da
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ds0
                                  .Attr<int64_t>("block"));
