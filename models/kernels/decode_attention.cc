// One query position per row attending over a head-major bfloat16 KV cache held as its bit
// patterns (uint16), the JAX engine's decode-step attention on CPU (models/kernels/cpu.py).
//
// For row b, KV head k and its G query heads: scores over the visible slots
// s in [lo_b, pos_b] (lo_b = max(0, pos_b - window + 1) with a sliding window, else 0),
// scaled, optionally soft-capped (tanh), softmax in float32, probabilities rounded to
// bfloat16 (as the XLA path casts them), output sum_s p[s] * V[s] in float32. Only the
// visible slots are read, straight from the uint16 cache: no copy of the cache, no mask.
// A row whose position is outside [0, S) gets zeros.
//
// Buffers: q f32 [B, K, G, H]; keys, values u16 [Bc, K, S, H] with Bc >= B (a call over
// the first B rows of a larger cache reads those rows in place); positions s32 [B];
// out f32 [B, K, G, H]. Work is split over (b, k) pairs across up to `threads` threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float round_to_bf16(float x) {  // round to nearest even, as XLA's convert
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Dims {
  int64_t B, K, G, S, H;
};

// One (row b, KV head k) pair of a call: its query [G, H] and output [G, H], and the keys and
// values [n, H] of the n slots it sees.
struct Pair {
  const float* q;
  float* out;
  const uint16_t* k;
  const uint16_t* v;
  int64_t n;
};

// Pair number `pair`; false (its output zeroed) where its row's position is outside [0, S).
inline bool open_pair(int64_t pair, const float* q, const uint16_t* keys, const uint16_t* values,
                      const int32_t* positions, float* out, const Dims& d, int64_t G,
                      int64_t H, int64_t window, Pair* p) {
  p->q = q + pair * G * H;
  p->out = out + pair * G * H;
  const int64_t pos = positions[pair / d.K];
  if (pos < 0 || pos >= d.S) {
    std::fill(p->out, p->out + G * H, 0.0f);
    return false;
  }
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  p->n = pos - lo + 1;
  p->k = keys + (pair * d.S + lo) * H;
  p->v = values + (pair * d.S + lo) * H;
  return true;
}

// sg[0, n) scores -> probabilities in place: soft-capped (softcap > 0), softmax in float32,
// each rounded to bf16 as XLA's path casts them.
inline void softmax_to_bf16(float* sg, int64_t n, float softcap) {
  if (softcap > 0.0f)
    for (int64_t s = 0; s < n; ++s) sg[s] = std::tanh(sg[s] / softcap) * softcap;
  float mx = sg[0];
  for (int64_t s = 1; s < n; ++s) mx = std::max(mx, sg[s]);
  float sum = 0.0f;
  for (int64_t s = 0; s < n; ++s) {
    sg[s] = std::exp(sg[s] - mx);
    sum += sg[s];
  }
  const float inv = 1.0f / sum;
  for (int64_t s = 0; s < n; ++s) sg[s] = round_to_bf16(sg[s] * inv);
}

// kG, kH > 0: the group size and head size known at compile time (the loops unroll and the
// queries and accumulators stay in registers); 0: taken from `d` at run time.
template <int kG, int kH>
void attend_pairs(const float* q, const uint16_t* keys, const uint16_t* values,
                  const int32_t* positions, float* out, Dims d, float scale, float softcap,
                  int64_t window, int64_t begin, int64_t end) {
  const int64_t G = kG > 0 ? kG : d.G, H = kH > 0 ? kH : d.H, S = d.S;
  std::vector<float> scores(static_cast<size_t>(G * S));
  std::vector<float> row(static_cast<size_t>(H));
  std::vector<float> acc(static_cast<size_t>(G * H));
  for (int64_t pair = begin; pair < end; ++pair) {
    Pair pr;
    if (!open_pair(pair, q, keys, values, positions, out, d, G, H, window, &pr)) continue;
    const float* qp = pr.q;
    float* op = pr.out;
    const uint16_t *kp = pr.k, *vp = pr.v;
    const int64_t n = pr.n;
    for (int64_t s = 0; s < n; ++s) {
      const uint16_t* ks = kp + s * H;
      for (int64_t h = 0; h < H; ++h) row[h] = bf16_to_f32(ks[h]);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qp + g * H;
        float dot = 0.0f;
        for (int64_t h = 0; h < H; ++h) dot += qg[h] * row[h];
        scores[g * S + s] = dot * scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) softmax_to_bf16(scores.data() + g * S, n, softcap);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < n; ++s) {
      const uint16_t* vs = vp + s * H;
      for (int64_t h = 0; h < H; ++h) row[h] = bf16_to_f32(vs[h]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * S + s];
        float* ag = acc.data() + g * H;
        for (int64_t h = 0; h < H; ++h) ag[h] += p * row[h];
      }
    }
    std::copy(acc.begin(), acc.end(), op);
  }
}

#if defined(__AVX512BF16__)
// The same attention for H a multiple of 32 on CPUs with AVX512_BF16: both products run as
// VDPBF16PS (pairs of bf16 products summed into float32 lanes), so the cache's bits are read
// as they are, with no conversion. The query is rounded to bf16 first, as XLA's path casts
// it to the cache dtype (exact for a bf16 model's query); the probabilities already are.
// Scores go 16 slots at a time: 16 per-slot accumulators reduced together by a transposing
// add tree (45 shuffles and adds) instead of 16 horizontal reductions. Values go 2 slots at
// a time: the two rows' words interleaved, so each float32 lane sums p[s]·V[s][h] +
// p[s+1]·V[s+1][h] for one h; the lanes' h order is undone once per pair at the end.

// r[j] = sum of the 16 lanes of v[j], j < 16.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8];
  for (int j = 0; j < 8; ++j)
    w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  __m512 x[4];
  for (int j = 0; j < 4; ++j)
    x[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }


template <int kG, int kH>
void attend_pairs_bf16(const float* q, const uint16_t* keys, const uint16_t* values,
                       const int32_t* positions, float* out, Dims d, float scale,
                       float softcap, int64_t window, int64_t begin, int64_t end) {
  constexpr int kC = kH / 32;  // 512-bit chunks of 32 bf16 per cache row
  const int64_t S = d.S;
  std::vector<float> scores(static_cast<size_t>(kG * (S + 16)));
  alignas(64) float acc[kG][kC][2][16];
  for (int64_t pair = begin; pair < end; ++pair) {
    Pair pr;
    if (!open_pair(pair, q, keys, values, positions, out, d, kG, kH, window, &pr)) continue;
    const float* qp = pr.q;
    float* op = pr.out;
    const uint16_t *kp = pr.k, *vp = pr.v;
    const int64_t n = pr.n;
    __m512bh qv[kG][kC];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kC; ++c)
        qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qp + g * kH + 32 * c + 16),
                                       _mm512_loadu_ps(qp + g * kH + 32 * c));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t s0 = 0; s0 < n; s0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - s0));
      for (int g = 0; g < kG; ++g) {
        __m512 dots[16];
        for (int j = 0; j < 16; ++j) {
          __m512 a = _mm512_setzero_ps();
          if (j < m) {
            const uint16_t* ks = kp + (s0 + j) * kH;
            for (int c = 0; c < kC; ++c)
              a = _mm512_dpbf16_ps(a, qv[g][c], as_bh(_mm512_loadu_si512(ks + 32 * c)));
          }
          dots[j] = a;
        }
        _mm512_storeu_ps(scores.data() + g * (S + 16) + s0,
                         _mm512_mul_ps(reduce16(dots), vscale));
      }
    }
    for (int g = 0; g < kG; ++g) {
      float* sg = scores.data() + g * (S + 16);
      softmax_to_bf16(sg, n, softcap);
      sg[n] = 0.0f;  // the partner of an odd last slot
    }
    __m512 va[kG][kC][2];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kC; ++c) va[g][c][0] = va[g][c][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s += 2) {
      const uint16_t* v0 = vp + s * kH;
      const uint16_t* v1 = v0 + kH;
      const bool pair_ok = s + 1 < n;
      __m512i lo_words[kC], hi_words[kC];
      for (int c = 0; c < kC; ++c) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
        const __m512i bq = pair_ok ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
        lo_words[c] = _mm512_unpacklo_epi16(a, bq);
        hi_words[c] = _mm512_unpackhi_epi16(a, bq);
      }
      for (int g = 0; g < kG; ++g) {
        const float* sg = scores.data() + g * (S + 16);
        uint32_t p0, p1;
        std::memcpy(&p0, sg + s, 4);
        std::memcpy(&p1, sg + s + 1, 4);
        const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int>((p0 >> 16) | (p1 & 0xFFFF0000u))));
        for (int c = 0; c < kC; ++c) {
          va[g][c][0] = _mm512_dpbf16_ps(va[g][c][0], as_bh(lo_words[c]), pp);
          va[g][c][1] = _mm512_dpbf16_ps(va[g][c][1], as_bh(hi_words[c]), pp);
        }
      }
    }
    // lane j of the unpacklo (unpackhi) accumulator of chunk c holds h = 32c + 8(j / 4) +
    // j % 4 (+ 4)
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kC; ++c) {
        _mm512_store_ps(acc[g][c][0], va[g][c][0]);
        _mm512_store_ps(acc[g][c][1], va[g][c][1]);
        for (int j = 0; j < 16; ++j) {
          const int h = 32 * c + 8 * (j / 4) + j % 4;
          op[g * kH + h] = acc[g][c][0][j];
          op[g * kH + h + 4] = acc[g][c][1][j];
        }
      }
  }
}
#define JAXRL_BF16_PAIRS(G, H) &attend_pairs_bf16<G, H>
#else
#define JAXRL_BF16_PAIRS(G, H) &attend_pairs<G, H>
#endif

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> keys,
                               ffi::Buffer<ffi::U16> values, ffi::Buffer<ffi::S32> positions,
                               ffi::ResultBuffer<ffi::F32> out, float scale, float softcap,
                               int64_t window, int64_t threads) {
  auto qd = q.dimensions();
  auto kd = keys.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || values.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q, keys, values must be 4-D");
  Dims d{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (kd[0] < d.B || kd[1] != d.K || kd[3] != d.H || positions.element_count() != d.B)
    return ffi::Error::InvalidArgument("decode_attention: mismatched shapes");
  const int64_t pairs = d.B * d.K;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, pairs));
  const float* qp = q.typed_data();
  const uint16_t* kp = keys.typed_data();
  const uint16_t* vp = values.typed_data();
  const int32_t* pp = positions.typed_data();
  float* op = out->typed_data();
  auto fn = &attend_pairs<0, 0>;
  if (d.H == 64 && d.G == 1) fn = JAXRL_BF16_PAIRS(1, 64);
  if (d.H == 64 && d.G == 2) fn = JAXRL_BF16_PAIRS(2, 64);
  if (d.H == 64 && d.G == 3) fn = JAXRL_BF16_PAIRS(3, 64);
  if (d.H == 64 && d.G == 4) fn = JAXRL_BF16_PAIRS(4, 64);
  if (d.H == 64 && d.G == 8) fn = JAXRL_BF16_PAIRS(8, 64);
  if (d.H == 128 && d.G == 1) fn = JAXRL_BF16_PAIRS(1, 128);
  if (d.H == 128 && d.G == 2) fn = JAXRL_BF16_PAIRS(2, 128);
  if (d.H == 128 && d.G == 4) fn = JAXRL_BF16_PAIRS(4, 128);
  if (d.H == 128 && d.G == 8) fn = JAXRL_BF16_PAIRS(8, 128);
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < n; ++t) {
    const int64_t begin = pairs * t / n, end = pairs * (t + 1) / n;
    try {
      pool.emplace_back(fn, qp, kp, vp, pp, op, d, scale, softcap, window, begin, end);
    } catch (const std::system_error&) {  // no thread to be had: this share runs here
      fn(qp, kp, vp, pp, op, d, scale, softcap, window, begin, end);
    }
  }
  fn(qp, kp, vp, pp, op, d, scale, softcap, window, 0, pairs / n);
  for (auto& th : pool) th.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("threads"));
