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
    const int64_t b = pair / d.K;
    const float* qp = q + pair * G * H;
    float* op = out + pair * G * H;
    const int64_t pos = positions[b];
    if (pos < 0 || pos >= S) {
      std::fill(op, op + G * H, 0.0f);
      continue;
    }
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t n = pos - lo + 1;
    const uint16_t* kp = keys + (pair * S + lo) * H;
    const uint16_t* vp = values + (pair * S + lo) * H;
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
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * S;
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
  if (d.H == 64 && d.G == 1) fn = &attend_pairs<1, 64>;
  if (d.H == 64 && d.G == 2) fn = &attend_pairs<2, 64>;
  if (d.H == 64 && d.G == 3) fn = &attend_pairs<3, 64>;
  if (d.H == 64 && d.G == 4) fn = &attend_pairs<4, 64>;
  if (d.H == 64 && d.G == 8) fn = &attend_pairs<8, 64>;
  if (d.H == 128 && d.G == 1) fn = &attend_pairs<1, 128>;
  if (d.H == 128 && d.G == 2) fn = &attend_pairs<2, 128>;
  if (d.H == 128 && d.G == 4) fn = &attend_pairs<4, 128>;
  if (d.H == 128 && d.G == 8) fn = &attend_pairs<8, 128>;
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
