// Shared by specjax's CPU kernels (rowdot.cc, attention.cc): AVX2 loads of
// float32 or bfloat16 vectors as float32, the one fixed order in which eight
// lanes of partial sums are combined (the kernels' row invariance rests on
// every sum being formed the same way wherever it is computed), and the split
// of a call's work over XLA's intra-op thread pool.

#ifndef SPECJAX_KERNELS_COMMON_H_
#define SPECJAX_KERNELS_COMMON_H_

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specjax {

constexpr int64_t kLanes = 8;

inline __m256 Load(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 Load(const uint16_t* p) {  // 8 bfloat16 -> float32 (exact)
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Lanes (l0..l7) -> ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// body(t) for every t in [0, tasks), on this thread and on up to `helpers` of
// the pool's threads. Tasks are claimed from a shared counter; this thread
// then waits only for tasks already claimed, which are running. It never
// waits for a helper to start: the pool's threads may all be busy (other
// devices' calls of a kernel on a host mesh), and a helper that starts late
// finds no task left and touches nothing but the shared counters.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t tasks, int64_t helpers, F body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [=] {
    for (int64_t t; (t = state->next.fetch_add(1, std::memory_order_acq_rel)) < tasks;) {
      body(t);
      state->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  while (state->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

// f(float{}) or f(uint16_t{}) (bfloat16's bits) by a buffer's element type;
// another type -> InvalidArgument(`error`).
template <typename F>
xla::ffi::Error ByFloatType(xla::ffi::DataType type, const char* error, F f) {
  if (type == xla::ffi::DataType::F32) {
    f(float{});
  } else if (type == xla::ffi::DataType::BF16) {
    f(uint16_t{});
  } else {
    return xla::ffi::Error::InvalidArgument(error);
  }
  return xla::ffi::Error::Success();
}

}  // namespace specjax

#endif  // SPECJAX_KERNELS_COMMON_H_
