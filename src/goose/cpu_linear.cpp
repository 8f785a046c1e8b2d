// goose's small-batch float32 linear layer for x86-64 CPUs with AVX2 + FMA (built by cpukernel.py).
//
//   y[m, n] = (y[m, n] +) sum_k in(x)[m, k] * w[n, k]  (+ bias[n])      w [N, K], y [M, N], row-major
//
// where in(x) is x [M, K] itself, or RMSNorm(x) (float32 Llama-style: x * rsqrt(mean(x^2) + eps) * g), or
// the gated activation silu(x[:, :K]) * x[:, K:] of x [M, 2K]; and "y +" (accumulate) adds the result to
// y in place, after the bias, as a residual connection does. These fuse the small element-wise steps
// around a decoder layer's projections into the call that needs them.
//
// Why: a verification forward multiplies every weight matrix by 1 to ~16 rows. At those sizes a forward
// is bound by reading the weights once; the BLAS/oneDNN kernels available to PyTorch on a small AVX2 CPU
// stream them at ~half the memory bandwidth and slow down quickly as rows are added. This kernel reads
// each weight once per call, whatever M is, and keeps every row's partial sums in registers.
//
// Layout: the weights are packed once as panels of 16 output columns, [ceil(N / 16)][K][16] (rows past N
// are zero), so one panel is a single contiguous stream. Each OpenMP thread takes a contiguous range of
// panels (the caller's torch thread count; torch's own libgomp runs the threads). Per panel, rows go in
// tiles of up to 6: 6 rows x 16 columns = 12 ymm accumulators, 2 weight registers, 1 broadcast register.
// The first tile of a panel prefetches the panel ahead; later tiles find it in L1/L2. Threads take pairs
// of adjacent panels, so the 1-2 rows left over (all rows of a 1- or 2-token step) run over both panels
// at once: four accumulators per row instead of two, twice the independent FMA chains.
//
// Numerics: every output is one fused-multiply-add chain over k = 0..K-1 in order, per column, followed
// by the bias add. The chain does not depend on M or on the row's tile, so a row's result is the same
// whatever rows it is computed with (float32 rounding differs from BLAS's, as two BLAS builds differ).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr int kPanel = 16;             // output columns per panel (two ymm registers)
constexpr int kTile = 6;               // rows per register tile
constexpr int kPrefetchBytes = 1024;   // how far ahead of the current row of the panel to prefetch (512..8192
                                       // measured within noise of each other)

// Valid columns of panel p (the last panel of N may be partial).
inline int panel_cols(int64_t N, int64_t p) {
  return static_cast<int>(N - p * kPanel < kPanel ? N - p * kPanel : kPanel);
}

inline void store(float* y, __m256 a0, __m256 a1, int cols, const float* bias, bool accumulate) {
  if (bias) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
  }
  float buf[kPanel];
  float* out = cols == kPanel ? y : buf;
  if (accumulate) {
    if (cols != kPanel) memcpy(buf, y, sizeof(float) * cols);
    a0 = _mm256_add_ps(_mm256_loadu_ps(out), a0);
    a1 = _mm256_add_ps(_mm256_loadu_ps(out + 8), a1);
  }
  _mm256_storeu_ps(out, a0);
  _mm256_storeu_ps(out + 8, a1);
  if (cols != kPanel) memcpy(y, buf, sizeof(float) * cols);
}

#define GOOSE_ZERO(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
#define GOOSE_FMA(i)                                              \
  if constexpr (R > i) {                                          \
    const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);      \
    a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0);                   \
    a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1);                   \
  }
#define GOOSE_STORE(i) \
  if constexpr (R > i) store(y + i * ldy, a##i##0, a##i##1, cols, bias, accumulate);

// R rows (x, stride ldx) times one panel w [K][16] -> y (stride ldy), `cols` valid columns.
template <int R, bool Prefetch>
inline void tile(const float* x, int64_t ldx, int K, const float* w, float* y, int64_t ldy, int cols,
                 const float* bias, bool accumulate) {
  GOOSE_ZERO(0) GOOSE_ZERO(1) GOOSE_ZERO(2) GOOSE_ZERO(3) GOOSE_ZERO(4) GOOSE_ZERO(5)
  for (int k = 0; k < K; ++k) {
    if constexpr (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * k) + kPrefetchBytes, _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + kPanel * k), w1 = _mm256_loadu_ps(w + kPanel * k + 8);
    GOOSE_FMA(0) GOOSE_FMA(1) GOOSE_FMA(2) GOOSE_FMA(3) GOOSE_FMA(4) GOOSE_FMA(5)
  }
  GOOSE_STORE(0) GOOSE_STORE(1) GOOSE_STORE(2) GOOSE_STORE(3) GOOSE_STORE(4) GOOSE_STORE(5)
}

template <bool Prefetch>
inline void rows(int r, const float* x, int64_t ldx, int K, const float* w, float* y, int64_t ldy, int cols,
                 const float* bias, bool accumulate) {
  switch (r) {
    case 6: tile<6, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 5: tile<5, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 4: tile<4, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 3: tile<3, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 2: tile<2, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 1: tile<1, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
  }
}

#define GOOSE_ZERO2(i) GOOSE_ZERO(i) __m256 b##i##0 = _mm256_setzero_ps(), b##i##1 = _mm256_setzero_ps();
#define GOOSE_FMA2(i)                                             \
  if constexpr (R > i) {                                          \
    const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);      \
    a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0);                   \
    a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1);                   \
    b##i##0 = _mm256_fmadd_ps(xv, v0, b##i##0);                   \
    b##i##1 = _mm256_fmadd_ps(xv, v1, b##i##1);                   \
  }
#define GOOSE_STORE2(i)                                                          \
  if constexpr (R > i) {                                                         \
    store(y + i * ldy, a##i##0, a##i##1, kPanel, bias, accumulate);              \
    store(y + i * ldy + kPanel, b##i##0, b##i##1, cols, bias ? bias + kPanel : nullptr, accumulate); \
  }

// R (1 or 2) rows times two adjacent panels at once (w, then w + K * 16, the second with `cols` valid
// columns) -> y: twice the independent FMA chains of `tile` for the few rows left after full tiles, with
// the same k-order chain per output.
template <int R, bool Prefetch>
inline void tile2(const float* x, int64_t ldx, int K, const float* w, float* y, int64_t ldy, int cols,
                  const float* bias, bool accumulate) {
  static_assert(R <= 2, "four accumulators per row: at most 2 rows fit the 16 registers");
  const float* v = w + static_cast<int64_t>(K) * kPanel;
  GOOSE_ZERO2(0) GOOSE_ZERO2(1)
  for (int k = 0; k < K; ++k) {
    if constexpr (Prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * k) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + kPanel * k) + kPrefetchBytes, _MM_HINT_T0);
    }
    const __m256 w0 = _mm256_loadu_ps(w + kPanel * k), w1 = _mm256_loadu_ps(w + kPanel * k + 8);
    const __m256 v0 = _mm256_loadu_ps(v + kPanel * k), v1 = _mm256_loadu_ps(v + kPanel * k + 8);
    GOOSE_FMA2(0) GOOSE_FMA2(1)
  }
  GOOSE_STORE2(0) GOOSE_STORE2(1)
}

// in(x) for the rows of x, written to buf [M, K] (see the header).
void prepare(const float* x, int64_t M, int64_t K, const float* norm, float eps, int gated, float* buf) {
  for (int64_t m = 0; m < M; ++m) {
    float* o = buf + m * K;
    if (gated) {
      const float* g = x + m * 2 * K;
      const float* u = g + K;
      for (int64_t k = 0; k < K; ++k) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    } else {
      const float* r = x + m * K;
      double ss = 0.0;
      for (int64_t k = 0; k < K; ++k) ss += (double)r[k] * r[k];
      const float scale = 1.0f / sqrtf((float)(ss / K) + eps);
      for (int64_t k = 0; k < K; ++k) o[k] = norm[k] * (r[k] * scale);
    }
  }
}

}  // namespace

extern "C" {

int goose_linear_abi(void) { return 2; }

// x [M, K] ([M, 2K] when gated), packed [ceil(N / 16)][K][16], bias [ceil(N / 16) * 16] or null,
// norm [K] or null, y [M, N]; all contiguous. accumulate: y += ..., else y = ...
void goose_linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, const float* bias,
                  float* y, const float* norm, float eps, int gated, int accumulate) {
  std::vector<float> buf;
  if (norm || gated) {
    buf.resize(M * K);
    prepare(x, M, K, norm, eps, gated, buf.data());
    x = buf.data();
  }
  const bool acc = accumulate != 0;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int k = static_cast<int>(K);
  // Work items are pairs of adjacent panels, so the 1-2 rows left after the full 6-row tiles can run
  // over both panels at once (tile2).
#pragma omp parallel for schedule(static)
  for (int64_t q = 0; q < (panels + 1) / 2; ++q) {
    const int64_t p0 = 2 * q, last = p0 + 1 < panels ? p0 + 1 : p0;
    for (int64_t m = 0; m < M; m += kTile) {
      const int r = static_cast<int>(M - m < kTile ? M - m : kTile);
      const float* xm = x + m * K;
      float* ym = y + m * N + p0 * kPanel;
      const float* b = bias ? bias + p0 * kPanel : nullptr;
      if (r <= 2 && last > p0) {
        const int cols = panel_cols(N, last);
        const float* w = packed + p0 * K * kPanel;
        if (r == 2)
          m == 0 ? tile2<2, true>(xm, K, k, w, ym, N, cols, b, acc) : tile2<2, false>(xm, K, k, w, ym, N, cols, b, acc);
        else
          m == 0 ? tile2<1, true>(xm, K, k, w, ym, N, cols, b, acc) : tile2<1, false>(xm, K, k, w, ym, N, cols, b, acc);
        continue;
      }
      for (int64_t p = p0; p <= last; ++p) {
        const int cols = panel_cols(N, p);
        const float* w = packed + p * K * kPanel;
        float* yp = y + m * N + p * kPanel;
        const float* bp = bias ? bias + p * kPanel : nullptr;
        if (m == 0)
          rows<true>(r, xm, K, k, w, yp, N, cols, bp, acc);
        else
          rows<false>(r, xm, K, k, w, yp, N, cols, bp, acc);
      }
    }
  }
}

}  // extern "C"
