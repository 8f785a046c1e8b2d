// `prepare`: the input of a fused projection, in(x) for the rows of x [M, K], written to buf [M, K]: the RMSNorm
// of each row (norm: its weight [K], eps), or with `gated` the activation silu(x[:, :K]) * x[:, K:] of x [M, 2K].
// One source for every kernel file (cpu_kernels.cpp, quant_kernels.cpp, int8_kernels.cpp), each compiling it
// with its own flags: the float32 kernels' `prepare` agree bit for bit, so fused float32 calls on float32
// panels and on GGUF blocks see the same inputs. The libraries' cache names hash this file too
// (cpukernel.source_text).

#pragma once

#include <math.h>
#include <stdint.h>

namespace {

void prepare(const float* x, int64_t M, int64_t K, const float* norm, float eps, int gated, float* buf) {
  // The threads split rows (and a gated row's values, in chunks of 256); every value is computed as written,
  // whichever thread computes it.
  if (gated) {
    const int64_t chunks = (K + 255) / 256;
#pragma omp parallel for collapse(2) schedule(static) if (M * K >= 8192)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < chunks; ++c) {
        float* o = buf + m * K;
        const float* g = x + m * 2 * K;
        const float* u = g + K;
        const int64_t end = (c + 1) * 256 < K ? (c + 1) * 256 : K;
        for (int64_t k = c * 256; k < end; ++k) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
      }
    return;
  }
#pragma omp parallel for schedule(static) if (M * K >= 8192)
  for (int64_t m = 0; m < M; ++m) {
    float* o = buf + m * K;
    const float* r = x + m * K;
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += (double)r[k] * r[k];
    const float scale = 1.0f / sqrtf((float)(ss / K) + eps);
    for (int64_t k = 0; k < K; ++k) o[k] = norm[k] * (r[k] * scale);
  }
}

}  // namespace
