// `prepare`: the input of a fused projection, in(x) for the rows of x [M, K], written to buf [M, K]: the RMSNorm
// of each row (norm: its weight [K], eps), or with `gated` the activation silu(x[:, :K]) * x[:, K:] of x [M, 2K].
// One source for every kernel file (cpu_kernels.cpp, quant_kernels.cpp, int8_kernels.cpp), each compiling it
// with its own flags: the float32 kernels' `prepare` agree bit for bit, so fused float32 calls on float32
// panels and on GGUF blocks see the same inputs. The libraries' cache names hash this file too
// (cpukernel.source_text).

#pragma once

#include <math.h>
#include <stdint.h>

#include "team.h"  // team::each: the parallel loops (OpenMP's worksharing, or a claim pool)

namespace {

// The RMSNorm of R consecutive rows of x [R, K] into out [R, K]: each row's sum of squares is its own chain over
// k in order (in double; a float's square is exact there), so R rows run R independent chains at once, and every
// value is computed as written.
template <int R>
inline void rms_tile(const float* x, int64_t K, const float* norm, float eps, float* out) {
  double ss[R];
  for (int r = 0; r < R; ++r) ss[r] = 0.0;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) ss[r] += (double)x[r * K + k] * x[r * K + k];
  for (int r = 0; r < R; ++r) {
    const float scale = 1.0f / sqrtf((float)(ss[r] / K) + eps);
    for (int64_t k = 0; k < K; ++k) out[r * K + k] = norm[k] * (x[r * K + k] * scale);
  }
}

constexpr int64_t kNormRows = 4;  // rows whose RMSNorm chains run together (`rms_tile`)

// The RMSNorm of rows [m0, m1) of x [., K] into the same rows of out, kNormRows at a time.
inline void rms_rows(const float* x, int64_t m0, int64_t m1, int64_t K, const float* norm, float eps, float* out) {
  for (int64_t m = m0; m < m1; m += kNormRows) {
    const int64_t r = m1 - m < kNormRows ? m1 - m : kNormRows;
    const float* xr = x + m * K;
    float* o = out + m * K;
    switch (r) {
      case 4: rms_tile<4>(xr, K, norm, eps, o); break;
      case 3: rms_tile<3>(xr, K, norm, eps, o); break;
      case 2: rms_tile<2>(xr, K, norm, eps, o); break;
      default: rms_tile<1>(xr, K, norm, eps, o); break;
    }
  }
}

// `prepare` by the threads of the enclosing parallel region (`team::each`, so every row is done on return): they
// split rows (a gated row's values in chunks of 256, RMSNorm rows kNormRows at a time); every value is computed
// as written, whichever thread computes it.
inline void prepare_team(const float* x, int64_t M, int64_t K, const float* norm, float eps, int gated, float* buf) {
  if (gated) {
    const int64_t chunks = (K + 255) / 256;
    team::each(M * chunks, [&](int64_t i) {
      const int64_t m = i / chunks, c = i % chunks;
      float* o = buf + m * K;
      const float* g = x + m * 2 * K;
      const float* u = g + K;
      const int64_t end = (c + 1) * 256 < K ? (c + 1) * 256 : K;
      for (int64_t k = c * 256; k < end; ++k) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    });
    return;
  }
  const int64_t tiles = (M + kNormRows - 1) / kNormRows;
  team::each(tiles, [&](int64_t t) {
    rms_rows(x, t * kNormRows, (t + 1) * kNormRows < M ? (t + 1) * kNormRows : M, K, norm, eps, buf);
  });
}

inline void prepare(const float* x, int64_t M, int64_t K, const float* norm, float eps, int gated, float* buf) {
#pragma omp parallel if (M * K >= 8192)
  prepare_team(x, M, K, norm, eps, gated, buf);
}

}  // namespace
