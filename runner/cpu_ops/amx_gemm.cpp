// bf16 linear on AMX for prompt rows: y = x @ W^T + bias, W packed once at load.
//
// oneDNN's bf16 matmul runs these shapes at ~2.3-2.6 TFLOP/s on two Sapphire Rapids cores,
// but at some row counts its split of the work leaves one thread idle and it runs at one
// core's rate (~1.2): SmolLM2's QKV (576 -> 960) at 768-1024 rows, o_proj at 512, down
// (1536 -> 576) at 256-1280, and each shape somewhere else in other runs. Here the split is
// fixed: each thread takes an equal share of the output channels, for any row count.
// The tile product is the same as oneDNN's: bf16 x bf16 with fp32 sums.
//
//   amx_pack_bf16(w [N, K] bf16) -> tiles [ceil(N/16), ceil(K/32), 512] bf16, zero padded:
//     tile (n, k) holds channels n*16.. and inputs k*32.. in AMX's pair-interleaved B order
//     (16 rows of input pairs, each row 16 channels x 2 inputs): one contiguous tile load.
//   amx_bf16_linear(x [M, K] bf16, tiles, bias [N]? fp32|bf16, N) -> [M, N] bf16

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace {

constexpr int64_t kTileN = 16;               // output channels per weight tile
constexpr int64_t kTileK = 32;               // inputs per tile (16 bf16 pairs)
constexpr int64_t kTileElems = kTileN * kTileK;
// Activation bytes a thread's rows may take: they stay in L2 while each of its channel
// pairs passes over them (each pair's weights, 36-96 KB, in L1). Measured on SmolLM2's
// shapes: 256-row blocks left large-N layers re-reading their weights from L3 once per
// block; 1 MB ones lost the rows from L2.
constexpr int64_t kRowBlockBytes = 640 * 1024;

at::Tensor amx_pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_bf16: [N, K] bf16");
  const at::Tensor src = w.contiguous();
  const int64_t n_dim = src.size(0), k_dim = src.size(1);
  const int64_t n_tiles = (n_dim + kTileN - 1) / kTileN, k_tiles = (k_dim + kTileK - 1) / kTileK;
  at::Tensor out = at::zeros({n_tiles, k_tiles, kTileElems}, src.options());
  headrace::pack_b_tiles(reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>()), n_dim,
                         k_dim, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

#if HEADRACE_AMX

// Bias and store up to 16 rows of one channel tile's fp32 sums as bf16 (masked at N's end).
void store_rows(const float* acc, int64_t rows, int64_t n0, int64_t n_dim, const float* bias,
                uint16_t* out) {
  const int64_t valid = std::min<int64_t>(kTileN, n_dim - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r)
    _mm256_mask_storeu_epi16(out + r * n_dim + n0, mask,
                             headrace::to_bf16(_mm512_add_ps(_mm512_load_ps(acc + r * 16), b)));
}

// x: [m_dim, k_pad] bf16 rows `x_stride` elements apart; `tail` holds its last m_dim % 16
// rows zero padded to 16 (tile loads read whole tiles).
//
// Per thread: its share of the channel pairs; per block of rows, each pair passes over all
// of them, 32 rows at a time, with its weights reloaded from L1 and the rows streamed from
// L2 (the T1 hint keeps them from evicting the weights). Walking the rows inner and the
// pairs outer ran 1.8-2.0 TFLOP/s; this order 2.3-3.5 on the same shapes.
void run(const uint16_t* x, int64_t x_stride, const uint16_t* tail, int64_t m_dim,
         int64_t k_pad, const uint16_t* tiles, int64_t n_tiles, const float* bias, int64_t n_dim,
         uint16_t* out) {
  const int64_t k_tiles = k_pad / kTileK, pairs = (n_tiles + 1) / 2;
  const int64_t full = m_dim / 16 * 16;
  const auto rows_at = [&](int64_t m0) { return m0 < full ? x + m0 * x_stride : tail; };
  const auto stride_at = [&](int64_t m0) { return (m0 < full ? x_stride : k_pad) * 2; };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  const int64_t row_block = std::max<int64_t>(32, kRowBlockBytes / (k_pad * 2) / 32 * 32);
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    headrace::load_tile_config(16, 64);
    alignas(64) float acc[4][kTileN * kTileN];
    const int64_t p_begin = pairs * t_begin / threads, p_end = pairs * t_end / threads;
    for (int64_t mb = 0; mb < m_dim; mb += row_block) {
      const int64_t mb_end = std::min(m_dim, mb + row_block);
      for (int64_t pair = p_begin; pair < p_end; ++pair) {
        const int64_t nt0 = 2 * pair;
        const bool two_n = nt0 + 1 < n_tiles;
        const uint16_t* b0 = tiles + nt0 * k_tiles * kTileElems;
        const uint16_t* b1 = b0 + k_tiles * kTileElems;
        for (int64_t m0 = mb; m0 < mb_end; m0 += 32) {
          const bool two_m = m0 + 16 < m_dim;
          const uint16_t* a0 = rows_at(m0);
          const uint16_t* a1 = two_m ? rows_at(m0 + 16) : nullptr;
          const int64_t a0_stride = stride_at(m0), a1_stride = two_m ? stride_at(m0 + 16) : 0;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kt = 0; kt < k_tiles; ++kt) {
            _tile_stream_loadd(4, a0 + kt * kTileK, a0_stride);
            _tile_loadd(6, b0 + kt * kTileElems, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_n) {
              _tile_loadd(7, b1 + kt * kTileElems, 64);
              _tile_dpbf16ps(1, 4, 7);
            }
            if (two_m) {
              _tile_stream_loadd(5, a1 + kt * kTileK, a1_stride);
              _tile_dpbf16ps(2, 5, 6);
              if (two_n) _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, acc[0], 64);
          if (two_n) _tile_stored(1, acc[1], 64);
          if (two_m) {
            _tile_stored(2, acc[2], 64);
            if (two_n) _tile_stored(3, acc[3], 64);
          }
          for (int64_t half = 0; half < (two_m ? 2 : 1); ++half) {
            const int64_t r0 = m0 + 16 * half, rows = std::min<int64_t>(16, m_dim - r0);
            for (int64_t t = 0; t < (two_n ? 2 : 1); ++t)
              store_rows(acc[2 * half + t], rows, (nt0 + t) * kTileN, n_dim, bias,
                         out + r0 * n_dim);
          }
        }
      }
    }
    _tile_release();
  });
}

#endif  // HEADRACE_AMX

at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  TORCH_CHECK(headrace::amx_usable(), "amx_bf16_linear: this build or CPU has no usable AMX");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_bf16_linear: x [M, K] bf16");
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(2) == kTileElems &&
                  tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(),
              "amx_bf16_linear: tiles must come from amx_pack_bf16");
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  const int64_t n_tiles = tiles.size(0), k_pad = tiles.size(1) * kTileK;
  headrace::check_b_tiles("amx_bf16_linear", tiles, k_dim, n_dim);
  const at::Tensor b = headrace::float_bias("amx_bf16_linear", bias, n_dim);
  at::Tensor out = at::empty({m_dim, n_dim}, x.options());
#if HEADRACE_AMX
  if (m_dim == 0) return out;
  // Tile loads read 32 inputs of 16 rows: rows read in place where K is whole tiles, the
  // last partial tile of rows from a zero-padded copy.
  at::Tensor xs = x;
  if (k_dim != k_pad || x.stride(1) != 1) {
    xs = at::zeros({m_dim, k_pad}, x.options());
    xs.narrow(1, 0, k_dim).copy_(x);
  }
  const int64_t full = m_dim / 16 * 16;
  at::Tensor tail;  // only where some rows are left past the whole tiles
  if (full < m_dim) {
    tail = at::zeros({16, k_pad}, x.options());
    tail.narrow(0, 0, m_dim - full).copy_(xs.narrow(0, full, m_dim - full));
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  run(xp, xs.stride(0),
      tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()) : nullptr,
      m_dim, k_pad, reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), n_tiles,
      b.defined() ? b.data_ptr<float>() : nullptr, n_dim,
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#endif
  return out;
}

}  // namespace

// For C++ callers (ops.h): the op above, outside this file's anonymous namespace.
namespace headrace::ops {
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  return ::amx_bf16_linear(x, tiles, bias, n_dim);
}
}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("amx_pack_bf16(Tensor weight) -> Tensor");
  m.def("amx_bf16_linear(Tensor x, Tensor tiles, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("amx_pack_bf16", &amx_pack_bf16);
  m.impl("amx_bf16_linear", &amx_bf16_linear);
}
