// Weight-only int8 linear on AMX tiles: y = x @ (q * scale)^T + bias, for batches of a few
// to a few dozen rows (a decode step of many requests).
//
// oneDNN's bf16 linear reads 2 bytes per weight; a decode step of 32 rows is still bound by
// reading the weights, so int8 weights (1 byte) are the gain, and AMX's bf16 tile multiply
// makes the arithmetic of 32 rows nearly free. AMX has no int8 x bf16 product: each 16 x 32
// weight tile is widened to bf16 (exact: |q| <= 127) in a buffer that stays in L1, loaded
// as a tile and multiplied into fp32 accumulator tiles; the per-channel scale and the bias
// are applied once at the end. Activations are rounded to bf16 (the model runs in bf16 when
// this path is chosen).
//
//   amx_pack_int8(q [N, K] int8) -> tiles [ceil(N/16), ceil(K/32), 512] int8, zero padded;
//     tile (n, k) holds rows n*16.. and columns k*32.. in AMX's pair-interleaved order for B
//     (16 rows of k pairs, each row 16 channels x 2 k), so a tile is one contiguous load.
//   amx_int8_linear(x [M, K] fp32|bf16, tiles, scale [N] fp32, bias [N]?, N) -> [M, N] x.dtype
//   amx_usable() -> whether this build has the AMX kernel and the kernel let us use AMX.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace {

using headrace::amx_usable;

constexpr int64_t kTileN = 16;                  // output channels per weight tile
constexpr int64_t kTileK = 32;                  // inputs per weight tile (16 bf16 pairs)
constexpr int64_t kTileBytes = kTileN * kTileK;  // int8 bytes per packed weight tile

at::Tensor amx_pack_int8(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "amx_pack_int8: [N, K] int8");
  const at::Tensor src = q.contiguous();
  const int64_t n_dim = src.size(0), k_dim = src.size(1);
  const int64_t n_tiles = (n_dim + kTileN - 1) / kTileN, k_tiles = (k_dim + kTileK - 1) / kTileK;
  at::Tensor out = at::zeros({n_tiles, k_tiles, kTileBytes}, src.options());
  headrace::pack_b_tiles(src.data_ptr<int8_t>(), n_dim, k_dim, out.data_ptr<int8_t>());
  return out;
}

#if HEADRACE_AMX

// The hardware prefetcher loses track of two interleaved weight streams: fetch every line of
// the tile this many tiles ahead in the same stream.
constexpr int64_t kPrefetchTiles = 8;

// One packed int8 weight tile -> bf16, prefetching ahead in its stream.
inline void widen_tile(const int8_t* src, uint16_t* dst) {
  for (int64_t line = 0; line < kTileBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchTiles * kTileBytes + line),
                 _MM_HINT_T0);
  for (int64_t i = 0; i < kTileBytes; i += 32) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    _mm512_storeu_si512(dst + i, (__m512i)pairs);
  }
}

// Scale, bias and store 16 accumulator rows of one channel tile (masked at the edges).
template <typename T>
void store_rows(const float* acc, int64_t rows, int64_t n0, int64_t n_dim, const float* scale,
                const float* bias, T* out) {
  const int64_t valid = std::min<int64_t>(kTileN, n_dim - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(acc + r * kTileN), s, b);
    T* dst = out + r * n_dim + n0;
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(dst, mask, v);
    } else {
      _mm256_mask_storeu_epi16(dst, mask, headrace::to_bf16(v));
    }
  }
}

// x: [m_pad, k_pad] bf16, m_pad a multiple of 16 and k_pad of 32 (zero padded).
template <typename T>
void run(const uint16_t* x, int64_t m_dim, int64_t m_pad, int64_t k_pad, const int8_t* tiles,
         int64_t n_tiles, const float* scale, const float* bias, int64_t n_dim, T* out) {
  const int64_t k_tiles = k_pad / kTileK;
  const int64_t x_stride = k_pad * 2;  // bytes
  // Work item: two channel tiles, so each activation tile loaded serves two products.
  const int64_t pairs = (n_tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    headrace::load_tile_config(16, 64);
    alignas(64) uint16_t wide[2][kTileBytes];
    alignas(64) float acc[2][kTileN * kTileN];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t nt0 = 2 * pair;
      const bool two_n = nt0 + 1 < n_tiles;
      // Rows in chunks of 32 (two activation tiles); the weight strip of this pair stays in
      // L2 after the first chunk, so only its widening is repeated.
      for (int64_t m0 = 0; m0 < m_pad; m0 += 32) {
        const bool two_m = m0 + 16 < m_pad;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kt = 0; kt < k_tiles; ++kt) {
          widen_tile(tiles + (nt0 * k_tiles + kt) * kTileBytes, wide[0]);
          if (two_n) widen_tile(tiles + ((nt0 + 1) * k_tiles + kt) * kTileBytes, wide[1]);
          const uint16_t* xk = x + m0 * k_pad + kt * kTileK;
          _tile_loadd(4, xk, x_stride);
          _tile_loadd(6, wide[0], 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_n) {
            _tile_loadd(7, wide[1], 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_m) {
            _tile_loadd(5, xk + 16 * k_pad, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_n) _tile_dpbf16ps(3, 5, 7);
          }
        }
        for (int64_t half = 0; half < (two_m ? 2 : 1); ++half) {
          if (half == 0) {
            _tile_stored(0, acc[0], 64);
            if (two_n) _tile_stored(1, acc[1], 64);
          } else {
            _tile_stored(2, acc[0], 64);
            if (two_n) _tile_stored(3, acc[1], 64);
          }
          const int64_t r0 = m0 + 16 * half;
          const int64_t rows = std::min<int64_t>(16, m_dim - r0);
          if (rows <= 0) continue;
          for (int64_t t = 0; t < (two_n ? 2 : 1); ++t)
            store_rows(acc[t], rows, (nt0 + t) * kTileN, n_dim, scale, bias, out + r0 * n_dim);
        }
      }
    }
    _tile_release();
  });
}

#endif  // HEADRACE_AMX

at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  TORCH_CHECK(amx_usable(), "amx_int8_linear: this build or CPU has no usable AMX");
  TORCH_CHECK(x.dim() == 2, "amx_int8_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "amx_int8_linear: fp32 or bf16 inputs only, got ", x.scalar_type());
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(2) == kTileBytes &&
                  tiles.scalar_type() == at::kChar && tiles.is_contiguous(),
              "amx_int8_linear: tiles must come from amx_pack_int8");
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  const int64_t n_tiles = tiles.size(0), k_pad = tiles.size(1) * kTileK;
  headrace::check_b_tiles("amx_int8_linear", tiles, k_dim, n_dim);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n_dim,
              "amx_int8_linear: scale must be fp32, one per output channel");
  const at::Tensor b = headrace::float_bias("amx_int8_linear", bias, n_dim);
  at::Tensor out = at::empty({m_dim, n_dim}, x.options());
#if HEADRACE_AMX
  if (m_dim == 0) return out;
  // Activation tiles are read 16 rows x 32 columns at a time. Rows that are not whole tiles
  // (a decode step of 1-15 rows: most calls) or fp32 rows are staged in whole tiles in a
  // buffer kept per thread; a zeroed tensor a call cost an allocation and a fill 120 times
  // a step. Pad rows are left as they are: an output row depends on its own input row only,
  // and pad rows' outputs are never stored. Pad columns are zeroed: they meet the weights'
  // zero padding in every row, and 0 x NaN would not be 0.
  const int64_t m_pad = (m_dim + 15) / 16 * 16;
  const uint16_t* xp;
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous() && m_pad == m_dim && k_pad == k_dim) {
    xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  } else {
    thread_local std::vector<uint16_t> staged;
    if (staged.size() < static_cast<size_t>(m_pad * k_pad)) staged.resize(m_pad * k_pad);
    if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < m_dim; ++r)
        std::memcpy(staged.data() + r * k_pad, src + r * x.stride(0), k_dim * 2);
    } else {
      at::from_blob(staged.data(), {m_dim, k_dim}, {k_pad, 1}, x.options().dtype(at::kBFloat16))
          .copy_(x);
    }
    for (int64_t r = 0; r < m_dim && k_pad > k_dim; ++r)
      std::memset(staged.data() + r * k_pad + k_dim, 0, (k_pad - k_dim) * 2);
    xp = staged.data();
  }
  const at::Tensor sc = scale.contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run<float>(xp, m_dim, m_pad, k_pad, tiles.data_ptr<int8_t>(), n_tiles, sc.data_ptr<float>(),
               bp, n_dim, out.data_ptr<float>());
  } else {
    run<c10::BFloat16>(xp, m_dim, m_pad, k_pad, tiles.data_ptr<int8_t>(), n_tiles,
                       sc.data_ptr<float>(), bp, n_dim, out.data_ptr<c10::BFloat16>());
  }
#endif
  return out;
}

}  // namespace

// For C++ callers (ops.h): the op above, outside this file's anonymous namespace.
namespace headrace::ops {
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  return ::amx_int8_linear(x, tiles, scale, bias, n_dim);
}
}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("amx_pack_int8(Tensor qweight) -> Tensor");
  m.def("amx_usable() -> bool", &amx_usable);
  m.def(
      "amx_int8_linear(Tensor x, Tensor tiles, Tensor scale, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("amx_pack_int8", &amx_pack_int8);
  m.impl("amx_int8_linear", &amx_int8_linear);
}
