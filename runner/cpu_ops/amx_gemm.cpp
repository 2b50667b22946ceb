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
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace {

constexpr int64_t kTileN = 16;               // output channels per weight tile
constexpr int64_t kTileK = 32;               // inputs per tile (16 bf16 pairs)
constexpr int64_t kTileElems = kTileN * kTileK;
// Weight bytes a thread keeps in L2 while all rows pass over them.
#ifndef HR_GEMM_BLOCK_KB
#define HR_GEMM_BLOCK_KB 512
#endif
constexpr int64_t kBlockBytes = HR_GEMM_BLOCK_KB * 1024;
// Activation bytes (32 rows) a slice of the inputs may take: they stay in L1 (48 KB here)
// beside the weight tiles streaming through.
constexpr int64_t kSliceBytes = 40 * 1024;

at::Tensor amx_pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_bf16: [N, K] bf16");
  const at::Tensor src = w.contiguous();
  const int64_t n_dim = src.size(0), k_dim = src.size(1);
  const int64_t n_tiles = (n_dim + kTileN - 1) / kTileN, k_tiles = (k_dim + kTileK - 1) / kTileK;
  at::Tensor out = at::zeros({n_tiles, k_tiles, kTileElems}, src.options());
  const auto* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  auto* d = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < n_dim; ++n) {
    const int64_t nt = n / kTileN, j = n % kTileN;
    for (int64_t k = 0; k < k_dim; ++k) {
      const int64_t kt = k / kTileK, pair = (k % kTileK) / 2, e = k % 2;
      d[(nt * k_tiles + kt) * kTileElems + pair * 2 * kTileN + j * 2 + e] = s[n * k_dim + k];
    }
  }
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
// Per thread: its channel pairs in blocks whose weights stay in L2; over a block, every
// 32 rows, and over those rows the inputs in slices whose activations (32 rows) stay in L1
// while each pair of the block passes over them. Weights stream through with the T1 hint so
// they do not evict those activations; the next slice's activations are prefetched while
// this one runs. Sums of a pair's tiles carry from one slice to the next in `partial`.
void run(const uint16_t* x, int64_t x_stride, const uint16_t* tail, int64_t m_dim,
         int64_t k_pad, const uint16_t* tiles, int64_t n_tiles, const float* bias, int64_t n_dim,
         uint16_t* out) {
  const int64_t k_tiles = k_pad / kTileK, pairs = (n_tiles + 1) / 2;
  const int64_t full = m_dim / 16 * 16;
  const auto rows_at = [&](int64_t m0) { return m0 < full ? x + m0 * x_stride : tail; };
  const auto stride_at = [&](int64_t m0) { return (m0 < full ? x_stride : k_pad) * 2; };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  const int64_t block_pairs =
      std::max<int64_t>(1, kBlockBytes / (2 * k_tiles * kTileElems * sizeof(uint16_t)));
  const int64_t slices = (32 * k_pad * 2 + kSliceBytes - 1) / kSliceBytes;
  const int64_t slice_tiles = (k_tiles + slices - 1) / slices;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    headrace::load_tile_config(16, 64);
    alignas(64) float acc[4][kTileN * kTileN];
    std::vector<float> partial(slices > 1 ? block_pairs * 4 * kTileN * kTileN : 0);
    const int64_t p_begin = pairs * t_begin / threads, p_end = pairs * t_end / threads;
    for (int64_t nb = p_begin; nb < p_end; nb += block_pairs) {
      const int64_t nb_end = std::min(p_end, nb + block_pairs);
      for (int64_t m0 = 0; m0 < m_dim; m0 += 32) {
        const bool two_m = m0 + 16 < m_dim;
        const uint16_t* a0 = rows_at(m0);
        const uint16_t* a1 = two_m ? rows_at(m0 + 16) : nullptr;
        const int64_t a0_stride = stride_at(m0), a1_stride = two_m ? stride_at(m0 + 16) : 0;
        for (int64_t k0 = 0; k0 < k_tiles; k0 += slice_tiles) {
          const int64_t k1 = std::min(k_tiles, k0 + slice_tiles);
          const bool first = k0 == 0, last = k1 == k_tiles;
          // The next slice's rows (or the next rows' first slice): 32 rows x its tiles'
          // 64-byte lines, a few lines per tile product below.
          const int64_t next_m = last ? m0 + 32 : m0, next_k = last ? 0 : k1;
          const int64_t next_lines =
              next_m < m_dim ? std::min<int64_t>(32, m_dim - next_m) * (std::min(k_tiles, next_k +
                                                                 slice_tiles) - next_k) : 0;
          const int64_t per_step = (next_lines + (nb_end - nb) * (k1 - k0) - 1) /
                                   std::max<int64_t>(1, (nb_end - nb) * (k1 - k0));
          int64_t line = 0;
          for (int64_t pair = nb; pair < nb_end; ++pair) {
            const int64_t nt0 = 2 * pair;
            const bool two_n = nt0 + 1 < n_tiles;
            const uint16_t* b0 = tiles + nt0 * k_tiles * kTileElems;
            const uint16_t* b1 = b0 + k_tiles * kTileElems;
            float* sums = partial.data() + (pair - nb) * 4 * kTileN * kTileN;
            if (first) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              _tile_loadd(0, sums, 64);
              _tile_loadd(1, sums + 256, 64);
              _tile_loadd(2, sums + 512, 64);
              _tile_loadd(3, sums + 768, 64);
            }
            for (int64_t kt = k0; kt < k1; ++kt) {
              for (int64_t i = 0; i < per_step && line < next_lines; ++i, ++line) {
                const int64_t r = line % 32 < m_dim - next_m ? line % 32 : 0;
                const int64_t c = next_k + line / 32;
                _mm_prefetch(reinterpret_cast<const char*>(rows_at(next_m + r / 16 * 16) +
                                                           r % 16 * stride_at(next_m) / 2 +
                                                           c * kTileK),
                             _MM_HINT_T0);
              }
              _tile_loadd(4, a0 + kt * kTileK, a0_stride);
              _tile_stream_loadd(6, b0 + kt * kTileElems, 64);
              _tile_dpbf16ps(0, 4, 6);
              if (two_n) {
                _tile_stream_loadd(7, b1 + kt * kTileElems, 64);
                _tile_dpbf16ps(1, 4, 7);
              }
              if (two_m) {
                _tile_loadd(5, a1 + kt * kTileK, a1_stride);
                _tile_dpbf16ps(2, 5, 6);
                if (two_n) _tile_dpbf16ps(3, 5, 7);
              }
            }
            if (!last) {
              _tile_stored(0, sums, 64);
              _tile_stored(1, sums + 256, 64);
              _tile_stored(2, sums + 512, 64);
              _tile_stored(3, sums + 768, 64);
              continue;
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
  TORCH_CHECK(k_dim <= k_pad && k_dim > k_pad - kTileK, "amx_bf16_linear: x has ", k_dim,
              " columns, the tiles were packed for ", k_pad, " (padded)");
  TORCH_CHECK(n_dim <= n_tiles * kTileN && n_dim > (n_tiles - 1) * kTileN,
              "amx_bf16_linear: n does not match the tiles");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim, "amx_bf16_linear: one bias per output channel");
    b = bias->to(at::kFloat).contiguous();
  }
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
  at::Tensor tail = at::zeros({16, k_pad}, x.options());
  if (full < m_dim) tail.narrow(0, 0, m_dim - full).copy_(xs.narrow(0, full, m_dim - full));
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  run(xp, xs.stride(0), reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()),
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
