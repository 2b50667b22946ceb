// Prompt-chunk attention on AMX, reading the paged KV cache in place (no padded gather, no
// mask tensor): flash-style, 16 query rows of one head against 32 keys at a time.
//
// torch's SDPA spent ~2 ms a layer on 16 prompts of 128 tokens here, plus the gather of
// their blocks and the scatter of the output; the score and value products are small
// matrix multiplies, which AMX does 16 x 16 x 32 at a time. Per request and KV head the keys
// are first copied into AMX's B-tile order (16 keys x 32 head dims, pairs interleaved) and
// the values likewise (32 keys x 16 head dims); then each tile of 16 query rows walks the
// key chunks up to its causal limit: scores on AMX, online softmax in fp32 (AVX-512), the
// probabilities rounded to bf16 and multiplied by the values on AMX, fp32 accumulation.
//
//   paged_prefill_attention_(out [T, H, D], q [T, H, D], kv_cache [2, N, S, KVH, D],
//                            block_tables [B, max_blocks], seq_lens [B], q_starts [B],
//                            q_lens [B], scale)
// Request b's queries are rows q_starts[b] .. + q_lens[b] of q (positions seq_lens[b] -
// q_lens[b] ..); their outputs are written to the same rows of out. bf16, D a multiple of 32;
// the cache bf16, or int8 (kv_rows.h: each row widened times its scale and rounded to bf16
// as it is packed, so the tiles never see the difference).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "kv_rows.h"
#include "prefill_args.h"
#include "vec.h"
#include "work_runs.h"

namespace {

constexpr int64_t kRows = 16;   // query rows per tile
constexpr int64_t kChunk = 32;  // keys per step (one bf16 tile of P)
constexpr int64_t kTile = 512;  // bf16 elements in one 16 x 64-byte tile

#if HEADRACE_AMX

// A cache row as bf16 bits: a bf16 row as it is; an int8 row widened times its scale and
// rounded into `buf`.
inline const uint16_t* bf16_row(const uint16_t* row, int64_t, uint16_t*) { return row; }
inline const uint16_t* bf16_row(const int8_t* row, int64_t dim, uint16_t* buf) {
  using headrace::Vec;
  const Vec s = Vec::set1(headrace::kv_row_scale(row, dim));
  for (int64_t c = 0; c < dim; c += Vec::N)
    (Vec::load(row + c) * s).store(reinterpret_cast<c10::BFloat16*>(buf) + c);
  return buf;
}

// Keys and values of one request and KV head in B-tile order, `chunks` chunks of 32 keys
// (zero past the request's keys):
//   keys   [chunks * 2 groups of 16 keys][D / 32][16 pairs of dims][16 keys][2]
//   values [chunks][D / 16][16 pairs of keys][16 dims][2]
// C: the cache's element, uint16_t (bf16 bits) or int8_t.
template <typename C>
void pack(const C* k_cache, const C* v_cache, const int64_t* table, int64_t n_keys,
          int64_t chunks, int64_t kvh, int64_t kv_heads, int64_t block_size, int64_t dim,
          uint16_t* keys, uint16_t* values) {
  const int64_t width = headrace::kv_row_width<C>(dim);
  const int64_t token_stride = kv_heads * width, block_stride = block_size * token_stride;
  alignas(64) uint16_t k_buf[256], v_buf[256];
  std::memset(keys, 0, chunks * kChunk * dim * sizeof(uint16_t));
  std::memset(values, 0, chunks * kChunk * dim * sizeof(uint16_t));
  for (int64_t t = 0; t < n_keys; ++t) {
    const int64_t offset = table[t / block_size] * block_stride + (t % block_size) * token_stride +
                           kvh * width;
    const uint16_t* k = bf16_row(k_cache + offset, dim, k_buf);
    const uint16_t* v = bf16_row(v_cache + offset, dim, v_buf);
    const int64_t group = t / 16, n = t % 16;
    for (int64_t s = 0; s < dim / 32; ++s) {
      uint16_t* tile = keys + (group * (dim / 32) + s) * kTile + n * 2;
      for (int64_t pair = 0; pair < 16; ++pair) {
        tile[pair * 32] = k[32 * s + 2 * pair];
        tile[pair * 32 + 1] = k[32 * s + 2 * pair + 1];
      }
    }
    const int64_t chunk = t / kChunk, pair = (t % kChunk) / 2, e = t % 2;
    for (int64_t c = 0; c < dim / 16; ++c) {
      uint16_t* tile = values + (chunk * (dim / 16) + c) * kTile + pair * 32 + e;
      for (int64_t n2 = 0; n2 < 16; ++n2) tile[n2 * 2] = v[16 * c + n2];
    }
  }
}

// One head's running state over a tile of up to 16 query rows. Sized for the widest head;
// only the first kRows * dim entries of qbuf and acc are used (and cleared: clearing all of
// them cost 24 KB of stores per tile).
struct HeadState {
  alignas(64) uint16_t qbuf[kRows * 256];
  alignas(64) uint16_t pbuf[kRows * kChunk];
  alignas(64) float sbuf[kRows * kChunk];
  alignas(64) float pv[kRows * 32];
  alignas(64) float acc[kRows * 256];
  alignas(64) float m[kRows], corr[kRows], lsum[kRows * 16];
};

// 2^x for x <= 0 (the probabilities of the online softmax, in base 2): a degree-5 Taylor
// polynomial of 2^r, |r| <= 1/2 (relative error ~2e-6, far under the bf16 rounding P
// takes), and the exponent; below -126 (masked keys: -inf, or -inf - -inf) it gives ~1e-38.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));  // NaN also takes the bound
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The 16 rows' maxima of v[0..16) as one vector (lane r: row r), by a transpose of partial
// maxima: ~45 instructions where 16 separate reductions take ~110.
inline __m512 row_maxima(const __m512 (&v)[kRows]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: rows 2i, 2i+1, lanes {0,2} and {1,3}
    pairs[i] = _mm512_max_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit block: rows 4i .. 4i+3
    quads[i] = _mm512_max_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  // Then across the four 128-bit blocks: block j of the result holds rows 4j .. 4j+3.
  const __m512 lo = _mm512_max_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi = _mm512_max_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_max_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

// Online softmax of one chunk's scores (in sbuf), in base 2: the scores are scaled by
// scale * log2(e) (`log2_scale`), so each probability is one exp2. Keys a row may not see
// get exactly 0; a chunk every row sees whole (kFull: all but the causal diagonal's) skips
// the masks. First the scaled scores and each row's max; then every row's rescale factor in
// one vector exp2; then the probabilities, rounded to bf16 into pbuf.
template <bool kFull>
void softmax_chunk(HeadState& st, int64_t rows, const __mmask16* lo_mask,
                   const __mmask16* hi_mask, __m512 log2_scale) {
  const __m512 neg = _mm512_set1_ps(-INFINITY);
  __m512 halves_max[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    float* sr = st.sbuf + r * kChunk;
    __m512 s0, s1;
    if constexpr (kFull) {
      s0 = _mm512_mul_ps(_mm512_load_ps(sr), log2_scale);
      s1 = _mm512_mul_ps(_mm512_load_ps(sr + 16), log2_scale);
    } else {
      s0 = _mm512_mask_mul_ps(neg, lo_mask[r], _mm512_load_ps(sr), log2_scale);
      s1 = _mm512_mask_mul_ps(neg, hi_mask[r], _mm512_load_ps(sr + 16), log2_scale);
    }
    _mm512_store_ps(sr, s0);
    _mm512_store_ps(sr + 16, s1);
    halves_max[r] = _mm512_max_ps(s0, s1);
  }
  const __m512 m_old = _mm512_load_ps(st.m);
  const __m512 m_new = _mm512_max_ps(m_old, row_maxima(halves_max));
  // Padding rows' factors are irrelevant: nothing of theirs is accumulated or written.
  _mm512_store_ps(st.corr, exp2_nonpositive(_mm512_sub_ps(m_old, m_new)));
  _mm512_store_ps(st.m, m_new);
  for (int64_t r = 0; r < kRows; ++r) {
    const float* sr = st.sbuf + r * kChunk;
    const __m512 mv = _mm512_set1_ps(r < rows ? st.m[r] : 0.0f);
    __m512 p0 = exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(sr), mv));
    __m512 p1 = exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(sr + 16), mv));
    if constexpr (!kFull) {
      p0 = _mm512_maskz_mov_ps(lo_mask[r], p0);
      p1 = _mm512_maskz_mov_ps(hi_mask[r], p1);
    }
    // Row sums stay 16 partial sums until the end: no horizontal add per chunk.
    _mm512_store_ps(st.lsum + r * 16, _mm512_fmadd_ps(_mm512_load_ps(st.lsum + r * 16),
                                                      _mm512_set1_ps(st.corr[r]),
                                                      _mm512_add_ps(p0, p1)));
    _mm512_store_si512(st.pbuf + r * kChunk, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
}

// acc = acc * corr + pv for 32 of a head's dims (16 * c ..) in every row.
void rescale_add(HeadState& st, int64_t rows, int64_t dim, int64_t c) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 cr = _mm512_set1_ps(st.corr[r]);
    float* a = st.acc + r * dim + 16 * c;
    _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), cr, _mm512_load_ps(st.pv + r * 32)));
    _mm512_store_ps(a + 16, _mm512_fmadd_ps(_mm512_load_ps(a + 16), cr,
                                            _mm512_load_ps(st.pv + r * 32 + 16)));
  }
}

// One tile of up to 16 query rows (positions first_pos ..) of NH (1 or 2) heads that share
// a KV head. Two heads go through each step together: the key and value tiles are loaded
// once for both, and four tile products instead of two are in flight before a store has to
// wait for one (the products' latency was ~40% of this loop with one head). Tiles: head h's
// queries, then its probabilities, in tile 3h; its scores, then its value products, in
// 4 + 2h and 5 + 2h; keys and values in 1 and 2.
template <int NH>
void query_tiles(const uint16_t* const* q, int64_t q_row_stride, int64_t rows, int64_t first_pos,
                 const uint16_t* keys, const uint16_t* values, int64_t dim, float scale,
                 uint16_t* const* out, int64_t out_row_stride) {
  static_assert(NH == 1 || NH == 2);
  HeadState st[NH];
  for (HeadState& h : st) {
    for (int64_t r = 0; r < kRows; ++r) h.m[r] = -INFINITY;
    std::memset(h.lsum, 0, sizeof(h.lsum));
    std::memset(h.acc, 0, rows * dim * sizeof(float));
  }
  for (int h = 0; h < NH; ++h) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(st[h].qbuf + r * dim, q[h] + r * q_row_stride, dim * sizeof(uint16_t));
    std::memset(st[h].qbuf + rows * dim, 0, (kRows - rows) * dim * sizeof(uint16_t));
  }
  const int64_t last_key = first_pos + rows - 1;
  // log2(e) folded into the scale: the softmax works in base 2 (exp2_nonpositive).
  const __m512 log2_scale = _mm512_set1_ps(scale * 1.44269504f);
  for (int64_t chunk = 0; chunk * kChunk <= last_key; ++chunk) {
    // Scores of the chunk's two groups of 16 keys.
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (NH == 2) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int64_t s = 0; s < dim / 32; ++s) {
      _tile_loadd(0, st[0].qbuf + 32 * s, dim * 2);
      if constexpr (NH == 2) _tile_loadd(3, st[NH - 1].qbuf + 32 * s, dim * 2);
      _tile_loadd(1, keys + ((2 * chunk) * (dim / 32) + s) * kTile, 64);
      _tile_loadd(2, keys + ((2 * chunk + 1) * (dim / 32) + s) * kTile, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_dpbf16ps(5, 0, 2);
      if constexpr (NH == 2) {
        _tile_dpbf16ps(6, 3, 1);
        _tile_dpbf16ps(7, 3, 2);
      }
    }
    _tile_stored(4, st[0].sbuf, kChunk * 4);
    _tile_stored(5, st[0].sbuf + 16, kChunk * 4);
    if constexpr (NH == 2) {
      _tile_stored(6, st[NH - 1].sbuf, kChunk * 4);
      _tile_stored(7, st[NH - 1].sbuf + 16, kChunk * 4);
    }
    if ((chunk + 1) * kChunk - 1 <= first_pos) {
      // Every row sees the whole chunk: no masks. Padding rows get the scores of their zero
      // queries, which nothing reads.
      for (HeadState& h : st) softmax_chunk<true>(h, rows, nullptr, nullptr, log2_scale);
    } else {
      // Keys of this chunk row r may see (0 for padding rows and rows before the chunk).
      __mmask16 lo_mask[kRows], hi_mask[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t visible =
            r < rows ? std::clamp<int64_t>(first_pos + r - chunk * kChunk + 1, 0, kChunk) : 0;
        lo_mask[r] = visible >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << visible) - 1);
        hi_mask[r] = visible <= 16 ? 0 : static_cast<__mmask16>((1u << (visible - 16)) - 1);
        if (visible == 32) hi_mask[r] = 0xFFFF;
      }
      for (HeadState& h : st) softmax_chunk<false>(h, rows, lo_mask, hi_mask, log2_scale);
    }
    // Values: P (16 x 32 keys) times each 32-key x 16-dim value tile, two at a time.
    _tile_loadd(0, st[0].pbuf, kChunk * 2);
    if constexpr (NH == 2) _tile_loadd(3, st[NH - 1].pbuf, kChunk * 2);
    for (int64_t c = 0; c < dim / 16; c += 2) {
      _tile_zero(4);
      _tile_zero(5);
      if constexpr (NH == 2) {
        _tile_zero(6);
        _tile_zero(7);
      }
      _tile_loadd(1, values + (chunk * (dim / 16) + c) * kTile, 64);
      _tile_loadd(2, values + (chunk * (dim / 16) + c + 1) * kTile, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_dpbf16ps(5, 0, 2);
      if constexpr (NH == 2) {
        _tile_dpbf16ps(6, 3, 1);
        _tile_dpbf16ps(7, 3, 2);
      }
      _tile_stored(4, st[0].pv, 128);
      _tile_stored(5, st[0].pv + 16, 128);
      if constexpr (NH == 2) {
        _tile_stored(6, st[NH - 1].pv, 128);
        _tile_stored(7, st[NH - 1].pv + 16, 128);
      }
      for (HeadState& h : st) rescale_add(h, rows, dim, c);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const float* acc = st[h].acc + r * dim;
      const __m512 inv =
          _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(st[h].lsum + r * 16)));
      for (int64_t c = 0; c < dim / 16; ++c)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(out[h] + r * out_row_stride + 16 * c),
            headrace::to_bf16(_mm512_mul_ps(_mm512_load_ps(acc + 16 * c), inv)));
    }
}

#endif  // HEADRACE_AMX

void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& q_starts, const at::Tensor& q_lens,
                              double scale) {
  TORCH_CHECK(headrace::amx_usable(), "paged_prefill_attention_: no usable AMX here");
  const headrace::PrefillArgs args =
      headrace::check_prefill_args(out, q, kv_cache, block_tables, seq_lens, q_starts, q_lens);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  headrace::kv_cache_serves(kv_cache.scalar_type(), at::kBFloat16),
              "paged_prefill_attention_: bf16 q and out, a bf16 or int8 cache");
  const int64_t heads = args.heads, dim = args.dim, kv_heads = args.kv_heads;
  const int64_t block_size = args.block_size, batch = args.batch, max_blocks = args.max_blocks;
  TORCH_CHECK(dim % 32 == 0 && dim <= 256, "paged_prefill_attention_: head dim 32k <= 256");
  const int64_t *lens = args.lens, *starts = args.starts, *counts = args.counts;
  const int64_t* tables = args.tables;
  std::vector<int64_t> pack_offset(batch + 1, 0), tile_offset(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t chunks = (lens[b] + kChunk - 1) / kChunk;
    pack_offset[b + 1] = pack_offset[b] + chunks * kChunk * dim * kv_heads;
    tile_offset[b + 1] = tile_offset[b] + (counts[b] + kRows - 1) / kRows * kv_heads;
  }
#if HEADRACE_AMX
  // Uninitialised and reused across calls (one per layer and step): `pack` clears what it
  // uses, and a fresh multi-MB vector cost a zero fill plus page faults every layer.
  thread_local std::vector<uint16_t> keys_buf, values_buf;
  if (keys_buf.size() < static_cast<size_t>(pack_offset[batch])) {
    keys_buf.resize(pack_offset[batch]);
    values_buf.resize(pack_offset[batch]);
  }
  uint16_t* keys = keys_buf.data();
  uint16_t* values = values_buf.data();
  // Units: (request, KV head), split by the chunks each packs (+ 1 for its fixed cost), as
  // the decode kernel splits its keys: by count, one long context beside short prompts left
  // one thread most of the copying.
  std::vector<int64_t> packed(batch * kv_heads + 1, 0);
  for (int64_t unit = 0; unit < batch * kv_heads; ++unit)
    packed[unit + 1] = packed[unit] + (lens[unit / kv_heads] + kChunk - 1) / kChunk + 1;
  // The cache's element type picked once: bf16 bits or int8 rows (kv_rows.h).
  const auto pack_all = [&](const auto* k_cache) {
    const auto* v_cache = k_cache + kv_cache.stride(0);
    headrace::parallel_even_runs(packed, [&](int64_t first, int64_t last) {
      for (int64_t unit = first; unit < last; ++unit) {
        const int64_t b = unit / kv_heads, kvh = unit % kv_heads;
        const int64_t chunks = (lens[b] + kChunk - 1) / kChunk;
        const int64_t at = pack_offset[b] + kvh * chunks * kChunk * dim;
        pack(k_cache, v_cache, tables + b * max_blocks, lens[b], chunks, kvh, kv_heads,
             block_size, dim, keys + at, values + at);
      }
    });
  };
  if (kv_cache.scalar_type() == at::kChar)
    pack_all(kv_cache.data_ptr<int8_t>());
  else
    pack_all(reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>()));
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = heads / kv_heads, q_stride = q.stride(0), row_stride = heads * dim;
  // Units: (request, KV head, tile of 16 rows), each the heads sharing that KV head. A
  // thread takes a contiguous run of units holding its share of the work (a tile's chunks up
  // to its causal limit): split in equal counts, one long prompt left the thread with its
  // later rows three quarters of the work; taken one at a time from a shared counter, short
  // prompts ran 10-25% slower (each thread read the other's packed keys, and the counter's
  // line moved between cores every unit).
  std::vector<int64_t> work(tile_offset[batch] + 1, 0);
  for (int64_t b = 0, unit = 0; b < batch; ++b) {
    const int64_t tiles = (tile_offset[b + 1] - tile_offset[b]) / kv_heads;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t t = 0; t < tiles; ++t, ++unit) {
        const int64_t last_key = lens[b] - counts[b] + std::min(counts[b], (t + 1) * kRows) - 1;
        work[unit + 1] = work[unit] + last_key / kChunk + 2;  // + 2: a tile's fixed cost
      }
  }
  headrace::parallel_even_runs(work, [&](int64_t first, int64_t last) {
    headrace::load_tile_config(16, 64);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = std::upper_bound(tile_offset.begin(), tile_offset.end(), unit) -
                        tile_offset.begin() - 1;
      const int64_t local = unit - tile_offset[b];
      const int64_t tiles = (tile_offset[b + 1] - tile_offset[b]) / kv_heads;
      const int64_t kvh = local / tiles, first = local % tiles * kRows;
      const int64_t rows = std::min(kRows, counts[b] - first);
      const int64_t chunks = (lens[b] + kChunk - 1) / kChunk;
      const int64_t at = pack_offset[b] + kvh * chunks * kChunk * dim;
      const int64_t row0 = starts[b] + first;
      for (int64_t head = kvh * group; head < (kvh + 1) * group; head += 2) {
        const uint16_t* qh[2] = {qp + row0 * q_stride + head * dim,
                                 qp + row0 * q_stride + (head + 1) * dim};
        uint16_t* oh[2] = {op + row0 * row_stride + head * dim,
                           op + row0 * row_stride + (head + 1) * dim};
        const auto tiles_of = head + 1 < (kvh + 1) * group ? query_tiles<2> : query_tiles<1>;
        tiles_of(qh, q_stride, rows, lens[b] - counts[b] + first, keys + at, values + at, dim,
                 static_cast<float>(scale), oh, row_stride);
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def(
      "paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor q_starts, Tensor q_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("paged_prefill_attention_", &paged_prefill_attention_);
}
