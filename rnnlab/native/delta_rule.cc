// The (gated) delta rule and DeltaProduct's n Householder steps a token, forward and backward, as one fused
// loop per batch row and head, exposed to XLA as FFI custom calls. Built on first use by rnnlab/fused.py.
//
// Per row and head, S: [dk, dv] float32, in rnnlab.cells.delta_rule_forms's row convention; token t has
// q_t [dk], a gate a_t = exp(log_alpha_t), and n sub-steps j of k_{t,j} [dk], v_{t,j} [dv], beta_{t,j}:
//
//     S = a_t S                                    (before the token's first sub-step)
//     e = v_{t,j} - k_{t,j} S;  S += beta_{t,j} k_{t,j}^T e        j = 1..n
//     o_t = q_t S                                  (after its last)
//
// XLA's scan keeps S in memory and pays a fixed cost per operation per step; here S stays in cache for the
// whole sequence and each step is two passes over it. The forward writes S at the start of every block of
// `block` tokens (`checkpoints`); the backward recomputes a block's states from its checkpoint into a buffer
// of its own, then runs the block's steps in reverse. Rows and heads are independent: they are shared out over
// XLA's intra-op thread pool, the calling thread working through them too (it never waits on a task that has not
// started, so a busy pool cannot deadlock it).
//
// Layouts (time-major, as the JAX forms): q [T, B, h, dk], k [T, B, h, n, dk], v [T, B, h, n, dv],
// beta [T, B, h, n], log_alpha [T, B, h], s0 / s_last [B, h, dk, dv], o [T, B, h, dv],
// checkpoints [ceil(T / block), B, h, dk, dv].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using rnnlab::ParallelFor;

namespace {

struct Dims {
  int64_t t, b, h, n, dk, dv, block;
  int64_t items() const { return b * h; }
  int64_t blocks() const { return (t + block - 1) / block; }
  int64_t state() const { return dk * dv; }
};

// Strides (in floats) of one time step of each input, and the offset of an item (row, head) in it.
struct Index {
  const Dims& d;
  int64_t q(int64_t t, int64_t item) const { return (t * d.items() + item) * d.dk; }
  int64_t k(int64_t t, int64_t item, int64_t j) const { return ((t * d.items() + item) * d.n + j) * d.dk; }
  int64_t v(int64_t t, int64_t item, int64_t j) const { return ((t * d.items() + item) * d.n + j) * d.dv; }
  int64_t beta(int64_t t, int64_t item, int64_t j) const { return (t * d.items() + item) * d.n + j; }
  int64_t gate(int64_t t, int64_t item) const { return t * d.items() + item; }
  int64_t o(int64_t t, int64_t item) const { return (t * d.items() + item) * d.dv; }
  int64_t s(int64_t block, int64_t item) const { return (block * d.items() + item) * d.state(); }
};

// One delta-rule sub-step on S in place: S = a S (a != 1 only at a token's first), e = v - k S, S += beta k^T e.
// `e` receives e (the backward needs it).
inline void DeltaStep(float* __restrict s, const float* __restrict k, const float* __restrict v, float beta, float a,
                      float* __restrict e, int64_t dk, int64_t dv) {
  for (int64_t c = 0; c < dv; ++c) e[c] = v[c];
  for (int64_t r = 0; r < dk; ++r) {
    float* row = s + r * dv;
    const float kr = k[r];
    if (a != 1.0f)
      for (int64_t c = 0; c < dv; ++c) row[c] *= a;
    for (int64_t c = 0; c < dv; ++c) e[c] -= kr * row[c];
  }
  for (int64_t r = 0; r < dk; ++r) {
    float* row = s + r * dv;
    const float bk = beta * k[r];
    for (int64_t c = 0; c < dv; ++c) row[c] += bk * e[c];
  }
}

// o = q S.
inline void Read(const float* __restrict s, const float* __restrict q, float* __restrict o, int64_t dk, int64_t dv) {
  for (int64_t c = 0; c < dv; ++c) o[c] = 0.0f;
  for (int64_t r = 0; r < dk; ++r) {
    const float* row = s + r * dv;
    const float qr = q[r];
    for (int64_t c = 0; c < dv; ++c) o[c] += qr * row[c];
  }
}

void ForwardItem(const Dims& d, int64_t item, const float* q, const float* k, const float* v, const float* beta,
                 const float* log_alpha, const float* s0, float* o, float* s_last, float* checkpoints) {
  const Index at{d};
  std::vector<float> state(s0 + item * d.state(), s0 + (item + 1) * d.state());
  std::vector<float> e(d.dv);
  float* s = state.data();
  for (int64_t t = 0; t < d.t; ++t) {
    if (t % d.block == 0) std::memcpy(checkpoints + at.s(t / d.block, item), s, d.state() * sizeof(float));
    const float a = std::exp(log_alpha[at.gate(t, item)]);
    for (int64_t j = 0; j < d.n; ++j)
      DeltaStep(s, k + at.k(t, item, j), v + at.v(t, item, j), beta[at.beta(t, item, j)], j == 0 ? a : 1.0f,
                e.data(), d.dk, d.dv);
    Read(s, q + at.q(t, item), o + at.o(t, item), d.dk, d.dv);
  }
  std::memcpy(s_last + item * d.state(), s, d.state() * sizeof(float));
}

void BackwardItem(const Dims& d, int64_t item, const float* q, const float* k, const float* v, const float* beta,
                  const float* log_alpha, const float* checkpoints, const float* d_o, const float* ds_last, float* dq,
                  float* dk_out, float* dv_out, float* dbeta, float* dlog_alpha, float* ds0) {
  const Index at{d};
  const int64_t size = d.state(), dk = d.dk, dv = d.dv;
  // states[(t - t0) * (n + 1) + j]: S before sub-step j of token t (j = 0: before the gate); j = n: after the token.
  std::vector<float> states(d.block * (d.n + 1) * size);
  std::vector<float> grad(ds_last + item * size, ds_last + (item + 1) * size);  // dL/dS after the current token
  std::vector<float> e(dv), du(dv), gated(size);
  float* g = grad.data();
  for (int64_t blk = d.blocks() - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * d.block, t1 = std::min(d.t, t0 + d.block);
    std::memcpy(states.data(), checkpoints + at.s(blk, item), size * sizeof(float));
    for (int64_t t = t0; t < t1; ++t) {
      float* before = states.data() + (t - t0) * (d.n + 1) * size;
      const float a = std::exp(log_alpha[at.gate(t, item)]);
      for (int64_t j = 0; j < d.n; ++j) {
        std::memcpy(before + (j + 1) * size, before + j * size, size * sizeof(float));
        DeltaStep(before + (j + 1) * size, k + at.k(t, item, j), v + at.v(t, item, j), beta[at.beta(t, item, j)],
                  j == 0 ? a : 1.0f, e.data(), dk, dv);
      }
      if (t + 1 < t1) std::memcpy(before + (d.n + 1) * size, before + d.n * size, size * sizeof(float));
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* before = states.data() + (t - t0) * (d.n + 1) * size;
      const float* after = before + d.n * size;
      const float* qt = q + at.q(t, item);
      const float* dot = d_o + at.o(t, item);
      float* dqt = dq + at.q(t, item);
      // o = q S_t: dq = S_t do, dS_t += q^T do.
      for (int64_t r = 0; r < dk; ++r) {
        const float* row = after + r * dv;
        float* grow = g + r * dv;
        float acc = 0.0f;
        for (int64_t c = 0; c < dv; ++c) {
          acc += row[c] * dot[c];
          grow[c] += qt[r] * dot[c];
        }
        dqt[r] = acc;
      }
      const float a = std::exp(log_alpha[at.gate(t, item)]);
      for (int64_t j = d.n - 1; j >= 0; --j) {
        // S_out = S_in + k^T u, u = beta e, e = v - k S_in; S_in = a S_before at j = 0, else S_before.
        const float* s_in = before + j * size;
        if (j == 0 && a != 1.0f) {
          for (int64_t x = 0; x < size; ++x) gated[x] = a * s_in[x];
          s_in = gated.data();
        }
        const float* kj = k + at.k(t, item, j);
        const float* vj = v + at.v(t, item, j);
        const float b = beta[at.beta(t, item, j)];
        for (int64_t c = 0; c < dv; ++c) {
          e[c] = vj[c];
          du[c] = 0.0f;
        }
        for (int64_t r = 0; r < dk; ++r) {
          const float* row = s_in + r * dv;
          const float* grow = g + r * dv;
          const float kr = kj[r];
          for (int64_t c = 0; c < dv; ++c) {
            e[c] -= kr * row[c];
            du[c] += kr * grow[c];
          }
        }
        float db = 0.0f;
        for (int64_t c = 0; c < dv; ++c) db += du[c] * e[c];
        dbeta[at.beta(t, item, j)] = db;
        float* dvj = dv_out + at.v(t, item, j);
        for (int64_t c = 0; c < dv; ++c) dvj[c] = b * du[c];  // de = beta du; dv = de
        float* dkj = dk_out + at.k(t, item, j);
        for (int64_t r = 0; r < dk; ++r) {
          const float* row = s_in + r * dv;
          float* grow = g + r * dv;
          const float kr = kj[r];
          float acc = 0.0f;
          for (int64_t c = 0; c < dv; ++c) {
            acc += b * (grow[c] * e[c] - row[c] * du[c]);  // dS_out u - S_in de
            grow[c] -= kr * b * du[c];                     // dS_in = dS_out - k^T de
          }
          dkj[r] = acc;
        }
      }
      // S_in = a S_before: d log_alpha = a <dS_in, S_before>, dS_before = a dS_in.
      float dot_s = 0.0f;
      for (int64_t x = 0; x < size; ++x) dot_s += g[x] * before[x];
      dlog_alpha[at.gate(t, item)] = a * dot_s;
      if (a != 1.0f)
        for (int64_t x = 0; x < size; ++x) g[x] *= a;
    }
  }
  std::memcpy(ds0 + item * size, g, size * sizeof(float));
}

Dims DimsOf(ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, int64_t block) {
  auto kd = k.dimensions(), vd = v.dimensions();
  return Dims{kd[0], kd[1], kd[2], kd[3], kd[4], vd[4], std::max<int64_t>(1, block)};
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> log_alpha, ffi::Buffer<ffi::F32> s0,
                   ffi::Result<ffi::Buffer<ffi::F32>> o, ffi::Result<ffi::Buffer<ffi::F32>> s_last,
                   ffi::Result<ffi::Buffer<ffi::F32>> checkpoints, int64_t block) {
  const Dims d = DimsOf(k, v, block);
  ParallelFor(&pool, d.items(), [&](int64_t item) {
    ForwardItem(d, item, q.typed_data(), k.typed_data(), v.typed_data(), beta.typed_data(), log_alpha.typed_data(),
                s0.typed_data(), o->typed_data(), s_last->typed_data(), checkpoints->typed_data());
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> log_alpha, ffi::Buffer<ffi::F32> checkpoints,
                    ffi::Buffer<ffi::F32> d_o, ffi::Buffer<ffi::F32> ds_last, ffi::Result<ffi::Buffer<ffi::F32>> dq,
                    ffi::Result<ffi::Buffer<ffi::F32>> dk, ffi::Result<ffi::Buffer<ffi::F32>> dv,
                    ffi::Result<ffi::Buffer<ffi::F32>> dbeta, ffi::Result<ffi::Buffer<ffi::F32>> dlog_alpha,
                    ffi::Result<ffi::Buffer<ffi::F32>> ds0, int64_t block) {
  const Dims d = DimsOf(k, v, block);
  ParallelFor(&pool, d.items(), [&](int64_t item) {
    BackwardItem(d, item, q.typed_data(), k.typed_data(), v.typed_data(), beta.typed_data(), log_alpha.typed_data(),
                 checkpoints.typed_data(), d_o.typed_data(), ds_last.typed_data(), dq->typed_data(),
                 dk->typed_data(), dv->typed_data(), dbeta->typed_data(), dlog_alpha->typed_data(),
                 ds0->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabDeltaRuleForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // log_alpha
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s0
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // s_last
                                  .Ret<ffi::Buffer<ffi::F32>>()  // checkpoints
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabDeltaRuleBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // log_alpha
                                  .Arg<ffi::Buffer<ffi::F32>>()  // checkpoints
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ds_last
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dbeta
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dlog_alpha
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ds0
                                  .Attr<int64_t>("block"));
