// One LSTM layer, forward and backward, as oneDNN's fused RNN primitive (the one torch's CPU
// nn.LSTM runs), exposed to XLA as FFI custom calls. Built on first use by rnnlab/onednn.py.
//
// Layouts are rnnlab's own, so no array is copied on the way in or out:
//   x [T, B, I] (oneDNN tnc), W_xh [I, 4H] (ldigo with L = D = 1), W_hh [H, 4H] (ldigo),
//   b [4H] (ldgo), hs [T, B, H] (tnc); gate blocks i, f, g, o in both libraries.
// The initial state is zero. The forward's workspace (the gates and states the backward
// reads) is an output of the forward call and an input of the backward call.

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <new>
#include <pthread.h>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

namespace {

struct Shape {
  int64_t t, b, i, h;
  bool operator<(const Shape& o) const { return std::tie(t, b, i, h) < std::tie(o.t, o.b, o.i, o.h); }
};

// Every oneDNN call runs on this one thread. OpenMP makes a thread team per calling thread, and XLA calls
// from several of its own; once a process holds more OpenMP threads than cores, GNU OpenMP stops spinning at
// its barriers, which made every time step pay a sleep and a wake-up (and slowed torch's OpenMP in the same
// process, where the two share libgomp).
class OneThread {
 public:
  OneThread() { std::thread([this] { Loop(); }).detach(); }  // lives as long as the process

  // Around a fork: no job runs while the caller holds the turn (so the child inherits no lock a job took).
  void Hold() { turn_.lock(); }
  void Release() { turn_.unlock(); }

  // Runs `job` on the thread and waits for it; calls from several threads take turns.
  void Run(const std::function<void()>& job) {
    std::lock_guard<std::mutex> turn(turn_);
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = &job;
    done_ = false;
    wake_.notify_all();
    wake_.wait(lock, [this] { return done_; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return job_ != nullptr; });
      const std::function<void()>* job = job_;
      lock.unlock();
      (*job)();
      lock.lock();
      job_ = nullptr;
      done_ = true;
      wake_.notify_all();
    }
  }

  std::mutex turn_, mutex_;
  std::condition_variable wake_;
  const std::function<void()>* job_ = nullptr;
  bool done_ = true;
};

OneThread* the_thread = nullptr;  // never destroyed: the detached thread may outlive static destructors
std::mutex the_thread_mutex;

OneThread& onednn_thread() {
  static bool registered = [] {  // a forked child has no copy of the thread: it starts its own
    pthread_atfork(
        [] {  // before the fork: wait out a job in flight
          the_thread_mutex.lock();
          if (the_thread != nullptr) the_thread->Hold();
        },
        [] {  // the parent goes on
          if (the_thread != nullptr) the_thread->Release();
          the_thread_mutex.unlock();
        },
        [] {  // the child: the old object's locks stay held by no thread there; start afresh
          the_thread = nullptr;
          new (&the_thread_mutex) std::mutex();
        });
    return true;
  }();
  (void)registered;
  std::lock_guard<std::mutex> lock(the_thread_mutex);
  if (the_thread == nullptr) the_thread = new OneThread();
  return *the_thread;
}

// `body` on the oneDNN thread; its oneDNN error as an FFI error.
ffi::Error on_onednn_thread(const char* what, const std::function<void()>& body) {
  std::string error;
  try {
    onednn_thread().Run([&] {
      try {
        body();
      } catch (const std::exception& e) {  // dnnl::error, std::bad_alloc, ...: an error for XLA, not a crash
        error = e.what();
      } catch (...) {
        error = "unknown error";
      }
    });
  } catch (const std::exception& e) {  // the thread could not be started
    error = e.what();
  }
  if (!error.empty()) return ffi::Error::Internal(std::string("rnnlab onednn lstm ") + what + ": " + error);
  return ffi::Error::Success();
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The primitives of one shape: made once (oneDNN generates their kernels), then reused.
struct Lstm {
  dnnl::lstm_forward::primitive_desc fwd_pd;
  dnnl::lstm_backward::primitive_desc bwd_pd;
  dnnl::lstm_forward fwd;
  dnnl::lstm_backward bwd;
  memory::desc x_md, wx_md, wh_md, b_md, hs_md;  // rnnlab's layouts
  memory::desc state_md;  // the initial h and c, [1, 1, B, H] each: zeros

  explicit Lstm(const Shape& s) {
    auto& engine = cpu_engine();
    x_md = memory::desc({s.t, s.b, s.i}, dt::f32, tag::tnc);
    hs_md = memory::desc({s.t, s.b, s.h}, dt::f32, tag::tnc);
    wx_md = memory::desc({1, 1, s.i, 4, s.h}, dt::f32, tag::ldigo);
    wh_md = memory::desc({1, 1, s.h, 4, s.h}, dt::f32, tag::ldigo);
    b_md = memory::desc({1, 1, 4, s.h}, dt::f32, tag::ldgo);
    auto wx_any = memory::desc({1, 1, s.i, 4, s.h}, dt::f32, tag::any);
    auto wh_any = memory::desc({1, 1, s.h, 4, s.h}, dt::f32, tag::any);
    state_md = memory::desc({1, 1, s.b, s.h}, dt::f32, tag::ldnc);
    memory::desc none;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // concurrent calls (one per device) each bring their own
    fwd_pd = dnnl::lstm_forward::primitive_desc(
        engine, dnnl::prop_kind::forward_training, dnnl::rnn_direction::unidirectional_left2right, x_md, state_md, state_md,
        wx_any, wh_any, b_md, hs_md, none, none, attr);
    bwd_pd = dnnl::lstm_backward::primitive_desc(
        engine, dnnl::prop_kind::backward, dnnl::rnn_direction::unidirectional_left2right, x_md, state_md, state_md,
        wx_any, wh_any, b_md, hs_md, none, none, x_md, state_md, state_md, wx_md, wh_md, b_md, hs_md, none, none,
        fwd_pd, attr);
    fwd = dnnl::lstm_forward(fwd_pd);
    bwd = dnnl::lstm_backward(bwd_pd);
  }
};

Lstm& lstm_for(const Shape& s) {
  static std::mutex mutex;
  static std::map<Shape, std::unique_ptr<Lstm>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& entry = cache[s];
  if (!entry) entry = std::make_unique<Lstm>(s);
  return *entry;
}

// `user` in rnnlab's layout, or a copy of it reordered into `wanted` (held in `storage`).
memory as_layout(const memory& user, const memory::desc& wanted, dnnl::stream& stream, std::vector<uint8_t>& storage) {
  if (user.get_desc() == wanted) return user;
  storage.resize(wanted.get_size());
  memory out(wanted, cpu_engine(), storage.data());
  dnnl::reorder(user, out).execute(stream, const_cast<memory&>(user), out);
  return out;
}

memory wrap(const memory::desc& md, const void* data) {
  return memory(md, cpu_engine(), const_cast<void*>(data));
}

// The layer's shape from x [T, B, I] and W_hh [H, 4H], once every argument's shape agrees with it.
ffi::Error shape_of(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w_xh, ffi::Buffer<ffi::F32>& w_hh,
                    ffi::Buffer<ffi::F32>& b, Shape* s) {
  auto xd = x.dimensions();
  auto wx = w_xh.dimensions();
  auto wh = w_hh.dimensions();
  if (xd.size() != 3 || wx.size() != 2 || wh.size() != 2)
    return ffi::Error::InvalidArgument("rnnlab onednn lstm: expected x [T, B, I], W_xh [I, 4H], W_hh [H, 4H]");
  *s = Shape{xd[0], xd[1], xd[2], wh[0]};
  if (wx[0] != s->i || wx[1] != 4 * s->h || wh[1] != 4 * s->h || b.element_count() != static_cast<size_t>(4 * s->h))
    return ffi::Error::InvalidArgument("rnnlab onednn lstm: expected W_xh [I, 4H], W_hh [H, 4H], b [4H]");
  return ffi::Error::Success();
}

bool is_sequence(ffi::Buffer<ffi::F32>& a, const Shape& s) {  // [T, B, H]
  auto d = a.dimensions();
  return d.size() == 3 && d[0] == s.t && d[1] == s.b && d[2] == s.h;
}

ffi::Error Forward(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w_xh, ffi::Buffer<ffi::F32> w_hh,
                   ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> hs, ffi::ResultBuffer<ffi::U8> workspace) {
  Shape s;
  if (auto e = shape_of(x, w_xh, w_hh, b, &s); e.failure()) return e;
  return on_onednn_thread("forward", [&] {
    Lstm& lstm = lstm_for(s);
    if (workspace->size_bytes() < lstm.fwd_pd.workspace_desc().get_size())
      throw dnnl::error(dnnl_invalid_arguments, "the workspace buffer is smaller than oneDNN's workspace");
    dnnl::stream stream(cpu_engine());
    thread_local std::vector<uint8_t> wx_store, wh_store, scratch;
    memory wx = as_layout(wrap(lstm.wx_md, w_xh.typed_data()), lstm.fwd_pd.weights_layer_desc(), stream, wx_store);
    memory wh = as_layout(wrap(lstm.wh_md, w_hh.typed_data()), lstm.fwd_pd.weights_iter_desc(), stream, wh_store);
    scratch.resize(lstm.fwd_pd.scratchpad_desc().get_size());
    thread_local std::vector<float> zeros;
    zeros.assign(s.b * s.h, 0.0f);
    lstm.fwd.execute(stream, {
        {DNNL_ARG_SRC_LAYER, wrap(lstm.x_md, x.typed_data())},
        {DNNL_ARG_SRC_ITER, wrap(lstm.state_md, zeros.data())},
        {DNNL_ARG_SRC_ITER_C, wrap(lstm.state_md, zeros.data())},
        {DNNL_ARG_WEIGHTS_LAYER, wx},
        {DNNL_ARG_WEIGHTS_ITER, wh},
        {DNNL_ARG_BIAS, wrap(lstm.b_md, b.typed_data())},
        {DNNL_ARG_DST_LAYER, wrap(lstm.hs_md, hs->typed_data())},
        {DNNL_ARG_WORKSPACE, wrap(lstm.fwd_pd.workspace_desc(), workspace->typed_data())},
        {DNNL_ARG_SCRATCHPAD, wrap(lstm.fwd_pd.scratchpad_desc(), scratch.data())},
    });
    stream.wait();
  });
}

ffi::Error Backward(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w_xh, ffi::Buffer<ffi::F32> w_hh,
                    ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> hs, ffi::Buffer<ffi::U8> workspace,
                    ffi::Buffer<ffi::F32> d_hs, ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw_xh,
                    ffi::ResultBuffer<ffi::F32> dw_hh, ffi::ResultBuffer<ffi::F32> db) {
  Shape s;
  if (auto e = shape_of(x, w_xh, w_hh, b, &s); e.failure()) return e;
  if (!is_sequence(hs, s) || !is_sequence(d_hs, s))
    return ffi::Error::InvalidArgument("rnnlab onednn lstm backward: expected hs and its gradient [T, B, H]");
  return on_onednn_thread("backward", [&] {
    Lstm& lstm = lstm_for(s);
    if (workspace.size_bytes() < lstm.bwd_pd.workspace_desc().get_size())
      throw dnnl::error(dnnl_invalid_arguments, "the workspace buffer is smaller than oneDNN's workspace");
    dnnl::stream stream(cpu_engine());
    thread_local std::vector<uint8_t> wx_store, wh_store, scratch;
    memory wx = as_layout(wrap(lstm.wx_md, w_xh.typed_data()), lstm.bwd_pd.weights_layer_desc(), stream, wx_store);
    memory wh = as_layout(wrap(lstm.wh_md, w_hh.typed_data()), lstm.bwd_pd.weights_iter_desc(), stream, wh_store);
    scratch.resize(lstm.bwd_pd.scratchpad_desc().get_size());
    // oneDNN adds the weight gradients into these buffers: start them at zero.
    std::memset(dw_xh->typed_data(), 0, dw_xh->size_bytes());
    std::memset(dw_hh->typed_data(), 0, dw_hh->size_bytes());
    std::memset(db->typed_data(), 0, db->size_bytes());
    thread_local std::vector<float> zeros, d_h0, d_c0;  // the initial state, and its gradients (not returned)
    zeros.assign(s.b * s.h, 0.0f);
    d_h0.resize(s.b * s.h);
    d_c0.resize(s.b * s.h);
    lstm.bwd.execute(stream, {
        {DNNL_ARG_SRC_LAYER, wrap(lstm.x_md, x.typed_data())},
        {DNNL_ARG_SRC_ITER, wrap(lstm.state_md, zeros.data())},
        {DNNL_ARG_SRC_ITER_C, wrap(lstm.state_md, zeros.data())},
        {DNNL_ARG_DIFF_SRC_ITER, wrap(lstm.state_md, d_h0.data())},
        {DNNL_ARG_DIFF_SRC_ITER_C, wrap(lstm.state_md, d_c0.data())},
        {DNNL_ARG_WEIGHTS_LAYER, wx},
        {DNNL_ARG_WEIGHTS_ITER, wh},
        {DNNL_ARG_BIAS, wrap(lstm.b_md, b.typed_data())},
        {DNNL_ARG_DST_LAYER, wrap(lstm.hs_md, hs.typed_data())},
        {DNNL_ARG_WORKSPACE, wrap(lstm.bwd_pd.workspace_desc(), workspace.typed_data())},
        {DNNL_ARG_DIFF_DST_LAYER, wrap(lstm.hs_md, d_hs.typed_data())},
        {DNNL_ARG_DIFF_SRC_LAYER, wrap(lstm.x_md, dx->typed_data())},
        {DNNL_ARG_DIFF_WEIGHTS_LAYER, wrap(lstm.wx_md, dw_xh->typed_data())},
        {DNNL_ARG_DIFF_WEIGHTS_ITER, wrap(lstm.wh_md, dw_hh->typed_data())},
        {DNNL_ARG_DIFF_BIAS, wrap(lstm.b_md, db->typed_data())},
        {DNNL_ARG_SCRATCHPAD, wrap(lstm.bwd_pd.scratchpad_desc(), scratch.data())},
    });
    stream.wait();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabLstmForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnlabLstmBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The forward's workspace size in bytes for this shape (asked when the step is traced), or -1.
extern "C" int64_t rnnlab_lstm_workspace_bytes(int64_t t, int64_t b, int64_t i, int64_t h) {
  int64_t size = -1;
  on_onednn_thread("workspace", [&] { size = lstm_for(Shape{t, b, i, h}).fwd_pd.workspace_desc().get_size(); });
  return size;
}
