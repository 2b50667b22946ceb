// Batched weight-only int8 linear without AMX: y = x @ (q * scale)^T + bias for 8-256 rows.
//
// A decode step of a few dozen requests still reads every weight once, so int8 weights
// (1 byte) beat oneDNN's bf16 (2 bytes) as long as the arithmetic keeps up with the memory;
// the fp32 GEMV (int8_linear.cpp) does not past ~8 rows. Here the weights are packed so that
// one vector holds G output channels x 4 inputs, and a register tile of MB rows x NG vectors
// multiplies each loaded weight vector into MB accumulators (no horizontal sums in the loop).
// Two inner loops, measured against each other at load (runner/batched_rows.py):
//
//   "dot"    activations quantised per row and per group of 32 inputs (dynamic scale
//            amax / kQMax), integer dot products in exact int32 within a group, folded
//            into fp32 across groups: AVX-512 VNNI or AVX-VNNI on int8 activations (u8 x
//            s8: the weights flip their sign bit to q + 128, minus 128 * the group's
//            activation sum), or AVX2 madd on int16 activations (s16 x s16 pairs into
//            int32: nothing saturates, unlike maddubs' int16 sums).
//   "widen"  weights widened in registers: to bf16 pairs for _mm512_dpbf16_ps (activations
//            rounded to bf16), else to fp32 for FMA (activations fp32).
//
//   batched_int8_pack(q [N, K] int8) -> [ceil(N/BN), ceil(K/4), BN, 4] int8, zero padded;
//     BN = batched_int8_block() channels (64 on AVX-512 builds, 16 on AVX2): one block is
//     one contiguous stream, read by one thread.
//   batched_int8_linear(x [M, K] fp32|bf16, packed, scale [N], bias?, N, kernel)
//     -> [M, N] x.dtype.
//   batched_int8_silu_mul(x, packed, scale [N], N, kernel) -> [M, N/2] x.dtype: silu(gate) *
//     up of a gate/up weight's halves (N a multiple of 2 BN), as the linear then
//     silu_and_mul give it, bit for bit.
//   batched_int8_kernels() -> this build's kernels as "name:isa".

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "act_quant.h"
#include "tile_driver.h"
#include "vec.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HR_W512 1
constexpr int64_t kG = 16;  // channels per vector
constexpr int64_t kGroups = 4;
#else
#define HR_W512 0
constexpr int64_t kG = 8;
constexpr int64_t kGroups = 2;
#endif
constexpr int64_t kBlockN = kG * kGroups;  // channels per packed block
constexpr int64_t kStepBytes = kBlockN * 4;  // one block's bytes for 4 inputs

// ---- inner-loop variants: zero / load / bcast / mac on one group of kG channels -----------
// Each keeps kAcc accumulators per (row, group); lane l of accumulator a holds a partial sum
// of channel (a * lanes + l) / R, R = kAcc * lanes / kG, summed in `finish`.

#if HR_W512 && defined(__AVX512VNNI__)
#define HR_DOT 1
constexpr const char* kDotIsa = "avx512_vnni";
struct Dot {
  using X = int8_t;
  using Acc = __m512i;
  using FAcc = __m512;
  using W = __m512i;
  using B = __m512i;
  static constexpr bool kOffset = true;
  static constexpr int kQMax = 127;
  // Two accumulator sets (int32 within a scale group, fp32 across them) share 32 registers.
  static constexpr int kAcc = 1, kW = 1, kNG = 2, kMB = 5;
  static void zero(Acc* a) { a[0] = _mm512_setzero_si512(); }
  static void fzero(FAcc* a) { a[0] = _mm512_setzero_ps(); }
  // dpbusd multiplies u8 by s8: the weights take the unsigned side (q + 128, by flipping the
  // sign bit), so the correction is 128 * the group's activation sum, one scalar per row.
  static void load(const int8_t* p, W* w) {
    w[0] = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(-128));
  }
  static B bcast(const X* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  }
  static void mac(Acc* a, const W* w, B b) { a[0] = _mm512_dpbusd_epi32(a[0], w[0], b); }
  static void fold(FAcc* f, const Acc* a, float scale) {
    f[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[0]), _mm512_set1_ps(scale), f[0]);
  }
};
#elif !HR_W512 && defined(__AVX2__) && defined(__AVXVNNI__)
#define HR_DOT 1
constexpr const char* kDotIsa = "avx_vnni";
struct Dot {
  using X = int8_t;
  using Acc = __m256i;
  using FAcc = __m256;
  using W = __m256i;
  using B = __m256i;
  static constexpr bool kOffset = true;
  static constexpr int kQMax = 127;
  static constexpr int kAcc = 1, kW = 1, kNG = 2, kMB = 3;
  static void zero(Acc* a) { a[0] = _mm256_setzero_si256(); }
  static void fzero(FAcc* a) { a[0] = _mm256_setzero_ps(); }
  static void load(const int8_t* p, W* w) {
    w[0] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                            _mm256_set1_epi8(-128));
  }
  static B bcast(const X* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  }
  static void mac(Acc* a, const W* w, B b) { a[0] = _mm256_dpbusd_avx_epi32(a[0], w[0], b); }
  static void fold(FAcc* f, const Acc* a, float scale) {
    f[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0]), _mm256_set1_ps(scale), f[0]);
  }
};
#elif !HR_W512 && defined(__AVX2__)
#define HR_DOT 1
constexpr const char* kDotIsa = "avx2_madd";
// Rows a tile multiplies each widened weight vector into. Five row accumulator pairs, the
// weights and a broadcast fill 13 of the 16 registers; the fp32 sums across groups live in
// memory (touched once a group). Against 3 rows with those sums in registers, three A/B runs
// on Zen 1: 1.03-1.11x at 4 rows, 1.02-1.07x at 8, 0.98-1.02x at 16-32 (rows 4 and 6 were
// no better; kernel_builds.py --variant rows3=-DHR_DOT_ROWS=3).
#ifndef HR_DOT_ROWS
#define HR_DOT_ROWS 5
#endif
// s8 widened to s16; madd sums two s16 x s16 products into int32, which cannot saturate.
// The activations are int16 (a step's 4 inputs are one 64-bit broadcast; built from 4 bytes
// it took ~14 scalar instructions per row and step), so they keep 16 bits, not 8: a group of
// 32 sums to at most 32 * 127 * 32767 < 2^31, and the answer is the weight-only int8 one to
// ~1e-5 (with int8 activations at one row, greedy SmolLM2 lost "Paris", Zen 1).
struct Dot {
  using X = int16_t;
  using Acc = __m256i;
  using FAcc = __m256;
  using W = __m256i;
  using B = __m256i;
  static constexpr bool kOffset = false;
  static constexpr int kQMax = 32767;
  static constexpr int kAcc = 2, kW = 2, kNG = 1, kMB = HR_DOT_ROWS;
  static void zero(Acc* a) { a[0] = a[1] = _mm256_setzero_si256(); }
  static void fzero(FAcc* a) { a[0] = a[1] = _mm256_setzero_ps(); }
  static void load(const int8_t* p, W* w) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static B bcast(const X* x) {
    int64_t v;
    std::memcpy(&v, x, 8);
    return _mm256_set1_epi64x(v);
  }
  static void mac(Acc* a, const W* w, B b) {
    a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(w[0], b));
    a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(w[1], b));
  }
  static void fold(FAcc* f, const Acc* a, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    f[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0]), s, f[0]);
    f[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[1]), s, f[1]);
  }
};
#else
#define HR_DOT 0
#endif

#if HR_W512 && defined(__AVX512BF16__)
#define HR_WIDEN 1
constexpr const char* kWidenIsa = "avx512_bf16";
struct Widen {
  using X = uint16_t;  // bf16 bits
  using Acc = __m512;
  using W = __m512bh;
  using B = __m512bh;
  static constexpr bool kOffset = false;
  static constexpr int kAcc = 2, kW = 2, kNG = 2, kMB = 4;
  static void zero(Acc* a) { a[0] = a[1] = _mm512_setzero_ps(); }
  static __m512 f32(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // 16 channels x 4 inputs -> two vectors of bf16 pairs: lane i = channel i/2, pair i%2.
  static void load(const int8_t* p, W* w) {
    w[0] = _mm512_cvtne2ps_pbh(f32(p + 16), f32(p));
    w[1] = _mm512_cvtne2ps_pbh(f32(p + 48), f32(p + 32));
  }
  static B bcast(const X* x) {
    int64_t v;
    std::memcpy(&v, x, 8);
    return (B)_mm512_set1_epi64(v);
  }
  static void mac(Acc* a, const W* w, B b) {
    a[0] = _mm512_dpbf16_ps(a[0], w[0], b);
    a[1] = _mm512_dpbf16_ps(a[1], w[1], b);
  }
};
#elif HR_W512
#define HR_WIDEN 1
constexpr const char* kWidenIsa = "avx512_fma";
struct Widen {
  using X = float;
  using Acc = __m512;
  using W = __m512;
  using B = __m512;
  static constexpr bool kOffset = false;
  static constexpr int kAcc = 4, kW = 4, kNG = 1, kMB = 4;
  static void zero(Acc* a) {
    for (int i = 0; i < 4; ++i) a[i] = _mm512_setzero_ps();
  }
  static void load(const int8_t* p, W* w) {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
  }
  static B bcast(const X* x) { return _mm512_broadcast_f32x4(_mm_loadu_ps(x)); }
  static void mac(Acc* a, const W* w, B b) {
    for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(w[i], b, a[i]);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define HR_WIDEN 1
constexpr const char* kWidenIsa = "avx2_fma";
struct Widen {
  using X = float;
  using Acc = __m256;
  using W = __m256;
  using B = __m256;
  static constexpr bool kOffset = false;
  static constexpr int kAcc = 4, kW = 4, kNG = 1, kMB = 2;
  static void zero(Acc* a) {
    for (int i = 0; i < 4; ++i) a[i] = _mm256_setzero_ps();
  }
  static void load(const int8_t* p, W* w) {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
  static B bcast(const X* x) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x)); }
  static void mac(Acc* a, const W* w, B b) {
    for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(w[i], b, a[i]);
  }
};
#else
#define HR_WIDEN 0
#endif

// ---- the register tile and the driver, shared by every variant ----------------------------

// How far ahead of a full scale group's steps the weights are prefetched (0: not at all).
// On Zen 1 (AVX2) the hardware prefetcher left a one-row dot call at ~10 GB/s of ~21; 2048
// bytes ahead (32 steps) ran a sweep of SmolLM2's linears 1.23-1.46x faster at 1 row,
// 1.13-1.25x at 2 and ~1.1x at 4, neutral at 8-32 (512, 1024, 3072 and 4096 were slower;
// benchmarks/kernel_builds.py). AVX-512 builds are unmeasured, so off until they are:
// HEADRACE_CPU_OPS_CFLAGS=-DHR_PREFETCH_BYTES=N builds another distance to compare.
#ifndef HR_PREFETCH_BYTES
#define HR_PREFETCH_BYTES (HR_W512 ? 0 : 2048)
#endif
constexpr int64_t kPrefetchBytes = HR_PREFETCH_BYTES;

// "dot" scales activations per row and per group of kScaleSteps * 4 = 32 inputs (as llama.cpp's
// activation blocks): one outlier then coarsens 32 inputs, not the whole row. Perplexity of
// SmolLM2 as `quantization auto` serves it in bf16 (benchmarks/quality_int8.py, AMX masked):
// per row +2.5% (over the +2% target), groups of 64 +2.2%, groups of 32 +1.7%.
constexpr int64_t kScaleSteps = headrace::kGroupWidth / 4;

// Sums the R lanes of each channel (float or int32 accumulators of the same layout).
template <class K, class A>
inline void finish(const A* acc, float* out) {
  constexpr int kLanes = sizeof(A) / 4;
  constexpr int R = K::kAcc * kLanes / kG;
  using Lane = std::conditional_t<std::is_same_v<A, __m256> || std::is_same_v<A, __m512>,
                                  float, int32_t>;
  Lane lanes[K::kAcc * kLanes];
  std::memcpy(lanes, acc, sizeof(lanes));
  for (int c = 0; c < kG; ++c) {
    Lane s = 0;
    for (int r = 0; r < R; ++r) s += lanes[c * R + r];
    out[c] = static_cast<float>(s);
  }
}

// MB rows x K::kNG groups (from group g0 of one block), k steps [s0, s1).
template <class K, int MB>
inline void steps(const typename K::X* x, int64_t x_stride, int64_t s0, int64_t s1,
                  const int8_t* block, int64_t g0, typename K::Acc (&acc)[MB][K::kNG][K::kAcc]) {
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < K::kNG; ++g) K::zero(acc[m][g]);
  for (int64_t s = s0; s < s1; ++s) {
    const int8_t* wp = block + s * kStepBytes + g0 * kG * 4;
    typename K::W w[K::kNG][K::kW];
    for (int g = 0; g < K::kNG; ++g) K::load(wp + g * kG * 4, w[g]);
    for (int m = 0; m < MB; ++m) {
      const typename K::B b = K::bcast(x + m * x_stride + s * 4);
      for (int g = 0; g < K::kNG; ++g) K::mac(acc[m][g], w[g], b);
    }
  }
}

// Keeps an accumulator's adds in step order ("v": any vector register, zmm16-31 included).
// Integer vector adds associate, so GCC's reassociation turned an unrolled group of steps into
// a tree of partial sums, the products parked on the stack until the tree summed them (42
// vector moves to and from the stack in the 3-row AVX2 dot loop); pinned, that loop ran
// 1.09-1.17x faster at 4-32 rows on Zen 1 (two runs of benchmarks/kernel_builds.py --variant
// nopin=-DHR_ACC_BARRIER=0), and the 5-row tile needs it to keep its sums in registers.
// Only here: in `steps` (the float "widen" kernels, no reassociation to undo) it made the
// AVX2 widen kernel 1.3-1.5x slower.
#ifndef HR_ACC_BARRIER
#define HR_ACC_BARRIER 1
#endif
template <class K, int MB>
inline void pin(typename K::Acc (&acc)[MB][K::kNG][K::kAcc]) {
  if constexpr (HR_ACC_BARRIER)
    for (int m = 0; m < MB; ++m)
      for (int g = 0; g < K::kNG; ++g)
        for (int a = 0; a < K::kAcc; ++a) __asm__("" : "+v"(acc[m][g][a]));
}

// The same for exactly S steps from s0.
template <class K, int MB, int S>
inline void steps_fixed(const typename K::X* x, int64_t x_stride, int64_t s0, const int8_t* block,
                        int64_t g0, typename K::Acc (&acc)[MB][K::kNG][K::kAcc]) {
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < K::kNG; ++g) K::zero(acc[m][g]);
  const int8_t* wp = block + s0 * kStepBytes + g0 * kG * 4;
  const typename K::X* xp = x + s0 * 4;
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) {
    if constexpr (kPrefetchBytes > 0)
      _mm_prefetch(reinterpret_cast<const char*>(wp + s * kStepBytes + kPrefetchBytes),
                   _MM_HINT_T0);
    typename K::W w[K::kNG][K::kW];
    for (int g = 0; g < K::kNG; ++g) K::load(wp + s * kStepBytes + g * kG * 4, w[g]);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const typename K::B b = K::bcast(xp + m * x_stride + s * 4);
      for (int g = 0; g < K::kNG; ++g) K::mac(acc[m][g], w[g], b);
    }
    pin<K, MB>(acc);
  }
}

// The float kernels: one accumulator set over all k4n steps. `xs` is unused.
template <class K, int MB>
void tile(const typename K::X* x, int64_t x_stride, const float*, int64_t k4n,
          const int8_t* block, int64_t g0, float* out) {
  typename K::Acc acc[MB][K::kNG][K::kAcc];
  steps<K, MB>(x, x_stride, 0, k4n, block, g0, acc);
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < K::kNG; ++g) finish<K>(acc[m][g], out + m * kBlockN + (g0 + g) * kG);
}

// "dot": exact int32 sums per scale group, folded into fp32 with the row's group scale
// `xs[m * groups + j]`. The u8 offset stays in the sums: its share is the same for every
// channel of a row, so `run` subtracts it once per output (an integer subtraction per group
// and accumulator here cost 3-10% of the kernel's time, Zen 5).
template <class K, int MB>
void tile_grouped(const typename K::X* x, int64_t x_stride, const float* xs, int64_t k4n, const int8_t* block, int64_t g0, float* out) {
  const int64_t groups = (k4n + kScaleSteps - 1) / kScaleSteps;
  typename K::FAcc f[MB][K::kNG][K::kAcc];
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < K::kNG; ++g) K::fzero(f[m][g]);
  for (int64_t j = 0; j < groups; ++j) {
    typename K::Acc acc[MB][K::kNG][K::kAcc];
    // Full groups take the loop with a constant trip count: unrolled, its accumulators stay
    // in registers (with the variable bound GCC copied them between registers every step,
    // and the dot kernel ran at ~half its peak, Zen 5).
    if ((j + 1) * kScaleSteps <= k4n)
      steps_fixed<K, MB, kScaleSteps>(x, x_stride, j * kScaleSteps, block, g0, acc);
    else
      steps<K, MB>(x, x_stride, j * kScaleSteps, k4n, block, g0, acc);
    for (int m = 0; m < MB; ++m)
      for (int g = 0; g < K::kNG; ++g)
        K::fold(f[m][g], acc[m][g], xs[m * groups + j]);
  }
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < K::kNG; ++g) finish<K>(f[m][g], out + m * kBlockN + (g0 + g) * kG);
}

// The "dot" kernels quantise their activations (they name the integer range, kQMax) and
// scale them per group; the "widen" kernels take float or bf16 activations as they are.
// (Told apart by the activation type, bf16's uint16_t bits passed for int16, and AVX512-BF16
// builds failed to compile.)
template <class K, class = void>
struct QuantisesActivations : std::false_type {};
template <class K>
struct QuantisesActivations<K, std::void_t<decltype(K::kQMax)>> : std::true_type {};
template <class K>
constexpr bool kGrouped = QuantisesActivations<K>::value;

// One row with every group of a block in one pass. With K's kNG < kGroups a lone row read
// each block kGroups / kNG times, each pass half of every line (the later passes from L1).
template <class K>
struct OneRow : K {
  static constexpr int kNG = kGroups, kMB = 1;
};

// Whether OneRow<K>'s tile fits the vector registers (int32 and fp32 sums, weights, one
// broadcast); the fp32 widen tiles would spill.
template <class K>
constexpr bool kOneRowFits =
    kGrouped<K> && kGroups * (2 * K::kAcc + K::kW) + 1 <= (HR_W512 ? 32 : 16);

template <class K, int MB>
void tile_rows(int rows, const typename K::X* x, int64_t x_stride, const float* xs,
               int64_t k4n, const int8_t* block, int64_t g0, float* out) {
  if constexpr (MB > 0) {
    if (rows == MB) {
      if constexpr (kGrouped<K>)
        return tile_grouped<K, MB>(x, x_stride, xs, k4n, block, g0, out);
      else
        return tile<K, MB>(x, x_stride, xs, k4n, block, g0, out);
    }
    tile_rows<K, MB - 1>(rows, x, x_stride, xs, k4n, block, g0, out);
  }
}

// `xs`: per row, `groups` group scales ("dot"), else null. `row_corr`: per row, the offset's
// share of every channel's folded sum (sum over groups of correction * scale), else null.
// `gated` (an MLP's gate/up, n_dim a multiple of 2 * kBlockN, no bias): gate block nb and
// up block nb + n_dim / (2 * kBlockN) are one unit, whose sums leave as silu(gate) * up into
// out [rows, n_dim / 2].
template <class K, typename T>
void run(const typename K::X* x, const float* xs, const float* row_corr, int64_t groups, int64_t rows,
         int64_t k4n, const int8_t* packed, const float* scale, const float* bias, int64_t n_dim,
         bool gated, T* out) {
  const int64_t blocks = (n_dim + kBlockN - 1) / kBlockN;
  const int64_t units = gated ? blocks / 2 : blocks;
  const int64_t x_stride = k4n * 4;
  headrace::for_each_tile(units, rows, K::kMB, x_stride * sizeof(typename K::X), [&] {
    return [&](int64_t nb, int64_t m0, int mb, bool) {
      float sums[2][K::kMB * kBlockN];
      const float* rs = xs ? xs + m0 * groups : nullptr;
      const auto product = [&](int64_t b, float* dst) {
        const int8_t* block = packed + b * k4n * kStepBytes;
        if (kOneRowFits<K> && mb == 1) {
          if constexpr (kOneRowFits<K>)
            tile_grouped<OneRow<K>, 1>(x + m0 * x_stride, x_stride, rs, k4n, block, 0, dst);
        } else {
          for (int64_t g0 = 0; g0 < kGroups; g0 += K::kNG)
            tile_rows<K, K::kMB>(mb, x + m0 * x_stride, x_stride, rs, k4n, block, g0, dst);
        }
      };
      product(nb, sums[0]);
      if (!gated) {
        headrace::store_tile(sums[0], kBlockN, mb, m0, nb * kBlockN, n_dim, row_corr, scale, bias,
                             out);
        return;
      }
      product(nb + units, sums[1]);
      headrace::store_tile_silu_mul(sums[0], sums[1], kBlockN, mb, m0, nb * kBlockN, n_dim / 2,
                                    row_corr, scale, out);
    };
  });
}

at::Tensor batched_int8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "batched_int8_pack: [N, K] int8");
  const at::Tensor src = q.contiguous();
  const int64_t n_dim = src.size(0), k_dim = src.size(1);
  const int64_t nb = (n_dim + kBlockN - 1) / kBlockN, k4n = (k_dim + 3) / 4;
  at::Tensor out = at::zeros({nb, k4n, kBlockN, 4}, src.options());
  const int8_t* s = src.data_ptr<int8_t>();
  int8_t* d = out.data_ptr<int8_t>();
  for (int64_t n = 0; n < n_dim; ++n)
    for (int64_t k = 0; k < k_dim; ++k)
      d[((n / kBlockN * k4n + k / 4) * kBlockN + n % kBlockN) * 4 + k % 4] = s[n * k_dim + k];
  return out;
}

int64_t batched_int8_block() { return kBlockN; }

std::vector<std::string> batched_int8_kernels() {
  std::vector<std::string> out;
#if HR_DOT
  out.push_back(std::string("dot:") + kDotIsa);
#endif
#if HR_WIDEN
  out.push_back(std::string("widen:") + kWidenIsa);
#endif
  return out;
}

template <class K, typename T>
void dispatch(const at::Tensor& x, int64_t k4n, const at::Tensor& packed, const at::Tensor& sc,
              const float* bias, int64_t n_dim, bool gated, at::Tensor& out) {
  using X = typename K::X;
  const int64_t rows = x.size(0), k_dim = x.size(1), width = k4n * 4;
  const at::Tensor xc = x.contiguous();
  const T* src = xc.data_ptr<T>();
  // Every element is written below (rows padded with zeros to width), so not zeroed first.
  const std::unique_ptr<X[]> xq(new X[rows * width]);
  std::vector<float> xs;
  std::vector<int32_t> xc_sums;
  std::vector<float> row_corr;
  const int64_t groups = (k4n + kScaleSteps - 1) / kScaleSteps;
  if constexpr (kGrouped<K>) {
    xs.resize(rows * groups);
    if (K::kOffset) xc_sums.resize(rows * groups), row_corr.resize(rows);
  }
  // Rows are independent: widened, padded and quantised (or copied) on both threads, straight
  // from x. A serial padded fp32 copy of x first, zeroed then filled, was 7% of a 512-row
  // 576 x 576 "dot" call's samples, with the other thread spinning through it (AMX masked).
  const int64_t grain = std::max<int64_t>(1, 16384 / width);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    // "dot" quantises from an fp32 row (columns past k_dim stay zero); "widen" writes its
    // fp32 or bf16 inputs straight into xq.
    std::vector<float> row(kGrouped<K> ? width : 0, 0.0f);
    for (int64_t m = begin; m < end; ++m) {
      const T* xm = src + m * k_dim;
      X* q = xq.get() + m * width;
      if constexpr (kGrouped<K>) {
        for (int64_t k = 0; k < k_dim; ++k) row[k] = static_cast<float>(xm[k]);
        headrace::quantise_row<X, K::kQMax>(row.data(), width, groups, q, xs.data() + m * groups,
                                            K::kOffset ? xc_sums.data() + m * groups : nullptr);
        // The offset's share of every channel's sum (128 * each group's sum of integers, by
        // its scale), one scalar per row: subtracted once in the epilogue rather than from
        // each group's integers in the inner loop.
        if (K::kOffset) {
          float c = 0.0f;
          for (int64_t j = 0; j < groups; ++j) c += xc_sums[m * groups + j] * xs[m * groups + j];
          row_corr[m] = 128.0f * c;
        }
      } else {
        static_assert(std::is_same_v<X, float> || std::is_same_v<X, uint16_t>,
                      "widen takes fp32 or bf16 bits");
        for (int64_t k = 0; k < k_dim; ++k) {
          const float v = static_cast<float>(xm[k]);
          if constexpr (std::is_same_v<X, float>)
            q[k] = v;
          else
            q[k] = c10::BFloat16(v).x;
        }
        std::fill(q + k_dim, q + width, X{0});
      }
    }
  });
  run<K, T>(xq.get(), xs.empty() ? nullptr : xs.data(), row_corr.empty() ? nullptr : row_corr.data(),
            groups, rows, k4n, packed.data_ptr<int8_t>(), sc.data_ptr<float>(), bias, n_dim, gated,
            out.data_ptr<T>());
}

template <class K>
void dispatch_dtype(const at::Tensor& x, int64_t k4n, const at::Tensor& packed,
                    const at::Tensor& sc, const float* bias, int64_t n_dim, bool gated,
                    at::Tensor& out) {
  if (x.scalar_type() == at::kFloat)
    dispatch<K, float>(x, k4n, packed, sc, bias, n_dim, gated, out);
  else
    dispatch<K, c10::BFloat16>(x, k4n, packed, sc, bias, n_dim, gated, out);
}

// Both ops: checks, then the product into `out` ([M, n_dim], or gated [M, n_dim / 2]).
at::Tensor batched_int8(const char* op, const at::Tensor& x, const at::Tensor& packed,
                        const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                        int64_t n_dim, const std::string& kernel, bool gated) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": fp32 or bf16 inputs only, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kBlockN && packed.size(3) == 4,
              op, ": packed must come from this build's batched_int8_pack");
  const int64_t k4n = packed.size(1);
  TORCH_CHECK((x.size(1) + 3) / 4 == k4n, op, ": x has ", x.size(1),
              " columns, the weight was packed for ", k4n * 4);
  TORCH_CHECK(n_dim > 0 && (n_dim + kBlockN - 1) / kBlockN == packed.size(0), op,
              ": n does not match the packed blocks");
  TORCH_CHECK(!gated || n_dim % (2 * kBlockN) == 0, op, ": n (", n_dim,
              ") must be halves of whole blocks of ", kBlockN, " channels");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n_dim, op,
              ": scale must be fp32, one per output channel");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim, op, ": one bias per output channel");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor sc = scale.contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({x.size(0), gated ? n_dim / 2 : n_dim}, x.options());
  if (x.size(0) == 0) return out;
  if (kernel == "dot") {
#if HR_DOT
    dispatch_dtype<Dot>(x, k4n, packed, sc, bp, n_dim, gated, out);
    return out;
#endif
  } else if (kernel == "widen") {
#if HR_WIDEN
    dispatch_dtype<Widen>(x, k4n, packed, sc, bp, n_dim, gated, out);
    return out;
#endif
  }
  TORCH_CHECK(false, op, ": kernel '", kernel, "' is not in this build (see batched_int8_kernels)");
  return out;
}

at::Tensor batched_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                               int64_t n_dim, const std::string& kernel) {
  return batched_int8("batched_int8_linear", x, packed, scale, bias, n_dim, kernel, false);
}

// silu(gate) * up of a gate/up weight's output halves: the same bits as batched_int8_linear
// then silu_and_mul, without the [M, n_dim] round trip.
at::Tensor batched_int8_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                                 const at::Tensor& scale, int64_t n_dim,
                                 const std::string& kernel) {
  return batched_int8("batched_int8_silu_mul", x, packed, scale, c10::nullopt, n_dim, kernel,
                      true);
}

}  // namespace

// For C++ callers (ops.h): the op above, outside this file's anonymous namespace.
namespace headrace::ops {
at::Tensor batched_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                               int64_t n_dim, const std::string& kernel) {
  return ::batched_int8_linear(x, packed, scale, bias, n_dim, kernel);
}
at::Tensor batched_int8_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                                 const at::Tensor& scale, int64_t n_dim,
                                 const std::string& kernel) {
  return ::batched_int8_silu_mul(x, packed, scale, n_dim, kernel);
}
}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("batched_int8_pack(Tensor q) -> Tensor");
  m.def("batched_int8_block() -> int", &batched_int8_block);
  m.def("batched_int8_kernels() -> str[]", &batched_int8_kernels);
  m.def(
      "batched_int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n, "
      "str kernel) -> Tensor");
  m.def(
      "batched_int8_silu_mul(Tensor x, Tensor packed, Tensor scale, int n, str kernel) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("batched_int8_pack", &batched_int8_pack);
  m.impl("batched_int8_linear", &batched_int8_linear);
  m.impl("batched_int8_silu_mul", &batched_int8_silu_mul);
}
