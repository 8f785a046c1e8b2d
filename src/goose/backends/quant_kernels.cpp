// goose's quantized-weight CPU kernels (built by quant.py, once per instruction set: AVX2 + FMA + F16C, and
// AVX-512 F/BW/VL): a small-batch linear layer over GGUF weight blocks (goose_quant_linear), the packing of
// GGUF rows into goose's panel layout (goose_quant_pack), and the dequantization of chosen rows (an
// embedding lookup, goose_quant_rows).
//
// ---- formats ----
//
// GGUF stores a weight W [N, K] row by row, each row as blocks along K. The formats read here (ggml's
// definitions; d, m, dmin are IEEE half floats):
//   Q8_0 (34 B / 32 weights):  d, q[32] int8                         w = d * q
//   Q4_0 (18 B / 32):          d, qs[16]: q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4      w = d * (q - 8)
//   Q4_1 (20 B / 32):          d, m, qs[16] as Q4_0                  w = d * q + m
//   Q4_K (144 B / 256):        d, dmin, 12 bytes of 6-bit (sc, mn) for 8 sub-blocks of 32, qs[128]
//                              (32-byte chunk c: low nibbles = sub-block 2c, high = 2c + 1)
//                              w = (d * sc) * q - (dmin * mn)
//   Q6_K (210 B / 256):        ql[128], qh[64], sc[16] int8 (one per 16 weights), d
//                              w = (d * sc) * (q - 32), q = 4 low bits from ql, 2 high from qh
//
// Every product above is exact in float32 (an 11-bit half mantissa times integers of at most 13 bits), so
// each weight has exactly one rounding at most (the final add of Q4_1 / Q4_K). goose writes each weight
// as w = fma(q, s, o) (Q4_1, Q4_K) or (q - c) * s (Q8_0, Q4_0, Q6_K; the integer c subtracted first) with
// float32 s, o per group of G weights: the same exact value and the same one rounding, so the weights this
// kernel multiplies are bit for bit the float32 weights gguf's own numpy dequantization gives, down to the
// sign of a zero (tests check it on every format).
//
// Packed layout: panels of 16 rows of W (16 output columns), rows past N zero. A panel is K / G groups
// one after the other, each a header then the group's quants for the 16 columns:
//   Q8_0: G 32, header d[16] f16,               quants [32][16] int8
//   Q4_0: G 32, header d[16] f16,               quants [16][16] bytes: k = 2j low nibble, 2j + 1 high
//   Q4_1: G 32, header d[16] f16, m[16] f16,    quants as Q4_0
//   Q4_K: G 32, header s[16] f32, o[16] f32,    quants as Q4_0          (s = d * sc, o = -(dmin * mn))
//   Q6_K: G 16, header s[16] f32,               quants [16][16] uint8 0..63 (s = d * sc)
// so a panel is one sequential stream and 16 columns of one k unpack into one 16-lane vector.
//
// ---- goose_quant_linear ----
//
//   y[m, n] = (y[m, n] +) sum_k in(x)[m, k] * w[n, k]  (+ bias[n])
//
// with in(x) and the fused options exactly as goose_linear in cpu_kernels.cpp (RMSNorm before, gated
// silu * up, residual add). Numerics: every output is one fused-multiply-add chain over k = 0..K-1 in
// order, started from zero, then + bias, then added to y: the same chain as goose_linear on the
// dequantized weights, so the two kernels give bit-identical results, and no result depends on M, on the
// row's tile, on the thread count, or on the instruction set (AVX2 and AVX-512 differ only in how many
// columns one instruction carries).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "gguf_formats.h"  // the formats' codes, GGUF blocks and packed layout (kInfo)
#include "prepare.h"  // `prepare`: RMSNorm or silu(gate) * up before a projection

namespace {

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// ---- 16-lane float vectors: one zmm with AVX-512, two ymm otherwise ----
#ifdef __AVX512F__
constexpr int kTile = 8;      // rows per register tile (2 panels x 8 rows = 16 accumulators of 32; 8 rows
                              // read each unpacked group 1.25x as often as 6 did: ~100 GFMA/s, not ~90)
constexpr int kPairRows = 8;  // tiles of up to this many rows run over two panels at once
constexpr int kQuadRows = 2;  // calls of up to this many rows take work items of four panels: a 1-row call
                              // is bound by the latency of its FMA chains (one per 16 columns, K long), so
                              // four panels at once keep four chains per row in flight instead of two
struct V {
  __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float a) { return {_mm512_set1_ps(a)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vhalf(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// 16 bytes of nibble pairs -> the low and the high nibbles minus `off`, as floats (exact)
inline void vnibbles(const uint8_t* p, int off, V& lo, V& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i o = _mm512_set1_epi32(off);
  lo = {_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), o))};
  hi = {_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), o))};
}
// 16 unsigned bytes minus `off`, as floats
inline V vu8(const uint8_t* p, int off) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtepi32_ps(_mm512_sub_epi32(b, _mm512_set1_epi32(off)))};
}
inline V vi8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
#else
constexpr int kTile = 4;
constexpr int kPairRows = 2;
constexpr int kQuadRows = 0;  // (four panels of two ymm each would not fit the 16 registers)
struct V {
  __m256 a, b;
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vfma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
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
inline void vnibbles(const uint8_t* p, int off, V& lo, V& hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b0 = _mm256_cvtepu8_epi32(raw), b1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw));
  const __m256i f = _mm256_set1_epi32(15), o = _mm256_set1_epi32(off);
  lo = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, f), o)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, f), o))};
  hi = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b0, 4), o)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b1, 4), o))};
}
inline V vu8(const uint8_t* p, int off) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i o = _mm256_set1_epi32(off);
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(raw), o)),
          _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw)), o))};
}
inline V vi8(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw)))};
}
#endif

// A group's header -> per-column scale s and offset o. Q8_0, Q4_0 and Q6_K have no offset: w = (q - c) * s
// with the integer c subtracted first, as gguf's numpy does (so even the sign of a zero weight is the same).
template <int F>
inline void header(const uint8_t* h, V& s, V& o) {
  if constexpr (F == kQ8_0 || F == kQ4_0) {
    s = vhalf(h);
    o = vzero();
  } else if constexpr (F == kQ4_1) {
    s = vhalf(h);
    o = vhalf(h + 32);
  } else if constexpr (F == kQ4_K) {
    s = vload(reinterpret_cast<const float*>(h));
    o = vload(reinterpret_cast<const float*>(h + 64));
  } else {
    s = vload(reinterpret_cast<const float*>(h));
    o = vzero();
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

// How many groups ahead a row tile asks each panel's weights into L1 (P panels at once, so the lines in flight
// are P times this). Whole exact forwards in one process, interleaved, on the Zen 5 of docs/performance.md: 4
// against 2 ran 1.05x as fast at 1-4 rows and 1.02x at 8-16; 6 about as 4; 10 and 16 slower than 6 (0.85-0.98x).
// (The integer kernels, one panel at a time, prefetch 16 groups ahead: int8_kernels.cpp.)
constexpr int kPrefetchGroups = 4;

// R rows of x (stride ldx) times P panels (w[p]) -> y (stride ldy): per output one FMA chain over k in order.
template <int F, int R, int P, bool Prefetch>
inline void tile(const float* x, int64_t ldx, int64_t K, const uint8_t* const* w, float* y, int64_t ldy,
                 const int* cols, const float* const* bias, bool accumulate) {
  constexpr int G = kInfo[F].group, GB = group_bytes(F), HB = kInfo[F].header;
  V acc[R][P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = vzero();
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; ++g) {
    V s[P], o[P];
    const uint8_t* q[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const uint8_t* h = w[p] + g * GB;
      if constexpr (Prefetch) {
        for (int off = 0; off < GB; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(h + kPrefetchGroups * GB + off), _MM_HINT_T0);
      }
      header<F>(h, s[p], o[p]);
      q[p] = h + HB;
    }
    const float* xg = x + g * G;
    if constexpr (nibbles(F)) {
      for (int j = 0; j < G / 2; ++j) {
        V lo[P], hi[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          if constexpr (F == kQ4_0) {
            vnibbles(q[p] + 16 * j, 8, lo[p], hi[p]);
            lo[p] = vmul(lo[p], s[p]);
            hi[p] = vmul(hi[p], s[p]);
          } else {
            vnibbles(q[p] + 16 * j, 0, lo[p], hi[p]);
            lo[p] = vfma(lo[p], s[p], o[p]);
            hi[p] = vfma(hi[p], s[p], o[p]);
          }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const V xv = vset(xg[r * ldx + 2 * j]);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[r][p] = vfma(xv, lo[p], acc[r][p]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const V xv = vset(xg[r * ldx + 2 * j + 1]);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[r][p] = vfma(xv, hi[p], acc[r][p]);
        }
      }
    } else {
      for (int j = 0; j < G; ++j) {
        V wv[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          if constexpr (F == kQ8_0)
            wv[p] = vmul(vi8(q[p] + 16 * j), s[p]);
          else
            wv[p] = vmul(vu8(q[p] + 16 * j, 32), s[p]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const V xv = vset(xg[r * ldx + j]);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[r][p] = vfma(xv, wv[p], acc[r][p]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) store(y + r * ldy + p * kCols, acc[r][p], cols[p], bias[p], accumulate);
}

template <int F, int P, bool Prefetch>
inline void rows(int r, const float* x, int64_t ldx, int64_t K, const uint8_t* const* w, float* y, int64_t ldy,
                 const int* cols, const float* const* bias, bool accumulate) {
  switch (r) {
#ifdef __AVX512F__
    case 8: tile<F, 8, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 7: tile<F, 7, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 6: tile<F, 6, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 5: tile<F, 5, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
#endif
    case 4: tile<F, 4, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 3: tile<F, 3, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    case 2: tile<F, 2, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
    default: tile<F, 1, P, Prefetch>(x, ldx, K, w, y, ldy, cols, bias, accumulate); break;
  }
}

// 1 or 2 rows times np (1..4) panels.
template <int F, bool Prefetch>
inline void few_rows(int r, int np, const float* x, int64_t K, const uint8_t* const* w, float* y, int64_t N,
                     const int* cols, const float* const* b, bool acc) {
#define GOOSE_FEW(P)                                                                     \
  (r == 2 ? tile<F, 2, P, Prefetch>(x, K, K, w, y, N, cols, b, acc)                       \
          : tile<F, 1, P, Prefetch>(x, K, K, w, y, N, cols, b, acc))
  switch (np) {
    case 4: GOOSE_FEW(4); break;
    case 3: GOOSE_FEW(3); break;
    case 2: GOOSE_FEW(2); break;
    default: GOOSE_FEW(1); break;
  }
#undef GOOSE_FEW
}

// Calls of up to kQuadRows rows: work items of four adjacent panels (fewer for the last), every row over
// all of them at once. (`linear_few` and `linear` split their work items over the threads of the enclosing
// parallel region.)
template <int F>
void linear_few(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias, float* y,
                bool acc) {
  const int64_t panels = (N + kCols - 1) / kCols;
  const int64_t pbytes = K / kInfo[F].group * group_bytes(F);
  team::each((panels + 3) / 4, [&](int64_t item) {
    const int64_t p0 = 4 * item, np = panels - p0 < 4 ? panels - p0 : 4;
    const uint8_t* w[4];
    int cols[4];
    const float* b[4];
    for (int t = 0; t < 4; ++t) {
      const int64_t p = p0 + (t < np ? t : 0);
      w[t] = packed + p * pbytes;
      cols[t] = static_cast<int>(N - p * kCols < kCols ? N - p * kCols : kCols);
      b[t] = bias ? bias + p * kCols : nullptr;
    }
    few_rows<F, true>(static_cast<int>(M), static_cast<int>(np), x, K, w, y + p0 * kCols, N, cols, b, acc);
  });
}

template <int F>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias, float* y,
            bool acc) {
  if (M <= kQuadRows) {
    if constexpr (kQuadRows > 0) linear_few<F>(x, M, K, packed, N, bias, y, acc);
    return;
  }
  const int64_t panels = (N + kCols - 1) / kCols;
  const int64_t pbytes = K / kInfo[F].group * group_bytes(F);
  team::each((panels + 1) / 2, [&](int64_t item) {
    const int64_t p0 = 2 * item, np = p0 + 1 < panels ? 2 : 1;
    const uint8_t* w[2] = {packed + p0 * pbytes, packed + (p0 + np - 1) * pbytes};
    int cols[2];
    const float* b[2];
    for (int t = 0; t < 2; ++t) {
      const int64_t p = p0 + (t < np ? t : 0);
      cols[t] = static_cast<int>(N - p * kCols < kCols ? N - p * kCols : kCols);
      b[t] = bias ? bias + p * kCols : nullptr;
    }
    const int64_t tiles = (M + kTile - 1) / kTile;  // rows spread evenly over the fewest tiles (12 = 6 + 6)
    for (int64_t m = 0, i = 0, r = 0; m < M; m += r, ++i) {
      r = (M - m) / (tiles - i);
      const float* xm = x + m * K;
      float* ym = y + m * N + p0 * kCols;
      if (np == 2 && r <= kPairRows) {
        if (m == 0)
          rows<F, 2, true>(static_cast<int>(r), xm, K, K, w, ym, N, cols, b, acc);
        else
          rows<F, 2, false>(static_cast<int>(r), xm, K, K, w, ym, N, cols, b, acc);
        continue;
      }
      for (int t = 0; t < np; ++t) {
        if (m == 0)
          rows<F, 1, true>(static_cast<int>(r), xm, K, K, w + t, ym + t * kCols, N, cols + t, b + t, acc);
        else
          rows<F, 1, false>(static_cast<int>(r), xm, K, K, w + t, ym + t * kCols, N, cols + t, b + t, acc);
      }
    }
  });
}

// ---- packing: GGUF rows -> panels ----

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

// Q4_K: the 6-bit scale and min of sub-block j (0..7) from the block's 12 scale bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One row's group g: its header values for column c, written into the panel group `dst`, and its G quants.
void pack_group(int f, const uint8_t* row, int64_t g, int c, uint8_t* dst) {
  const Info& in = kInfo[f];
  uint8_t* qd = dst + in.header;
  uint8_t q[32];
  switch (f) {
    case kQ8_0: {
      const uint8_t* b = row + g * in.bbytes;
      memcpy(dst + 2 * c, b, 2);
      memcpy(q, b + 2, 32);
      break;
    }
    case kQ4_0:
    case kQ4_1: {
      const uint8_t* b = row + g * in.bbytes;
      memcpy(dst + 2 * c, b, 2);
      if (f == kQ4_1) memcpy(dst + 32 + 2 * c, b + 2, 2);
      const uint8_t* qs = b + (f == kQ4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        q[j] = qs[j] & 15;
        q[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case kQ4_K: {
      const uint8_t* b = row + (g / 8) * in.bbytes;
      const int j = static_cast<int>(g % 8);
      const float d = half_to_float(rd16(b)), dmin = half_to_float(rd16(b + 2));
      int sc, mn;
      scale_min_k4(b + 4, j, sc, mn);
      const float s = d * static_cast<float>(sc), o = -(dmin * static_cast<float>(mn));
      memcpy(dst + 4 * c, &s, 4);
      memcpy(dst + 64 + 4 * c, &o, 4);
      const uint8_t* qs = b + 16 + 32 * (j / 2);
      for (int t = 0; t < 32; ++t) q[t] = j % 2 ? qs[t] >> 4 : qs[t] & 15;
      break;
    }
    default: {  // Q6_K: group g = 16 weights, index i0 = 16 (g % 16) within its 256-weight block
      const uint8_t* b = row + (g / 16) * in.bbytes;
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t sc = static_cast<int8_t>(b[192 + g % 16]);
      const float s = half_to_float(rd16(b + 208)) * static_cast<float>(sc);
      memcpy(dst + 4 * c, &s, 4);
      for (int t = 0; t < 16; ++t) {
        const int i = static_cast<int>(16 * (g % 16) + t), n = i / 128, l = i % 32, quarter = (i % 128) / 32;
        const uint8_t lb = ql[64 * n + 32 * (quarter & 1) + l];
        const int low = quarter < 2 ? lb & 15 : lb >> 4;
        const int high = (qh[32 * n + l] >> (2 * quarter)) & 3;
        q[t] = static_cast<uint8_t>(low | (high << 4));
      }
      break;
    }
  }
  if (nibbles(f)) {
    for (int j = 0; j < 16; ++j) qd[16 * j + c] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
  } else {
    for (int t = 0; t < in.group; ++t) qd[16 * t + c] = q[t];
  }
}

// The weight of panel group `grp` (16 columns) at column c, index t within the group: exactly the value the
// linear kernel multiplies (same operations, one rounding).
inline float weight_at(int f, const uint8_t* grp, int c, int t) {
  const Info& in = kInfo[f];
  const uint8_t* qd = grp + in.header;
  switch (f) {
    case kQ8_0:
      return static_cast<float>(static_cast<int8_t>(qd[16 * t + c])) * half_to_float(rd16(grp + 2 * c));
    case kQ4_0: {
      const float s = half_to_float(rd16(grp + 2 * c));
      const int q = (qd[16 * (t / 2) + c] >> (4 * (t % 2))) & 15;
      return static_cast<float>(q - 8) * s;
    }
    case kQ4_1: {
      const float s = half_to_float(rd16(grp + 2 * c)), o = half_to_float(rd16(grp + 32 + 2 * c));
      const int q = (qd[16 * (t / 2) + c] >> (4 * (t % 2))) & 15;
      return fmaf(static_cast<float>(q), s, o);
    }
    case kQ4_K: {
      float s, o;
      memcpy(&s, grp + 4 * c, 4);
      memcpy(&o, grp + 64 + 4 * c, 4);
      const int q = (qd[16 * (t / 2) + c] >> (4 * (t % 2))) & 15;
      return fmaf(static_cast<float>(q), s, o);
    }
    default: {
      float s;
      memcpy(&s, grp + 4 * c, 4);
      return static_cast<float>(qd[16 * t + c] - 32) * s;
    }
  }
}

}  // namespace

extern "C" {

int goose_quant_abi(void) { return 1; }

// The calling thread's projections run on this library's claim pool with `width` threads while its OpenMP
// regions have one thread (width <= 1: OpenMP's team; team.h).
void goose_quant_claim(int width) { team::claim(width); }

#ifdef __AVX512F__
int goose_quant_isa(void) { return 512; }
#else
int goose_quant_isa(void) { return 256; }
#endif

// Bytes of the packed form of an [N, K] weight in format f (0 when K is not a whole number of GGUF blocks).
int64_t goose_quant_packed_bytes(int f, int64_t N, int64_t K) {
  if (f < 0 || f >= kFormats || K <= 0 || N <= 0 || K % kInfo[f].block) return 0;
  return (N + kCols - 1) / kCols * (K / kInfo[f].group) * group_bytes(f);
}

// rows[n] points at row n of the GGUF tensor (K / block blocks of bbytes each); out must hold
// goose_quant_packed_bytes(f, N, K) bytes. Returns 0, or -1 for a bad format or K.
int goose_quant_pack(int f, const uint8_t* const* rows, int64_t N, int64_t K, uint8_t* out) {
  const int64_t bytes = goose_quant_packed_bytes(f, N, K);
  if (bytes == 0) return -1;
  memset(out, 0, bytes);
  const int64_t groups = K / kInfo[f].group, gb = group_bytes(f), pbytes = groups * gb;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* panel = out + (n / kCols) * pbytes;
    for (int64_t g = 0; g < groups; ++g) pack_group(f, rows[n], g, static_cast<int>(n % kCols), panel + g * gb);
  }
  return 0;
}

// out[i] = row ids[i] of the dequantized [N, K] weight (float32 [n, K]); ids must be in [0, N).
void goose_quant_rows(int f, const uint8_t* packed, int64_t N, int64_t K, const int64_t* ids, int64_t n, float* out) {
  (void)N;
  const int G = kInfo[f].group;
  const int64_t groups = K / G, gb = group_bytes(f), pbytes = groups * gb;
#pragma omp parallel for schedule(static) if (n > 4)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* panel = packed + (ids[i] / kCols) * pbytes;
    const int c = static_cast<int>(ids[i] % kCols);
    float* o = out + i * K;
    for (int64_t g = 0; g < groups; ++g)
      for (int t = 0; t < G; ++t) o[g * G + t] = weight_at(f, panel + g * gb, c, t);
  }
}

// x [M, K] ([M, 2K] when gated), packed from goose_quant_pack (format f, [N, K]), bias [ceil(N / 16) * 16]
// or null, norm [K] or null, y [M, N]; all contiguous. accumulate: y += ..., else y = ...
void goose_quant_linear(int f, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                        const float* bias, float* y, const float* norm, float eps, int gated, int accumulate) {
  std::vector<float> buf(norm || gated ? M * K : 0);
  const float* in = norm || gated ? buf.data() : x;
  const bool acc = accumulate != 0;
  // one parallel region: the threads split in(x)'s rows (`prepare_team`), then the panels
#pragma omp parallel
  {
    if (norm || gated) prepare_team(x, M, K, norm, eps, gated, buf.data());
    switch (f) {
      case kQ8_0: linear<kQ8_0>(in, M, K, packed, N, bias, y, acc); break;
      case kQ4_0: linear<kQ4_0>(in, M, K, packed, N, bias, y, acc); break;
      case kQ4_1: linear<kQ4_1>(in, M, K, packed, N, bias, y, acc); break;
      case kQ4_K: linear<kQ4_K>(in, M, K, packed, N, bias, y, acc); break;
      case kQ6_K: linear<kQ6_K>(in, M, K, packed, N, bias, y, acc); break;
      default: break;
    }
  }
}

}  // extern "C"
