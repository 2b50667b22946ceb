// bf16 linear on AMX for prompt rows: y = x @ W^T + bias, W packed once at load.
//
// oneDNN's bf16 matmul runs these shapes at ~2.3-2.6 TFLOP/s on two Sapphire Rapids cores,
// but at some row counts its split of the work leaves one thread idle and it runs at one
// core's rate (~1.2): SmolLM2's QKV (576 -> 960) at 768-1024 rows, o_proj at 512, down
// (1536 -> 576) at 256-1280, and each shape somewhere else in other runs. Here the split is
// fixed: each thread takes an equal share of the output channels, or past kSplitRows rows a
// thread an equal share of the rows.
// The tile product is the same as oneDNN's: bf16 x bf16 with fp32 sums.
//
//   amx_pack_bf16(w [N, K] bf16) -> tiles [ceil(N/16), ceil(K/32), 512] bf16, zero padded:
//     tile (n, k) holds channels n*16.. and inputs k*32.. in AMX's pair-interleaved B order
//     (16 rows of input pairs, each row 16 channels x 2 inputs): one contiguous tile load.
//   amx_bf16_linear(x [M, K] bf16, tiles, bias [N]? fp32|bf16, N) -> [M, N] bf16
//   amx_bf16_silu_mul(x [M, K] bf16, tiles, N) -> [M, N/2] bf16: silu(gate) * up of a
//     gate/up weight's halves (rows [0, N/2) gate, the rest up; N/2 whole channel tiles),
//     as amx_bf16_linear then silu_and_mul give it, bit for bit, without the [M, N] pass
//     through memory between them (13% of a 2,048-token prompt step on SmolLM2)

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
// Rows a thread must get before the threads split the rows instead of the channels. Split
// by rows, a thread reads every weight but only its own rows, which the op before it wrote
// from the same thread (elementwise ops split rows the same way) and which stay in its L2;
// split by channels, each thread reads every row. 30 layers' SmolLM2 shapes, weights cold,
// rows fresh from an elementwise op, per layer: 2,048 rows 7.1-7.6 against 8.4-8.9 ms,
// 1,024 3.6-3.9 against 4.3-4.5, 512 2.1-2.2 against 2.2-2.4; level at 128-256.
constexpr int64_t kSplitRows = 256;

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

// A 32 x 32 block's fp32 sums (four tiles: rows 0-15 and 16-31 of channel tiles nt0 and
// nt1), on their way out as bf16 while the next block's products run: the tile unit and the
// vector units then work at once. Done in one piece after its products, the way out took
// 26% of a layer's time at 2,048 rows (40% of gate/up's with silu * up).
struct Leaving {
  const float (*acc)[kTileN * kTileN] = nullptr;
  int64_t m0 = 0, rows = 0, next = 0;  // rows [m0, m0 + rows), the next one to store
  int64_t nt0 = 0, pair = 0;
  bool two_n = false;
};

// One output row of a leaving block: biased sums (masked at N's end), or with kSiluMul
// silu(gate) * up with gate, up and silu's output rounded to bf16 as amx_bf16_linear's
// output then silu_and_mul (elementwise.cpp) round them: the fused op gives the same bits.
template <bool kSiluMul>
void store_row(const Leaving& b, int64_t r, int64_t n_dim, const float* bias, uint16_t* out) {
  const float* sums = b.acc[r < 16 ? 0 : 2] + (r % 16) * kTileN;
  const int64_t row = b.m0 + r;
  if constexpr (kSiluMul) {
    const c10::BFloat16* bf16 = nullptr;  // the rounding tag
    const headrace::Vec y =
        headrace::silu_times(headrace::Vec::load(sums).rounded(bf16),
                             headrace::Vec::load(sums + kTileN * kTileN).rounded(bf16), bf16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + row * (n_dim / 2) + b.pair * kTileN),
                        headrace::to_bf16(y.v));
  } else {
    for (int64_t t = 0; t < (b.two_n ? 2 : 1); ++t) {
      const int64_t n0 = (b.nt0 + t) * kTileN, valid = std::min<int64_t>(kTileN, n_dim - n0);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      __m512 y = _mm512_load_ps(sums + t * kTileN * kTileN);
      if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + n0));
      _mm256_mask_storeu_epi16(out + row * n_dim + n0, mask, headrace::to_bf16(y));
    }
  }
}

// x: [m_dim, k_pad] bf16 rows `x_stride` elements apart; `tail` holds its last m_dim % 16
// rows zero padded to 16 (tile loads read whole tiles).
//
// Per thread: its share of the channel pairs (or, past kSplitRows rows a thread, of the
// rows); per block of its rows, each of its pairs passes over all of them, 32 rows at a
// time, with its weights reloaded from L1 and the rows streamed from L2 (the T1 hint keeps
// them from evicting the weights). Walking the rows inner and the pairs outer ran 1.8-2.0
// TFLOP/s; this order 2.3-3.5 on the same shapes.
//
// A pair is two channel tiles that share the row tiles' loads: neighbours (2p, 2p + 1) with
// their biased sums stored, or with kSiluMul gate tile p and its up tile p + n_tiles / 2,
// whose sums leave as silu(gate) * up in the output's channels p*16.. (n_dim / 2 wide).
template <bool kSiluMul>
void run(const uint16_t* x, int64_t x_stride, const uint16_t* tail, int64_t m_dim,
         int64_t k_pad, const uint16_t* tiles, int64_t n_tiles, const float* bias, int64_t n_dim,
         uint16_t* out) {
  const int64_t k_tiles = k_pad / kTileK, pairs = kSiluMul ? n_tiles / 2 : (n_tiles + 1) / 2;
  const int64_t full = m_dim / 16 * 16;
  const auto rows_at = [&](int64_t m0) { return m0 < full ? x + m0 * x_stride : tail; };
  const auto stride_at = [&](int64_t m0) { return (m0 < full ? x_stride : k_pad) * 2; };
  // Past kSplitRows rows a thread, each thread takes its share of the rows and every pair.
  const bool split_rows = m_dim >= kSplitRows * at::get_num_threads();
  const int64_t row_units = (m_dim + 31) / 32;  // rows are split in whole 32-row steps
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), split_rows ? row_units : pairs);
  const int64_t row_block = std::max<int64_t>(32, kRowBlockBytes / (k_pad * 2) / 32 * 32);
  // Rows of the leaving block stored per step along K: all of them by the block's last step.
  const int64_t rows_a_step = (32 + k_tiles - 1) / k_tiles;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    headrace::load_tile_config(16, 64);
    alignas(64) float acc[2][4][kTileN * kTileN];  // the running block's and the leaving one's
    Leaving leaving;
    const auto store = [&](int64_t until) {
      for (const int64_t end = std::min(until, leaving.rows); leaving.next < end; ++leaving.next)
        store_row<kSiluMul>(leaving, leaving.next, n_dim, bias, out);
    };
    int set = 0;
    const int64_t p_begin = split_rows ? 0 : pairs * t_begin / threads;
    const int64_t p_end = split_rows ? pairs : pairs * t_end / threads;
    const int64_t m_begin = split_rows ? row_units * t_begin / threads * 32 : 0;
    const int64_t m_end = split_rows ? std::min(m_dim, row_units * t_end / threads * 32) : m_dim;
    for (int64_t mb = m_begin; mb < m_end; mb += row_block) {
      const int64_t mb_end = std::min(m_end, mb + row_block);
      for (int64_t pair = p_begin; pair < p_end; ++pair) {
        const int64_t nt0 = kSiluMul ? pair : 2 * pair, nt1 = kSiluMul ? pair + pairs : nt0 + 1;
        const bool two_n = nt1 < n_tiles;
        const uint16_t* b0 = tiles + nt0 * k_tiles * kTileElems;
        const uint16_t* b1 = tiles + nt1 * k_tiles * kTileElems;
        for (int64_t m0 = mb; m0 < mb_end; m0 += 32) {
          const bool two_m = m0 + 16 < mb_end;
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
            store((kt + 1) * rows_a_step);
          }
          store(32);
          float (*sums)[kTileN * kTileN] = acc[set];
          _tile_stored(0, sums[0], 64);
          if (two_n) _tile_stored(1, sums[1], 64);
          if (two_m) {
            _tile_stored(2, sums[2], 64);
            if (two_n) _tile_stored(3, sums[3], 64);
          }
          leaving = {sums, m0, std::min<int64_t>(32, mb_end - m0), 0, nt0, pair, two_n};
          set ^= 1;
        }
      }
    }
    store(32);
    _tile_release();
  });
}

#endif  // HEADRACE_AMX

// Both ops: checks, then the product into `out` ([M, n_dim] or with kSiluMul [M, n_dim / 2]).
template <bool kSiluMul>
at::Tensor product(const char* op, const at::Tensor& x, const at::Tensor& tiles,
                   const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  TORCH_CHECK(headrace::amx_usable(), op, ": this build or CPU has no usable AMX");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x [M, K] bf16");
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(2) == kTileElems &&
                  tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(),
              op, ": tiles must come from amx_pack_bf16");
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  const int64_t n_tiles = tiles.size(0), k_pad = tiles.size(1) * kTileK;
  headrace::check_b_tiles(op, tiles, k_dim, n_dim);
  // The gate half must end on a tile boundary for tile p + n_tiles / 2 to be up channel p.
  TORCH_CHECK(!kSiluMul || n_dim % (2 * kTileN) == 0, op, ": n (", n_dim,
              ") must be a multiple of ", 2 * kTileN);
  const at::Tensor b = headrace::float_bias(op, bias, n_dim);
  at::Tensor out = at::empty({m_dim, kSiluMul ? n_dim / 2 : n_dim}, x.options());
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
  run<kSiluMul>(
      xp, xs.stride(0),
      tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()) : nullptr,
      m_dim, k_pad, reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), n_tiles,
      b.defined() ? b.data_ptr<float>() : nullptr, n_dim,
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#endif
  return out;
}

at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  return product<false>("amx_bf16_linear", x, tiles, bias, n_dim);
}

at::Tensor amx_bf16_silu_mul(const at::Tensor& x, const at::Tensor& tiles, int64_t n_dim) {
  return product<true>("amx_bf16_silu_mul", x, tiles, c10::nullopt, n_dim);
}

}  // namespace

// For C++ callers (ops.h): the ops above, outside this file's anonymous namespace.
namespace headrace::ops {
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim) {
  return ::amx_bf16_linear(x, tiles, bias, n_dim);
}
at::Tensor amx_bf16_silu_mul(const at::Tensor& x, const at::Tensor& tiles, int64_t n_dim) {
  return ::amx_bf16_silu_mul(x, tiles, n_dim);
}
}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("amx_pack_bf16(Tensor weight) -> Tensor");
  m.def("amx_bf16_linear(Tensor x, Tensor tiles, Tensor? bias, int n) -> Tensor");
  m.def("amx_bf16_silu_mul(Tensor x, Tensor tiles, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("amx_pack_bf16", &amx_pack_bf16);
  m.impl("amx_bf16_linear", &amx_bf16_linear);
  m.impl("amx_bf16_silu_mul", &amx_bf16_silu_mul);
}
