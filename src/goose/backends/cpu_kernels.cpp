// goose's float32 CPU kernels for x86-64 with AVX2 + FMA, or AVX-512 (built by cpukernel.py): a small-batch linear
// layer (goose_linear), a decoder layer's attention on a static KV cache (goose_attention), and the top k
// of logit rows (goose_topk).
//
// ---- goose_linear ----
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
// Layout: the weights are packed once as panels of 16 output columns, each stored as two halves of 8
// columns, [ceil(N / 16)][2][K][8] (rows past N are zero): a panel is two contiguous streams, read side by
// side. On this class of machine one core reads memory faster from several sequential streams at once
// than from one (measured: 1 stream ~9 GB/s, 2 ~12, 4 ~13 on a 2-core EPYC VM), which is what makes a
// 6-row tile as fast as a 1-row one. Each OpenMP thread takes a contiguous range of panels (the caller's
// torch thread count; torch's own libgomp runs the threads). Per panel, rows go in tiles of up to 6:
// 6 rows x 16 columns = 12 ymm accumulators, 2 weight registers, 1 broadcast register. The first tile of a
// panel prefetches ahead; later tiles find the panel in L1/L2. Threads take pairs of adjacent panels, so
// the 1-2 rows left over (all rows of a 1- or 2-token step) run over both panels at once: four streams,
// four accumulators per row instead of two, twice the independent FMA chains.
//
// Numerics: every output is one fused-multiply-add chain over k = 0..K-1 in order, per column, followed
// by the bias add. The chain does not depend on M or on the row's tile, so a row's result is the same
// whatever rows it is computed with (float32 rounding differs from BLAS's, as two BLAS builds differ).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <string.h>

#include <vector>

#include "prepare.h"  // `prepare`: RMSNorm or silu(gate) * up before a projection

namespace {

constexpr int kPanel = 16;             // output columns per panel (two ymm registers)
constexpr int kHalf = 8;               // a panel is stored as two halves of 8 columns, [2][K][8]
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
  const float* h = w + static_cast<int64_t>(K) * kHalf;  // the panel's second half
  GOOSE_ZERO(0) GOOSE_ZERO(1) GOOSE_ZERO(2) GOOSE_ZERO(3) GOOSE_ZERO(4) GOOSE_ZERO(5)
  for (int k = 0; k < K; ++k) {
    if constexpr (Prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(h + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
    }
    const __m256 w0 = _mm256_loadu_ps(w + kHalf * k), w1 = _mm256_loadu_ps(h + kHalf * k);
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
  const int64_t half = static_cast<int64_t>(K) * kHalf;
  const float *h = w + half, *v = w + 2 * half, *g = w + 3 * half;  // four streams: both halves of both panels
  GOOSE_ZERO2(0) GOOSE_ZERO2(1)
  for (int k = 0; k < K; ++k) {
    if constexpr (Prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(h + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
    }
    const __m256 w0 = _mm256_loadu_ps(w + kHalf * k), w1 = _mm256_loadu_ps(h + kHalf * k);
    const __m256 v0 = _mm256_loadu_ps(v + kHalf * k), v1 = _mm256_loadu_ps(g + kHalf * k);
    GOOSE_FMA2(0) GOOSE_FMA2(1)
  }
  GOOSE_STORE2(0) GOOSE_STORE2(1)
}

// ---- goose_attention helpers ----
//
// Two arrangements of the same per-row arithmetic (scores: an FMA chain over D and a fixed horizontal sum;
// softmax_numerators; weighted sums: an FMA chain over the keys in order), with bit-identical results:
// `attention`, the plain one (a work item is one token's query heads, at most 3, over all its keys), the
// reference (goose_attention_plain); and `attention_groups`, which goose_attention runs on both variants (all
// the query rows of a sequence that read one kv head share each block of keys and values; see there).

// e^x for x <= 0 (softmax arguments after subtracting the max), 8 lanes: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n through the exponent bits.
// Lanes below -87 (and -inf) give 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);   // ln2 in two parts (Cody-Waite)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef __AVX512F__
// exp_nonpositive on 16 lanes: the same operations lane by lane, so the same bits.
inline __m512 exp_nonpositive512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}
#endif

// 8 floats from float32 or bfloat16 entries (a bfloat16 is the top half of the float32 it denotes)
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Rotary embedding (Hugging Face's rotate_half convention) of one head x [D] -> o [D]:
// o = x * cos + (-x[D/2:], x[:D/2]) * sin.
inline void rope(const float* x, const float* cos, const float* sin, int D, float* o) {
  const int h = D / 2;
  for (int d = 0; d < h; ++d) o[d] = x[d] * cos[d] - x[d + h] * sin[d];
  for (int d = h; d < D; ++d) o[d] = x[d] * cos[d] + x[d - h] * sin[d];
}

// The first m (1..4) of the 4 scores in v, stored at out.
inline void store_scores(float* out, __m128 v, int64_t m) {
  if (m == 4) {
    _mm_storeu_ps(out, v);
  } else {
    float buf[4];
    _mm_storeu_ps(buf, v);
    for (int t = 0; t < m; ++t) out[t] = buf[t];
  }
}

// Scores s_r[j] = scale * <q_r, keys[j]> of R query rows q [R][D] for j in [0, T), keys [T][D] (D a
// multiple of 8), 4 keys at a time, each key loaded once for the R rows (4 R accumulators). Every
// (row, key) dot product is the same chain of FMAs and the same horizontal sum wherever it falls, so a
// score depends on neither T nor R (the last block re-reads key T-1 for its missing keys).
template <int R>
inline void scores(const float* q, const float* keys, int64_t T, int D, float scale, float* s, int64_t lds) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < T; j0 += 4) {
    const float* k[4];
    for (int t = 0; t < 4; ++t) k[t] = keys + (j0 + t < T ? j0 + t : T - 1) * D;
    __m256 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) a[r][t] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d);
      const __m256 k2 = _mm256_loadu_ps(k[2] + d), k3 = _mm256_loadu_ps(k[3] + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + d);
        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
        a[r][2] = _mm256_fmadd_ps(qv, k2, a[r][2]);
        a[r][3] = _mm256_fmadd_ps(qv, k3, a[r][3]);
      }
    }
    const int64_t m = T - j0 < 4 ? T - j0 : 4;
    for (int r = 0; r < R; ++r) {
      // [sum a0, .., sum a3]: pairwise within 128-bit lanes, then the two lanes added
      const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
      const __m128 v = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)),
                                  _mm256_castps256_ps128(sc));
      store_scores(s + r * lds + j0, v, m);
    }
  }
}

// o_r [8 W] = inv_r * sum_j e_r[j] v[j] for R rows (e_r = e + r * lde, o_r = o + r * ldo) over j in
// [0, T), v rows of stride D: each value vector is loaded once for the R rows (R x W accumulators).
template <int R, int W>
inline void weighted(const float* e, int64_t lde, const float* v, int64_t T, int64_t D, const float* inv, float* o,
                     int64_t ldo) {
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < T; ++j) {
    for (int r = 0; r < R; ++r) {
      const __m256 ej = _mm256_set1_ps(e[r * lde + j]);
      for (int c = 0; c < W; ++c) acc[r][c] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(v + j * D + 8 * c), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 iv = _mm256_set1_ps(inv[r]);
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + r * ldo + 8 * c, _mm256_mul_ps(acc[r][c], iv));
  }
}

template <int R>
inline void weighted_rows(const float* e, int64_t lde, const float* v, int64_t T, int D, const float* inv, float* o,
                          int64_t ldo) {
  for (int d0 = 0; d0 < D; d0 += 32) {  // 32 columns (4 x 8) at a time
    switch (D - d0 < 32 ? (D - d0) / 8 : 4) {
      case 4: weighted<R, 4>(e, lde, v + d0, T, D, inv, o + d0, ldo); break;
      case 3: weighted<R, 3>(e, lde, v + d0, T, D, inv, o + d0, ldo); break;
      case 2: weighted<R, 2>(e, lde, v + d0, T, D, inv, o + d0, ldo); break;
      default: weighted<R, 1>(e, lde, v + d0, T, D, inv, o + d0, ldo); break;
    }
  }
}

// Softmax numerators of s [T] in place (e^(s - max), masked -inf -> 0) padded with zeros to a multiple
// of 8; returns 1 / their sum. The sum runs over 8 lanes, a key's lane being its rank among the keys the row
// sees. For a causal row that is its position. A tree row (`seen`: which of the last n positions it sees,
// the positions before them all seen) adds its new-token terms at their ranks. So a tree node's sum is the
// one its path gives as a causal run (the same terms in the same lanes), and accepting a node never changes
// its logits in the last bit.
// `rest`: scratch for tree rows, at least n + 16 floats.
inline float softmax_numerators(float* s, int64_t T, const uint8_t* seen = nullptr, int64_t n = 0,
                                float* rest = nullptr) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
#ifdef __AVX512F__
  // four independent max chains (the max of finite scores is the same value in any order; a zero's sign
  // does not change any e^(s - max))
  __m512 m4[4];
  for (int u = 0; u < 4; ++u) m4[u] = _mm512_set1_ps(-INFINITY);
  for (; j + 64 <= T; j += 64)
    for (int u = 0; u < 4; ++u) m4[u] = _mm512_max_ps(m4[u], _mm512_loadu_ps(s + j + 16 * u));
  const __m512 m16 = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
  mx = _mm256_max_ps(_mm512_castps512_ps256(m16), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m16), 1)));
#endif
  for (; j + 8 <= T; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  float buf[8];
  _mm256_storeu_ps(buf, mx);
  float m = buf[0];
  for (int t = 1; t < 8; ++t) m = buf[t] > m ? buf[t] : m;
  for (; j < T; ++j) m = s[j] > m ? s[j] : m;
  for (int64_t t = T; t < T + 8; ++t) s[t] = -INFINITY;  // pad the last block
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  const int64_t p = seen ? T - n : T, b0 = p / 8 * 8;  // blocks below b0 hold prefix terms only
  j = 0;
#ifdef __AVX512F__
  const __m512 mv16 = _mm512_set1_ps(m);
  for (; j + 16 <= (T + 7) / 8 * 8; j += 16) {  // two 8-key blocks at once, added to total in order
    const __m512 e = exp_nonpositive512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv16));
    _mm512_storeu_ps(s + j, e);
    if (!seen || j < b0) total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
    if (!seen || j + 8 < b0) total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (; j < T; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    if (!seen || j < b0) total = _mm256_add_ps(total, e);
  }
  if (seen) {  // the rest: prefix terms from b0, then the seen new tokens' terms in order, zero-padded
    int64_t k = 0;
    for (int64_t t = b0; t < p; ++t) rest[k++] = s[t];
    for (int64_t t = 0; t < n; ++t)
      if (seen[t]) rest[k++] = s[p + t];
    for (int64_t t = k; t < (k + 7) / 8 * 8; ++t) rest[t] = 0.0f;
    for (int64_t t = 0; t < k; t += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(rest + t));
  }
  _mm256_storeu_ps(buf, total);
  float sum = 0.0f;
  for (int t = 0; t < 8; ++t) sum += buf[t];
  return 1.0f / sum;
}

#ifdef __AVX512F__
// ---- the AVX-512 variant of goose_linear ----
//
// Same packed layout and the same numerics (one FMA chain over k in order per output, then bias, then the
// accumulate add): its results are bit-identical to the AVX2 variant's. A panel's 16 columns are one zmm
// register, assembled from the panel's two 8-column halves (one load + one insert per k). A work item is a
// pair of adjacent panels (P = 2, or 1 for a last odd panel); its rows go in tiles of up to kTile512 rows,
// the rows split evenly over the tiles: R rows x P panels accumulators (at most 24 of the 32 registers), each
// weight vector loaded once per tile and used by R rows. One row already runs two or four independent chains
// (P panels) reading four streams, which is more than a memory-bound single-row step needs.
constexpr int kTile512 = 12;

// The 16 columns of row k of a panel (halves w and h) as one vector.
inline __m512 panel16(const float* w, const float* h, int64_t k) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(w + kHalf * k)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(h + kHalf * k)), 1));
}

inline void store16(float* y, __m512 a, int cols, const float* bias, bool accumulate) {
  const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1u);
  if (bias) a = _mm512_add_ps(a, _mm512_loadu_ps(bias));  // bias is padded to whole panels
  if (accumulate) a = _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), a);
  _mm512_mask_storeu_ps(y, m, a);
}

// R rows (x, stride ldx) times P adjacent panels (from w) -> y (stride ldy); cols: valid columns of the
// last panel.
template <int R, int P, bool Prefetch>
inline void tile512(const float* x, int64_t ldx, int64_t K, const float* w, float* y, int64_t ldy, int cols,
                    const float* bias, bool accumulate) {
  const int64_t half = K * kHalf;
  const float* s[2 * P];  // the panels' halves
  for (int q = 0; q < 2 * P; ++q) s[q] = w + q * half;
  __m512 acc[R][P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (Prefetch) {
#pragma GCC unroll 4
      for (int q = 0; q < 2 * P; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(s[q] + kHalf * k) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m512 wv[P];
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) wv[p] = panel16(s[2 * p], s[2 * p + 1], k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
      store16(y + r * ldy + p * kPanel, acc[r][p], p == P - 1 ? cols : kPanel, bias ? bias + p * kPanel : nullptr,
              accumulate);
}

template <int P, bool Prefetch>
inline void rows512(int r, const float* x, int64_t ldx, int64_t K, const float* w, float* y, int64_t ldy, int cols,
                    const float* bias, bool accumulate) {
  switch (r) {
    case 12: tile512<12, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 11: tile512<11, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 10: tile512<10, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 9: tile512<9, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 8: tile512<8, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 7: tile512<7, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 6: tile512<6, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 5: tile512<5, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 4: tile512<4, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 3: tile512<3, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 2: tile512<2, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    default: tile512<1, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
  }
}

void linear512(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, int64_t panels,
               const float* bias, float* y, bool acc) {
  const int64_t tiles = (M + kTile512 - 1) / kTile512;
#pragma omp parallel
  team::each((panels + 1) / 2, [&](int64_t q) {
    const int64_t p0 = 2 * q;
    const bool two = p0 + 1 < panels;
    const int cols = panel_cols(N, two ? p0 + 1 : p0);
    const float* w = packed + p0 * K * kPanel;
    const float* b = bias ? bias + p0 * kPanel : nullptr;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {  // tile t: rows [m, m + r), sizes differing by at most 1
      const int r = static_cast<int>(M / tiles + (t < M % tiles ? 1 : 0));
      const float* xm = x + m * K;
      float* ym = y + m * N + p0 * kPanel;
      if (two)
        t == 0 ? rows512<2, true>(r, xm, K, K, w, ym, N, cols, b, acc) : rows512<2, false>(r, xm, K, K, w, ym, N, cols, b, acc);
      else
        t == 0 ? rows512<1, true>(r, xm, K, K, w, ym, N, cols, b, acc) : rows512<1, false>(r, xm, K, K, w, ym, N, cols, b, acc);
      m += r;
    }
  });
}

// ---- the AVX-512 variant of the attention's inner loops ----
//
// Query rows go in pairs: one zmm holds 8 values of each row of a pair (lanes 0-7 the first, 8-15 the
// second), and each lane does exactly what the 8-lane code does for its row, in the same order, so every
// score and output is bit-identical to the AVX2 variant's. A score tile takes up to kPairs512 pairs of query
// rows that read one kv head (several tokens and the query heads of their group): each key vector is loaded
// once for all of them (see attention_groups for how the rows of a whole sequence share a block of keys).
constexpr int kPairs512 = 4;

inline __m512 both_halves(const float* p) {  // 8 floats in lanes 0-7 and again in 8-15
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
inline __m512 both_halves(const uint16_t* p) {  // 8 bfloat16 entries as floats, twice
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(ld8(p))));
}
// 16 floats (the lanes in m; the others 0), from float32 or bfloat16 entries
inline __m512 ld16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld16(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// _mm256_hadd_ps on each 256-bit half: per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
inline __m512 hadd512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores (see `scores`) of P row pairs, qp [P][D / 8][16] (pair-interleaved), over keys [T][D]; row r's
// scores go to s[r] (2 P row pointers). S: D / 8 when known at compile time (the loops then unroll and the
// accumulators stay in registers), else 0. pf (or null): pf_lines cache lines from there to fetch into L2
// meanwhile, spread evenly over the keys (a few per 4 keys, so they never crowd the line fill buffers).
template <int P, int S = 0, class E = float>
inline void scores512(const float* qp, const E* keys, int64_t T, int D, float scale, float* const* s,
                      const float* pf = nullptr, int64_t pf_lines = 0) {
  const __m512 sc = _mm512_set1_ps(scale);
  const int steps = S ? S : D / 8;
  const int64_t per = pf ? (pf_lines + (T + 3) / 4 - 1) / ((T + 3) / 4) : 0;  // lines per 4 keys
  for (int64_t j0 = 0; j0 < T; j0 += 4) {
    if (pf)
      for (int64_t l = j0 / 4 * per; l < (j0 / 4 + 1) * per && l < pf_lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * l, _MM_HINT_T1);
    const E* k[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) k[t] = keys + (j0 + t < T ? j0 + t : T - 1) * D;
    __m512 a[P][4];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) a[p][t] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int d = 0; d < steps; ++d) {
      const __m512 k0 = both_halves(k[0] + 8 * d), k1 = both_halves(k[1] + 8 * d);
      const __m512 k2 = both_halves(k[2] + 8 * d), k3 = both_halves(k[3] + 8 * d);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512 qv = _mm512_loadu_ps(qp + (p * steps + d) * 16);
        a[p][0] = _mm512_fmadd_ps(qv, k0, a[p][0]);
        a[p][1] = _mm512_fmadd_ps(qv, k1, a[p][1]);
        a[p][2] = _mm512_fmadd_ps(qv, k2, a[p][2]);
        a[p][3] = _mm512_fmadd_ps(qv, k3, a[p][3]);
      }
    }
    const __mmask8 m = static_cast<__mmask8>(T - j0 < 4 ? (1u << (T - j0)) - 1u : 0xFu);
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      // the 8-lane code's hadd tree on both rows at once (hadd within 128-bit lanes is these two shuffles
      // and one add), then the two 128-bit lanes of each row added: row a in lane 0, row b in lane 2
      const __m512 u = hadd512(hadd512(a[p][0], a[p][1]), hadd512(a[p][2], a[p][3]));
      const __m512 v = _mm512_mul_ps(_mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1))), sc);
      _mm_mask_storeu_ps(s[2 * p] + j0, m, _mm512_castps512_ps128(v));
      _mm_mask_storeu_ps(s[2 * p + 1] + j0, m, _mm512_extractf32x4_ps(v, 2));
    }
  }
}
#endif  // __AVX512F__

}  // namespace

extern "C" {

int goose_kernels_abi(void) { return 12; }

// The calling thread's projections (`goose_linear`, and those of `goose_layers` on float32 panels) run on this
// library's claim pool with `width` threads while its OpenMP regions have one thread (width <= 1: OpenMP's team;
// team.h). The attention stays on OpenMP.
void goose_kernels_claim(int width) { team::claim(width); }

#ifdef __AVX512F__
int goose_kernels_isa(void) { return 512; }
#else
int goose_kernels_isa(void) { return 256; }
#endif

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
#ifdef __AVX512F__
  linear512(x, M, k, packed, N, panels, bias, y, acc);
  return;
#endif
  // Work items are pairs of adjacent panels, so the 1-2 rows left after the full 6-row tiles can run
  // over both panels at once (tile2).
#pragma omp parallel
  team::each((panels + 1) / 2, [&](int64_t q) {
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
  });
}


}  // extern "C"

namespace {

// One segment of an attention call: n new tokens appended at positions p..p+n-1 of one sequence's cache.
struct Segment {
  int64_t n;               // new tokens
  int64_t row0;            // their first row in qkv and out
  const float* cos;        // [n, D]
  const float* sin;        // [n, D]
  float* keys;             // this layer's cache of the sequence, [Kh][cap][D] (null when held in bfloat16)
  float* vals;             // [Kh][cap][D]
  int64_t cap, p;
  const uint8_t* allowed;  // [n, back + n] or null (causal)
  uint16_t* keys16 = nullptr;  // the cache held in bfloat16 instead (keys, vals null), [Kh][cap][D] each
  uint16_t* vals16 = nullptr;
  int64_t back = 0;  // cached keys p-back..p-1 that `allowed` also governs (0: every cached key is seen)
};

// ---- a cache held in bfloat16 ----
// A key or value is rounded once to bfloat16 (to nearest, ties to even; NaN stays NaN) when written, and read
// back as the float32 it denotes (exactly): attention then runs its float32 arithmetic, unchanged, on those
// values. Every row that reads an entry reads the same value, whatever the rows and the split.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void bf16_to_float(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    memcpy(dst + i, &u, 4);
  }
}

// The softmax numerators of new token i's scores sr [Tv] over segment g (a tree row masks the new tokens it does
// not see first), in place; returns 1 / their sum. `rest`: scratch of g.back + g.n + 16 floats.
inline float row_softmax(const Segment& g, int64_t i, float* sr, int64_t Tv, float* rest) {
  if (!g.allowed) return softmax_numerators(sr, Tv);
  const int64_t w = g.back + g.n;  // the keys the mask governs: p-back .. p+n-1
  const uint8_t* seen = g.allowed + i * w;
  for (int64_t t = 0; t < w; ++t)
    if (!seen[t]) sr[g.p - g.back + t] = -INFINITY;
  return softmax_numerators(sr, Tv, seen, w, rest);
}

// The new tokens' rotated keys and their values, written into each sequence's cache before any row reads them.
void write_new_kv(const float* qkv, int64_t H, int64_t Kh, int64_t D, const Segment* segs, int64_t nseg) {
  const int64_t row = (H + 2 * Kh) * D;
  for (int64_t s = 0; s < nseg; ++s) {
    const Segment& g = segs[s];
    std::vector<float> k(g.keys16 ? D : 0);
    for (int64_t i = 0; i < g.n; ++i)
      for (int64_t h = 0; h < Kh; ++h) {
        const float* x = qkv + (g.row0 + i) * row;
        const int64_t at = (h * g.cap + g.p + i) * D;
        if (g.keys16) {
          rope(x + (H + h) * D, g.cos + i * D, g.sin + i * D, static_cast<int>(D), k.data());
          for (int64_t d = 0; d < D; ++d) {
            g.keys16[at + d] = to_bf16(k[d]);
            g.vals16[at + d] = to_bf16(x[(H + Kh + h) * D + d]);
          }
        } else {
          rope(x + (H + h) * D, g.cos + i * D, g.sin + i * D, static_cast<int>(D), g.keys + at);
          memcpy(g.vals + at, x + (H + Kh + h) * D, sizeof(float) * D);
        }
      }
  }
}

// Attention of a decoder layer for several sequences in one parallel region (see goose_attention), in the
// plain arrangement: the bit reference of attention_groups.
void attention(const float* qkv, int64_t H, int64_t Kh, int64_t D, const Segment* segs, int64_t nseg, float scale,
               float* out) {
  const int64_t row = (H + 2 * Kh) * D, G = H / Kh;
  const int d = static_cast<int>(D);
  constexpr int kRows = 3;  // query heads per work item (they share every key load)
  const int64_t groups = (G + kRows - 1) / kRows;
  std::vector<int64_t> first(nseg + 1, 0);  // work items of segment s: [first[s], first[s + 1])
  write_new_kv(qkv, H, Kh, D, segs, nseg);
  int64_t longest = 0, widest = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const Segment& g = segs[s];
    first[s + 1] = first[s] + g.n * Kh * groups;
    longest = g.p + g.n > longest ? g.p + g.n : longest;
    widest = g.back + g.n > widest ? g.back + g.n : widest;
  }
  const int64_t lds = longest + 8;
#pragma omp parallel
  {
    std::vector<float> sc(kRows * lds), q(kRows * D), rest(widest + 16), kb, vb;  // kb, vb: a bfloat16 head, read
#pragma omp for schedule(static)
    for (int64_t item = 0; item < first[nseg]; ++item) {
      int64_t s = 0;
      while (item >= first[s + 1]) ++s;
      const Segment& g = segs[s];
      const int64_t local = item - first[s], T = g.p + g.n;
      const int64_t i = local / (Kh * groups), kv = local / groups % Kh, h0 = kv * G + local % groups * kRows;
      const int R = static_cast<int>(G - (h0 - kv * G) < kRows ? G - (h0 - kv * G) : kRows);
      const float* x = qkv + (g.row0 + i) * row;
      for (int r = 0; r < R; ++r) rope(x + (h0 + r) * D, g.cos + i * D, g.sin + i * D, d, q.data() + r * D);
      const int64_t Tv = g.allowed ? T : g.p + i + 1;  // causal: new tokens up to i; a tree masks below
      const float* kh = g.keys + kv * g.cap * D;
      const float* vh = g.vals + kv * g.cap * D;
      if (g.keys16) {
        kb.resize(Tv * D);
        vb.resize(Tv * D);
        bf16_to_float(g.keys16 + kv * g.cap * D, Tv * D, kb.data());
        bf16_to_float(g.vals16 + kv * g.cap * D, Tv * D, vb.data());
        kh = kb.data();
        vh = vb.data();
      }
      switch (R) {
        case 3: scores<3>(q.data(), kh, Tv, d, scale, sc.data(), lds); break;
        case 2: scores<2>(q.data(), kh, Tv, d, scale, sc.data(), lds); break;
        default: scores<1>(q.data(), kh, Tv, d, scale, sc.data(), lds); break;
      }
      float inv[kRows];
      for (int r = 0; r < R; ++r) inv[r] = row_softmax(g, i, sc.data() + r * lds, Tv, rest.data());
      float* o = out + (g.row0 + i) * H * D + h0 * D;
      switch (R) {
        case 3: weighted_rows<3>(sc.data(), lds, vh, Tv, d, inv, o, D); break;
        case 2: weighted_rows<2>(sc.data(), lds, vh, Tv, d, inv, o, D); break;
        default: weighted_rows<1>(sc.data(), lds, vh, Tv, d, inv, o, D); break;
      }
    }
  }
}

// ---- the grouped attention: groups of query rows over blocks of keys and values ----
//
// Same bits as `attention`, arranged so that each key and value is read from memory once per step for all
// the query rows of a sequence. A group is up to kGroupRows query rows of one segment that read one kv head
// (row q = token q / G, query head kv G + q % G). A layer's groups go through three phases in one parallel
// region (in waves whose score rows fit kWaveFloats):
//  A. scores: tiles of (group, key range); each block of keys (kBlockFloats) is loaded into L1 once (the
//     next one prefetched into L2 meanwhile) and used by all the group's rows, a register tile of rows at a
//     time (Isa::scores);
//  B. each row's softmax numerators (row_softmax), in place;
//  C. weighted sums: tiles of (group, rows, columns); each block of values is used by the tile's rows, whose
//     accumulators are kept between blocks, so every output is still one FMA chain over j in order.
// Tiles split the work over the threads even with fewer groups than threads (one sequence with few kv
// heads, 3 on 2 threads): by key range in A, by rows (many) or columns (few rows) in C; B runs inside C's
// tiles when C is not split by columns, and when no group is split a group's phases are one work item (no
// barrier between them). No tile's numbers depend on the split.
// The plan and phases are `attention_groups<Isa>`; only the vector inner loops differ between the variants:
// Groups256 (AVX2: 16 ymm registers, one row per register) and Groups512 (AVX-512: 32 zmm registers, two
// rows per register).
constexpr int kGroupRows = 48;            // query rows per group (a multiple of 6 and of 8)
constexpr int64_t kBlockFloats = 4096;   // a block of keys (values): 16 KB, 64 keys at D = 64
constexpr int64_t kWaveFloats = 1 << 19;  // score rows per wave (2 MB)
constexpr int64_t kSplitWork = 12288;     // keys x rows of a wave from which groups are split over threads
                                          // (one token's 3 kv heads at 512 cached tokens)
constexpr int64_t kSplitRowsWork = 4096;  // the same, for groups of rows enough to split by rows

struct Group {
  const Segment* g;
  int64_t kv, q0, Tmax, sc;  // kv head, first row, keys read, offset of its score rows in the wave's buffer
  int R, S;                  // rows, score rows (R rounded up to Isa::kRowMultiple: an odd group's last
                             // AVX-512 pair repeats its last row)
};

struct Tile {
  int64_t group, a0, a1;  // A: key range [a0, a1); C: rows [a0, a1)
  int64_t c0, c1;         // C: columns [c0, c1)
};

// scores (see `scores`) of R query rows q [R][D] over keys [T][D]; row r's scores go to s[r]. S: D / 8 when
// known at compile time (the loops then unroll), else 0. pf (or null): pf_lines cache lines from there to
// fetch into L2 meanwhile, spread evenly over the keys (a few per 4 keys, so they never crowd the line fill
// buffers). R x 4 accumulators and the 4 key vectors fill the 16 registers at R = 3 (q is read from L1).
// _mm256_hadd_ps: per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3], in fewer micro-ops on Zen 3
inline __m256 hadd256(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int R, int S, class E>
inline void scores_tile(const float* q, const E* keys, int64_t T, int D, float scale, float* const* s,
                        const float* pf, int64_t pf_lines) {
  const __m256 sc = _mm256_set1_ps(scale);
  const int steps = S ? S : D / 8;
  const int64_t per = pf ? (pf_lines + (T + 3) / 4 - 1) / ((T + 3) / 4) : 0;  // lines per 4 keys
  for (int64_t j0 = 0; j0 < T; j0 += 4) {
    if (pf)
      for (int64_t l = j0 / 4 * per; l < (j0 / 4 + 1) * per && l < pf_lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * l, _MM_HINT_T1);
    const E* k[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) k[t] = keys + (j0 + t < T ? j0 + t : T - 1) * D;
    __m256 a[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) a[r][t] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int d = 0; d < steps; ++d) {
      const __m256 k0 = ld8(k[0] + 8 * d), k1 = ld8(k[1] + 8 * d);
      const __m256 k2 = ld8(k[2] + 8 * d), k3 = ld8(k[3] + 8 * d);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + 8 * d);
        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
        a[r][2] = _mm256_fmadd_ps(qv, k2, a[r][2]);
        a[r][3] = _mm256_fmadd_ps(qv, k3, a[r][3]);
      }
    }
    const int64_t m = T - j0 < 4 ? T - j0 : 4;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // the horizontal sums of `scores` (hadd as two shuffles and an add)
      const __m256 u = hadd256(hadd256(a[r][0], a[r][1]), hadd256(a[r][2], a[r][3]));
      const __m128 v = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)),
                                  _mm256_castps256_ps128(sc));
      store_scores(s[r] + j0, v, m);
    }
  }
}

template <int S, class E>
inline void scores_rows(int R, const float* q, const E* keys, int64_t T, int D, float scale, float* const* s,
                        const float* pf, int64_t pf_lines) {
  switch (R) {
    case 3: scores_tile<3, S>(q, keys, T, D, scale, s, pf, pf_lines); break;
    case 2: scores_tile<2, S>(q, keys, T, D, scale, s, pf, pf_lines); break;
    default: scores_tile<1, S>(q, keys, T, D, scale, s, pf, pf_lines); break;
  }
}

// o[r][0..8 W) for R rows over values j in [j0, j1) (v is already offset to the tile's first column):
// accumulators from acc (rows of stride lda; zeros when `first`), back to acc, or when `inv` is given times
// inv[r] into o[r]. ahead (or 0): prefetch distance in values, for the values j with j % pf_every == pf_at.
template <int R, int W, class E>
inline void weighted_block(const float* const* e, const E* v, int64_t j0, int64_t j1, int64_t D, float* acc,
                           int64_t lda, bool first, const float* inv, float* const* o, int64_t ahead,
                           int64_t pf_every, int64_t pf_at) {
  __m256 a[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) a[r][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * lda + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    if (ahead && j % pf_every == pf_at)  // fetch the same columns of value j + ahead into L2 meanwhile
      for (int c = 0; c < W; c += 2) _mm_prefetch(reinterpret_cast<const char*>(v + (j + ahead) * D + 8 * c), _MM_HINT_T1);
    __m256 vv[W];
    for (int c = 0; c < W; ++c) vv[c] = ld8(v + j * D + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 ej = _mm256_set1_ps(e[r][j]);
      for (int c = 0; c < W; ++c) a[r][c] = _mm256_fmadd_ps(ej, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (inv) {
      const __m256 iv = _mm256_set1_ps(inv[r]);
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(o[r] + 8 * c, _mm256_mul_ps(a[r][c], iv));
    } else {
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc + r * lda + 8 * c, a[r][c]);
    }
  }
}

template <int W, class E>
inline void weighted_block_rows(int R, const float* const* e, const E* v, int64_t j0, int64_t j1, int64_t D,
                                float* acc, int64_t lda, bool first, const float* inv, float* const* o,
                                int64_t ahead, int64_t pf_every, int64_t pf_at) {
  switch (R) {
    case 6: weighted_block<6, W>(e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at); break;
    case 5: weighted_block<5, W>(e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at); break;
    case 4: weighted_block<4, W>(e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at); break;
    case 3: weighted_block<3, W>(e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at); break;
    case 2: weighted_block<2, W>(e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at); break;
    default: weighted_block<1, W>(e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at); break;
  }
}

// The AVX2 inner loops of attention_groups. Scores: 3 rows x 4 keys per register tile. Weighted sums: passes
// of 32 columns (4 vectors; a pass at the end of a row may be narrower), 3 rows x 4 vectors of accumulators
// (4 x 3, 6 x 2, 6 x 1 for narrower passes). Measured on Zen 3: 32-column passes beat 16-column ones (6 x 2)
// once the values come from memory, as they do in a model's forward.
struct Groups256 {
  static constexpr int kRowMultiple = 1;  // score rows per query row
  static constexpr int kScoreTile = 3;    // score rows per scores call
  static constexpr int kVec = 8;          // columns per vector
  static constexpr int kPassCols = 32;    // columns per weighted pass
  static constexpr int rows_for(int W) { return W >= 4 ? 3 : W == 3 ? 4 : 6; }  // rows per weighted_block call

  // query q [D] as score row r of the group's packed queries
  static void pack(float* qp, int r, const float* q, int D) { memcpy(qp + r * D, q, sizeof(float) * D); }

  template <class E>
  static void scores(int rows, const float* qq, const E* keys, int64_t T, int D, float scale,
                     float* const* s, const float* pf, int64_t pf_lines) {
    switch (D) {  // head sizes with unrolled loops
      case 64: scores_rows<8>(rows, qq, keys, T, D, scale, s, pf, pf_lines); break;
      case 128: scores_rows<16>(rows, qq, keys, T, D, scale, s, pf, pf_lines); break;
      default: scores_rows<0>(rows, qq, keys, T, D, scale, s, pf, pf_lines); break;
    }
  }

  template <class E>
  static void weighted(int W, int R, const float* const* e, const E* v, int64_t j0, int64_t j1, int64_t D,
                       float* acc, int64_t lda, bool first, const float* inv, float* const* o, int64_t /*cols*/,
                       int64_t ahead, int64_t pf_every, int64_t pf_at) {
    if (W == 4)
      weighted_block_rows<4>(R, e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at);
    else if (W == 3)
      weighted_block_rows<3>(R, e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at);
    else if (W == 2)
      weighted_block_rows<2>(R, e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at);
    else
      weighted_block_rows<1>(R, e, v, j0, j1, D, acc, lda, first, inv, o, ahead, pf_every, pf_at);
  }
};

#ifdef __AVX512F__
// weighted_block with 16-column vectors: o[r][0..16 W), the last vector only the lanes in `last`.
template <int R, int W, class E>
inline void weighted_block512(const float* const* e, const E* v, int64_t j0, int64_t j1, int64_t D, float* acc,
                              int64_t lda, bool first, const float* inv, float* const* o, __mmask16 last,
                              int64_t ahead, int64_t pf_every, int64_t pf_at) {
  __m512 a[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) a[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * lda + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    if (ahead && j % pf_every == pf_at)  // fetch the same columns of value j + ahead into L2 meanwhile
      for (int c = 0; c < W; ++c) _mm_prefetch(reinterpret_cast<const char*>(v + (j + ahead) * D + 16 * c), _MM_HINT_T1);
    __m512 vv[W];
    for (int c = 0; c < W; ++c) vv[c] = ld16(c == W - 1 ? last : 0xFFFF, v + j * D + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 ej = _mm512_set1_ps(e[r][j]);
      for (int c = 0; c < W; ++c) a[r][c] = _mm512_fmadd_ps(ej, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (inv) {
      const __m512 iv = _mm512_set1_ps(inv[r]);
      for (int c = 0; c < W; ++c)
        _mm512_mask_storeu_ps(o[r] + 16 * c, c == W - 1 ? last : 0xFFFF, _mm512_mul_ps(a[r][c], iv));
    } else {
      for (int c = 0; c < W; ++c) _mm512_storeu_ps(acc + r * lda + 16 * c, a[r][c]);
    }
  }
}

// Rows per weighted_block512 call for W column vectors (R W accumulators of the 32 registers).
constexpr int rows_for512(int W) { return W >= 4 ? 6 : 8; }

template <int W, class E>
inline void weighted_block_rows512(int R, const float* const* e, const E* v, int64_t j0, int64_t j1, int64_t D,
                                   float* acc, int64_t lda, bool first, const float* inv, float* const* o,
                                   __mmask16 last, int64_t ahead, int64_t pf_every, int64_t pf_at) {
  switch (R) {
    case 8: if constexpr (rows_for512(W) >= 8) weighted_block512<8, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    case 7: if constexpr (rows_for512(W) >= 7) weighted_block512<7, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    case 6: weighted_block512<6, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    case 5: weighted_block512<5, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    case 4: weighted_block512<4, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    case 3: weighted_block512<3, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    case 2: weighted_block512<2, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    default: weighted_block512<1, W>(e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
  }
}

template <int S, class E>
inline void scores_pairs(int np, const float* qp, const E* keys, int64_t T, int D, float scale, float* const* s,
                         const float* pf, int64_t pf_lines) {
  switch (np) {
    case 4: scores512<4, S>(qp, keys, T, D, scale, s, pf, pf_lines); break;
    case 3: scores512<3, S>(qp, keys, T, D, scale, s, pf, pf_lines); break;
    case 2: scores512<2, S>(qp, keys, T, D, scale, s, pf, pf_lines); break;
    default: scores512<1, S>(qp, keys, T, D, scale, s, pf, pf_lines); break;
  }
}

// The AVX-512 inner loops of attention_groups. Scores: kPairs512 row pairs x 4 keys per register tile, the
// queries pair-interleaved ([pairs][D / 8][16]: score row r at pair r / 2, lanes 8 (r % 2) ..). Weighted
// sums: passes of 64 columns (4 vectors), rows_for512(W) rows per register tile.
struct Groups512 {
  static constexpr int kRowMultiple = 2;
  static constexpr int kScoreTile = 2 * kPairs512;
  static constexpr int kVec = 16;
  static constexpr int kPassCols = 64;
  static constexpr int rows_for(int W) { return rows_for512(W); }

  static void pack(float* qp, int r, const float* q, int D) {
    const int steps = D / 8;
    for (int k = 0; k < steps; ++k) memcpy(qp + ((r / 2) * steps + k) * 16 + (r % 2) * 8, q + 8 * k, sizeof(float) * 8);
  }

  template <class E>
  static void scores(int rows, const float* qq, const E* keys, int64_t T, int D, float scale,
                     float* const* s, const float* pf, int64_t pf_lines) {
    switch (D) {  // head sizes with unrolled loops
      case 64: scores_pairs<8>(rows / 2, qq, keys, T, D, scale, s, pf, pf_lines); break;
      case 128: scores_pairs<16>(rows / 2, qq, keys, T, D, scale, s, pf, pf_lines); break;
      default: scores_pairs<0>(rows / 2, qq, keys, T, D, scale, s, pf, pf_lines); break;
    }
  }

  template <class E>
  static void weighted(int W, int R, const float* const* e, const E* v, int64_t j0, int64_t j1, int64_t D,
                       float* acc, int64_t lda, bool first, const float* inv, float* const* o, int64_t cols,
                       int64_t ahead, int64_t pf_every, int64_t pf_at) {
    const __mmask16 last = cols % 16 ? static_cast<__mmask16>(0x00FF) : static_cast<__mmask16>(0xFFFF);
    switch (W) {
      case 4: weighted_block_rows512<4>(R, e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
      case 3: weighted_block_rows512<3>(R, e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
      case 2: weighted_block_rows512<2>(R, e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
      default: weighted_block_rows512<1>(R, e, v, j0, j1, D, acc, lda, first, inv, o, last, ahead, pf_every, pf_at); break;
    }
  }
};
#endif

template <class Isa>
void attention_groups(const float* qkv, int64_t H, int64_t Kh, int64_t D, const Segment* segs, int64_t nseg,
                      float scale, float* out) {
  const int64_t row = (H + 2 * Kh) * D, G = H / Kh;
  const int d = static_cast<int>(D);
  constexpr int M = Isa::kRowMultiple;
  write_new_kv(qkv, H, Kh, D, segs, nseg);
  // the caller's plan and score rows, reused across calls (no allocation once grown)
  thread_local struct {
    std::vector<Group> groups;
    std::vector<int64_t> waves, offA, offC;  // per wave: its first group, its first tile in tilesA / tilesC
    std::vector<Tile> tilesA, tilesC;
    std::vector<char> split_cols;  // per wave: C splits columns, so B runs as its own phase
    std::vector<float> scores, inv;
  } plan;
  std::vector<Group>& groups = plan.groups;
  std::vector<int64_t>& waves = plan.waves;
  groups.clear();
  waves.assign(1, 0);  // groups of wave w: [waves[w], waves[w + 1])
  int64_t widest = 0, wave_floats = 0, arena = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const Segment& g = segs[s];
    widest = g.back + g.n > widest ? g.back + g.n : widest;
    for (int64_t kv = 0; kv < Kh; ++kv)
      for (int64_t q0 = 0; q0 < g.n * G; q0 += kGroupRows) {
        const int R = static_cast<int>(g.n * G - q0 < kGroupRows ? g.n * G - q0 : kGroupRows), S = (R + M - 1) / M * M;
        const int64_t last_token = (q0 + R - 1) / G;
        const int64_t Tmax = g.allowed ? g.p + g.n : g.p + last_token + 1;  // causal: rows see up to their token
        const int64_t floats = S * (Tmax + 8);
        if (wave_floats > 0 && wave_floats + floats > kWaveFloats) {
          waves.push_back(static_cast<int64_t>(groups.size()));
          wave_floats = 0;
        }
        groups.push_back(Group{&g, kv, q0, Tmax, wave_floats, R, S});
        wave_floats += floats;
        arena = wave_floats > arena ? wave_floats : arena;
      }
  }
  waves.push_back(static_cast<int64_t>(groups.size()));
  const size_t nwaves = waves.size() - 1;
  if (static_cast<int64_t>(plan.scores.size()) < arena) plan.scores.resize(arena);
  if (plan.inv.size() < groups.size() * kGroupRows) plan.inv.resize(groups.size() * kGroupRows);
  float* const sbuf = plan.scores.data();
  float* const inv_all = plan.inv.data();
  const int threads = omp_get_max_threads();
  const int64_t block = kBlockFloats / D < 16 ? 16 : kBlockFloats / D / 4 * 4;  // keys per block, a multiple of 4
  // Tiles per wave, per phase (A, then C)
  std::vector<Tile>& tilesA = plan.tilesA;
  std::vector<Tile>& tilesC = plan.tilesC;
  tilesA.clear();
  tilesC.clear();
  plan.offA.assign(1, 0);
  plan.offC.assign(1, 0);
  plan.split_cols.assign(nwaves, 0);
  constexpr int split_rows = Isa::rows_for(Isa::kPassCols / Isa::kVec);  // rows of a full pass's register tile
  for (size_t w = 0; w < nwaves; ++w) {
    const int64_t n = waves[w + 1] - waves[w];
    int64_t work = 0;  // keys x rows (at least 8 rows: a few rows cost the time to read their keys)
    for (int64_t k = waves[w]; k < waves[w + 1]; ++k) work += groups[k].Tmax * (groups[k].S < 8 ? 8 : groups[k].S);
    // tiles per group for ~2 per thread, when the work pays for the barriers between phases: from kSplitWork,
    // or from kSplitRowsWork when every group has the rows to split C by rows (no phase B of its own)
    int64_t fewest = kGroupRows;
    for (int64_t k = waves[w]; k < waves[w + 1]; ++k) fewest = groups[k].R < fewest ? groups[k].R : fewest;
    const bool split = work >= kSplitWork || (fewest >= 2 * split_rows && work >= kSplitRowsWork);
    const int64_t parts = threads > 1 && split ? (2 * threads + n - 1) / n : 1;
    for (int64_t k = waves[w]; k < waves[w + 1]; ++k) {
      const Group& gr = groups[k];
      const int64_t per = ((gr.Tmax + parts - 1) / parts + 3) / 4 * 4;  // keys per A tile, a multiple of 4
      for (int64_t a = 0; a < gr.Tmax; a += per) tilesA.push_back(Tile{k, a, a + per < gr.Tmax ? a + per : gr.Tmax, 0, D});
      if (parts > 1 && gr.R >= 2 * split_rows) {  // rows: whole register tiles of a full pass
        const int64_t rows = ((gr.R + parts - 1) / parts + split_rows - 1) / split_rows * split_rows;
        for (int64_t a = 0; a < gr.R; a += rows) tilesC.push_back(Tile{k, a, a + rows < gr.R ? a + rows : gr.R, 0, D});
      } else if (parts > 1 && D >= 2 * Isa::kVec) {  // columns: whole vectors
        const int64_t vecs = (D + Isa::kVec - 1) / Isa::kVec, cols = (vecs + parts - 1) / parts * Isa::kVec;
        for (int64_t c = 0; c < D; c += cols) tilesC.push_back(Tile{k, 0, gr.R, c, c + cols < D ? c + cols : D});
        plan.split_cols[w] = 1;
      } else {
        tilesC.push_back(Tile{k, 0, gr.R, 0, D});
      }
    }
    plan.offA.push_back(static_cast<int64_t>(tilesA.size()));
    plan.offC.push_back(static_cast<int64_t>(tilesC.size()));
  }
  const int64_t* offA = plan.offA.data();
  const int64_t* offC = plan.offC.data();
  const char* split_cols = plan.split_cols.data();
  auto score_row = [&](const Group& gr, int r) { return sbuf + gr.sc + r * (gr.Tmax + 8); };
  auto softmax_rows = [&](const Group& gr, int64_t r0, int64_t r1, float* rest, float* inv) {
    const Segment& g = *gr.g;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = (gr.q0 + r) / G, Tv = g.allowed ? g.p + g.n : g.p + i + 1;
      float* sr = score_row(gr, static_cast<int>(r));
      inv[r] = row_softmax(g, i, sr, Tv, rest);
      for (int64_t t = Tv; t < gr.Tmax; ++t) sr[t] = 0.0f;  // keys past the row's own add zeros (exactly)
    }
  };
  const int64_t lda = (D + Isa::kVec - 1) / Isa::kVec * Isa::kVec;  // accumulator rows: whole vectors
  struct Scratch {
    std::vector<float> q, qp, rest, acc;
  };
  // A: scores of a group's rows over a key range, a block of keys at a time
  auto run_scores = [&](const Tile& tl, Scratch& w) {
    const Group& gr = groups[tl.group];
    const Segment& g = *gr.g;
    float* srow[kGroupRows];
    for (int r = 0; r < gr.S; ++r) {
      const int64_t qi = gr.q0 + (r < gr.R ? r : gr.R - 1), i = qi / G, h = gr.kv * G + qi % G;
      srow[r] = score_row(gr, r);
      rope(qkv + (g.row0 + i) * row + h * D, g.cos + i * D, g.sin + i * D, d, w.q.data());
      Isa::pack(w.qp.data(), r, w.q.data(), d);
    }
    const float* kh = g.keys16 ? nullptr : g.keys + gr.kv * g.cap * D;
    const uint16_t* kh16 = g.keys16 ? g.keys16 + gr.kv * g.cap * D : nullptr;
    for (int64_t j0 = tl.a0; j0 < tl.a1; j0 += block) {
      const int64_t len = tl.a1 - j0 < block ? tl.a1 - j0 : block;

      for (int r0 = 0; r0 < gr.S; r0 += Isa::kScoreTile) {
        float* s[Isa::kScoreTile];
        const int nr = gr.S - r0 < Isa::kScoreTile ? gr.S - r0 : Isa::kScoreTile;
        for (int r = 0; r < nr; ++r) s[r] = srow[r0 + r] + j0;
        // the row tiles fetch the tile's next block meanwhile, each pass over this block a share of its lines
        const int64_t next = tl.a1 - (j0 + len) < block ? tl.a1 - (j0 + len) : block;
        const int64_t per_line = kh16 ? 32 : 16;  // entries per cache line
        const int64_t lines = next * D / per_line, passes = (gr.S + Isa::kScoreTile - 1) / Isa::kScoreTile;
        const int64_t pass = r0 / Isa::kScoreTile;
        const char* nb = kh16 ? reinterpret_cast<const char*>(kh16 + (j0 + len) * D)
                              : reinterpret_cast<const char*>(kh + (j0 + len) * D);
        const float* pf = next > 0 ? reinterpret_cast<const float*>(nb + pass * lines / passes * 64) : nullptr;
        const int64_t pf_lines = (pass + 1) * lines / passes - pass * lines / passes;
        if (kh16)
          Isa::scores(nr, w.qp.data() + r0 * D, kh16 + j0 * D, len, d, scale, s, pf, pf_lines);
        else
          Isa::scores(nr, w.qp.data() + r0 * D, kh + j0 * D, len, d, scale, s, pf, pf_lines);
      }
    }
  };
  // C: weighted sums of a tile's rows and columns, a block of values at a time (B first when `softmax`)
  auto run_weighted = [&](const Tile& tl, Scratch& w, bool softmax) {
    const Group& gr = groups[tl.group];
    const Segment& g = *gr.g;
    float* inv = inv_all + tl.group * kGroupRows;
    if (softmax) softmax_rows(gr, tl.a0, tl.a1, w.rest.data(), inv);
    const float* e[kGroupRows];
    float* o[kGroupRows];
    for (int64_t r = tl.a0; r < tl.a1; ++r) {
      const int64_t qi = gr.q0 + r, i = qi / G, h = gr.kv * G + qi % G;
      e[r] = score_row(gr, static_cast<int>(r));
      o[r] = out + (g.row0 + i) * H * D + h * D;
    }
    const float* vh = g.vals16 ? nullptr : g.vals + gr.kv * g.cap * D;
    const uint16_t* vh16 = g.vals16 ? g.vals16 + gr.kv * g.cap * D : nullptr;
    for (int64_t j0 = 0; j0 < gr.Tmax; j0 += block) {
      const int64_t j1 = gr.Tmax - j0 < block ? gr.Tmax : j0 + block;
      const bool first = j0 == 0, final = j1 == gr.Tmax;
      for (int64_t c0 = tl.c0; c0 < tl.c1; c0 += Isa::kPassCols) {
        const int64_t cols = tl.c1 - c0 < Isa::kPassCols ? tl.c1 - c0 : Isa::kPassCols;
        const int W = static_cast<int>((cols + Isa::kVec - 1) / Isa::kVec), step = Isa::rows_for(W);
        for (int64_t r = tl.a0; r < tl.a1; r += step) {
          const int R = static_cast<int>(tl.a1 - r < step ? tl.a1 - r : step);
          float* a = w.acc.data() + (r - tl.a0) * lda + (c0 - tl.c0);
          float* oc[kGroupRows];
          for (int k = 0; k < R; ++k) oc[k] = o[r + k] + c0;
          const float* iv = final ? inv + r : nullptr;
          // the next block, each row set fetching every sets-th value of it
          const int64_t ahead = j1 + (j1 - j0) <= gr.Tmax ? j1 - j0 : 0, sets = (tl.a1 - tl.a0 + step - 1) / step;
          const int64_t pf_every = sets, pf_at = (r - tl.a0) / step;
          if (vh16)
            Isa::weighted(W, R, e + r, vh16 + c0, j0, j1, D, a, lda, first, iv, oc, cols, ahead, pf_every, pf_at);
          else
            Isa::weighted(W, R, e + r, vh + c0, j0, j1, D, a, lda, first, iv, oc, cols, ahead, pf_every, pf_at);
        }
      }
    }
  };
#pragma omp parallel
  {
    thread_local Scratch w;  // this thread's, reused across calls
    if (static_cast<int64_t>(w.q.size()) < D) w.q.resize(D);
    if (static_cast<int64_t>(w.qp.size()) < kGroupRows * D) w.qp.resize(kGroupRows * D);
    if (static_cast<int64_t>(w.rest.size()) < widest + 16) w.rest.resize(widest + 16);
    if (static_cast<int64_t>(w.acc.size()) < kGroupRows * lda) w.acc.resize(kGroupRows * lda);
    for (size_t v = 0; v < nwaves; ++v) {
      const int64_t a0 = offA[v], na = offA[v + 1] - a0, c0 = offC[v], nc = offC[v + 1] - c0;
      if (na == waves[v + 1] - waves[v] && nc == na) {
        // no group split: a group's three phases in one work item, without barriers between them
#pragma omp for schedule(static)
        for (int64_t t = 0; t < na; ++t) {
          run_scores(tilesA[a0 + t], w);
          run_weighted(tilesC[c0 + t], w, true);
        }
        continue;
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < na; ++t) run_scores(tilesA[a0 + t], w);
      if (split_cols[v]) {  // B: softmax numerators, when C's tiles share rows
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = waves[v]; k < waves[v + 1]; ++k)
          softmax_rows(groups[k], 0, groups[k].R, w.rest.data(), inv_all + k * kGroupRows);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < nc; ++t) run_weighted(tilesC[c0 + t], w, !split_cols[v]);
    }
  }
}

void attention_best(const float* qkv, int64_t H, int64_t Kh, int64_t D, const Segment* segs, int64_t nseg,
                    float scale, float* out) {
#ifdef __AVX512F__
  attention_groups<Groups512>(qkv, H, Kh, D, segs, nseg, scale, out);
#else
  attention_groups<Groups256>(qkv, H, Kh, D, segs, nseg, scale, out);
#endif
}

// A segment over a float32 cache, or a bfloat16 one (kv16).
Segment segment(int64_t n, int64_t row0, const float* cos, const float* sin, void* keys, void* vals, int64_t cap,
                int64_t p, const uint8_t* allowed, int kv16) {
  Segment g{n, row0, cos, sin, nullptr, nullptr, cap, p, allowed};
  if (kv16) {
    g.keys16 = static_cast<uint16_t*>(keys);
    g.vals16 = static_cast<uint16_t*>(vals);
  } else {
    g.keys = static_cast<float*>(keys);
    g.vals = static_cast<float*>(vals);
  }
  return g;
}

}  // namespace

extern "C" {

// One decoder layer's attention for n new tokens appended to a static KV cache at positions p..p+n-1.
//   qkv [n, (H + 2 Kh) D]: the q, k and v projections of the new tokens (heads in order);
//   cos, sin [n, D]: their rotary tables; keys, vals: this layer's cache, [Kh][cap][D] each (the new
//   tokens' rotated keys and values are written into it), float32, or bfloat16 when kv16 (see to_bf16);
//   allowed [n, n] (uint8, row i = which new tokens token i sees) or null (causal); out [n, H D]. Query head h
//   reads kv head h / (H / Kh).
// Each (token, head) row is independent: scores over the visible keys, softmax (in float32, max
// subtracted), the weighted sum of values; a row's result does not depend on n or on the other rows.
void goose_attention(const float* qkv, int64_t n, int64_t H, int64_t Kh, int64_t D, const float* cos,
                     const float* sin, void* keys, void* vals, int64_t cap, int64_t p, const uint8_t* allowed,
                     float scale, float* out, int kv16) {
  const Segment seg = segment(n, 0, cos, sin, keys, vals, cap, p, allowed, kv16);
  attention_best(qkv, H, Kh, D, &seg, 1, scale, out);
}

// goose_attention in the plain arrangement (`attention`: one token's query heads per work item), the bit
// reference of the grouped kernels, which give the same bits (for tests and benchmarks).
void goose_attention_plain(const float* qkv, int64_t n, int64_t H, int64_t Kh, int64_t D, const float* cos,
                           const float* sin, void* keys, void* vals, int64_t cap, int64_t p, const uint8_t* allowed,
                           float scale, float* out, int kv16) {
  const Segment seg = segment(n, 0, cos, sin, keys, vals, cap, p, allowed, kv16);
  attention(qkv, H, Kh, D, &seg, 1, scale, out);
}

// The same for several sequences in one call (one parallel region): segment s's tokens are rows
// desc[9 s + 1] .. + desc[9 s] of qkv and out; desc per segment: n, row0, cos, sin (pointers), cache (the
// sequence's [layers][2][Kh][cap][D] cache), cap, p, allowed (pointer or 0), kv16 (1: the cache is bfloat16).
// `layer` picks the cache layer.
// Every row's result is the one goose_attention gives for its segment alone.
static std::vector<Segment> batch_segments(int64_t Kh, int64_t D, int64_t nseg, const int64_t* desc, int64_t layer) {
  std::vector<Segment> segs(nseg);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t* e = desc + 9 * s;
    const int64_t half = Kh * e[5] * D, bytes = e[8] ? 2 : 4;  // entries of one layer's keys; bytes per entry
    char* cache = reinterpret_cast<char*>(e[4]) + layer * 2 * half * bytes;
    segs[s] = segment(e[0], e[1], reinterpret_cast<const float*>(e[2]), reinterpret_cast<const float*>(e[3]), cache,
                      cache + half * bytes, e[5], e[6], reinterpret_cast<const uint8_t*>(e[7]), static_cast<int>(e[8]));
  }
  return segs;
}

void goose_attention_batch(const float* qkv, int64_t H, int64_t Kh, int64_t D, int64_t nseg, const int64_t* desc,
                           int64_t layer, float scale, float* out) {
  const std::vector<Segment> segs = batch_segments(Kh, D, nseg, desc, layer);
  attention_best(qkv, H, Kh, D, segs.data(), nseg, scale, out);
}

// The decoder layers of one forward, all in one call (no interpreter between the ~5 kernel calls of each
// layer): for every layer l, with x [M, hid] the residual stream (updated in place),
//   qkv = qkv_proj(RMSNorm_ln1(x)); att = attention (goose_attention_batch, layer l, over desc's segments);
//   x += o_proj(att); gu = gate_up_proj(RMSNorm_ln2(x)); x += down_proj(silu(gu[:, :I]) * gu[:, I:]).
// Each projection is the plan's goose_linear (fmt < 0: float32 panels) or goose_quant_linear (fmt: its
// format code) with the arguments the per-layer calls pass, so the results are bit-identical to them.
// qkv, att and gu are scratch buffers of [M, (H + 2 Kh) D], [M, H D] and [M, 2 I] floats.
struct PlanLinear {
  const void* fn;  // goose_linear or goose_quant_linear (any library built from this project)
  int64_t fmt;     // -1: float32 panels; else the quantized format code
  const void* w;   // the packed weight
  int64_t n, k;    // outputs; inputs (of the ungated input)
  const float* bias;  // padded to whole panels, or null
};
struct PlanLayer {
  const float* ln1;
  const float* ln2;
  float eps1, eps2;
  PlanLinear qkv, o, gate_up, down;
};
typedef void (*FloatLinearFn)(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*,
                              const float*, float, int, int);
typedef void (*QuantLinearFn)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*,
                              const float*, float, int, int);

static void plan_linear(const PlanLinear& op, const float* x, int64_t M, float* y, const float* norm, float eps,
                        int gated, int accumulate) {
  if (op.fmt < 0)
    reinterpret_cast<FloatLinearFn>(const_cast<void*>(op.fn))(x, M, op.k, static_cast<const float*>(op.w), op.n,
                                                               op.bias, y, norm, eps, gated, accumulate);
  else
    reinterpret_cast<QuantLinearFn>(const_cast<void*>(op.fn))(static_cast<int>(op.fmt), x, M, op.k,
                                                               static_cast<const uint8_t*>(op.w), op.n, op.bias, y,
                                                               norm, eps, gated, accumulate);
}

static void plan_layer(const PlanLayer& P, float* x, int64_t M, float* qkv, float* att, float* gu, int64_t H,
                       int64_t Kh, int64_t D, const Segment* segs, int64_t nseg, float scale) {
  plan_linear(P.qkv, x, M, qkv, P.ln1, P.eps1, 0, 0);
  attention_best(qkv, H, Kh, D, segs, nseg, scale, att);
  plan_linear(P.o, att, M, x, nullptr, 0.0f, 0, 1);
  plan_linear(P.gate_up, x, M, gu, P.ln2, P.eps2, 0, 0);
  plan_linear(P.down, gu, M, x, nullptr, 0.0f, 1, 1);
}

void goose_layers(const PlanLayer* plan, int64_t first, int64_t last, float* x, int64_t M, float* qkv, float* att,
                  float* gu, int64_t H, int64_t Kh, int64_t D, int64_t nseg, const int64_t* desc, float scale) {
  for (int64_t l = first; l < last; ++l) {  // layers first .. last - 1 (a forward that taps the stream between)
    const std::vector<Segment> segs = batch_segments(Kh, D, nseg, desc, l);
    plan_layer(plan[l], x, M, qkv, att, gu, H, Kh, D, segs.data(), nseg, scale);
  }
}

// A draft head's step (goose.backends.head.FastHead) in one call: x [M, hid] = fc(in [M, fc.k]) (a row's token
// embedding and the target's feature side by side), then the decoder layer P as goose_layers runs it, over one
// sequence's float32 cache keys, vals [Kh][cap][D]: the M rows are written at p..p+M-1 (rotary tables cos, sin
// [M, D]) and see every key before p - back; keys p-back .. p+M-1 as allowed [M, back + M] (uint8) says, or,
// with allowed null, causally (back 0). qkv, att, gu: scratch as goose_layers'.
void goose_head_layer(const PlanLinear* fc, const PlanLayer* P, const float* in, int64_t M, float* x, float* qkv,
                      float* att, float* gu, int64_t H, int64_t Kh, int64_t D, const float* cos, const float* sin,
                      float* keys, float* vals, int64_t cap, int64_t p, const uint8_t* allowed, int64_t back,
                      float scale) {
  plan_linear(*fc, in, M, x, nullptr, 0.0f, 0, 0);
  Segment seg = segment(M, 0, cos, sin, keys, vals, cap, p, allowed, 0);
  seg.back = allowed ? back : 0;
  plan_layer(*P, x, M, qkv, att, gu, H, Kh, D, &seg, 1, scale);
}

// The k largest values of each row of x [n, V] (row stride ldx) in descending order, ties to the lower
// index (NaNs are never taken; slots they leave empty hold NaN, index 0): vals [n, k], ids [n, k], k <= V. One pass per row: a sorted buffer of k,
// and 8 values at a time compared with its smallest, so almost every block is skipped after the first few.
void goose_topk(const float* x, int64_t n, int64_t V, int64_t ldx, int64_t k, float* vals, int64_t* ids) {
#pragma omp parallel for schedule(static) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * ldx;
    float* tv = vals + i * k;
    int64_t* ti = ids + i * k;
    int64_t filled = 0;
    auto offer = [&](float v, int64_t j) {  // insert after every value >= v (earlier indices win ties)
      if (!(v > (filled < k ? -INFINITY : tv[k - 1])) && !(filled < k && v == -INFINITY)) return;
      int64_t pos = filled < k ? filled++ : k - 1;
      while (pos > 0 && tv[pos - 1] < v) {
        tv[pos] = tv[pos - 1];
        ti[pos] = ti[pos - 1];
        --pos;
      }
      tv[pos] = v;
      ti[pos] = j;
    };
    int64_t j = 0;
    for (; j < V && filled < k; ++j) offer(row[j], j);
    for (; j + 32 <= V; j += 32) {  // 32 values per test: a block with no candidate costs ~4 compares
      const __m256 th = _mm256_set1_ps(tv[k - 1]);
      const __m256 any = _mm256_or_ps(
          _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), th, _CMP_GT_OQ),
                       _mm256_cmp_ps(_mm256_loadu_ps(row + j + 8), th, _CMP_GT_OQ)),
          _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j + 16), th, _CMP_GT_OQ),
                       _mm256_cmp_ps(_mm256_loadu_ps(row + j + 24), th, _CMP_GT_OQ)));
      if (_mm256_movemask_ps(any))
        for (int t = 0; t < 32; ++t) offer(row[j + t], j + t);
    }
    for (; j < V; ++j) offer(row[j], j);
    for (; filled < k; ++filled) {  // fewer than k values that are not NaN
      tv[filled] = NAN;
      ti[filled] = 0;
    }
  }
}


// An adjacency table's harvest in one call (goose.drafting.adjacency): the top k of each row of x [n, V] as
// goose_topk, their scores (with_scores: the softmax over the k values, exp(v - max) / sum; else 1 / k) to
// ids [n, k] and scores [n, k], then row tokens[i] of the table (tab_ids, tab_scores [rows, k], observed
// [rows]) set to row i's, in the order of the rows (the last of duplicate tokens wins). Returns the number of
// tokens outside 0..rows-1 (their rows are not written).
int64_t goose_harvest(const float* x, int64_t n, int64_t V, int64_t ldx, int64_t k, const int64_t* tokens,
                      int with_scores, int64_t* ids, float* scores, int64_t rows, int64_t* tab_ids,
                      float* tab_scores, uint8_t* observed) {
  goose_topk(x, n, V, ldx, k, scores, ids);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    float* s = scores + i * k;
    if (with_scores) {
      const float top = s[0];
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += (s[j] = expf(s[j] - top));
      for (int64_t j = 0; j < k; ++j) s[j] /= sum;
    } else {
      for (int64_t j = 0; j < k; ++j) s[j] = 1.0f / static_cast<float>(k);
    }
    const int64_t t = tokens[i];
    if (t < 0 || t >= rows) {
      ++bad;
      continue;
    }
    memcpy(tab_ids + t * k, ids + i * k, sizeof(int64_t) * k);
    memcpy(tab_scores + t * k, s, sizeof(float) * k);
    observed[t] = 1;
  }
  return bad;
}

}  // extern "C"
