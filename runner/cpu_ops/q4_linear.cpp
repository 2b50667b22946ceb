// 4-bit block weights (GGUF's Q4_1: per 32 inputs of a channel, w = d * q + m with q in 0..15)
// multiplied by int8 activations with AVX2's maddubs, for prompt chunks and decode batches.
//
// Why 4-bit blocks and not the int8 copy's int16 madd: maddubs multiplies 32 u8 x s8 pairs a
// ymm instruction where madd multiplies 16, at the same rate (benchmarks/mac_peak.py, Zen 1:
// 38.5 against 19.2 G multiply-adds/s a core), but its pair sums are saturating int16. With q
// at most 15 and |x| at most 127, a pair is at most 3810 and eight steps' sums (one block of
// 32 inputs) at most 30480: they add in int16 with no saturation, and one madd by ones a
// block widens them to int32 (33.6 G/s with that widening). The weights are the GGUF's own
// numbers (q, d, m), so only the activations are rounded, per 32 inputs to int8, as
// llama.cpp's Q4_1 x Q8_1 dot does; and they are half the bytes of int8.
//
//   q4_pack(q [N, K] uint8 0..15, d [N, K/32] fp32, m [N, K/32] fp32) -> (packed
//     [ceil(N/24), K/8, 24, 4] uint8: per block of 24 channels and pair of steps t, channel
//     c's byte i holds input 8t + i in its low nibble and 8t + 4 + i in its high one;
//     scales [ceil(N/24), K/32, 2, 24] fp32: a block's d then m per group), K a multiple of 32.
//   q4_linear(x [M, K] fp32|bf16, packed, scales, bias?, N) -> [M, N] x.dtype:
//     y = x @ (d * q + m)^T + bias, x rounded per row and 32 inputs.
//   q4_kernels() -> this build's kernel as "name:isa" (none without AVX2).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "act_quant.h"
#include "tile_driver.h"
#include "ops.h"

namespace {

// Channels per packed block: three ymm of 8 int32 lanes. A 2-row x 24-channel register tile
// on unpacked weights ran 1.06-1.07x a 4 x 16 one on packed weights in this op on Zen 1 (the
// 4 SmolLM2 shapes, 2048 rows, both threads): each broadcast of a row's 4 inputs feeds three
// maddubs instead of two.
constexpr int64_t kVecs = 3;
constexpr int64_t kBlockN = 8 * kVecs;
constexpr int64_t kStepBytes = kBlockN * 4;  // one block's unpacked bytes for a 4-input step
constexpr int64_t kPairBytes = kStepBytes;  // ... and packed bytes for a pair of steps
constexpr int64_t kBlockPairs = headrace::kGroupWidth / 8;  // step pairs per 32-input group

#if defined(__AVX2__) && defined(__FMA__)
#define HR_Q4 1

// Rows a register tile multiplies each weight vector into: 3 int16 sums a row, three weight
// vectors (and three more while unpacking nibbles), the mask and a broadcast fill 14 of 16
// registers at 2; the fp32 sums across groups live in memory between folds.
#ifndef HR_Q4_ROWS
#define HR_Q4_ROWS 2
#endif
constexpr int kRows = HR_Q4_ROWS;

using Acc = __m256i[kVecs];

// Keeps each int16 sum in a register, its adds in order (see batched_int8.cpp's `pin`).
template <int MB>
inline void pin(Acc (&acc)[MB]) {
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < kVecs; ++v) __asm__("" : "+x"(acc[m][v]));
}

// One step (4 inputs) of MB rows: x points at the rows' 4 int8 inputs of this step.
template <int MB>
inline void step(const int8_t* x, int64_t x_stride, const __m256i (&w)[kVecs], Acc (&acc)[MB]) {
  for (int m = 0; m < MB; ++m) {
    int32_t v;
    std::memcpy(&v, x + m * x_stride, 4);
    const __m256i b = _mm256_set1_epi32(v);
    for (int i = 0; i < kVecs; ++i)
      acc[m][i] = _mm256_add_epi16(acc[m][i], _mm256_maddubs_epi16(w[i], b));
  }
  pin<MB>(acc);
}

// A block's nibbles as one u8 a weight, step after step ([K/4, 24, 4]): what `tile` reads in
// place of the packed block where a thread multiplies the block into more than one row tile,
// so the nibbles are unpacked once a block rather than once a tile (what makes 2-row tiles
// pay: a stand-alone copy of the loop on Zen 1 ran 1.03-1.09x with it at 4 x 16 tiles).
void unpack_block(const uint8_t* block, int64_t width, uint8_t* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int64_t t = 0; t < width / 8; ++t)
    for (int v = 0; v < kVecs; ++v) {
      const __m256i r =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + t * kPairBytes) + v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * t * kStepBytes) + v,
                          _mm256_and_si256(r, nib));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * t + 1) * kStepBytes) + v,
                          _mm256_and_si256(_mm256_srli_epi16(r, 4), nib));
    }
}

// MB rows x one block of 24 channels over all K: out[m * 24 + c]. `block` is packed, or
// unpacked (`unpack_block`) with kUnpacked.
// xs/xsum: per row and 32-input group, the activation scale and scale * sum of its integers.
template <int MB, bool kUnpacked>
void tile(const int8_t* x, int64_t x_stride, const float* xs, const float* xsum, int64_t groups,
          const uint8_t* block, const float* scales, float* out) {
  __m256 f[MB][kVecs];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < kVecs; ++v) f[m][v] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < groups; ++j) {
    Acc acc[MB];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm256_setzero_si256();
    const int8_t* xp = x + j * headrace::kGroupWidth;
    if constexpr (kUnpacked) {
      const uint8_t* wp = block + j * 2 * kBlockPairs * kStepBytes;
#pragma GCC unroll 8
      for (int t = 0; t < 2 * kBlockPairs; ++t) {
        const __m256i* in = reinterpret_cast<const __m256i*>(wp + t * kStepBytes);
        __m256i w[kVecs];
        for (int v = 0; v < kVecs; ++v) w[v] = _mm256_loadu_si256(in + v);
        step<MB>(xp + t * 4, x_stride, w, acc);
      }
    } else {
      const uint8_t* wp = block + j * kBlockPairs * kPairBytes;
#pragma GCC unroll 4
      for (int t = 0; t < kBlockPairs; ++t) {
        const __m256i* in = reinterpret_cast<const __m256i*>(wp + t * kPairBytes);
        __m256i r[kVecs], w[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          r[v] = _mm256_loadu_si256(in + v);
          w[v] = _mm256_and_si256(r[v], nib);
        }
        step<MB>(xp + t * 8, x_stride, w, acc);
        for (int v = 0; v < kVecs; ++v) w[v] = _mm256_and_si256(_mm256_srli_epi16(r[v], 4), nib);
        step<MB>(xp + t * 8 + 4, x_stride, w, acc);
      }
    }
    // Per channel: sum(d q x) = d * scale * (int sum), and sum(m x) = m * scale * sum(q).
    const float* d = scales + j * 2 * kBlockN;
    for (int v = 0; v < kVecs; ++v) {
      const __m256 dv = _mm256_loadu_ps(d + 8 * v), mv = _mm256_loadu_ps(d + kBlockN + 8 * v);
      for (int m = 0; m < MB; ++m) {
        const __m256 s = _mm256_set1_ps(xs[m * groups + j]);
        const __m256 c = _mm256_set1_ps(xsum[m * groups + j]);
        const __m256 i = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][v], ones));
        f[m][v] = _mm256_fmadd_ps(mv, c, _mm256_fmadd_ps(i, _mm256_mul_ps(dv, s), f[m][v]));
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(out + m * kBlockN + 8 * v, f[m][v]);
}

template <int MB, bool kUnpacked>
void tile_rows(int rows, const int8_t* x, int64_t x_stride, const float* xs, const float* xsum,
               int64_t groups, const uint8_t* block, const float* scales, float* out) {
  if constexpr (MB > 0) {
    if (rows == MB) return tile<MB, kUnpacked>(x, x_stride, xs, xsum, groups, block, scales, out);
    tile_rows<MB - 1, kUnpacked>(rows, x, x_stride, xs, xsum, groups, block, scales, out);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const float* bias,
         int64_t n_dim, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1), groups = width / headrace::kGroupWidth;
  const at::Tensor xc = x.contiguous();
  std::vector<int8_t> xq(rows * width);
  std::vector<float> xs(rows * groups), xsum(rows * groups);
  std::vector<int32_t> isum(rows * groups);
  const int64_t grain = std::max<int64_t>(1, 16384 / width);
  // Rows quantised straight from x on both threads (a serial fp32 copy first cost ~5% of a
  // 1024-row call).
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<T, float> ? 0 : width);
    for (int64_t m = begin; m < end; ++m) {
      const int64_t o = m * groups;
      const T* src = xc.data_ptr<T>() + m * width;
      const float* row;
      if constexpr (std::is_same_v<T, float>) {
        row = src;
      } else {
        for (int64_t k = 0; k < width; ++k) widened[k] = static_cast<float>(src[k]);
        row = widened.data();
      }
      headrace::quantise_row<int8_t, 127>(row, width, groups, xq.data() + m * width,
                                          xs.data() + o, isum.data() + o);
      for (int64_t j = 0; j < groups; ++j) xsum[o + j] = xs[o + j] * isum[o + j];
    }
  });
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  T* op = out.data_ptr<T>();
  headrace::for_each_tile(packed.size(0), rows, kRows, width, [&] {
    // This run's unpacked block and which block it is (-1: none yet).
    return [&, unpacked = std::vector<uint8_t>(), unpacked_block = int64_t{-1}](
               int64_t nb, int64_t m0, int mb, bool more) mutable {
      float sums[kRows * kBlockN];
      const uint8_t* block = pk + nb * (width / 8) * kPairBytes;
      const int8_t* xm = xq.data() + m0 * width;
      const float *xsm = xs.data() + m0 * groups, *xsumm = xsum.data() + m0 * groups;
      const float* sm = sp + nb * groups * 2 * kBlockN;
      // A block's first tile in this run unpacks it where the run's next tile is the same
      // block's (a block split between two runs or panels is unpacked by each).
      if (unpacked_block != nb && more) {
        unpacked.resize(width * kBlockN);
        unpack_block(block, width, unpacked.data());
        unpacked_block = nb;
      }
      if (unpacked_block == nb)
        tile_rows<kRows, true>(mb, xm, width, xsm, xsumm, groups, unpacked.data(), sm, sums);
      else
        tile_rows<kRows, false>(mb, xm, width, xsm, xsumm, groups, block, sm, sums);
      headrace::store_tile(sums, kBlockN, mb, m0, nb * kBlockN, n_dim, nullptr, nullptr, bias,
                           op);
    };
  });
}
#else
#define HR_Q4 0
#endif

// [N, G] fp32 d and m -> [ceil(N/24), G, 2, 24], zero padded: what a block's group reads.
at::Tensor block_major(const at::Tensor& d, const at::Tensor& mn, int64_t blocks) {
  const int64_t n_dim = d.size(0), groups = d.size(1);
  at::Tensor out = at::zeros({2, blocks * kBlockN, groups}, d.options());
  out[0].narrow(0, 0, n_dim).copy_(d);
  out[1].narrow(0, 0, n_dim).copy_(mn);
  return out.view({2, blocks, kBlockN, groups}).permute({1, 3, 0, 2}).contiguous();
}

std::vector<at::Tensor> q4_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q4_pack: q must be [N, K] uint8");
  const int64_t n_dim = q.size(0), k_dim = q.size(1), groups = k_dim / headrace::kGroupWidth;
  TORCH_CHECK(k_dim % headrace::kGroupWidth == 0, "q4_pack: K must be a multiple of 32, got ",
              k_dim);
  TORCH_CHECK(q.max().item<int64_t>() <= 15, "q4_pack: q must be in 0..15");
  for (const at::Tensor* t : {&d, &mn})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n_dim &&
                    t->size(1) == groups,
                "q4_pack: d and m must be [N, K/32] fp32");
  const int64_t blocks = (n_dim + kBlockN - 1) / kBlockN;
  const at::Tensor src = q.contiguous();
  at::Tensor out = at::zeros({blocks, k_dim / 8, kBlockN, 4}, src.options());
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < n_dim; ++n)
    for (int64_t k = 0; k < k_dim; ++k) {
      const int64_t t = k / 8, i = k % 4, high = k % 8 / 4;
      o[((n / kBlockN * (k_dim / 8) + t) * kBlockN + n % kBlockN) * 4 + i] |=
          static_cast<uint8_t>(s[n * k_dim + k] << (4 * high));
    }
  return {out, block_major(d, mn, blocks)};
}

std::vector<std::string> q4_kernels() {
#if HR_Q4
  return {"q4:avx2_maddubs"};
#else
  return {};
#endif
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  TORCH_CHECK(x.dim() == 2, "q4_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q4_linear: fp32 or bf16 inputs only, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockN && packed.size(3) == 4,
              "q4_linear: packed must come from q4_pack");
  const int64_t k_dim = packed.size(1) * 8, groups = k_dim / headrace::kGroupWidth;
  TORCH_CHECK(x.size(1) == k_dim, "q4_linear: x has ", x.size(1), " columns, the weight ", k_dim);
  TORCH_CHECK(n_dim > 0 && (n_dim + kBlockN - 1) / kBlockN == packed.size(0),
              "q4_linear: n does not match the packed blocks");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({packed.size(0), groups, 2, kBlockN}),
              "q4_linear: scales must come from q4_pack");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim, "q4_linear: one bias per output channel");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (x.size(0) == 0) return out;
#if HR_Q4
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    run<float>(x, packed, scales, bp, n_dim, out);
  else
    run<c10::BFloat16>(x, packed, scales, bp, n_dim, out);
  return out;
#else
  TORCH_CHECK(false, "q4_linear: this build has no AVX2 (see q4_kernels)");
  return out;
#endif
}

}  // namespace

namespace headrace::ops {
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  return ::q4_linear(x, packed, scales, bias, n_dim);
}
}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("q4_pack(Tensor q, Tensor d, Tensor m) -> Tensor[]");
  m.def("q4_kernels() -> str[]", &q4_kernels);
  m.def("q4_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("q4_pack", &q4_pack);
  m.impl("q4_linear", &q4_linear);
}
