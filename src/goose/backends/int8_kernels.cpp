// goose's integer-dot kernels over GGUF weight blocks (built by int8.py, once per variant: AMX-INT8,
// AVX512-VNNI with VBMI, AVX-VNNI, AVX2): y = in(x) W^T with the activations quantized to 8 bits per row, in blocks of 32,
// and exact int32 dot products against the weights' integer quants. The packed weight is the one
// quant_kernels.cpp packs and reads (goose_quant_pack; 16-column panels, see the layout there), so one
// QuantWeight serves both arithmetics.
//
// ---- the arithmetic (the same float operations in the same order on every variant) ----
//
// Activations, per row and per block b of 32 values x[32]:
//   amax = max |x|;  d = amax / 127;  id = d != 0 ? 1 / d : 0;  q = rint(x * id)  (round half to even; |q| <= 127)
//   (all float32 operations, as written). S(b) = sum of q (int), S16(h) = sum of the 16 q of half-block h.
// Weights: the integer quants of each group (G = 32, Q6_K: 16) and their float32 scale s (and offset o):
//   Q8_0: s = d_w (half), w = s * q                Q4_0: s = d_w, w = s * (q - 8)
//   Q4_1: s = d_w, o = m_w (halves), w = s*q + o   Q4_K: s = d*sc, o = -(dmin*mn) (float32), w = s*q + o
//   Q6_K: s = d*sc (float32), w = s * (q - 32), groups of 16
// One output y[m, n] is a float32 chain over the groups g of the row, in order, from acc = 0:
//   i   = sum_k q_w[k] * q_x[k]  - c * S   (exact int32; c = 8 for Q4_0, 32 for Q6_K (S16), else 0)
//   acc = fma(float(i), s * d, acc)                         (d: the row's scale of the block holding g)
//   acc = fma(o, d * float(S), acc)                         (Q4_1 and Q4_K only)
// (fma: one rounding), then acc + bias (if any), then y + acc (accumulate). No other multiply and add is
// fused (the file is compiled with -ffp-contract=off), so a NumPy reference that emulates fma exactly gives
// the same bits. Nothing depends on M,
// on the row tile, on the thread count or on the variant: integer sums are exact in any order and the
// float chain is per output.
//
// in(x) and the fused options (RMSNorm before, gated silu * up, residual add) are those of
// goose_quant_linear, with one difference: the gated activation silu(g) * u uses goose's own exp (`activate`
// below, 8 values per instruction, the same float operations on every variant) instead of libm's expf one value
// at a time. The RMSNorm is `rms_rows`, the one the float kernels' `prepare` runs (prepare.h), compiled here
// without contraction.

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "gguf_formats.h"  // the formats' codes, GGUF blocks and packed layout (kInfo)
#include "prepare.h"  // `rms_rows`: the RMSNorm before a projection

namespace {

constexpr int kBlock = 32; // activation block

// ---- 16 columns of int32 / float32: one zmm, or two ymm ----
#if defined(__AVX512F__)
#define GOOSE_VNNI 1
constexpr int kTile = 16;  // rows per panel pass: up to 8 as one tile, 9-16 as two tiles per group (`tile`)
constexpr int kAmxRows = 12;  // calls of at least this many rows use AMX tiles (AMX builds; fewer: as vnni512)
struct I {
  __m512i v;
};
struct V {
  __m512 v;
};
inline I izero() { return {_mm512_setzero_si512()}; }
inline I iset(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline I iadd(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I ixor(I a, I b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline I bcast(const uint8_t* p) {
  int32_t t;
  memcpy(&t, p, 4);
  return {_mm512_set1_epi32(t)};
}
// 64 bytes = 4 rows (k or j) x 16 columns -> dword c holds the 4 bytes of column c
inline I wload(const uint8_t* p) {
  const __m512i idx = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11,
                                      58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53,
                                      37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32,
                                      16, 0);
  return {_mm512_permutexvar_epi8(idx, _mm512_loadu_si512(p))};
}
inline I lo4(I a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(15))}; }
inline I hi4(I a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(15))}; }
// acc + sum over each dword of u (unsigned bytes) * s (signed bytes)
inline I dot(I acc, I u, I s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
inline V vcvt(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline V vset(float a) { return {_mm512_set1_ps(a)}; }
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vhalf(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
#else
#if defined(__AVXVNNI__)
#define GOOSE_VNNI 1
#else
#define GOOSE_VNNI 0
#endif
constexpr int kTile = 4;
struct I {
  __m256i a, b;
};
struct V {
  __m256 a, b;
};
inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I iset(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I iadd(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline I ixor(I x, I y) { return {_mm256_xor_si256(x.a, y.a), _mm256_xor_si256(x.b, y.b)}; }
inline I bcast(const uint8_t* p) {
  int32_t t;
  memcpy(&t, p, 4);
  const __m256i v = _mm256_set1_epi32(t);
  return {v, v};
}
inline I wload(const uint8_t* p) {
  const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32));
  const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48));
  const __m128i t0 = _mm_unpacklo_epi8(r0, r1), t1 = _mm_unpackhi_epi8(r0, r1);
  const __m128i t2 = _mm_unpacklo_epi8(r2, r3), t3 = _mm_unpackhi_epi8(r2, r3);
  return {_mm256_set_m128i(_mm_unpackhi_epi16(t0, t2), _mm_unpacklo_epi16(t0, t2)),
          _mm256_set_m128i(_mm_unpackhi_epi16(t1, t3), _mm_unpacklo_epi16(t1, t3))};
}
inline I lo4(I x) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)};
}
inline I hi4(I x) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi16(x.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(x.b, 4), m)};
}
#if GOOSE_VNNI
inline I dot(I acc, I u, I s) {
  return {_mm256_dpbusd_avx_epi32(acc.a, u.a, s.a), _mm256_dpbusd_avx_epi32(acc.b, u.b, s.b)};
}
#else
// u <= 63 here (quants of at most 6 bits), or |w| <= 128 of Q8_0 against |x| <= 127:: the pairwise int16 sums
// of maddubs cannot saturate
inline I dot(I acc, I u, I s) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(_mm256_maddubs_epi16(u.a, s.a), one)),
          _mm256_add_epi32(acc.b, _mm256_madd_epi16(_mm256_maddubs_epi16(u.b, s.b), one))};
}
#endif
inline V vcvt(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V vfma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V vadd(V x, V y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline V vhalf(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
#endif

#if !GOOSE_VNNI
// Q8_0 without VNNI: |w| (unsigned) times x * sign(w)
inline I qabs(I x) { return {_mm256_abs_epi8(x.a), _mm256_abs_epi8(x.b)}; }
inline I qsign(I x, I w) { return {_mm256_sign_epi8(x.a, w.a), _mm256_sign_epi8(x.b, w.b)}; }
#endif

#if defined(__AMX_INT8__)
#define GOOSE_AMX 1
#else
#define GOOSE_AMX 0
#endif

// Q8_0 on VNNI multiplies unsigned weights, w + 128 (the sign bit flipped as they are loaded), by the signed
// activations; the excess 128 * S (S: the block's sum of activations) is the row's integer correction ic.
// (AMX multiplies signed by signed: no correction.)
constexpr bool kOffsetQ8 = GOOSE_VNNI;

// The activations of M rows, quantized for format F: q in the order the kernel reads (nibble formats:
// within each 8 values, the 4 even then the 4 odd ones), and per row and group g the group's scale d, its integer
// correction ic (-c * S, see the top; Q8_0 on VNNI: -128 * S, see kOffsetQ8) and, for Q4_1 / Q4_K, dS = d * S.
struct Act {
  std::vector<uint8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> ic;
  int64_t ldq = 0, ldg = 0;  // q: row stride; d, ds, ic: row-major, [row][group], ldg entries per row (whole
                             // cache lines: the threads that quantize rows write no line another thread writes)
};

struct PairAct;  // the pairs path's expanded activations (plain AVX2 builds only; see linear_pairs)

// One block of 32 activations (max of |x| is exact in any order; x * id and the conversion, rounding half to
// even, are per lane): its scale d returned, its 32 bytes to `out` in the kernel's order (`nibble`:
// each 8 values as the 4 even then the 4 odd ones), the sums of both halves in s[2].
inline __m128i bytes16(const float* x, float id);
inline float absmax32(const float* x);
float quantize_block(const float* x, uint8_t* out, bool nibble, int32_t* s) {
  const float amax = absmax32(x);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int h = 0; h < 2; ++h) {
    __m128i b = bytes16(x + 16 * h, id);
    // sum of 16 signed bytes: sad of (b ^ 0x80) against zero, minus 16 * 128
    const __m128i sad = _mm_sad_epu8(_mm_xor_si128(b, _mm_set1_epi8(-128)), _mm_setzero_si128());
    s[h] = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128;
    if (nibble) b = _mm_shuffle_epi8(b, order);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), b);
  }
  return d;
}

#if defined(__AVX512F__)
inline float absmax32(const float* x) {
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16))));
}
inline __m128i bytes16(const float* x, float id) {
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(id))));
}
#else
inline float absmax32(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
  for (int t = 8; t < kBlock; t += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + t)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline __m128i bytes16(const float* x, float id) {
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(id)));
  const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), _mm256_set1_ps(id)));
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
#endif

// ---- the gated activation: out[m, k] = silu(g) * u, g = x[m, k], u = x[m, K + k], for x [M, 2K] ----
// Per value, in float32, every operation rounded as written (none fused; no libm):
//   t = min(max(-g, -104), 89)          (-g NaN: -104; g NaN still gives NaN below)
//   n = rint(t * LOG2E)                 (round half to even; an integer in [-150, 128])
//   r = (t - n * L1) - n * L2           (L1 has 16 significant bits, so n * L1 is exact)
//   p = c7; p = p * r + c6; ... ; p = p * r + c0    (c_k = 1 / k!, rounded to float32; c1 = c0 = 1)
//   e = (p * 2^(j - 1)) * 2, j = min(max(n, -126), 128)
//                                       (2^(j - 1) formed from its exponent bits, 2^-127 as 0: e = exp(-g) within
//                                        a few ulp; 0 below 2^-125, inf above ~88.7)
//   out = g / (1 + e) * u
// The constants are the exact float32 values below. Every variant runs these lane by lane, 8 lanes at a time with
// AVX2 instructions or 16 with their AVX-512 forms, so the bits do not depend on the variant, the row or the thread.
constexpr float kLog2e = 0x1.715476p+0f, kL1 = 0x1.62e4p-1f, kL2 = 0x1.7f7d1cp-20f;
constexpr float kC[8] = {1.0f, 1.0f, 0x1p-1f, 0x1.555556p-3f, 0x1.555556p-5f, 0x1.111112p-7f, 0x1.6c16c2p-10f,
                         0x1.a01a02p-13f};

inline __m256 silu_up(__m256 g, __m256 u) {
  const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(-104.0f)),
                                 _mm256_set1_ps(89.0f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(t, _mm256_mul_ps(n, _mm256_set1_ps(kL1))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kL2)));
  __m256 p = _mm256_set1_ps(kC[7]);
  for (int c = 6; c >= 0; --c) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kC[c]));
  const __m256i j = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(-126)),
                                     _mm256_set1_epi32(128));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(j, _mm256_set1_epi32(126)), 23));
  const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, scale), _mm256_set1_ps(2.0f));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

#if defined(__AVX512F__)
// silu_up on 16 lanes: the same operations lane by lane (roundscale to nearest even is vroundps's rounding, the
// truncating conversion, integer min / max and min_ps / max_ps's NaN rule are those of the 8-lane forms), so the
// same bits
inline __m512 silu_up16(__m512 g, __m512 u) {
  const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-104.0f)),
                                 _mm512_set1_ps(89.0f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(t, _mm512_mul_ps(n, _mm512_set1_ps(kL1))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(kL2)));
  __m512 p = _mm512_set1_ps(kC[7]);
  for (int c = 6; c >= 0; --c) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kC[c]));
  const __m512i j = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(-126)),
                                     _mm512_set1_epi32(128));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(j, _mm512_set1_epi32(126)), 23));
  const __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, scale), _mm512_set1_ps(2.0f));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

void activate(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = x + m * 2 * K;
    const float* u = g + K;
    float* o = out + m * K;
#if defined(__AVX512F__)
    for (int64_t k = 0; k < K; k += 16)  // (K is a multiple of 32 here)
      _mm512_storeu_ps(o + k, silu_up16(_mm512_loadu_ps(g + k), _mm512_loadu_ps(u + k)));
#else
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_ps(o + k, silu_up(_mm256_loadu_ps(g + k), _mm256_loadu_ps(u + k)));
#endif
  }
}

// The activations' buffers for M rows of K values (format F), whole tiles of 16 rows (for AMX; the q rows past
// M are zero). Their contents are written by `quantize_rows`.
template <int F>
void size_act(int64_t M, int64_t K, Act& a) {
  const int64_t groups = K / kInfo[F].group, padded = (M + 15) / 16 * 16;
  a.ldq = K;
  a.ldg = (groups + 15) / 16 * 16;
  a.q.resize(padded * K);
  if (padded > M) memset(a.q.data() + M * K, 0, (padded - M) * K);
  a.d.resize(M * a.ldg);
  a.ic.resize(M * a.ldg);
  if (has_offset(F)) a.ds.resize(M * a.ldg);
}

// Rows [m0, m1) of x [., K] quantized into a (sized by `size_act`).
template <int F>
void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t K, Act& a, bool offset8) {
  const int64_t blocks = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    float* d_m = a.d.data() + m * a.ldg;
    int32_t* ic_m = a.ic.data() + m * a.ldg;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t s[2];
      const float d = quantize_block(x + m * K + b * kBlock, a.q.data() + m * K + b * kBlock, nibbles(F), s);
      if constexpr (F == kQ6_K) {
        d_m[2 * b] = d;
        d_m[2 * b + 1] = d;
        ic_m[2 * b] = -32 * s[0];
        ic_m[2 * b + 1] = -32 * s[1];
      } else {
        d_m[b] = d;
        ic_m[b] = F == kQ4_0 ? -8 * (s[0] + s[1]) : F == kQ8_0 && offset8 ? -128 * (s[0] + s[1]) : 0;
        if constexpr (has_offset(F)) a.ds[m * a.ldg + b] = d * static_cast<float>(s[0] + s[1]);
      }
    }
  }
}

// The input of a projection for rows [m0, m1): in(x) (see the top: the RMSNorm with `norm`, silu(g) * u when
// `gated`, else x itself; written to buf [M, K] when it is not x), quantized into a.
template <int F>
void input_rows(const float* x, int64_t m0, int64_t m1, int64_t K, const float* norm, float eps, bool gated,
                float* buf, Act& a, bool offset8) {
  const float* in = x;
  if (gated) {
    activate(x + m0 * 2 * K, m1 - m0, K, buf + m0 * K);
    in = buf;
  } else if (norm) {
    rms_rows(x, m0, m1, K, norm, eps, buf);
    in = buf;
  }
  quantize_rows<F>(in, m0, m1, K, a, offset8);
}

// The row ranges the threads split for `input_rows`: up to kNormRows rows each (the RMSNorm's chains run together),
// fewer when that gives each thread a range.
inline int64_t input_step(int64_t M, int threads) {
  const int64_t per = (M + threads - 1) / threads;
  return per < kNormRows ? (per > 0 ? per : 1) : kNormRows;
}

template <int F>
inline void header(const uint8_t* h, V& s, V& o) {
  o = vzero();  // (no offset: unused)
  if constexpr (F == kQ8_0 || F == kQ4_0) {
    s = vhalf(h);
  } else if constexpr (F == kQ4_1) {
    s = vhalf(h);
    o = vhalf(h + 32);
  } else if constexpr (F == kQ4_K) {
    s = vload(reinterpret_cast<const float*>(h));
    o = vload(reinterpret_cast<const float*>(h + 64));
  } else {
    s = vload(reinterpret_cast<const float*>(h));
  }
}

inline void store(float* y, V a, int cols, const float* bias, bool accumulate) {
  if (bias) a = vadd(a, vload(bias));
  float buf[kCols];
  float* out = cols == kCols ? y : buf;
  if (accumulate) {
    if (cols != kCols) memcpy(buf, y, sizeof(float) * cols);
    a = vadd(vload(out), a);
  }
  vstore(out, a);
  if (cols != kCols) memcpy(y, buf, sizeof(float) * cols);
}

// One step of an output's float chain (the top of this file): group g of activation row m, whose exact
// integer dot product with the group's quants is ia (before the format's correction -c * S), the group's
// scales s and offsets o (Q4_1, Q4_K). Every arrangement below runs its chains through this one function.
template <int F>
inline V chain(V acc, I ia, V s, V o, const Act& a, int64_t m, int64_t g) {
  const int64_t at = m * a.ldg + g;
  if constexpr (F == kQ4_0 || F == kQ6_K || (F == kQ8_0 && kOffsetQ8)) ia = iadd(ia, iset(a.ic[at]));
  acc = vfma(vcvt(ia), vmul(s, vset(a.d[at])), acc);
  if constexpr (has_offset(F)) acc = vfma(o, vset(a.ds[at]), acc);
  return acc;
}

// The weight stream of a row tile: group g + kPrefetchGroups's bytes asked into L1 while group g (header at h)
// computes. 16 groups (5-9 KB ahead; the threads' panels are contiguous, so past a panel's end it is their next
// panel): whole int8 forwards in one process, interleaved, on the Zen 5 of docs/performance.md, 8 groups against
// 2 ran 1.14x as fast at 1 row and 1.17-1.21x at 2-8 rows; 16 against 8 1.01-1.06x; 32 no better than 16.
constexpr int kPrefetchGroups = 16;
template <int F>
inline void prefetch_ahead(const uint8_t* h) {
  constexpr int GB = group_bytes(F);
  for (int off = 0; off < GB; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(h + kPrefetchGroups * GB + off), _MM_HINT_T0);
}

// One group g (header at h) of one panel for R rows from row m0 of the activations: their exact integer dot
// products with the group's quants, chained into acc[0..R).
template <int F, int R>
__attribute__((always_inline)) inline void group_rows(const Act& a, int64_t m0, int64_t g, const uint8_t* h, V* acc) {
  constexpr int G = kInfo[F].group, HB = kInfo[F].header;
  const uint8_t* q = h + HB;
  I ia[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) ia[r] = izero();
  const uint8_t* xg = a.q.data() + m0 * a.ldq + g * G;
  if constexpr (nibbles(F)) {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const I v = wload(q + 64 * t), lo = lo4(v), hi = hi4(v);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        ia[r] = dot(ia[r], lo, bcast(xg + r * a.ldq + 8 * t));
        ia[r] = dot(ia[r], hi, bcast(xg + r * a.ldq + 8 * t + 4));
      }
    }
  } else if constexpr (F == kQ6_K) {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const I v = wload(q + 64 * t);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) ia[r] = dot(ia[r], v, bcast(xg + r * a.ldq + 4 * t));
    }
  } else {  // Q8_0
#if GOOSE_VNNI
    const I flip = iset(static_cast<int32_t>(0x80808080u));
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const I v = ixor(wload(q + 64 * t), flip);  // w + 128, unsigned
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) ia[r] = dot(ia[r], v, bcast(xg + r * a.ldq + 4 * t));
    }
#else
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const I v = wload(q + 64 * t), u = qabs(v);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) ia[r] = dot(ia[r], u, qsign(bcast(xg + r * a.ldq + 4 * t), v));
    }
#endif
  }
  V s, o;
  header<F>(h, s, o);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = chain<F>(acc[r], ia[r], s, o, a, m0 + r, g);
}

// R + R2 rows (starting at row m0 of the activations) times one panel w -> y (stride ldy). With R2 > 0 the rows
// run as two tiles within each group, so the panel's weights are read from memory once, at the pace of all the
// rows (two tiles one after the other would read them from memory at the first tile's pace, then from L1);
// each row's chain is the same either way.
template <int F, int R, int R2 = 0>
void tile(const Act& a, int64_t m0, int64_t K, const uint8_t* w, float* y, int64_t ldy, int cols, const float* bias,
          bool accumulate, bool prefetch) {
  constexpr int G = kInfo[F].group, GB = group_bytes(F);
  const int64_t groups = K / G;
  V acc[R + R2];
#pragma GCC unroll 16
  for (int r = 0; r < R + R2; ++r) acc[r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* h = w + g * GB;
    if (prefetch) prefetch_ahead<F>(h);
    group_rows<F, R>(a, m0, g, h, acc);
    if constexpr (R2 > 0) group_rows<F, R2>(a, m0 + R, g, h, acc + R);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R + R2; ++r) store(y + r * ldy, acc[r], cols, bias, accumulate);
}

template <int F>
inline void rows(int r, const Act& a, int64_t m0, int64_t K, const uint8_t* w, float* y, int64_t ldy, int cols,
                 const float* bias, bool acc, bool pf) {
  switch (r) {
#if defined(__AVX512F__)
    case 16: tile<F, 8, 8>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 15: tile<F, 8, 7>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 14: tile<F, 7, 7>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 13: tile<F, 7, 6>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 12: tile<F, 6, 6>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 11: tile<F, 6, 5>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 10: tile<F, 5, 5>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 9: tile<F, 5, 4>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 8: tile<F, 8>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 7: tile<F, 7>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 6: tile<F, 6>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 5: tile<F, 5>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
#endif
    case 4: tile<F, 4>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 3: tile<F, 3>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    case 2: tile<F, 2>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
    default: tile<F, 1>(a, m0, K, w, y, ldy, cols, bias, acc, pf); break;
  }
}

// Every 16-column panel (the threads of the enclosing parallel region split the panels) times the M rows in
// tiles of at most `tile` rows, spread evenly over the fewest tiles: run(r, m, p, cols) for the r rows from m on
// panel p (cols columns).
template <typename Run>
void each_tile(int64_t M, int64_t N, int tile, const Run& run) {
  const int64_t panels = (N + kCols - 1) / kCols, tiles = (M + tile - 1) / tile;
  team::each(panels, [&](int64_t p) {
    const int cols = static_cast<int>(N - p * kCols < kCols ? N - p * kCols : kCols);
    for (int64_t m = 0, i = 0, r = 0; m < M; m += r, ++i) {
      r = (M - m) / (tiles - i);
      run(static_cast<int>(r), m, p, cols);
    }
  });
}

// The plain AVX2 build (vpmaddubsw, no VNNI) has two more arrangements of the same arithmetic, below.
#if !defined(__AVX512F__) && !GOOSE_VNNI
#define GOOSE_MADDUBS 1
#else
#define GOOSE_MADDUBS 0
#endif

#if GOOSE_MADDUBS
// ---- AVX2 (vpmaddubsw), calls of at least panel_rows<F>() rows: weights unpacked once per panel ----
// Per call and 16-column panel, the weights become vpmaddubsw operands once, in a per-thread scratch: per
// group the unpacked quants of both 8-column halves (nibble formats: low, high; Q8_0: |w|, w), then the
// group's scales (and offsets) as float32. Tiles of up to kPanelTile rows then run over the groups, row by row
// within a group (a row's activation broadcast serves both halves; the operands are re-read from L1). Within a
// group the products are summed in int16 where no sum can reach 2^15 and widened to int32 once by vpmaddwd:
// nibble formats, 16 products per lane of at most 15 * 127 (30480); Q6_K, 4 products of at most 63 * 127
// (32004); Q8_0 widens each vpmaddubsw (2 products of at most 128 * 127). The integer sums are exact, so every
// output has the float chain described at the top: the bits of `tile`.
constexpr int kPanelTile = 4;

// The fewest rows for which unpacking a panel once pays (measured on Zen 3: whole int8 forwards, the weights
// streaming from memory, for the nibble formats (the pairs ran 6 and 7 rows 1.05-1.07x as fast, 8 rows even);
// benchmarks/int8_cost.py's shapes for Q8_0, whose unpacked operands (|w| and w: 1 KB per group) cost more to
// store than its rows gain below 32).
template <int F>
constexpr int panel_rows() {
  return F == kQ8_0 ? 32 : 8;
}

// ymm operands per group (both halves)
template <int F>
constexpr int panel_vecs() {
  return F == kQ8_0 ? 32 : (F == kQ6_K ? 8 : 16);
}

// Scratch of one panel: group g's operands at w + g * panel_vecs, its 16 scales at s + 16 g, offsets (Q4_1,
// Q4_K) at o + 16 g.
struct PanelScratch {
  __m256i* w = nullptr;
  float *s = nullptr, *o = nullptr;
  int64_t vecs = 0, groups = 0;  // what w and s, o hold room for

  // room for `groups_` groups of `nv` vectors: a thread's scratch grows to the largest call it ran, then is reused
  void reserve(int64_t groups_, int nv) {
    if (groups_ * nv > vecs) {
      free(w);
      vecs = groups_ * nv;
      w = static_cast<__m256i*>(aligned_alloc(32, vecs * sizeof(__m256i)));
    }
    if (groups_ > groups) {
      groups = groups_;
      free(s);
      free(o);
      s = static_cast<float*>(aligned_alloc(32, groups * 16 * sizeof(float)));
      o = static_cast<float*>(aligned_alloc(32, groups * 16 * sizeof(float)));
    }
  }
  ~PanelScratch() {
    free(w);
    free(s);
    free(o);
  }
};

template <int F>
void panel_unpack(const uint8_t* packed, int64_t groups, const PanelScratch& ps) {
  constexpr int GB = group_bytes(F), HB = kInfo[F].header, NV = panel_vecs<F>();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* h = packed + g * GB;
    const uint8_t* q = h + HB;
    __m256i* w = ps.w + g * NV;
    if constexpr (nibbles(F)) {
      for (int t = 0; t < 4; ++t) {
        const I v = wload(q + 64 * t), lo = lo4(v), hi = hi4(v);
        w[4 * t] = lo.a, w[4 * t + 1] = lo.b, w[4 * t + 2] = hi.a, w[4 * t + 3] = hi.b;
      }
    } else if constexpr (F == kQ6_K) {
      for (int t = 0; t < 4; ++t) {
        const I v = wload(q + 64 * t);
        w[2 * t] = v.a, w[2 * t + 1] = v.b;
      }
    } else {
      for (int t = 0; t < 8; ++t) {
        const I v = wload(q + 64 * t), u = qabs(v);
        w[4 * t] = u.a, w[4 * t + 1] = u.b, w[4 * t + 2] = v.a, w[4 * t + 3] = v.b;
      }
    }
    V s, o;
    header<F>(h, s, o);
    _mm256_store_ps(ps.s + 16 * g, s.a);
    _mm256_store_ps(ps.s + 16 * g + 8, s.b);
    if constexpr (has_offset(F)) {
      _mm256_store_ps(ps.o + 16 * g, o.a);
      _mm256_store_ps(ps.o + 16 * g + 8, o.b);
    }
  }
}

inline __m256i bcast4(const uint8_t* p) {
  int32_t t;
  memcpy(&t, p, 4);
  return _mm256_set1_epi32(t);
}
// vpmaddubsw of the unsigned operand at u (scratch) and s
inline __m256i mub(const __m256i* u, __m256i s) { return _mm256_maddubs_epi16(_mm256_load_si256(u), s); }

// R rows (from m0) times one panel (its scratch) -> y, as `tile`.
template <int F, int R>
void panel_tile(const Act& a, int64_t m0, int64_t groups, const PanelScratch& ps, float* y, int64_t ldy, int cols,
                const float* bias, bool accumulate) {
  constexpr int G = kInfo[F].group, NV = panel_vecs<F>();
  const uint8_t* xq = a.q.data() + m0 * a.ldq;
  const int64_t ldq = a.ldq;
  const __m256i ones = _mm256_set1_epi16(1);
  V acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i* v = ps.w + g * NV;
    const uint8_t* xg = xq + g * G;
    const V sg = vload(ps.s + 16 * g), og = has_offset(F) ? vload(ps.o + 16 * g) : vzero();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xg + r * ldq;
      I ia;
      if constexpr (nibbles(F)) {
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m256i b0 = bcast4(x + 8 * t), b1 = bcast4(x + 8 * t + 4);
          s0 = _mm256_add_epi16(s0, _mm256_add_epi16(mub(v + 4 * t, b0), mub(v + 4 * t + 2, b1)));
          s1 = _mm256_add_epi16(s1, _mm256_add_epi16(mub(v + 4 * t + 1, b0), mub(v + 4 * t + 3, b1)));
        }
        ia = {_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones)};
      } else if constexpr (F == kQ6_K) {
        ia = izero();
#pragma GCC unroll 2
        for (int t = 0; t < 4; t += 2) {
          const __m256i b0 = bcast4(x + 4 * t), b1 = bcast4(x + 4 * t + 4);
          const __m256i pa = _mm256_add_epi16(mub(v + 2 * t, b0), mub(v + 2 * t + 2, b1));
          const __m256i pb = _mm256_add_epi16(mub(v + 2 * t + 1, b0), mub(v + 2 * t + 3, b1));
          ia.a = _mm256_add_epi32(ia.a, _mm256_madd_epi16(pa, ones));
          ia.b = _mm256_add_epi32(ia.b, _mm256_madd_epi16(pb, ones));
        }
      } else {  // Q8_0: |w| times x * sign(w)
        ia = izero();
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m256i b = bcast4(x + 4 * t);
          const __m256i pa = mub(v + 4 * t, _mm256_sign_epi8(b, _mm256_load_si256(v + 4 * t + 2)));
          const __m256i pb = mub(v + 4 * t + 1, _mm256_sign_epi8(b, _mm256_load_si256(v + 4 * t + 3)));
          ia.a = _mm256_add_epi32(ia.a, _mm256_madd_epi16(pa, ones));
          ia.b = _mm256_add_epi32(ia.b, _mm256_madd_epi16(pb, ones));
        }
      }
      acc[r] = chain<F>(acc[r], ia, sg, og, a, m0 + r, g);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store(y + r * ldy, acc[r], cols, bias, accumulate);
}

template <int F>
void linear_panels(const Act& a, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias, float* y,
                   bool acc) {
  constexpr int NV = panel_vecs<F>();
  const int64_t groups = K / kInfo[F].group, panels = (N + kCols - 1) / kCols;
  const int64_t pbytes = groups * group_bytes(F);
  const int64_t tiles = (M + kPanelTile - 1) / kPanelTile;  // rows spread evenly over the fewest tiles
  auto panel = [&](int64_t p, const PanelScratch& ps) {
    const int cols = static_cast<int>(N - p * kCols < kCols ? N - p * kCols : kCols);
    const uint8_t* w = packed + p * pbytes;
    panel_unpack<F>(w, groups, ps);
    if (p + 1 < panels)  // the next panel's weights arrive in L2 while this one computes (L1 holds the scratch)
      for (int64_t off = 0; off < pbytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + pbytes + off), _MM_HINT_T1);
    const float* b = bias ? bias + p * kCols : nullptr;
    for (int64_t m = 0, i = 0, r = 0; m < M; m += r, ++i) {
      r = (M - m) / (tiles - i);
      float* yp = y + m * N + p * kCols;
      switch (r) {
        case 4: panel_tile<F, 4>(a, m, groups, ps, yp, N, cols, b, acc); break;
        case 3: panel_tile<F, 3>(a, m, groups, ps, yp, N, cols, b, acc); break;
        case 2: panel_tile<F, 2>(a, m, groups, ps, yp, N, cols, b, acc); break;
        default: panel_tile<F, 1>(a, m, groups, ps, yp, N, cols, b, acc); break;
      }
    }
  };
#pragma omp parallel
  {
    PanelScratch mine;  // this thread's of OpenMP's team
    const bool pooled = team::pooled();
    if (!pooled) mine.reserve(groups, NV);
    team::each(panels, [&](int64_t p) {
      if (!pooled) return panel(p, mine);
      thread_local PanelScratch ps;  // on the claim pool: the running thread's, grown as needed
      ps.reserve(groups, NV);
      panel(p, ps);
    });
  }
}

// ---- AVX2, nibble formats, calls of fewer than panel_rows<F>() rows: pairs of byte rows, no transpose ----
// A panel's 64 bytes of quants (4 byte rows j x 16 columns, see wload) are read as two ymm, [j0 | j1] and
// [j2 | j3]; one vpunpck{l,h}bw gives, per 16-bit lane, one column's bytes of rows (j0, j2) (low 128 bits) or
// (j1, j3) (high): 16 lanes, 8 columns, without the transpose of wload. The activation operand of those lanes
// is expanded once per call (PairAct: per 4 activation bytes x[j] of a nibble slice, 32 bytes holding
// (x[0], x[2]) 8 times, then (x[1], x[3]) 8 times), so vpmaddubsw reads it from memory. A lane sums 16 products
// of at most 15 * 127 per group in int16 (30480), then the two 128-bit halves, widened, are added per column.
struct PairAct {
  std::vector<uint8_t> bytes;  // [row][K / 4] operands of 32 bytes (grown as needed; all a call reads is written first)
  int64_t ld = 0;              // operands per row
  const __m256i* x() const { return reinterpret_cast<const __m256i*>(bytes.data()); }
};

void size_pairs(int64_t M, int64_t K, PairAct& e) {
  e.ld = K / 4;
  if (static_cast<int64_t>(e.bytes.size()) < M * e.ld * 32) e.bytes.resize(M * e.ld * 32);
}

// Rows [m0, m1) of the activations expanded into e (sized by `size_pairs`).
void expand_pairs(const Act& a, int64_t m0, int64_t m1, PairAct& e) {
  __m256i* out = reinterpret_cast<__m256i*>(e.bytes.data());
  const __m256i order = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3,
                                         1, 3, 1, 3, 1, 3);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t i = 0; i < e.ld; ++i) {
      int32_t t;
      memcpy(&t, a.q.data() + m * a.ldq + 4 * i, 4);
      _mm256_storeu_si256(out + m * e.ld + i, _mm256_shuffle_epi8(_mm256_set1_epi32(t), order));
    }
}

// the 8 int32 column sums of 16 int16 lanes (low half: rows j0, j2; high: j1, j3)
inline __m256i widen_pairs(__m256i s) {
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)));
}

// R rows (from m0) times one panel w -> y, as `tile` (nibble formats).
template <int F, int R>
void pair_tile(const Act& a, const PairAct& e, int64_t m0, int64_t K, const uint8_t* w, float* y, int64_t ldy,
               int cols, const float* bias, bool accumulate, bool prefetch) {
  constexpr int G = kInfo[F].group, GB = group_bytes(F), HB = kInfo[F].header;
  const int64_t groups = K / G;
  const __m256i* xe = e.x() + m0 * e.ld;
  const __m256i m15 = _mm256_set1_epi8(15);
  V acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* h = w + g * GB;
    if (prefetch) prefetch_ahead<F>(h);
    const uint8_t* q = h + HB;
    __m256i sa[R], sb[R];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * t));
      const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * t + 32));
      const __m256i t1 = _mm256_unpacklo_epi8(A, B), t2 = _mm256_unpackhi_epi8(A, B);
      const __m256i l1 = _mm256_and_si256(t1, m15), h1 = _mm256_and_si256(_mm256_srli_epi16(t1, 4), m15);
      const __m256i l2 = _mm256_and_si256(t2, m15), h2 = _mm256_and_si256(_mm256_srli_epi16(t2, 4), m15);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i* x = xe + r * e.ld + g * (G / 4) + 2 * t;
        const __m256i xl = _mm256_loadu_si256(x), xh = _mm256_loadu_si256(x + 1);
        const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh));
        const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(l2, xl), _mm256_maddubs_epi16(h2, xh));
        sa[r] = t ? _mm256_add_epi16(sa[r], pa) : pa;
        sb[r] = t ? _mm256_add_epi16(sb[r], pb) : pb;
      }
    }
    V s, o;
    header<F>(h, s, o);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r] = chain<F>(acc[r], I{widen_pairs(sa[r]), widen_pairs(sb[r])}, s, o, a, m0 + r, g);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store(y + r * ldy, acc[r], cols, bias, accumulate);
}

// Run by every thread of the enclosing parallel region (they split the panels), e expanded from a.
template <int F>
void linear_pairs(const Act& a, const PairAct& e, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                  const float* bias, float* y, bool acc) {
  const int64_t pbytes = K / kInfo[F].group * group_bytes(F);
  each_tile(M, N, kTile, [&](int r, int64_t m, int64_t p, int cols) {
    const uint8_t* w = packed + p * pbytes;
    const float* b = bias ? bias + p * kCols : nullptr;
    float* yp = y + m * N + p * kCols;
    switch (r) {
      case 4: pair_tile<F, 4>(a, e, m, K, w, yp, N, cols, b, acc, m == 0); break;
      case 3: pair_tile<F, 3>(a, e, m, K, w, yp, N, cols, b, acc, m == 0); break;
      case 2: pair_tile<F, 2>(a, e, m, K, w, yp, N, cols, b, acc, m == 0); break;
      default: pair_tile<F, 1>(a, e, m, K, w, yp, N, cols, b, acc, m == 0); break;
    }
  });
}
#endif

#if GOOSE_AMX
// ---- AMX-INT8: the integer dot products of up to 16 rows x 16 columns of a group in one tile op ----
struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// A panel's weights as AMX B tiles, once per call: per group G / 4 rows of 16 columns x 4 bytes (nibble
// formats: the low then the high nibbles of each 64 bytes, the order of the activations).
template <int F>
void amx_panel_weights(const uint8_t* w, int64_t groups, uint8_t* bt) {
  constexpr int G = kInfo[F].group, GB = group_bytes(F), HB = kInfo[F].header;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = w + g * GB + HB;
    uint8_t* b = bt + g * (G / 4 * 64);
    if constexpr (nibbles(F)) {
      for (int t = 0; t < 4; ++t) {
        const I v = wload(q + 64 * t);
        _mm512_store_si512(b + 128 * t, lo4(v).v);
        _mm512_store_si512(b + 128 * t + 64, hi4(v).v);
      }
    } else {
      for (int t = 0; t < G / 4; ++t) _mm512_store_si512(b + 64 * t, wload(q + 64 * t).v);
    }
  }
}

// Tiles: C in 0/1, A in 2/3, B in 4/5 (two groups in flight: the tile product of group g + 1 runs while the
// vector units do group g's float chain).
// rows: of A and C (calls of fewer than 16 rows multiply only those)
template <int F>
void amx_config(int rows) {
  constexpr int G = kInfo[F].group;
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 2; ++t) {
    cfg.rows[t] = rows, cfg.colsb[t] = 64;           // C: rows x 16 int32
    cfg.rows[2 + t] = rows, cfg.colsb[2 + t] = G;    // A: rows x G activation bytes
    cfg.rows[4 + t] = G / 4, cfg.colsb[4 + t] = 64;  // B: G / 4 rows x 16 columns x 4 bytes
  }
  _tile_loadconfig(&cfg);
}

// group g's product into C tile 0 (A 2, B 4) or 1 (A 3, B 5): the tile numbers are immediates
#define GOOSE_AMX_ISSUE(NAME, C, A, B)                                                  \
  template <int F>                                                                      \
  inline void NAME(const uint8_t* xa, int64_t ldq, const uint8_t* b) {                  \
    _tile_loadd(A, xa, ldq);                                                            \
    _tile_loadd(B, b, 64);                                                              \
    _tile_zero(C);                                                                      \
    if constexpr (F == kQ8_0) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B);        \
  }
GOOSE_AMX_ISSUE(amx_issue0, 0, 2, 4)
GOOSE_AMX_ISSUE(amx_issue1, 1, 3, 5)
#undef GOOSE_AMX_ISSUE

// R rows (m0..) of one panel: per group, C = A B in tiles, stored, then each row's float chain as in `tile`
// (the integer corrections are exact, so adding them after the product changes nothing), accumulators in
// registers.
template <int F, int R>
void amx_tile(const Act& a, int64_t m0, int64_t K, const uint8_t* w, const uint8_t* bt, float* y, int64_t ldy,
              int cols, const float* bias, bool accumulate) {
  constexpr int G = kInfo[F].group, GB = group_bytes(F), BB = G / 4 * 64;
  const int64_t groups = K / G;
  const uint8_t* xq = a.q.data() + m0 * a.ldq;
  alignas(64) int32_t ct[2][16 * 16];
  V acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  // Pipelined: step g stores group g's C (its product issued two steps earlier), runs group g - 1's float
  // chain on the C stored one step earlier, then issues group g + 2's product into the tiles just freed; so
  // no tile or vector instruction waits for a tile result. (GCC's tile intrinsics declare no memory effects:
  // the empty asm statements tell the compiler that the tile store wrote ct.)
  amx_issue0<F>(xq, a.ldq, bt);
  if (groups > 1) amx_issue1<F>(xq + G, a.ldq, bt + BB);
  for (int64_t g = 0; g <= groups; ++g) {
    if (g < groups) {
      if (g & 1) {
        _tile_stored(1, ct[1], 64);
        asm volatile("" : "+m"(ct[1]));
      } else {
        _tile_stored(0, ct[0], 64);
        asm volatile("" : "+m"(ct[0]));
      }
    }
    if (g > 0) {
      const int64_t gc = g - 1;  // group gc's float chain, exactly as in `tile`
      const int32_t* c = ct[gc & 1];
      V s, o;
      header<F>(w + gc * GB, s, o);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r] = chain<F>(acc[r], I{_mm512_load_si512(c + 16 * r)}, s, o, a, m0 + r, gc);
    }
    if (g + 2 < groups) {
      if (g & 1) amx_issue1<F>(xq + (g + 2) * G, a.ldq, bt + (g + 2) * BB);
      else amx_issue0<F>(xq + (g + 2) * G, a.ldq, bt + (g + 2) * BB);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store(y + r * ldy, acc[r], cols, bias, accumulate);
}

template <int F>
void amx_rows(int r, const Act& a, int64_t m0, int64_t K, const uint8_t* w, const uint8_t* bt, float* y,
              int64_t ldy, int cols, const float* bias, bool acc) {
#define GOOSE_AMX_CASE(R) \
  case R: amx_tile<F, R>(a, m0, K, w, bt, y, ldy, cols, bias, acc); break;
  switch (r) {
    GOOSE_AMX_CASE(16) GOOSE_AMX_CASE(15) GOOSE_AMX_CASE(14) GOOSE_AMX_CASE(13) GOOSE_AMX_CASE(12)
    GOOSE_AMX_CASE(11) GOOSE_AMX_CASE(10) GOOSE_AMX_CASE(9) GOOSE_AMX_CASE(8) GOOSE_AMX_CASE(7)
    GOOSE_AMX_CASE(6) GOOSE_AMX_CASE(5) GOOSE_AMX_CASE(4) GOOSE_AMX_CASE(3) GOOSE_AMX_CASE(2)
    default: amx_tile<F, 1>(a, m0, K, w, bt, y, ldy, cols, bias, acc); break;
  }
#undef GOOSE_AMX_CASE
}

// All M rows of each panel: the panel's B tiles made once, then row tiles of 16 (the activation rows past M
// are zero, see `quantize`).
template <int F>
void linear_amx(const Act& a, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias, float* y,
                bool acc) {
  constexpr int G = kInfo[F].group;
  const int64_t groups = K / G, panels = (N + kCols - 1) / kCols, pbytes = groups * group_bytes(F);
#pragma omp parallel
  {
    uint8_t* bt = static_cast<uint8_t*>(aligned_alloc(64, groups * (G / 4 * 64)));
    amx_config<F>(M < 16 ? static_cast<int>(M) : 16);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int cols = static_cast<int>(N - p * kCols < kCols ? N - p * kCols : kCols);
      const uint8_t* w = packed + p * pbytes;
      amx_panel_weights<F>(w, groups, bt);
      if (p + 1 < panels)  // the next panel's weights arrive while this one computes
        for (int64_t off = 0; off < pbytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + pbytes + off), _MM_HINT_T0);
      asm volatile("" ::: "memory");  // the tile loads read bt (the tile intrinsics declare no memory use)
      for (int64_t m = 0; m < M; m += 16) {
        const int r = static_cast<int>(M - m < 16 ? M - m : 16);
        amx_rows<F>(r, a, m, K, w, bt, y + m * N + p * kCols, N, cols, bias ? bias + p * kCols : nullptr, acc);
      }
    }
    _tile_release();
    free(bt);
  }
}
#endif

// y = in(x) W^T (see the top) for the M rows of x: per call, the threads first split the rows' inputs (in(x),
// quantized; `input_rows`), then the panels, in one parallel region where the path allows (the buffers are the
// calling thread's, reused across calls).
template <int F>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias, float* y,
            bool acc, const float* norm, float eps, bool gated) {
  thread_local Act mine;  // (the parallel region's threads see these through the references below: a
  thread_local std::vector<float> buf;  // thread_local named inside it would be the running thread's own)
  Act& a = mine;
  size_act<F>(M, K, a);
  if ((norm || gated) && static_cast<int64_t>(buf.size()) < M * K) buf.resize(M * K);
  float* const in = buf.data();
  const int64_t step = input_step(M, team::threads()), ranges = (M + step - 1) / step;
  // each thread's share of the rows: in(x), quantized (and, for the pairs below, expanded by the same thread)
  auto inputs = [&](bool offset8, PairAct* e = nullptr) {
    team::each(ranges, [&](int64_t i) {
      const int64_t m0 = i * step, m1 = (i + 1) * step < M ? (i + 1) * step : M;
      input_rows<F>(x, m0, m1, K, norm, eps, gated, in, a, offset8);
#if GOOSE_MADDUBS
      if (e) expand_pairs(a, m0, m1, *e);
#endif
    });
  };
#if GOOSE_AMX
  if (M >= kAmxRows) {
#pragma omp parallel
    inputs(false);
    linear_amx<F>(a, M, K, packed, N, bias, y, acc);
    return;
  }
#endif
#if GOOSE_MADDUBS
  if (M >= panel_rows<F>()) {
#pragma omp parallel
    inputs(kOffsetQ8);
    linear_panels<F>(a, M, K, packed, N, bias, y, acc);
    return;
  }
  if constexpr (nibbles(F)) {  // (the region reaches a and e only through the lambda made here; see `mine`)
    thread_local PairAct pairs;  // the calling thread's, reused across calls (as `mine`)
    PairAct& e = pairs;
    size_pairs(M, K, e);
    auto run = [&] {
      inputs(kOffsetQ8, &e);
      linear_pairs<F>(a, e, M, K, packed, N, bias, y, acc);
    };
#pragma omp parallel
    run();
    return;
  }
#endif
  const int64_t pbytes = K / kInfo[F].group * group_bytes(F);
#pragma omp parallel
  {
    inputs(kOffsetQ8);
    each_tile(M, N, kTile, [&](int r, int64_t m, int64_t p, int cols) {
      rows<F>(r, a, m, K, packed + p * pbytes, y + m * N + p * kCols, N, cols, bias ? bias + p * kCols : nullptr,
              acc, m == 0);
    });
  }
}

}  // namespace

extern "C" {

int goose_int8_abi(void) { return 1; }

// The calling thread's projections run on this library's claim pool with `width` threads while its OpenMP
// regions have one thread (width <= 1: OpenMP's team; team.h). The AMX path stays on OpenMP.
void goose_int8_claim(int width) { team::claim(width); }

// 1 when this library's variant can run here: the AMX variant asks Linux for the tile data state first
// (arch_prctl ARCH_REQ_XCOMP_PERM, once per process); 0 when refused.
int goose_int8_ready(void) {
#if GOOSE_AMX
  static const int ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return 1;
#endif
}

// 1024: AMX-INT8 (+ AVX512-VNNI); 512: AVX512-VNNI; 257: AVX-VNNI; 256: AVX2
int goose_int8_isa(void) {
#if GOOSE_AMX
  return 1024;
#elif defined(__AVX512F__)
  return 512;
#elif GOOSE_VNNI
  return 257;
#else
  return 256;
#endif
}

// The quantized activations of x [M, K] (K a multiple of 32), in natural order: q [M, K] int8, d [M, K / 32].
void goose_int8_quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      int32_t s[2];
      uint8_t* out = reinterpret_cast<uint8_t*>(q + m * K + b * kBlock);
      d[m * (K / kBlock) + b] = quantize_block(x + m * K + b * kBlock, out, false, s);
    }
}

// The call shape of goose_quant_linear (same packed weight, same fused options): x [M, K] ([M, 2K] gated),
// packed [N, K] in format f, bias [ceil(N / 16) * 16] or null, norm [K] or null, y [M, N].
void goose_int8_linear(int f, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                       const float* bias, float* y, const float* norm, float eps, int gated, int accumulate) {
  const bool acc = accumulate != 0, g = gated != 0;
  switch (f) {
    case kQ8_0: linear<kQ8_0>(x, M, K, packed, N, bias, y, acc, norm, eps, g); break;
    case kQ4_0: linear<kQ4_0>(x, M, K, packed, N, bias, y, acc, norm, eps, g); break;
    case kQ4_1: linear<kQ4_1>(x, M, K, packed, N, bias, y, acc, norm, eps, g); break;
    case kQ4_K: linear<kQ4_K>(x, M, K, packed, N, bias, y, acc, norm, eps, g); break;
    case kQ6_K: linear<kQ6_K>(x, M, K, packed, N, bias, y, acc, norm, eps, g); break;
    default: break;
  }
}

}  // extern "C"
