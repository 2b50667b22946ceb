// The loop the batched kernels (batched_int8.cpp, q4_linear.cpp) run their register tiles in,
// and the store of a tile's sums.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace headrace {

// For every (block of output channels, tile of up to `tile_rows` rows) pair, split into one
// contiguous run per thread. Rows go in panels whose activations (`row_bytes` a row) fit in
// half of a 512 KB L2, and within a panel block by block: the first row tile of a block
// streams its weights, the others find them in cache, while the panel's rows stay in L2 for
// every block (2048 rows of a 576-wide prompt are 1.2 MB, read once per block otherwise). At
// most one block per thread boundary is read twice. Split by blocks alone, 3 or 9 blocks (192
// and 576 channels) left a thread idle for a third or a ninth. make() is called once a run
// and returns the fn(block, first_row, rows, more) called for each pair of it, `more` telling
// whether the run's next pair is the same block's next tile: state a run keeps (a buffer)
// lives in that fn, never shared between threads.
template <class Make>
void for_each_tile(int64_t blocks, int64_t rows, int64_t tile_rows, int64_t row_bytes,
                   const Make& make) {
  constexpr int64_t kPanelBytes = 256 * 1024;
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  const int64_t panel_rows = kPanelBytes / std::max<int64_t>(1, row_bytes);
  const int64_t panel = std::max<int64_t>(1, panel_rows / tile_rows);  // in tiles
  const int64_t panel_items = blocks * panel;
  at::parallel_for(0, blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    auto fn = make();
    // Panel p holds tiles [p * panel, min(tiles, (p + 1) * panel)), block-major within; the
    // position is found once a run and then stepped (no division a tile).
    const int64_t p = begin / panel_items, rest = begin - p * panel_items;
    int64_t first = p * panel, in_panel = std::min(panel, tiles - first);
    int64_t nb = rest / in_panel, t = rest % in_panel;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = (first + t) * tile_rows;
      const bool more = t + 1 < in_panel && item + 1 < end;
      fn(nb, m0, static_cast<int>(std::min(tile_rows, rows - m0)), more);
      if (++t < in_panel) continue;
      t = 0;
      if (++nb < blocks) continue;
      nb = 0;
      first += panel;
      in_panel = std::min(panel, tiles - first);
    }
  });
}

// A tile's sums ([rows, block_n]) into out [.., n_dim] from (first_row, n0), the channels
// below n_dim only, as (sum - shift[row]) * scale[channel] + bias[channel], each of the three
// left out where null. A vector of channels at a time: one value at a time it was 7% of the
// samples of a 512-row gate/up "dot" call (AMX masked); the ragged end one by one.
template <typename T>
void store_tile(const float* sums, int64_t block_n, int rows, int64_t first_row, int64_t n0,
                int64_t n_dim, const float* shift, const float* scale, const float* bias,
                T* out) {
  const int64_t valid = std::min(block_n, n_dim - n0);
  for (int m = 0; m < rows; ++m) {
    T* o = out + (first_row + m) * n_dim + n0;
    const float* s = sums + m * block_n;
    const float sh = shift ? shift[first_row + m] : 0.0f;
    int64_t c = 0;
#if HEADRACE_VEC
    const Vec shv = Vec::set1(sh);
    for (; c + Vec::N <= valid; c += Vec::N) {
      Vec v = Vec::load(s + c) - shv;
      if (scale) v = v * Vec::load(scale + n0 + c);
      if (bias) v = v + Vec::load(bias + n0 + c);
      v.store(o + c);
    }
#endif
    for (; c < valid; ++c) {
      float v = s[c] - sh;
      if (scale) v *= scale[n0 + c];
      if (bias) v += bias[n0 + c];
      o[c] = static_cast<T>(v);
    }
  }
}

#if HEADRACE_VEC
// A gated unit's sums (gate and up blocks, [rows, block_n] each, block_n a multiple of
// Vec::N) into out [.., half] from (first_row, n0) as silu(gate) * up: gate and up scaled as
// store_tile scales them (up's scales `half` channels on) and rounded to T, silu's output
// rounded to T, the product rounded to T: where the linear's output then silu_and_mul
// (elementwise.cpp) round, so the fused op gives the same bits.
template <typename T>
void store_tile_silu_mul(const float* gate, const float* up, int64_t block_n, int rows,
                         int64_t first_row, int64_t n0, int64_t half, const float* shift,
                         const float* scale, T* out) {
  const T* tag = nullptr;
  for (int m = 0; m < rows; ++m) {
    T* o = out + (first_row + m) * half + n0;
    const Vec sh = Vec::set1(shift ? shift[first_row + m] : 0.0f);
    for (int64_t c = 0; c < block_n; c += Vec::N) {
      const Vec g = ((Vec::load(gate + m * block_n + c) - sh) * Vec::load(scale + n0 + c))
                        .rounded(tag);
      const Vec u =
          ((Vec::load(up + m * block_n + c) - sh) * Vec::load(scale + half + n0 + c)).rounded(tag);
      silu_times(g, u, tag).store(o + c);
    }
  }
}
#endif

}  // namespace headrace
