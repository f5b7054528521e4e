// y f32 [M, N] = x bf16 [M, K] @ w bf16 [K, N], float32 accumulation: the JAX engine's
// projections on CPUs with AVX512-BF16 (models/kernels/bf16_matmul.py).
//
// XLA:CPU's bf16 dot with float32 accumulation reaches about 0.6 of the two cores' vdpbf16ps
// rate on the decode step's shapes (64 rows x 576 x 1536). Here the columns go in panels of 64:
// a thread packs a panel of w once per call into vdpbf16ps's operand layout ([K/2][64][2]:
// the two k-neighbours of each column side by side; zeros past K and N), then multiplies every
// 8-row block of x by it with 32 accumulators (8 rows x 4 vectors of 16 columns), each x pair
// broadcast once per row. Panels are split over up to `threads` shares: this thread runs one,
// XLA's intra-op thread pool the others (inline where it has no pool), and this thread waits
// for them spinning (the shares are short and even).
//
// JaxrlBf16MatmulPacked takes w already packed (bf16_matmul.py's pack, once per weight version:
// [ceil(N/64)][ceil(K/2)][64][2]) and shares panel x 8-row units over the threads.
//
// vdpbf16ps treats denormal inputs as zero and rounds to nearest even per instruction (two
// products and the accumulator): results may differ from XLA's in the last float32 bits.
// Without AVX512-BF16 the handler refuses (jaxrl_bf16_matmul_supported() says so first).
#include <algorithm>
#include <atomic>
#include <memory>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JAXRL_HAS_BF16_DOT 1
#else
#define JAXRL_HAS_BF16_DOT 0
#endif

namespace ffi = xla::ffi;

namespace {

#if JAXRL_HAS_BF16_DOT
constexpr int64_t kPanel = 64;  // columns per panel: 4 vectors of 16

// w [K, N] columns n0..n0+63 -> packed [ceil(K/2)][64][2] (uint16), zeros past K and N.
void pack_panel(const uint16_t* w, int64_t K, int64_t N, int64_t n0, uint16_t* packed) {
  const int64_t pairs = (K + 1) / 2;
  // permutex2var: index i < 32 takes a[i], 32 + i takes b[i]; pairs (a[c], b[c]) for c 0..15
  const __m512i interleave = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(interleave, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const int64_t k0 = 2 * kp, k1 = 2 * kp + 1;
    uint16_t* out = packed + kp * kPanel * 2;
    for (int j = 0; j < 2; ++j) {  // 32 columns of rows k0 and k1 -> two vectors of pairs
      const int64_t c = n0 + 32 * j;
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(32, N - c));
      const __mmask32 m = valid >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << valid) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(m, w + k0 * N + c);
      const __m512i b = k1 < K ? _mm512_maskz_loadu_epi16(m, w + k1 * N + c)
                               : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 64 * j, _mm512_permutex2var_epi16(a, interleave, b));
      _mm512_storeu_si512(out + 64 * j + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

template <int MR>
void block(const uint16_t* x, int64_t K, const uint16_t* packed, float* y, int64_t N,
           int64_t m0, int64_t n0) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  for (int64_t kp = 0; kp < full; ++kp) {
    const uint16_t* wp = packed + kp * kPanel * 2;
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + (m0 + i) * K + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  if (K % 2) {  // the last k alone: its pair's upper half is zero on both sides
    const uint16_t* wp = packed + full * kPanel * 2;
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int i = 0; i < MR; ++i) {
      const uint32_t pair = x[(m0 + i) * K + K - 1];
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t c = n0 + 16 * j;
    const int64_t valid = std::min<int64_t>(16, N - c);
    if (valid <= 0) break;
    const __mmask16 m = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + c, m, acc[i][j]);
  }
}

using BlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, float*, int64_t, int64_t,
                         int64_t);
constexpr BlockFn kBlocks[9] = {nullptr,  &block<1>, &block<2>, &block<3>, &block<4>,
                                &block<5>, &block<6>, &block<7>, &block<8>};

// An empty product: nothing to write (M or N zero) or zeros (K zero). True when it was one.
bool empty_product(int64_t M, int64_t K, int64_t N, float* y) {
  if (M != 0 && N != 0 && K != 0) return false;
  if (M != 0 && N != 0) std::fill(y, y + M * N, 0.0f);
  return true;
}

// Rows [m0, m1) of the columns of panel p, from its packed operand.
void panel_rows(const uint16_t* x, const uint16_t* packed, float* y, int64_t M, int64_t K,
                int64_t N, int64_t p, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m += 8)
    kBlocks[std::min<int64_t>(8, std::min(m1, M) - m)](x, K, packed, y, N, m, p * kPanel);
}

// Shares [0, n) of `count` units, each claimed from a counter by this thread and by tasks on
// XLA's intra-op pool (inline where it has none); `run(u0, u1)` computes units [u0, u1).
// This thread waits only for shares a task has claimed, which are running: a task the pool
// starts late (its threads busy, this call's own among them) finds nothing left and touches
// nothing but the shared counters it holds.
template <typename Run>
void shared(ffi::ThreadPool& pool, int64_t count, int64_t threads, Run run) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, count));
  struct Shares {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shares = std::make_shared<Shares>();
  auto work = [=](Shares& s) {
    for (int64_t t; (t = s.next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      run(count * t / n, count * (t + 1) / n);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < n; ++t) pool.Schedule([shares, work] { work(*shares); });
  work(*shares);
  while (shares->done.load(std::memory_order_acquire) < n) _mm_pause();
}
#endif

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y,
                          int64_t threads) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("bf16_matmul: x, w and y must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (wd[0] != K || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("bf16_matmul: mismatched shapes");
#if JAXRL_HAS_BF16_DOT
  float* yp = y->typed_data();
  if (empty_product(M, K, N, yp)) return ffi::Error::Success();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  const int64_t count = (N + kPanel - 1) / kPanel;
  // a thread packs each of its panels into its own buffer, then runs every row block on it
  shared(pool, count, threads, [=](int64_t p0, int64_t p1) {
    std::vector<uint16_t> packed(static_cast<size_t>((K + 1) / 2) * kPanel * 2);
    for (int64_t p = p0; p < p1; ++p) {
      pack_panel(wp, K, N, p * kPanel, packed.data());
      panel_rows(xp, packed.data(), yp, M, K, N, p, 0, M);
    }
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("bf16_matmul: built without AVX512-BF16");
#endif
}

// y f32 [M, N] = x bf16 [M, K] @ w, w given packed once per weight version
// (`bf16_matmul.pack`): [P, ceil(K/2), 64, 2] with P = ceil(N/64), zeros past K and N, the
// layout pack_panel writes. The work is split in units of one panel by 8 rows, panel-major, so
// a share runs whole panels' row blocks in turn while its panel stays in the core's caches.
ffi::Error Bf16MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                                ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y,
                                int64_t threads) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2)
    return ffi::Error::InvalidArgument("bf16_matmul_packed: x, y 2-D and w 4-D");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (yd[0] != M || wd[0] != (N + 63) / 64 || wd[1] != (K + 1) / 2 || wd[2] != 64 || wd[3] != 2)
    return ffi::Error::InvalidArgument("bf16_matmul_packed: mismatched shapes");
#if JAXRL_HAS_BF16_DOT
  float* yp = y->typed_data();
  if (empty_product(M, K, N, yp)) return ffi::Error::Success();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  const int64_t panel = ((K + 1) / 2) * kPanel * 2;  // elements per packed panel
  const int64_t blocks = (M + 7) / 8;
  shared(pool, wd[0] * blocks, threads, [=](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1;) {
      const int64_t p = u / blocks, b0 = u % blocks;
      const int64_t b1 = std::min(blocks, b0 + (u1 - u));
      panel_rows(xp, wp + p * panel, yp, M, K, N, p, 8 * b0, std::min(M, 8 * b1));
      u += b1 - b0;
    }
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("bf16_matmul_packed: built without AVX512-BF16");
#endif
}

}  // namespace

extern "C" int jaxrl_bf16_matmul_supported() { return JAXRL_HAS_BF16_DOT; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlBf16MatmulPacked, Bf16MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
