// A few rows times a weight matrix on the CPU, reading the weights once:
// y (R, F) = x (R, D) @ w^T for w stored (F, D) in float32 or bfloat16,
// float32 accumulation.
//
// Why: XLA CPU has no fast kernel for 2-16 rows (measured in
// specjax/kernels/__init__.py's docstring): its one-row GEMV streams the
// weights near bandwidth, but 5 rows cost 2x that, so a (k + 1)-token verify
// forward costs ~1.8 AR steps. Here each weight vector is loaded once and
// multiplied into every row's accumulator, so R rows cost about what one does
// while the weights' bandwidth, not the arithmetic, bounds the product.
//
// Every output element y[r, f] is computed the same way whatever R is and
// whatever the other rows hold: eight lanes of partial sums over d (lane l
// takes d = l, l + 8, ...), combined in one fixed order. A row's result is
// therefore bit for bit the same in a one-row AR step and in a verify block
// (tests/test_kernels.py); threads split the output columns, never a sum.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace specjax {
namespace {

constexpr int64_t kMaxGroup = 8;  // rows whose accumulators stay in registers
// Weight bytes a chunk of weight rows spans when more than one group of rows
// passes over it (within a 32 KiB L1 data cache, beside the rows of x).
constexpr int64_t kChunkBytes = 16 << 10;
// Products smaller than this (weight elements) run on the calling thread alone:
// handing work to the pool costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 19;

// Rows [r0, r0 + G) of x against weight rows [f, f + FB): G x FB accumulators
// in registers, each weight vector loaded once for the G rows.
template <int G, int FB, typename W>
inline void Tile(const float* x, const W* w, float* y, int64_t r0, int64_t f, int64_t d_dim,
                 int64_t f_dim) {
  const int64_t body = d_dim - d_dim % kLanes;
  __m256 acc[G][FB];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < FB; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < body; d += kLanes) {
    __m256 wv[FB];
    for (int j = 0; j < FB; ++j) wv[j] = Load(w + (f + j) * d_dim + d);
    for (int g = 0; g < G; ++g) {
      const __m256 xv = Load(x + (r0 + g) * d_dim + d);
      for (int j = 0; j < FB; ++j) acc[g][j] = _mm256_fmadd_ps(wv[j], xv, acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < FB; ++j) {
      float s = Sum(acc[g][j]);
      for (int64_t d = body; d < d_dim; ++d) {  // a tail shorter than a vector
        s = std::fma(ToFloat(w[(f + j) * d_dim + d]), x[(r0 + g) * d_dim + d], s);
      }
      y[(r0 + g) * f_dim + f + j] = s;
    }
  }
}

// Rows [r0, r0 + G) against weight rows [f0, f1): one or two rows take 4 or 2
// weight rows at a time (independent chains hide the FMA's latency), more
// rows one weight row at a time (each of their accumulators is a chain).
template <int G, typename W>
void Rows(const float* x, const W* w, float* y, int64_t r0, int64_t f0, int64_t f1,
          int64_t d_dim, int64_t f_dim) {
  constexpr int FB = G == 1 ? 4 : G == 2 ? 2 : 1;
  int64_t f = f0;
  for (; f + FB <= f1; f += FB) Tile<G, FB>(x, w, y, r0, f, d_dim, f_dim);
  for (; f < f1; ++f) Tile<G, 1>(x, w, y, r0, f, d_dim, f_dim);
}

// Weight rows [f0, f1) against every row of x, in chunks of weight rows small
// enough to stay in the L1 cache while every group of up to 8 rows (one
// register group) passes over them: the weights are read from memory once
// whatever the row count.
template <typename W>
void Columns(const float* x, const W* w, float* y, int64_t rows, int64_t f0, int64_t f1,
             int64_t d_dim, int64_t f_dim) {
  const int64_t chunk =
      rows <= kMaxGroup ? f1 - f0
                        : std::max<int64_t>(4, kChunkBytes / (d_dim * int64_t{sizeof(W)}) / 4 * 4);
  for (int64_t fc = f0; fc < f1; fc += chunk) {
    const int64_t fe = std::min(f1, fc + chunk);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxGroup) {
      switch (std::min<int64_t>(rows - r0, kMaxGroup)) {
        case 1: Rows<1>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        case 2: Rows<2>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        case 3: Rows<3>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        case 4: Rows<4>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        case 5: Rows<5>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        case 6: Rows<6>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        case 7: Rows<7>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
        default: Rows<8>(x, w, y, r0, fc, fe, d_dim, f_dim); break;
      }
    }
  }
}

template <typename W>
void Run(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t rows,
         int64_t f_dim, int64_t d_dim) {
  // Column blocks, one per thread of the pool (a multiple of 64 columns, so no
  // cache line of y is shared).
  const int64_t workers =
      f_dim * d_dim < kMinParallel ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t per = ((f_dim + workers - 1) / workers + 63) / 64 * 64;
  const int64_t tasks = (f_dim + per - 1) / per;
  ParallelFor(pool, tasks, tasks - 1, [=](int64_t t) {
    Columns(x, w, y, rows, t * per, std::min(f_dim, (t + 1) * per), d_dim, f_dim);
  });
}

ffi::Error RowDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || valid.element_count() != 1) {
    return ffi::Error::InvalidArgument("rowdot: x (R, D), w (F, D) and a row count expected");
  }
  const int64_t d_dim = xd[1], f_dim = wd[0];
  // Only the first `valid` rows are computed (a padded tile's real rows); the
  // rest of y is zero. No row's bits depend on it.
  const int64_t rows = std::clamp<int64_t>(valid.typed_data()[0], 0, xd[0]);
  float* out = y->typed_data();
  if (rows < xd[0]) std::memset(out + rows * f_dim, 0, (xd[0] - rows) * f_dim * sizeof(float));
  if (rows == 0) return ffi::Error::Success();
  return ByFloatType(w.element_type(), "rowdot: weights must be float32 or bfloat16",
                              [&](auto tag) {
                                using W = decltype(tag);
                                Run(pool, x.typed_data(), static_cast<const W*>(w.untyped_data()),
                                    out, rows, f_dim, d_dim);
                              });
}

}  // namespace
}  // namespace specjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowDot, specjax::RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
