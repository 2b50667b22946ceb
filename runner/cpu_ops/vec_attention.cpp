// Prompt-chunk attention without AMX, reading the paged KV cache in place (no gather, no
// padding, no mask tensor): flash-style, written once against `Vec` (AVX-512 or AVX2).
//
// A tile is up to 16 query positions times the g query heads that share one KV head (at most
// 64 rows), so every cached key and value row is read once per tile. The tile walks the keys
// up to its last position, kKeys (32) at a time across blocks, each chunk's keys and values
// widened to fp32 once. Rows run along the vector lanes: the queries are
// transposed once a tile (and scaled), so a key's scores for N rows are one vector of
// broadcast-FMAs, and the online softmax (running max, rescale, row sums) is vertical vector
// work with no per-row reductions. Values accumulate in fp32 rows.
//
// fp32 FMAs rather than AVX512-BF16 dot products: on Sapphire Rapids (AMX masked) a
// _mm512_dpbf16_ps issues every other cycle, two FMAs every cycle, and the earlier kernel on
// dot products (keys transposed per chunk, softmax a row at a time) took 7.1 ms for 4 x 512
// SmolLM2 prompt tokens a layer, where this one takes 4.4 (SDPA 5.6-6.3). Zen 4's bf16 dot
// products are said to issue as often as its FMAs; a bf16 score pass chosen by measurement
// could pay there (not measured: no Zen 4 was lent since).
//
//   paged_prefill_attention_vec_(out [T, H, D], q [T, H, D], kv_cache [2, N, S, KVH, D],
//                                block_tables [B, max_blocks], seq_lens [B], q_starts [B],
//                                q_lens [B], scale)
// The semantics of paged_prefill_attention_ (amx_attention.cpp): request b's queries are rows
// q_starts[b] .. + q_lens[b] of q, at positions seq_lens[b] - q_lens[b] ..; their outputs go
// to the same rows of out. fp32 or bf16 (q, cache and out alike; or an int8 cache, kv_rows.h,
// whose rows are widened times their scales), D 64 or 128.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_rows.h"
#include "prefill_args.h"
#include "vec.h"

namespace {

using namespace headrace;

constexpr int64_t kMaxRows = 64;       // query rows per tile: positions x heads of a group
constexpr int64_t kMaxPositions = 16;  // positions per tile
// The running max starts finite, so exp(m_old - m_new) is 1 for a row that saw no key yet
// (never NaN) and ~0 once it sees one.
constexpr float kNoMax = -1e30f;

#if HEADRACE_VEC
constexpr int64_t N = Vec::N;
// Keys a chunk covers at most, across blocks: the values' rescale and the softmax's work per
// row vector come once a chunk. 32 against 16 (within a block, as before): 4 x 512 SmolLM2
// prompt tokens 4.49-4.58 against 4.63-4.66 ms a layer, a mixed step of four long chunks 34.7
// against 36.2-37.2 (AMX masked; -DHR_VEC_KEYS=16 builds the other to compare).
#ifndef HR_VEC_KEYS
#define HR_VEC_KEYS 32
#endif
constexpr int64_t kKeys = HR_VEC_KEYS;
#if defined(__AVX512F__)
// Score tile: kScoreVecs row vectors x kScoreKeys keys of accumulators (24 of 32 registers);
// value tile: kAccRegs accumulators, at most kMaxCols vectors of a row.
constexpr int kScoreVecs = 3, kScoreKeys = 8, kAccRegs = 16, kMaxCols = 8;
#else
constexpr int kScoreVecs = 3, kScoreKeys = 4, kAccRegs = 8, kMaxCols = 4;  // 16 registers
#endif

// dst [keys][D] fp32: the cached rows of positions c0 .. c0 + n widened (found through the
// block table), zero past them up to a whole score block (their scores are never read, but
// a stale row may hold NaN).
template <int D, typename C>
void widen_rows(const C* cache, const int64_t* table, int64_t block_size, int64_t block_stride,
                int64_t token_stride, int64_t c0, int64_t n, int64_t keys, float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = c0 + t;
    const C* src = cache + table[pos / block_size] * block_stride + pos % block_size * token_stride;
    // kv_row_scale is a constant 1 for float rows: the multiply folds away.
    const Vec s = Vec::set1(kv_row_scale(src, D));
    for (int64_t c = 0; c < D; c += N) (Vec::load(src + c) * s).store(dst + t * D + c);
  }
  std::fill(dst + n * D, dst + keys * D, 0.0f);
}

// s[t][r] = k_t . q_r for `keys` keys and the V row vectors from v0: qt is the tile's
// queries transposed ([D][rows]), so a key's dimension is one broadcast feeding V FMAs and a
// key's scores for N rows are one vector.
template <int D, int V>
void score_block(const float* qt, int64_t rows, const float* k, int64_t keys, int64_t v0,
                 float* s) {
  for (int64_t t0 = 0; t0 < keys; t0 += kScoreKeys) {
    Vec acc[kScoreKeys][V];
    for (auto& a : acc)
      for (auto& x : a) x = Vec::set1(0.0f);
    for (int d = 0; d < D; ++d) {
      Vec q[V];
      for (int v = 0; v < V; ++v) q[v] = Vec::load(qt + d * rows + (v0 + v) * N);
      for (int i = 0; i < kScoreKeys; ++i) {
        const Vec kv = Vec::set1(k[(t0 + i) * D + d]);
        for (int v = 0; v < V; ++v) acc[i][v] = Vec::fmadd(kv, q[v], acc[i][v]);
      }
    }
    for (int i = 0; i < kScoreKeys; ++i)
      for (int v = 0; v < V; ++v) acc[i][v].store(s + (t0 + i) * rows + (v0 + v) * N);
  }
}

template <int D>
void scores(const float* qt, int64_t rows, const float* k, int64_t keys, float* s) {
  const int64_t vecs = rows / N;
  int64_t v0 = 0;
  for (; v0 + kScoreVecs <= vecs; v0 += kScoreVecs)
    score_block<D, kScoreVecs>(qt, rows, k, keys, v0, s);
  if (vecs - v0 == 2) score_block<D, 2>(qt, rows, k, keys, v0, s);
  if (vecs - v0 == 1) score_block<D, 1>(qt, rows, k, keys, v0, s);
}

// acc[r] = acc[r] * corr[r] + sum_t p[t][r] v_t over the chunk's n value rows (v: [n][D]
// fp32), for `rows` rows (a multiple of the row block). Accumulators stay in registers for a
// block of rows x columns.
template <int D>
void add_values(const float* v, int64_t n, const float* p, const float* corr, int64_t rows,
                float* acc) {
  constexpr int NV = D / N;
  constexpr int CV = NV < kMaxCols ? NV : kMaxCols;
  constexpr int MR = kAccRegs / CV;
  static_assert(N % MR == 0, "row blocks tile a row vector");
  for (int64_t r0 = 0; r0 < rows; r0 += MR) {
    for (int c0 = 0; c0 < NV; c0 += CV) {
      Vec a[MR][CV];
      for (int i = 0; i < MR; ++i) {
        const Vec cr = Vec::set1(corr[r0 + i]);
        for (int c = 0; c < CV; ++c) a[i][c] = Vec::load(acc + (r0 + i) * D + (c0 + c) * N) * cr;
      }
      for (int64_t t = 0; t < n; ++t) {
        Vec vv[CV];
        for (int c = 0; c < CV; ++c) vv[c] = Vec::load(v + t * D + (c0 + c) * N);
        for (int i = 0; i < MR; ++i) {
          const Vec w = Vec::set1(p[t * rows + r0 + i]);
          for (int c = 0; c < CV; ++c) a[i][c] = Vec::fmadd(w, vv[c], a[i][c]);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < CV; ++c) a[i][c].store(acc + (r0 + i) * D + (c0 + c) * N);
    }
  }
}

// Where a tile's rows and keys are: row r is position r / group (of `positions`, the first at
// first_pos) of query head r % group; q and out point at the tile's first position and head.
template <typename T>
struct Tile {
  const T* q;
  int64_t q_stride;
  T* out;
  int64_t out_stride;
  int64_t group, positions, first_pos;
};

template <int D, typename T, typename C>
void tile_attention(const Tile<T>& tile, const C* k_cache, const C* v_cache,
                    const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t kvh,
                    float scale) {
  const int64_t valid = tile.positions * tile.group;
  const int64_t rows = (valid + N - 1) / N * N;  // whole row vectors; pad rows never stored
  alignas(64) float qt[D * kMaxRows], acc[kMaxRows * D], k[kKeys * D], v[kKeys * D];
  alignas(64) float s[kKeys * kMaxRows], m[kMaxRows], lsum[kMaxRows], corr[kMaxRows];
  int64_t row_pos[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    row_pos[r] = r < valid ? tile.first_pos + r / tile.group : -1;
    const T* src = tile.q + (r / tile.group) * tile.q_stride + (r % tile.group) * D;
    // The scale goes in once here, not on every score.
    for (int64_t d = 0; d < D; ++d) qt[d * rows + r] = r < valid ? widen(src[d]) * scale : 0.0f;
  }
  std::fill(m, m + rows, kNoMax);
  std::fill(lsum, lsum + rows, 0.0f);
  std::fill(acc, acc + rows * D, 0.0f);
  constexpr int64_t W = kv_row_width<C>(D);
  const int64_t token_stride = kv_heads * W, block_stride = block_size * token_stride;
  const int64_t last = tile.first_pos + tile.positions - 1;  // the tile's last key
  for (int64_t c0 = 0; c0 <= last;) {
    const int64_t n = std::min(kKeys, last + 1 - c0);
    const int64_t keys = (n + kScoreKeys - 1) / kScoreKeys * kScoreKeys;  // scored
    const auto gather = [&](const C* cache, float* dst) {
      widen_rows<D>(cache + kvh * W, table, block_size, block_stride, token_stride, c0, n, keys,
                    dst);
    };
    gather(k_cache, k);
    gather(v_cache, v);
    scores<D>(qt, rows, k, keys, s);
    // Keys past a row's position: -inf. Only chunks on the tile's diagonal have any; keys
    // past the chunk are never read. A pad row (zero queries) needs none elsewhere: its
    // scores are 0, its sums finite, and it is never stored.
    if (c0 + n - 1 > tile.first_pos)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < rows; ++r)
          if (c0 + t > row_pos[r]) s[t * rows + r] = -INFINITY;
    // Online softmax, N rows a vector: the running max, the rescale of what the rows summed
    // so far, and this chunk's probabilities (exp clamps -inf to ~1e-38: masked keys add
    // nothing a float holds beside a row's own max, exp(0) = 1).
    for (int64_t r = 0; r < rows; r += N) {
      Vec mx = Vec::load(s + r);
      for (int64_t t = 1; t < n; ++t) mx = Vec::max(mx, Vec::load(s + t * rows + r));
      const Vec old = Vec::load(m + r), now = Vec::max(old, mx);
      const Vec cr = (old - now).exp();
      cr.store(corr + r);
      now.store(m + r);
      Vec sum = Vec::load(lsum + r) * cr;
      for (int64_t t = 0; t < n; ++t) {
        const Vec p = (Vec::load(s + t * rows + r) - now).exp();
        p.store(s + t * rows + r);
        sum = sum + p;
      }
      sum.store(lsum + r);
    }
    add_values<D>(v, n, s, corr, rows, acc);
    c0 += n;
  }
  for (int64_t r = 0; r < valid; ++r) {
    const Vec inv = Vec::set1(1.0f / lsum[r]);
    T* dst = tile.out + (r / tile.group) * tile.out_stride + (r % tile.group) * D;
    for (int64_t c = 0; c < D / N; ++c) (Vec::load(acc + r * D + c * N) * inv).store(dst + c * N);
  }
}
#endif  // HEADRACE_VEC

// T: q's and out's dtype; C: the cache's (T, or int8).
template <int D, typename T, typename C>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables,
         int64_t max_blocks, const int64_t* lens, const int64_t* starts, const int64_t* counts,
         int64_t batch, float scale) {
#if HEADRACE_VEC
  const int64_t heads = q.size(1), kv_heads = kv_cache.size(3), block_size = kv_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t positions = std::clamp<int64_t>(kMaxRows / group, 1, kMaxPositions);
  // Units: (request, tile, KV head); each request's last (heaviest, causal) tiles first, taken
  // one at a time by whichever thread is free: tiles differ in work by up to the chunk length.
  std::vector<int64_t> unit_offset(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    unit_offset[b + 1] = unit_offset[b] + (counts[b] + positions - 1) / positions * kv_heads;
  const C* k_cache = kv_cache.data_ptr<C>();
  const C* v_cache = k_cache + kv_cache.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0), out_stride = heads * D;
  std::atomic<int64_t> next{0};
  const int64_t total = unit_offset[batch];
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t unit; (unit = next.fetch_add(1)) < total;) {
      const int64_t b = std::upper_bound(unit_offset.begin(), unit_offset.end(), unit) -
                        unit_offset.begin() - 1;
      const int64_t local = unit - unit_offset[b];
      const int64_t tiles = (unit_offset[b + 1] - unit_offset[b]) / kv_heads;
      const int64_t first = (tiles - 1 - local / kv_heads) * positions, kvh = local % kv_heads;
      const int64_t row0 = starts[b] + first;
      const Tile<T> tile{qp + row0 * q_stride + kvh * group * D,
                         q_stride,
                         op + row0 * out_stride + kvh * group * D,
                         out_stride,
                         group,
                         std::min(positions, counts[b] - first),
                         lens[b] - counts[b] + first};
      tile_attention<D>(tile, k_cache, v_cache, tables + b * max_blocks, block_size, kv_heads,
                        kvh, scale);
    }
  });
#endif
}

void paged_prefill_attention_vec_(at::Tensor& out, const at::Tensor& q,
                                  const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& q_starts,
                                  const at::Tensor& q_lens, double scale) {
  TORCH_CHECK(HEADRACE_VEC, "paged_prefill_attention_vec_: this build has no AVX-512 or AVX2");
  const PrefillArgs a =
      check_prefill_args(out, q, kv_cache, block_tables, seq_lens, q_starts, q_lens);
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  kv_cache_serves(kv_cache.scalar_type(), dtype) && out.scalar_type() == dtype,
              "paged_prefill_attention_vec_: q and out fp32 or bf16, kv_cache the same or int8");
  TORCH_CHECK(a.dim == 64 || a.dim == 128, "paged_prefill_attention_vec_: head dim 64 or 128");
  TORCH_CHECK(a.heads / a.kv_heads <= kMaxRows, "paged_prefill_attention_vec_: at most ",
              kMaxRows, " query heads per KV head");
  const float s = static_cast<float>(scale);
  const auto go = [&](auto kernel) {
    kernel(out, q, kv_cache, a.tables, a.max_blocks, a.lens, a.starts, a.counts, a.batch, s);
  };
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  using BF = c10::BFloat16;
  if (dtype == at::kFloat && int8)
    go(a.dim == 64 ? run<64, float, int8_t> : run<128, float, int8_t>);
  else if (dtype == at::kFloat)
    go(a.dim == 64 ? run<64, float, float> : run<128, float, float>);
  else if (int8)
    go(a.dim == 64 ? run<64, BF, int8_t> : run<128, BF, int8_t>);
  else
    go(a.dim == 64 ? run<64, BF, BF> : run<128, BF, BF>);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def(
      "paged_prefill_attention_vec_(Tensor(a!) out, Tensor q, Tensor kv_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor q_starts, Tensor q_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("paged_prefill_attention_vec_", &paged_prefill_attention_vec_);
}
