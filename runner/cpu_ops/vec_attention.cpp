// Prompt-chunk attention without AMX, reading the paged KV cache in place (no gather, no
// padding, no mask tensor): flash-style, written once against `Vec` (AVX-512 or AVX2).
//
// A tile is up to 16 query positions times the g query heads that share one KV head (at most
// 64 rows), so every cached key and value row is read once per tile. The tile walks the keys
// up to its last position, kKeys (16) at a time, always inside one block: the keys are
// transposed into [D][16], so each row's 16 scores are one AVX-512 vector (two AVX2 ones) of
// broadcast-FMAs (with AVX512-BF16 and a bf16 cache the bf16 pairs are transposed as 32-bit
// words and multiplied by _mm512_dpbf16_ps, no widening); online softmax in fp32; values
// accumulated in fp32, each row widened once per few query rows (with AVX512-BF16: P rounded
// to bf16, as the AMX kernel does, times value rows paired across keys on _mm512_dpbf16_ps).
//
//   paged_prefill_attention_vec_(out [T, H, D], q [T, H, D], kv_cache [2, N, S, KVH, D],
//                                block_tables [B, max_blocks], seq_lens [B], q_starts [B],
//                                q_lens [B], scale)
// The semantics of paged_prefill_attention_ (amx_attention.cpp): request b's queries are rows
// q_starts[b] .. + q_lens[b] of q, at positions seq_lens[b] - q_lens[b] ..; their outputs go
// to the same rows of out. fp32 or bf16 (q, cache and out alike), D 64 or 128.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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
#if defined(__AVX512F__)
// dst[c * dst_stride + r] = word c of row r (rows r >= n read as 0): a 16 x 16 block of 32-bit
// words (fp32 values or bf16 pairs), row r at src + r * stride.
inline void transpose_words(const uint32_t* src, int64_t stride, int64_t n, uint32_t* dst,
                            int64_t dst_stride) {
  __m512i r[16], a[16];
  for (int i = 0; i < 16; ++i)
    r[i] = i < n ? _mm512_loadu_si512(src + i * stride) : _mm512_setzero_si512();
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  // Now r[4i + j], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + j.
  for (int j = 0; j < 4; ++j) {
    const __m512i c0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i c1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i c2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i c3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_si512(dst + j * dst_stride, _mm512_shuffle_i32x4(c0, c2, 0x88));
    _mm512_storeu_si512(dst + (4 + j) * dst_stride, _mm512_shuffle_i32x4(c1, c3, 0x88));
    _mm512_storeu_si512(dst + (8 + j) * dst_stride, _mm512_shuffle_i32x4(c0, c2, 0xdd));
    _mm512_storeu_si512(dst + (12 + j) * dst_stride, _mm512_shuffle_i32x4(c1, c3, 0xdd));
  }
}
// Registers for the value accumulators (32 vector registers) and the widest column run.
constexpr int kAccRegs = 16, kMaxCols = 8;
#else
// The AVX2 version: an 8 x 8 block.
inline void transpose_words(const uint32_t* src, int64_t stride, int64_t n, uint32_t* dst,
                            int64_t dst_stride) {
  __m256 r[8], a[8];
  for (int i = 0; i < 8; ++i)
    r[i] = i < n ? _mm256_loadu_ps(reinterpret_cast<const float*>(src + i * stride))
                 : _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  const auto lo = [](__m256 x, __m256 y) {
    return _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y)));
  };
  const auto hi = [](__m256 x, __m256 y) {
    return _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y)));
  };
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = lo(a[4 * i], a[4 * i + 2]);
    r[4 * i + 1] = hi(a[4 * i], a[4 * i + 2]);
    r[4 * i + 2] = lo(a[4 * i + 1], a[4 * i + 3]);
    r[4 * i + 3] = hi(a[4 * i + 1], a[4 * i + 3]);
  }
  // Now r[4i + j], 128-bit half L: rows 4i .. 4i + 3 of column 4L + j.
  float* out = reinterpret_cast<float*>(dst);
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(out + j * dst_stride, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
    _mm256_storeu_ps(out + (4 + j) * dst_stride, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
  }
}
// 16 vector registers: 8 accumulators, 4 value vectors, a broadcast.
constexpr int kAccRegs = 8, kMaxCols = 4;
#endif

// bf16 dot products of bf16 caches where the CPU has them (the fp32 path widens instead).
template <typename T>
constexpr bool kDot =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// Keys a chunk covers (at most; a chunk never crosses a block), as NC vectors of scores a row.
// 16 on AVX2 too, two vectors: each broadcast of a query value then feeds two FMAs (one fed
// one, so a row's scores were a broadcast load per FMA), and a row's softmax bookkeeping and
// its accumulators' rescale come once per 16 keys, not per 8.
constexpr int64_t kKeys = 16;
constexpr int NC = static_cast<int>(kKeys / N);
static_assert(kKeys % N == 0, "a chunk is whole vectors of scores");

// Scores of `rows` (a multiple of 8) rows against one chunk's keys: s[r][t] = q_r . k_t.
// kt: [D][kKeys] fp32; q: [rows][D] fp32. Blocks of 8 / NC rows x NC vectors of keys.
template <int D>
void scores_fp32(const float* q, const float* kt, int64_t rows, float* s) {
  constexpr int R = 8 / NC;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    Vec acc[R][NC];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NC; ++c) acc[i][c] = Vec::set1(0.0f);
    for (int d = 0; d < D; ++d) {
      Vec k[NC];
      for (int c = 0; c < NC; ++c) k[c] = Vec::load(kt + d * kKeys + c * N);
      for (int i = 0; i < R; ++i) {
        const Vec qv = Vec::set1(q[(r0 + i) * D + d]);
        for (int c = 0; c < NC; ++c) acc[i][c] = Vec::fmadd(qv, k[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NC; ++c) acc[i][c].store(s + (r0 + i) * kKeys + c * N);
  }
}

#if defined(__AVX512BF16__)
// As scores_fp32 from bf16 pairs: kw [D / 2][16] words, q [rows][D / 2] words.
template <int D>
void scores_bf16(const uint32_t* q, const uint32_t* kw, int64_t rows, float* s) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < D / 2; ++j) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kw + j * 16);
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(q[(r0 + i) * (D / 2) + j]), k);
    }
    for (int i = 0; i < 8; ++i) _mm512_storeu_ps(s + (r0 + i) * kKeys, acc[i]);
  }
}

// The value pass on bf16 dot products: P rounded to bf16 (as the AMX kernel does) times
// values paired across keys. For pair i (keys 2i, 2i + 1) and 32 dims, unpacklo/hi_epi16 of
// the two rows give two vectors of (v_2i[d], v_2i+1[d]) words, lane 4L + k holding dim
// 8L + k (lo) or 8L + 4 + k (hi): the accumulators keep that order, `store_bf16_order` undoes
// it once at the end. Rows past n are zero (their p is 0, a stale row might hold NaN).
template <int D>
void add_values_bf16(const c10::BFloat16* v, int64_t stride, int64_t n, const float* p,
                     const float* corr, int64_t rows, float* acc) {
  constexpr int NV = D / 16;  // accumulator vectors a row: lo and hi per 32 dims
  constexpr int CV = NV < kMaxCols ? NV : kMaxCols;
  constexpr int MR = kAccRegs / CV;
  const int64_t pairs = (n + 1) / 2;
  alignas(64) __m512i vp[8 * NV];
  for (int64_t i = 0; i < pairs; ++i) {
    const auto* a = reinterpret_cast<const __m512i*>(v + 2 * i * stride);
    const auto* b = reinterpret_cast<const __m512i*>(v + (2 * i + 1) * stride);
    for (int cb = 0; cb < D / 32; ++cb) {
      const __m512i x = _mm512_loadu_si512(a + cb);
      const __m512i y = 2 * i + 1 < n ? _mm512_loadu_si512(b + cb) : _mm512_setzero_si512();
      vp[i * NV + 2 * cb] = _mm512_unpacklo_epi16(x, y);
      vp[i * NV + 2 * cb + 1] = _mm512_unpackhi_epi16(x, y);
    }
  }
  alignas(64) uint32_t pw[kMaxRows * 8];
  for (int64_t r = 0; r < rows; ++r)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw + r * 8),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * kKeys)));
  for (int64_t r0 = 0; r0 < rows; r0 += MR) {
    for (int c0 = 0; c0 < NV; c0 += CV) {
      __m512 a[MR][CV];
      for (int i = 0; i < MR; ++i) {
        const __m512 cr = _mm512_set1_ps(corr[r0 + i]);
        for (int c = 0; c < CV; ++c)
          a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + (c0 + c) * 16), cr);
      }
      for (int64_t t = 0; t < pairs; ++t) {
        for (int i = 0; i < MR; ++i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[(r0 + i) * 8 + t]);
          for (int c = 0; c < CV; ++c)
            a[i][c] = _mm512_dpbf16_ps(a[i][c], w, (__m512bh)vp[t * NV + c0 + c]);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < CV; ++c) _mm512_storeu_ps(acc + (r0 + i) * D + (c0 + c) * 16, a[i][c]);
    }
  }
}

// out[0 .. D) = acc row in add_values_bf16's order, times inv, rounded to bf16.
template <int D>
void store_bf16_order(const float* acc, __m512 inv, c10::BFloat16* out) {
  // Output dim d of 32 from lo lane 4 (d / 8) + d % 8 when d % 8 < 4, else hi lane (+ 16)
  // 4 (d / 8) + d % 8 - 4.
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int cb = 0; cb < D / 32; ++cb) {
    const __m512 lo = _mm512_loadu_ps(acc + cb * 32), hi = _mm512_loadu_ps(acc + cb * 32 + 16);
    store16(out + cb * 32, _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), inv));
    store16(out + cb * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), inv));
  }
}
#endif

// acc[r] = acc[r] * corr[r] + sum_t p[r][t] v_t over one chunk's n value rows, for `rows` rows
// (a multiple of the row block). Accumulators stay in registers for a block of rows x columns.
template <int D, typename T>
void add_values(const T* v, int64_t stride, int64_t n, const float* p, const float* corr,
                int64_t rows, float* acc) {
  constexpr int NV = D / N;
  constexpr int CV = NV < kMaxCols ? NV : kMaxCols;
  constexpr int MR = kAccRegs / CV;
  for (int64_t r0 = 0; r0 < rows; r0 += MR) {
    for (int c0 = 0; c0 < NV; c0 += CV) {
      Vec a[MR][CV];
      for (int i = 0; i < MR; ++i) {
        const Vec cr = Vec::set1(corr[r0 + i]);
        for (int c = 0; c < CV; ++c) a[i][c] = Vec::load(acc + (r0 + i) * D + (c0 + c) * N) * cr;
      }
      for (int64_t t = 0; t < n; ++t) {
        Vec vv[CV];
        for (int c = 0; c < CV; ++c) vv[c] = Vec::load(v + t * stride + (c0 + c) * N);
        for (int i = 0; i < MR; ++i) {
          const Vec w = Vec::set1(p[(r0 + i) * kKeys + t]);
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

template <int D, typename T>
void tile_attention(const Tile<T>& tile, const T* k_cache, const T* v_cache,
                    const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t kvh,
                    float scale) {
  constexpr int64_t kWords = D * static_cast<int64_t>(sizeof(T)) / 4;  // 32-bit words a row
  const int64_t valid = tile.positions * tile.group;
  const int64_t rows8 = (valid + 7) / 8 * 8;       // rows the score blocks compute
  const int64_t rows_n = (valid + N - 1) / N * N;  // rows the vector rescale covers
  alignas(64) float qf[kDot<T> ? 1 : kMaxRows * D];
  alignas(64) uint32_t qw[kDot<T> ? kMaxRows * D / 2 : 1];
  alignas(64) uint32_t words[kWords * kKeys];
  alignas(64) float kt[kDot<T> ? 1 : D * kKeys];
  alignas(64) float s[kMaxRows * kKeys], lsum[kMaxRows * N], acc[kMaxRows * D];
  alignas(64) float m[kMaxRows], row_max[kMaxRows], corr[kMaxRows];
  int64_t visible[kMaxRows];
  std::fill(m, m + kMaxRows, kNoMax);
  std::memset(lsum, 0, rows_n * N * sizeof(float));
  std::memset(acc, 0, rows8 * D * sizeof(float));
  for (int64_t r = 0; r < rows8; ++r) {
    const T* src = tile.q + (r / tile.group) * tile.q_stride + (r % tile.group) * D;
    if constexpr (kDot<T>) {
      if (r < valid)
        std::memcpy(qw + r * (D / 2), src, D * sizeof(T));
      else
        std::memset(qw + r * (D / 2), 0, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] = r < valid ? widen(src[d]) : 0.0f;
    }
  }
  const int64_t token_stride = kv_heads * D, block_stride = block_size * token_stride;
  const int64_t last = tile.first_pos + tile.positions - 1;  // the tile's last key
  const Vec scale_v = Vec::set1(scale);
  for (int64_t c0 = 0; c0 <= last;) {
    const int64_t in = c0 % block_size;
    const int64_t n = std::min({kKeys, block_size - in, last + 1 - c0});
    const int64_t offset = table[c0 / block_size] * block_stride + in * token_stride + kvh * D;
    // Scores: the chunk's keys transposed, then NC vectors of scores per row.
    const auto* k_words = reinterpret_cast<const uint32_t*>(k_cache + offset);
    const int64_t word_stride = token_stride * static_cast<int64_t>(sizeof(T)) / 4;
    for (int64_t cb = 0; cb < kWords / N; ++cb)
      for (int h = 0; h < NC; ++h)
        transpose_words(k_words + h * N * word_stride + cb * N, word_stride,
                        std::clamp<int64_t>(n - h * N, 0, N), words + cb * N * kKeys + h * N,
                        kKeys);
    if constexpr (kDot<T>) {
#if defined(__AVX512BF16__)
      scores_bf16<D>(qw, words, rows8, s);
#endif
    } else if constexpr (std::is_same_v<T, float>) {
      scores_fp32<D>(qf, reinterpret_cast<const float*>(words), rows8, s);
    } else {
      // bf16 pairs to fp32: element 2j is a word's low half, 2j + 1 its high half.
      auto* bits = reinterpret_cast<uint32_t*>(kt);
#pragma omp simd
      for (int64_t i = 0; i < kWords * kKeys; ++i) {
        const int64_t j = i / kKeys, t = i % kKeys;
        bits[(2 * j) * kKeys + t] = words[i] << 16;
        bits[(2 * j + 1) * kKeys + t] = words[i] & 0xffff0000u;
      }
      scores_fp32<D>(qf, kt, rows8, s);
    }
    // Online softmax: keys past a row's position (and past the chunk) get probability 0.
    for (int64_t r = 0; r < rows_n; ++r) {
      const int64_t pos = tile.first_pos + r / tile.group;
      const int64_t vis = r < valid ? std::clamp<int64_t>(pos - c0 + 1, 0, n) : 0;
      visible[r] = vis;
      float* sr = s + r * kKeys;
      if (vis == 0) {
        std::fill(sr, sr + kKeys, 0.0f);
        row_max[r] = m[r];  // rescale by exp(0) = 1: the row is unchanged
        continue;
      }
      for (int c = 0; c < NC; ++c) (Vec::load(sr + c * N) * scale_v).store(sr + c * N);
      for (int64_t t = vis; t < kKeys; ++t) sr[t] = -INFINITY;
      Vec mx = Vec::load(sr);
      for (int c = 1; c < NC; ++c) mx = Vec::max(mx, Vec::load(sr + c * N));
      row_max[r] = std::max(m[r], mx.max());
    }
    for (int64_t r = 0; r < rows_n; r += N) {
      const Vec old = Vec::load(m + r), now = Vec::load(row_max + r);
      (old - now).exp().store(corr + r);
      now.store(m + r);
    }
    for (int64_t r = 0; r < rows_n; ++r) {
      if (visible[r] == 0) continue;
      float* sr = s + r * kKeys;
      const Vec mr = Vec::set1(m[r]);
      for (int c = 0; c < NC; ++c) (Vec::load(sr + c * N) - mr).exp().store(sr + c * N);
      for (int64_t t = visible[r]; t < kKeys; ++t) sr[t] = 0.0f;
      // Row sums stay N partial sums until the end: no horizontal add per chunk.
      Vec sum = Vec::load(lsum + r * N) * Vec::set1(corr[r]);
      for (int c = 0; c < NC; ++c) sum = sum + Vec::load(sr + c * N);
      sum.store(lsum + r * N);
    }
    if constexpr (kDot<T>) {
#if defined(__AVX512BF16__)
      add_values_bf16<D>(v_cache + offset, token_stride, n, s, corr, rows8, acc);
#endif
    } else {
      add_values<D>(v_cache + offset, token_stride, n, s, corr, rows8, acc);
    }
    c0 += n;
  }
  for (int64_t r = 0; r < valid; ++r) {
    const Vec inv = Vec::set1(1.0f / Vec::load(lsum + r * N).sum());
    T* dst = tile.out + (r / tile.group) * tile.out_stride + (r % tile.group) * D;
    if constexpr (kDot<T>) {
#if defined(__AVX512BF16__)
      store_bf16_order<D>(acc + r * D, inv.v, dst);
#endif
      continue;
    }
    for (int64_t c = 0; c < D / N; ++c) (Vec::load(acc + r * D + c * N) * inv).store(dst + c * N);
  }
}
#endif  // HEADRACE_VEC

template <int D, typename T>
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
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + kv_cache.stride(0);
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
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && out.sizes() == q.sizes(),
              "q and out [T, H, D], kv_cache [2, N, S, KVH, D]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  kv_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_prefill_attention_vec_: q, out and kv_cache all fp32 or all bf16");
  // q may be a view into the fused QKV output: rows apart, heads and dims contiguous.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  kv_cache.is_contiguous(),
              "q with contiguous heads, out and kv_cache contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefill_attention_vec_: head dim 64 or 128");
  TORCH_CHECK(heads / kv_heads <= kMaxRows, "paged_prefill_attention_vec_: at most ", kMaxRows,
              " query heads per KV head");
  for (const auto* t : {&block_tables, &seq_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tables, lengths and starts: contiguous int64");
  const int64_t batch = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == batch && q_starts.size(0) == batch &&
                  q_lens.size(0) == batch,
              "one table, length, start and query count per request");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* counts = q_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  // Checked once here, so the kernel never reads or writes outside its tensors.
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(counts[b] >= 1 && counts[b] <= lens[b] && lens[b] <= max_blocks * block_size,
                "query count or seq_len out of range");
    TORCH_CHECK(starts[b] >= 0 && starts[b] + counts[b] <= tokens, "query rows out of range");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range of the cache");
    }
  }
  const float s = static_cast<float>(scale);
  const auto go = [&](auto kernel) {
    kernel(out, q, kv_cache, tables, max_blocks, lens, starts, counts, batch, s);
  };
  if (dtype == at::kFloat)
    go(dim == 64 ? run<64, float> : run<128, float>);
  else
    go(dim == 64 ? run<64, c10::BFloat16> : run<128, c10::BFloat16>);
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
