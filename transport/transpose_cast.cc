// Packing's transposed cast: a float32 matrix held [C, ld] row-major (a JAX kernel [in, out])
// written as its transpose [R, C] in bfloat16 (the HF layout [out, in]), in one pass.
//
// dst[r * C + c] = bf16(src[c * ld + r]) for r < R, c < C, rounded to nearest even (the bits
// XLA's convert and torch's copy give), a NaN to the quiet NaN of its sign (0x7FC0 / 0xFFC0, as
// XLA and ml_dtypes write it; torch's vectorized copy writes 0xFFFF). With AVX-512F the
// matrix goes in 16 x 16 tiles: 16 row loads, an in-register transpose (unpack 32 / 64 bit,
// then two rounds of 128-bit lane shuffles), the rounding in integer lanes, 16 stores of 16
// bf16; the edges and other CPUs take the scalar loop. One thread: packing runs beside the
// wire on the same cores (transport.base.one_thread).

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PREFETCH = 32;  // floats ahead along each source row (4 tiles)

inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u)  // NaN (an integer test: -ffast-math cannot drop it)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void scalar_block(const float* src, int64_t ld, uint16_t* dst, int64_t C, int64_t r0, int64_t r1,
                  int64_t c0, int64_t c1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) dst[r * C + c] = bf16_bits(src[c * ld + r]);
}

#if defined(__AVX512F__)
inline __m256i bf16_lanes(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7fff));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i qnan = _mm512_or_si512(
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
      _mm512_set1_epi32(0x7fc0));
  r = _mm512_mask_mov_epi32(r, nan, qnan);
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 lo64(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline __m512 hi64(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

// rows c0..c0+15 of src, columns r0..r0+15 -> dst rows r0..r0+15, columns c0..c0+15.
inline void tile16(const float* src, int64_t ld, uint16_t* dst, int64_t C, int64_t r0,
                   int64_t c0) {
  __m512 a[16], t[16];
  for (int k = 0; k < 16; ++k) a[k] = _mm512_loadu_ps(src + (c0 + k) * ld + r0);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // a[4i + j], lane L: rows 4i..4i+3 at column 4L + j
    a[4 * i + 0] = lo64(t[4 * i + 0], t[4 * i + 2]);
    a[4 * i + 1] = hi64(t[4 * i + 0], t[4 * i + 2]);
    a[4 * i + 2] = lo64(t[4 * i + 1], t[4 * i + 3]);
    a[4 * i + 3] = hi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 p = _mm512_shuffle_f32x4(a[j], a[4 + j], 0x88);
    const __m512 q = _mm512_shuffle_f32x4(a[j], a[4 + j], 0xDD);
    const __m512 s = _mm512_shuffle_f32x4(a[8 + j], a[12 + j], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(a[8 + j], a[12 + j], 0xDD);
    const __m512 col[4] = {_mm512_shuffle_f32x4(p, s, 0x88), _mm512_shuffle_f32x4(q, w, 0x88),
                           _mm512_shuffle_f32x4(p, s, 0xDD), _mm512_shuffle_f32x4(q, w, 0xDD)};
    for (int L = 0; L < 4; ++L) {
      uint16_t* out = dst + (r0 + 4 * L + j) * C + c0;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_lanes(col[L]));
    }
  }
}
#endif

}  // namespace

extern "C" {

// 1 where the 16 x 16 tiles were compiled in (AVX-512F), else 0 (scalar only: slower than
// torch's two-pass copy, so the caller keeps that).
int jaxrl_transpose_cast_vectorized() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

void jaxrl_transpose_cast_f32_bf16(const float* src, int64_t ld, uint16_t* dst, int64_t R,
                                   int64_t C) {
  int64_t R16 = 0, C16 = 0;
#if defined(__AVX512F__)
  R16 = R - R % 16;
  C16 = C - C % 16;
  for (int64_t c0 = 0; c0 < C16; c0 += 32) {  // 32 source rows: whole 64-byte output lines
    const bool two = c0 + 32 <= C16;
    const int rows = two ? 32 : 16;
    for (int64_t r0 = 0; r0 < R16; r0 += 16) {  // along the source rows: sequential reads
      if (r0 + PREFETCH < R)  // 32 streams are more than the hardware prefetchers follow
        for (int k = 0; k < rows; ++k)
          _mm_prefetch(reinterpret_cast<const char*>(src + (c0 + k) * ld + r0 + PREFETCH),
                       _MM_HINT_T0);
      tile16(src, ld, dst, C, r0, c0);
      if (two) tile16(src, ld, dst, C, r0, c0 + 16);
    }
  }
#endif
  scalar_block(src, ld, dst, C, 0, R16, C16, C);  // right edge of the tiled rows
  scalar_block(src, ld, dst, C, R16, R, 0, C);    // bottom rows
}

}  // extern "C"
