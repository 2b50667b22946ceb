// 4-bit block weights (GGUF's Q4_1: per 32 inputs of a channel, w = d * q + m with q in 0..15)
// for a decode step of a few rows, where the step is bound by reading the weights.
//
// Why beside q4_linear.cpp: that kernel is built for batches (int8 activations, maddubs,
// register tiles of rows); at one row it lost to the int8 copies on Zen 1, and int8
// activations at one row changed greedy text. A single stream wants the fewest bytes read
// with activations kept as exact as the int8 copies': here they are rounded to int16 per 32
// inputs (~2e-5 relative, as batched_int8.cpp's AVX2 "dot"), the nibbles widened to int16
// with shifts and masks (no shuffles), and multiplied with vpdpwssd (AVX512-VNNI, AVX-VNNI)
// or vpmaddwd. The bytes: 0.625 a weight (nibbles and fp16 d, m, as the GGUF's) against
// the int8 copies' 1.0, so SmolLM2's decoder streams 66 MB a token, not 106.
//
//   q4_gemv_pack(q [N, K] uint8 0..15, d [N, K/32] fp32, m [N, K/32] fp32)
//       -> packed [ceil(N/16), K/32, 320] uint8
//     Per block of 16 channels and group of 32 inputs: four 64-byte chunks of nibbles, then
//     d[16] and m[16] as fp16 (a block's group is one contiguous read). Chunk c holds
//     inputs 8c..8c+7 as 32 little-endian 16-bit words: word 2i + e of channel i, its nibble
//     n (bits 4n..4n+3) is input 8c + 2n + e. A mask and three shifts give four vectors of
//     int16 pairs, channel i's pair in 32-bit lane i: what vpdpwssd multiplies by a
//     broadcast pair of activations.
//   q4_gemv(x [M, K] fp32|bf16, packed, bias?, N) -> [M, N] x.dtype:
//     y = round16(x) @ (d * q + m)^T + bias, x rounded per row and 32 inputs.
//   q4_gemv_kernels() -> this build's kernel as "q4_gemv:isa" (none without AVX2).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "act_quant.h"
#include "ops.h"
#include "tile_driver.h"

namespace {

constexpr int64_t kChannels = 16;              // a block's output channels
constexpr int64_t kChunkBytes = 64;            // 16 channels x 8 inputs of nibbles
constexpr int64_t kChunks = 4;                 // per group of 32 inputs
constexpr int64_t kScaleBytes = kChannels * 2 * 2;  // d[16], m[16] fp16
constexpr int64_t kGroupBytes = kChunks * kChunkBytes + kScaleBytes;  // 320

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HR_Q4_GEMV 1
// One 64-byte chunk a vector: 16 int32 lanes, one channel each.
struct Isa {
  using I = __m512i;
  using F = __m512;
  static constexpr int kHalves = 1;  // vectors a chunk fills
  static constexpr int kLanes = 16;
#if defined(__AVX512VNNI__)
  static constexpr const char* kName = "avx512_vnni";
#else
  static constexpr const char* kName = "avx512_madd";
#endif
  static constexpr int kSums = 2;
  // Groups fetched ahead of the one multiplied: at one row on Sapphire Rapids, 4.13 against
  // 4.25 ms a sweep of SmolLM2's decoder without (8 ahead: 4.30, 16: 4.49).
  static constexpr int64_t kAhead = 4;
#define HR_Q4_UNROLL_CHUNKS _Pragma("GCC unroll 4")
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I mask() { return _mm512_set1_epi16(0x000F); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  template <int S>
  static I shift(I a) { return _mm512_srli_epi16(a, S); }
  static I pair(const int16_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  }
  static I madd(I acc, I w, I x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
  }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // Lanes [16 h, 16 h + 16) of 16 fp16 values.
  static F halves(const uint8_t* p, int) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* out, F v) { _mm512_storeu_ps(out, v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HR_Q4_GEMV 1
// One 64-byte chunk is two vectors: channels 0-7, then 8-15.
struct Isa {
  using I = __m256i;
  using F = __m256;
  static constexpr int kHalves = 2;
  static constexpr int kLanes = 8;
#if defined(__AVXVNNI__)
  static constexpr const char* kName = "avx_vnni";
  static constexpr int kSums = 2;
#else
  static constexpr const char* kName = "avx2_madd";
  static constexpr int kSums = 1;
#endif
  // Zen 3 streams one core's share only with the fetch ~15 KB ahead of two blocks' reads:
  // one layer per 1-row call, 40 layers in turn on one core, 13.6 GB/s at 4 groups ahead
  // against 20.6 at 24 (2.0x the 4-ahead kernel with its unrolled chunks and spills).
  static constexpr int64_t kAhead = 24;
// The four chunks stay a loop: unrolled, their unpacked nibbles and sums outgrew the 16 ymm
// registers (1.7 KB of spills; one layer hot on one Zen 3 core, 18.7 against 25.5 GB/s).
#define HR_Q4_UNROLL_CHUNKS
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I mask() { return _mm256_set1_epi16(0x000F); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  template <int S>
  static I shift(I a) { return _mm256_srli_epi16(a, S); }
  static I pair(const int16_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  }
  static I madd(I acc, I w, I x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F halves(const uint8_t* p, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
  }
  static void store(float* out, F v) { _mm256_storeu_ps(out, v); }
};
#else
#define HR_Q4_GEMV 0
#endif

#if HR_Q4_GEMV
constexpr int kHalves = Isa::kHalves;
// Rows a tile multiplies each unpacked chunk into (more rows take more tiles, the weights
// then re-read from cache).
constexpr int kMaxRows = 2;
// Groups are fetched Isa::kAhead ahead of the one multiplied; past a block's end that is the
// next block's first groups, which a run reads next or leaves to another thread.
constexpr int64_t kAhead = Isa::kAhead;
// Sums per (row, block, half): two (even and odd nibbles) where the multiply-add is one
// instruction whose ~5-cycle latency would chain (vpdpwssd); one on AVX2 where vpmaddwd feeds
// a 1-cycle add, and a second set only spends registers its 16 do not have to spare.
constexpr int kSums = Isa::kSums;

// Blocks a tile streams side by side: independent multiply-add chains (vpdpwssd's latency is
// ~5 cycles) and a few read streams, within the vector registers (32 zmm, 16 ymm; on AVX2 two
// rows of two blocks fit since the activation pairs are not held: 15.4 against 11.9 GB/s of
// one block, hot on one Zen 3 core).
template <int MB>
constexpr int blocks_for_rows() {
  return kHalves == 1 ? (MB == 1 ? 4 : 2) : 2;
}

// MB rows x NB blocks (16 channels each) over all K: out[m][b * 16 + c].
// x: int16 rows (stride K); xs / xsum: per row and group, the scale and scale * sum of its
// integers (the m term: sum(m x) = m * scale * sum(q)).
template <int MB, int NB>
void tile(const int16_t* x, int64_t k_dim, const float* xs, const float* xsum, int64_t groups,
          const uint8_t* w, int64_t block_stride, float* out) {
  using I = Isa::I;
  using F = Isa::F;
  F f[MB][NB][kHalves];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < kHalves; ++h) f[m][b][h] = Isa::fzero();
  const I mask = Isa::mask();
  for (int64_t j = 0; j < groups; ++j) {
    I acc[MB][NB][kHalves][kSums];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < kHalves; ++h)
          for (int s = 0; s < kSums; ++s) acc[m][b][h][s] = Isa::zero();
    const int16_t* xg = x + j * headrace::kGroupWidth;
    for (int b = 0; b < NB; ++b)
      for (int64_t line = 0; line < kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * block_stride +
                                                   (j + kAhead) * kGroupBytes + line),
                     _MM_HINT_T0);
    HR_Q4_UNROLL_CHUNKS
    for (int c = 0; c < kChunks; ++c) {
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < kHalves; ++h) {
          const I r = Isa::load(w + b * block_stride + j * kGroupBytes + c * kChunkBytes +
                                h * (kChunkBytes / kHalves));
          const I wn[4] = {Isa::and_(r, mask), Isa::and_(Isa::shift<4>(r), mask),
                           Isa::and_(Isa::shift<8>(r), mask), Isa::shift<12>(r)};
          // The activation pairs are broadcast where used, not held: two rows' eight
          // held pairs outgrew AVX2's registers (2 rows x 2 blocks: 1.29x hot on Zen 3).
          for (int n = 0; n < 4; ++n)
            for (int m = 0; m < MB; ++m)
              acc[m][b][h][n % kSums] = Isa::madd(acc[m][b][h][n % kSums], wn[n],
                                                  Isa::pair(xg + m * k_dim + 8 * c + 2 * n));
        }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* s = w + b * block_stride + j * kGroupBytes + kChunks * kChunkBytes;
      for (int h = 0; h < kHalves; ++h) {
        const F d = Isa::halves(s, h), mn = Isa::halves(s + kChannels * 2, h);
        for (int m = 0; m < MB; ++m) {
          I total = acc[m][b][h][0];
          for (int s = 1; s < kSums; ++s) total = Isa::add(total, acc[m][b][h][s]);
          const F sums = Isa::cvt(total);
          const F scaled = Isa::mul(d, Isa::set1(xs[m * groups + j]));
          f[m][b][h] = Isa::fmadd(mn, Isa::set1(xsum[m * groups + j]),
                                  Isa::fmadd(sums, scaled, f[m][b][h]));
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < kHalves; ++h)
        Isa::store(out + m * NB * kChannels + b * kChannels + h * Isa::kLanes, f[m][b][h]);
}

// Blocks [first, last) for rows [m0, m0 + MB), written to y (row stride n_dim) with the bias.
template <int MB, typename T>
void blocks_of_rows(int64_t first, int64_t last, int64_t m0, const int16_t* xq, int64_t k_dim,
                    const float* xs, const float* xsum, int64_t groups, const uint8_t* packed,
                    const float* bias, int64_t n_dim, T* y) {
  constexpr int NB = blocks_for_rows<MB>();
  const int64_t stride = groups * kGroupBytes;
  float sums[MB * NB * kChannels];
  const int16_t* xm = xq + m0 * k_dim;
  const float *xsm = xs + m0 * groups, *xsumm = xsum + m0 * groups;
  auto emit = [&](int64_t b0, int nb) {
    headrace::store_tile(sums, nb * kChannels, MB, m0, b0 * kChannels, n_dim, nullptr, nullptr,
                         bias, y);
  };
  int64_t b = first;
  for (; b + NB <= last; b += NB) {
    tile<MB, NB>(xm, k_dim, xsm, xsumm, groups, packed + b * stride, stride, sums);
    emit(b, NB);
  }
  for (; b < last; ++b) {
    tile<MB, 1>(xm, k_dim, xsm, xsumm, groups, packed + b * stride, stride, sums);
    emit(b, 1);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n_dim,
         at::Tensor& out) {
  const int64_t rows = x.size(0), k_dim = x.size(1), groups = k_dim / headrace::kGroupWidth;
  const at::Tensor xc = x.contiguous();
  std::vector<int16_t> xq(rows * k_dim);
  std::vector<float> xs(rows * groups), xsum(rows * groups), widened(k_dim);
  std::vector<int32_t> isum(rows * groups);
  // A few rows: quantised on this thread (a parallel region costs more than the work).
  for (int64_t m = 0; m < rows; ++m) {
    const T* src = xc.data_ptr<T>() + m * k_dim;
    const float* row;
    if constexpr (std::is_same_v<T, float>) {
      row = src;
    } else {
      for (int64_t k = 0; k < k_dim; ++k) widened[k] = static_cast<float>(src[k]);
      row = widened.data();
    }
    const int64_t o = m * groups;
    headrace::quantise_row<int16_t, 32767>(row, k_dim, groups, xq.data() + m * k_dim,
                                           xs.data() + o, isum.data() + o);
    for (int64_t j = 0; j < groups; ++j) xsum[o + j] = xs[o + j] * isum[o + j];
  }
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  // Each thread one contiguous run of blocks: its weights are one stream from memory.
  at::parallel_for(0, packed.size(0), 1, [&](int64_t first, int64_t last) {
    int64_t m0 = 0;
    for (; m0 + kMaxRows <= rows; m0 += kMaxRows)
      blocks_of_rows<kMaxRows>(first, last, m0, xq.data(), k_dim, xs.data(), xsum.data(),
                               groups, pk, bias, n_dim, y);
    if (m0 < rows)
      blocks_of_rows<1>(first, last, m0, xq.data(), k_dim, xs.data(), xsum.data(), groups, pk,
                        bias, n_dim, y);
  });
}
#endif

at::Tensor q4_gemv_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q4_gemv_pack: q must be [N, K] uint8");
  const int64_t n_dim = q.size(0), k_dim = q.size(1), groups = k_dim / headrace::kGroupWidth;
  TORCH_CHECK(k_dim > 0 && k_dim % headrace::kGroupWidth == 0,
              "q4_gemv_pack: K must be a multiple of 32, got ", k_dim);
  TORCH_CHECK(q.max().item<int64_t>() <= 15, "q4_gemv_pack: q must be in 0..15");
  for (const at::Tensor* t : {&d, &mn})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n_dim &&
                    t->size(1) == groups,
                "q4_gemv_pack: d and m must be [N, K/32] fp32");
  const int64_t blocks = (n_dim + kChannels - 1) / kChannels;
  const at::Tensor qc = q.contiguous(), dc = d.contiguous(), mc = mn.contiguous();
  at::Tensor out = at::zeros({blocks, groups, kGroupBytes}, qc.options());
  const uint8_t* s = qc.data_ptr<uint8_t>();
  const float *dp = dc.data_ptr<float>(), *mp = mc.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n_dim, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t i = n % kChannels;
      for (int64_t j = 0; j < groups; ++j) {
        uint8_t* g = o + (n / kChannels * groups + j) * kGroupBytes;
        for (int64_t k = 0; k < headrace::kGroupWidth; ++k) {
          const int64_t c = k / 8, nib = k % 8 / 2, e = k % 2;
          const int64_t word = 2 * i + e;
          const uint8_t v = s[n * k_dim + j * headrace::kGroupWidth + k];
          // Nibble `nib` of a little-endian word: byte nib / 2, high half for odd nib.
          g[c * kChunkBytes + word * 2 + nib / 2] |= static_cast<uint8_t>(v << (4 * (nib % 2)));
        }
        const c10::Half dh(dp[n * groups + j]), mh(mp[n * groups + j]);
        std::memcpy(g + kChunks * kChunkBytes + i * 2, &dh, 2);
        std::memcpy(g + kChunks * kChunkBytes + kChannels * 2 + i * 2, &mh, 2);
      }
    }
  });
  return out;
}

std::vector<std::string> q4_gemv_kernels() {
#if HR_Q4_GEMV
  return {std::string("q4_gemv:") + Isa::kName};
#else
  return {};
#endif
}

at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  TORCH_CHECK(x.dim() == 2, "q4_gemv: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q4_gemv: fp32 or bf16 inputs only, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "q4_gemv: packed must come from q4_gemv_pack");
  const int64_t k_dim = packed.size(1) * headrace::kGroupWidth;
  TORCH_CHECK(x.size(1) == k_dim, "q4_gemv: x has ", x.size(1), " columns, the weight ", k_dim);
  TORCH_CHECK(n_dim > 0 && (n_dim + kChannels - 1) / kChannels == packed.size(0),
              "q4_gemv: n does not match the packed blocks");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim, "q4_gemv: one bias per output channel");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (x.size(0) == 0) return out;
#if HR_Q4_GEMV
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    run<float>(x, packed, bp, n_dim, out);
  else
    run<c10::BFloat16>(x, packed, bp, n_dim, out);
  return out;
#else
  TORCH_CHECK(false, "q4_gemv: this build has no AVX2 (see q4_gemv_kernels)");
  return out;
#endif
}

}  // namespace

namespace headrace::ops {
at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  return ::q4_gemv(x, packed, bias, n_dim);
}
}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("q4_gemv_pack(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("q4_gemv_kernels() -> str[]", &q4_gemv_kernels);
  m.def("q4_gemv(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("q4_gemv_pack", &q4_gemv_pack);
  m.impl("q4_gemv", &q4_gemv);
}
