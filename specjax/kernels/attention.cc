// Decode-time attention of a few query rows over the KV cache, each row over
// its own view of the cache, on the CPU:
//
//   out[p, h] = sum_n softmax(scale * q[p, h] . K[n])_n V[n]
//
// over the view slots n = 0, 1, ... of row p that are visible, in that order;
// view slot n reads cache slot src[p, n] of batch row row[p] (a chain's view is
// the cache itself; a tree node's lays its ancestors out by depth, where
// one-token steps along its path would have put them).
//
// Why: XLA CPU runs the few-row attention einsums of the batch-invariant
// forward at a small fraction of the machine's speed (~100 us a layer for
// one query over 192 slots), and the invariant forward pays it on every row
// of a padded tile. Here the work is proportional to the visible slots.
//
// Every output element is computed the same way whatever the other rows, the
// row count, the cache's size and where the row sits: the scores' dot products
// in eight lanes of partial sums over the head dimension combined in one fixed
// order; the softmax's sum in eight lanes over the visible slots (slot n in
// lane n % 8) combined in one fixed order; the weighted values summed slot
// after slot; invisible slots are skipped, never summed as zeros. So a row's
// result is bit for bit the same in a one-token AR step and in a verify block
// (tests/test_kernels.py); threads split (row, KV head) pairs, never a sum.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace specjax {
namespace {

// Work (visible slots x query heads x head dim, summed over the units) below
// which the call runs on the calling thread alone.
constexpr int64_t kMinParallel = int64_t{1} << 17;

// float32 -> the cache's dtype -> float32 (round to nearest even, as XLA's
// convert; NaN stays NaN).
inline float Round(float v, float) { return v; }
inline float Round(float v, uint16_t) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return v;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0, lane by lane (each lane's result depends on its input
// only): x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by a degree-6 polynomial
// (relative error ~2e-7), times 2^n; exp(x) = 0 below -87.
inline __m256 Exp(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

// o (NV x 8 floats) = sum over n of w[n] V[slots[n]], slot after slot, the
// accumulators in registers (the generic loop's bits: fma from zero, in order).
template <int NV, typename C>
inline void Values(const float* w, const int64_t* slots, int64_t m, const C* vb, int64_t stride,
                   float* o) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t n = 0; n < m; ++n) {
    const __m256 wv = _mm256_set1_ps(w[n]);
    const C* vr = vb + slots[n] * stride;
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(wv, Load(vr + i * kLanes), acc[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o + i * kLanes, acc[i]);
}

// The scores of G query heads (q, G x dh) against two slots' keys k0, k1 (dh a
// multiple of 8), interleaved: each is the generic loop's sum, bit for bit.
template <int G, typename C>
inline void Scores2(const float* q, const C* k0, const C* k1, int64_t dh, float scale,
                    float* out, int64_t stride) {
  __m256 a0[G], a1[G];
  for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dh; d += kLanes) {
    const __m256 x0 = Load(k0 + d), x1 = Load(k1 + d);
    for (int g = 0; g < G; ++g) {
      const __m256 qv = Load(q + g * dh + d);
      a0[g] = _mm256_fmadd_ps(x0, qv, a0[g]);
      a1[g] = _mm256_fmadd_ps(x1, qv, a1[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    out[g * stride] = Sum(a0[g]) * scale;
    out[g * stride + 1] = Sum(a1[g]) * scale;
  }
}

struct Shape {
  int64_t rows, slots, batch, kv_heads, group, head_dim;
};

// One query row p against one KV head: its `group` query heads.
template <typename C>
void Unit(const float* q, const C* k, const C* v, const int32_t* row, const int32_t* src,
          const bool* vis, float scale, const Shape& s, int64_t p, int64_t kh, float* out,
          std::vector<int64_t>& slots, std::vector<float>& scores) {
  const int64_t dh = s.head_dim, g_n = s.group, body = dh - dh % kLanes;
  float* o = out + (p * s.kv_heads + kh) * s.group * dh;  // (group, dh)
  std::fill(o, o + s.group * dh, 0.0f);
  const int64_t b = row[p];
  if (b < 0 || b >= s.batch) return;
  slots.clear();
  for (int64_t n = 0; n < s.slots; ++n) {
    if (vis[p * s.slots + n]) {
      const int64_t slot = src[p * s.slots + n];
      if (slot >= 0 && slot < s.slots) slots.push_back(slot);
    }
  }
  const int64_t m = static_cast<int64_t>(slots.size());
  if (m == 0) return;
  const int64_t padded = (m + kLanes - 1) / kLanes * kLanes;
  scores.assign(g_n * padded, 0.0f);
  const int64_t stride = s.kv_heads * dh;  // one slot's K (or V) of one batch row
  const C* kb = k + b * s.slots * stride + kh * dh;
  const C* vb = v + b * s.slots * stride + kh * dh;
  const float* qp = q + (p * s.kv_heads + kh) * s.group * dh;
  int64_t n = 0;  // scores: q . K[slot], per query head
  if (g_n == 3 && body == dh) {  // SmolLM2's group: two slots at a time (six independent sums)
    for (; n + 2 <= m; n += 2) Scores2<3>(qp, kb + slots[n] * stride, kb + slots[n + 1] * stride,
                                          dh, scale, scores.data() + n, padded);
  }
  for (; n < m; ++n) {
    const C* kr = kb + slots[n] * stride;
    for (int64_t gi = 0; gi < g_n; ++gi) {
      const float* qh = qp + gi * dh;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < body; d += kLanes) acc = _mm256_fmadd_ps(Load(kr + d), Load(qh + d), acc);
      float sc = Sum(acc);
      for (int64_t d = body; d < dh; ++d) sc = std::fma(ToFloat(kr[d]), qh[d], sc);
      scores[gi * padded + n] = sc * scale;
    }
  }
  for (int64_t gi = 0; gi < g_n; ++gi) {
    float* sc = scores.data() + gi * padded;
    float mx = sc[0];
    for (int64_t n = 1; n < m; ++n) mx = std::max(mx, sc[n]);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 z = _mm256_setzero_ps();
    for (int64_t n = 0; n < padded; n += kLanes) {  // lanes past m: exp of -inf -> 0
      __m256 x = _mm256_sub_ps(Load(sc + n), mxv);
      if (n + kLanes > m) {
        alignas(32) float t[kLanes];
        _mm256_store_ps(t, x);
        for (int64_t l = m - n; l < kLanes; ++l) t[l] = -INFINITY;
        x = _mm256_load_ps(t);
      }
      const __m256 e = Exp(x);
      _mm256_storeu_ps(sc + n, e);
      z = _mm256_add_ps(z, e);
    }
    const float total = Sum(z);
    for (int64_t n = 0; n < m; ++n) sc[n] = Round(sc[n] / total, C{});  // in the cache's dtype
    float* oh = o + gi * dh;
    switch (dh) {  // weights x values, slot after slot, from o = 0
      case 64: Values<8>(sc, slots.data(), m, vb, stride, oh); break;
      case 128: Values<16>(sc, slots.data(), m, vb, stride, oh); break;
      default:
        for (int64_t n = 0; n < m; ++n) {
          const __m256 w = _mm256_set1_ps(sc[n]);
          const C* vr = vb + slots[n] * stride;
          for (int64_t d = 0; d < body; d += kLanes) {
            _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(w, Load(vr + d), Load(oh + d)));
          }
          for (int64_t d = body; d < dh; ++d) oh[d] = std::fma(sc[n], ToFloat(vr[d]), oh[d]);
        }
    }
  }
}

template <typename C>
void Run(ffi::ThreadPool& pool, const float* q, const C* k, const C* v, const int32_t* row,
         const int32_t* src, const bool* vis, float scale, const Shape& s, int64_t valid,
         float* out) {
  const int64_t units = valid * s.kv_heads;
  std::fill(out + units * s.group * s.head_dim, out + s.rows * s.kv_heads * s.group * s.head_dim,
            0.0f);  // padding rows
  if (units == 0) return;
  const int64_t work_size = units * s.slots * s.group * s.head_dim;
  const int64_t helpers =
      work_size < kMinParallel ? 0 : std::min<int64_t>(pool.num_threads(), units - 1);
  ParallelFor(pool, units, helpers, [=](int64_t u) {
    thread_local std::vector<int64_t> slots;
    thread_local std::vector<float> scores;
    Unit(q, k, v, row, src, vis, scale, s, u / s.kv_heads, u % s.kv_heads, out, slots, scores);
  });
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> src,
                         ffi::Buffer<ffi::PRED> vis, ffi::Buffer<ffi::S32> valid, float scale,
                         ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto sd = src.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || v.dimensions().size() != 4 || sd.size() != 2 ||
      k.element_type() != v.element_type() || kd[3] != qd[2] || qd[1] % kd[2] != 0 ||
      sd[0] != qd[0] || sd[1] != kd[1] || vis.element_count() != src.element_count() ||
      row.element_count() != qd[0] || valid.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "attention: q (P, H, Dh), k and v (B, S, G, Dh) alike, row (P,), src and vis (P, S), "
        "a row count expected");
  }
  for (int64_t i = 0; i < 4; ++i) {
    if (v.dimensions()[i] != kd[i]) return ffi::Error::InvalidArgument("attention: k, v differ");
  }
  const Shape s{qd[0], kd[1], kd[0], kd[2], qd[1] / kd[2], qd[2]};
  const int64_t n = std::clamp<int64_t>(valid.typed_data()[0], 0, qd[0]);
  float* o = out->typed_data();
  return ByFloatType(k.element_type(), "attention: the cache must be float32 or bfloat16",
                              [&](auto tag) {
                                using C = decltype(tag);
                                Run(pool, q.typed_data(), static_cast<const C*>(k.untyped_data()),
                                    static_cast<const C*>(v.untyped_data()), row.typed_data(),
                                    src.typed_data(), vis.typed_data(), scale, s, n, o);
                              });
}

}  // namespace
}  // namespace specjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttention, specjax::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
