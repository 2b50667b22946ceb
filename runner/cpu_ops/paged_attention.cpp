// Decode attention that reads the paged KV cache in place (no gathered copy per layer).
//
// One query token per request. Work is split over (request, KV head) pairs, and a context
// past kSplitKeys over splits of its keys, merged after: the g query heads that share a KV
// head are computed together, so every cached key and value is read once per step and layer.
// Arithmetic is fp32 whatever the storage dtype (bf16 keys may be multiplied as bf16 pairs,
// whose products are exact in fp32).
//
// Layouts (the torch reference's, runner/attention.py):
//   q            [B, H, D]                 fp32 or bf16
//   kv_cache     [2, num_blocks, block_size, KVH, D], same dtype as q; or int8 rows of
//                D + 4 (kv_rows.h), whose scales multiply each key's scores and each
//                value's weight (the rows are widened, never dequantised in memory)
//   block_tables [B, max_blocks] int64     (entries past a request's length are ignored)
//   seq_lens     [B] int64                 keys each request attends (its new token included)
//   out          [B, H, D]                 q's dtype

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "act_quant.h"
#include "kv_rows.h"
#include "ops.h"
#include "vec.h"
#include "work_runs.h"

namespace {

using namespace headrace;

// A row of n values widened to fp32 (a cache row times its scale).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  const float s = kv_row_scale(src, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]) * s;
}

template <typename T, typename C>
void decode_one(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                int64_t seq_len, int64_t kvh, int64_t group, int64_t kv_heads,
                int64_t block_size, int64_t head_dim, float scale, T* out) {
  // q and out point at this KV head's first query head: rows h * D for h in [0, group).
  const int64_t token_stride = kv_heads * kv_row_width<C>(head_dim);  // between tokens
  const int64_t block_stride = block_size * token_stride;
  std::vector<float> qf(group * head_dim), row(head_dim), acc(group * head_dim, 0.0f);
  std::vector<float> scores(group * seq_len);
  for (int64_t j = 0; j < group; ++j) {
    load_row(q + j * head_dim, qf.data() + j * head_dim, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) qf[j * head_dim + d] *= scale;
  }
  // Scores, one pass over the keys.
  for (int64_t t = 0; t < seq_len; ++t) {
    const C* k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                 kvh * kv_row_width<C>(head_dim);
    load_row(k, row.data(), head_dim);
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = qf.data() + j * head_dim;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_dim; ++d) s += qj[d] * row[d];
      scores[j * seq_len + t] = s;
    }
  }
  // Softmax per query head (max subtracted: exp never overflows).
  std::vector<float> inv_sum(group);
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores.data() + j * seq_len;
    float m = *std::max_element(s, s + seq_len);
    float sum = 0.0f;
    for (int64_t t = 0; t < seq_len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[j] = 1.0f / sum;
  }
  // Weighted values, one pass.
  for (int64_t t = 0; t < seq_len; ++t) {
    const C* v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                 kvh * kv_row_width<C>(head_dim);
    load_row(v, row.data(), head_dim);
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * seq_len + t];
      float* aj = acc.data() + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) aj[d] += p * row[d];
    }
  }
  for (int64_t j = 0; j < group; ++j)
    for (int64_t d = 0; d < head_dim; ++d)
      out[j * head_dim + d] = static_cast<T>(acc[j * head_dim + d] * inv_sum[j]);
}

#if HEADRACE_VEC
// Vector path for the common head sizes (AVX-512 or AVX2, through Vec): the key row is
// widened once per token for all g query heads.

// Tokens a call of for_each_block's fn covers: the prefetch of blocks ahead is spread over
// the block in pieces this size, four tokens of it per four computed. Prefetching a whole
// 16-token block at once (64 lines for D = 64 in fp32) filled the core's miss buffers: on
// Zen 1 the prefetch instruction itself took a sixth of the kernel's samples at 512 keys.
constexpr int64_t kPiece = 4;
static_assert(kPiece % 4 == 0, "the score pass takes four keys at a time from a piece");

// Blocks ahead of the one computed that for_each_block prefetches. A block's pass takes
// ~50 ns with its rows in cache, well under a cold read: with one block ahead, 30 layers'
// decode attention over scattered blocks took 5.0-6.1 ms at 32 x 160 keys against 4.2-4.9
// three ahead (Intel AMX guest; two and four ahead were between or level with three).
constexpr int64_t kBlocksAhead = 3;

// Prefetch n tokens' rows for this KV head while earlier tokens are computed: blocks sit
// anywhere in a cache of hundreds of MB, so each is a cold, non-sequential read.
template <typename T>
inline void prefetch_rows(const T* row, int64_t n, int64_t token_stride, int64_t width) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t off = 0; off < width; off += 64 / static_cast<int64_t>(sizeof(T)))
      _mm_prefetch(reinterpret_cast<const char*>(row + t * token_stride + off), _MM_HINT_T0);
}

// fn(rows, start, n) for each piece of up to kPiece tokens of one KV head's keys or values,
// in order: `rows` is the piece's first token for this head (tokens kv_heads rows apart),
// `start` its position, `n` its tokens. With `prefetch`, the same tokens of the block
// kBlocksAhead on are prefetched before each piece, and of every block up to it during the
// first block (the first itself is fetched during the item before: `run`).
template <int D, typename T, typename Fn>
inline void for_each_block(const T* cache, const int64_t* table, int64_t seq_len, int64_t kvh,
                           int64_t kv_heads, int64_t block_size, bool prefetch, Fn&& fn) {
  constexpr int64_t W = kv_row_width<T>(D);
  const int64_t token_stride = kv_heads * W;
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  for (int64_t start = 0, blk = 0; start < seq_len; start += block_size, ++blk) {
    const T* rows = cache + table[blk] * block_stride + kvh * W;
    const int64_t n = std::min(block_size, seq_len - start);
    // The blocks whose prefetch is spread over this one.
    const T* ahead[kBlocksAhead];
    int64_t ahead_n[kBlocksAhead], count = 0;
    if (prefetch)
      for (int64_t a = blk == 0 ? 1 : kBlocksAhead; a <= kBlocksAhead && blk + a < num_blocks;
           ++a, ++count) {
        ahead[count] = cache + table[blk + a] * block_stride + kvh * W;
        ahead_n[count] = std::min(block_size, seq_len - (blk + a) * block_size);
      }
    for (int64_t t = 0; t < n; t += kPiece) {
      const int64_t m = std::min(kPiece, n - t);
      for (int64_t i = 0; i < count; ++i)
        if (t < ahead_n[i])
          prefetch_rows(ahead[i] + t * token_stride, std::min(m, ahead_n[i] - t), token_stride, W);
      fn(rows + t * token_stride, start + t, m);
    }
  }
}

// out[h] = sum_t p[h][t] v[t] * inv_sum[h] for G heads (G and D fixed: the G x D / N
// accumulators stay in registers) over one KV head's values; each value row is widened once
// (an int8 row's scale goes into its weights, p[h][t] * scale).
template <int G, int D, typename T, typename O>
void weighted_values(const float* p, int64_t p_stride, const float* inv_sum, const T* v_cache,
                     const int64_t* table, int64_t seq_len, int64_t kvh, int64_t kv_heads,
                     int64_t block_size, bool prefetch, O* out) {
  constexpr int NV = D / Vec::N;
  const int64_t token_stride = kv_heads * kv_row_width<T>(D);
  Vec acc[G][NV];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < NV; ++i) acc[h][i] = Vec::set1(0.0f);
  // Later passes over the same values find them in cache: only the first prefetches.
  for_each_block<D>(v_cache, table, seq_len, kvh, kv_heads, block_size, prefetch,
                    [&](const T* v, int64_t start, int64_t n) {
                      for (int64_t t = 0; t < n; ++t, v += token_stride) {
                        Vec vv[NV];
                        for (int i = 0; i < NV; ++i) vv[i] = Vec::load(v + i * Vec::N);
                        const float s = kv_row_scale(v, D);
                        for (int h = 0; h < G; ++h) {
                          const Vec w = Vec::set1(p[h * p_stride + start + t] * s);
                          for (int i = 0; i < NV; ++i) acc[h][i] = Vec::fmadd(w, vv[i], acc[h][i]);
                        }
                      }
                    });
  for (int h = 0; h < G; ++h) {
    const Vec inv = Vec::set1(inv_sum[h]);
    for (int i = 0; i < NV; ++i) (acc[h][i] * inv).store(out + h * D + i * Vec::N);
  }
}

// weighted_values for g (at most 4) heads: G is a template argument so the accumulators stay
// in registers, one instance per count.
template <int D, typename T, typename O>
void values_pass(int g, const float* p, int64_t p_stride, const float* inv_sum, const T* v_cache,
                 const int64_t* table, int64_t seq_len, int64_t kvh, int64_t kv_heads,
                 int64_t block_size, bool prefetch, O* out) {
  using Pass = void (*)(const float*, int64_t, const float*, const T*, const int64_t*, int64_t,
                        int64_t, int64_t, int64_t, bool, O*);
  constexpr Pass passes[] = {weighted_values<1, D, T, O>, weighted_values<2, D, T, O>,
                             weighted_values<3, D, T, O>, weighted_values<4, D, T, O>};
  passes[g - 1](p, p_stride, inv_sum, v_cache, table, seq_len, kvh, kv_heads, block_size, prefetch,
                out);
}

// Accumulator registers the value pass may use (AVX-512 has 32 vector registers, AVX2 16).
constexpr int kAccRegs = Vec::N == 16 ? 16 : 8;
static_assert(kAccRegs / 4 <= 4, "weighted_values is instantiated for up to 4 heads");

// Scores of g query heads against one KV head's keys into scores [g][padded], one pass over
// the keys: dot4(j, k, stride, out) writes head j's scores of the four keys from k (rows
// `stride` apart), dot1(j, k) returns one. Four keys at a time per head: four independent
// multiply-add chains and one reduction tree for their sums (one key at a time waited on its
// chain and its three-step reduction: ~2x slower on Zen 1).
template <int D, typename T, typename Dot4, typename Dot1>
void score_keys(const T* k_cache, const int64_t* table, int64_t seq_len, int64_t kvh,
                int64_t group, int64_t kv_heads, int64_t block_size, float* scores,
                int64_t padded, Dot4&& dot4, Dot1&& dot1) {
  const int64_t token_stride = kv_heads * kv_row_width<T>(D);
  for_each_block<D>(k_cache, table, seq_len, kvh, kv_heads, block_size, true,
                    [&](const T* k, int64_t start, int64_t n) {
                      int64_t t = 0;
                      for (; t + 4 <= n; t += 4, k += 4 * token_stride)
                        for (int64_t j = 0; j < group; ++j)
                          dot4(j, k, token_stride, scores + j * padded + start + t);
                      for (; t < n; ++t, k += token_stride)
                        for (int64_t j = 0; j < group; ++j)
                          scores[j * padded + start + t] = dot1(j, k);
                    });
}

// score_keys with the keys widened to fp32 and the queries scaled first (the int8 cache's
// keys take scores_int8).
template <int D, typename T>
void scores_widened(const T* q, float scale, const T* k_cache, const int64_t* table,
                    int64_t seq_len, int64_t kvh, int64_t group, int64_t kv_heads,
                    int64_t block_size, float* scores, int64_t padded) {
  constexpr int NV = D / Vec::N;
  std::vector<float> q_scaled(group * D);
  float* qs = q_scaled.data();
  for (int64_t j = 0; j < group; ++j)
    for (int i = 0; i < NV; ++i)
      (Vec::load(q + j * D + i * Vec::N) * Vec::set1(scale)).store(qs + j * D + i * Vec::N);
  const auto dot4 = [&](int64_t j, const T* k, int64_t stride, float* out) {
    const float* qj = qs + j * D;
    Vec acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = Vec::load(qj) * Vec::load(k + r * stride);
    for (int i = 1; i < NV; ++i) {
      const Vec qv = Vec::load(qj + i * Vec::N);
      for (int r = 0; r < 4; ++r)
        acc[r] = Vec::fmadd(qv, Vec::load(k + r * stride + i * Vec::N), acc[r]);
    }
    Vec::sum4(acc, out);
  };
  const auto dot1 = [&](int64_t j, const T* k) {
    const float* qj = qs + j * D;
    Vec acc = Vec::load(qj) * Vec::load(k);
    for (int i = 1; i < NV; ++i)
      acc = Vec::fmadd(Vec::load(qj + i * Vec::N), Vec::load(k + i * Vec::N), acc);
    return acc.sum();
  };
  score_keys<D>(k_cache, table, seq_len, kvh, group, kv_heads, block_size, scores, padded, dot4,
                dot1);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// score_keys for a bf16 cache and bf16 queries, unscaled: the keys multiplied as they are
// stored, in bf16 pairs (vdpbf16ps: products exact in fp32, summed in fp32), not widened once
// per head. A quarter less time than widening at SmolLM2's 3 heads a KV head, with the keys
// in cache (Sapphire Rapids-class guest).
template <int D>
void scores_bf16_pairs(const c10::BFloat16* q, const c10::BFloat16* k_cache,
                       const int64_t* table, int64_t seq_len, int64_t kvh, int64_t group,
                       int64_t kv_heads, int64_t block_size, float* scores, int64_t padded) {
  using T = c10::BFloat16;
  constexpr int NP = D / 32;  // vectors of 32 bf16 a row
  const auto row = [](const T* p, int i) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const __m512i*>(p) + i);
  };
  const auto dot4 = [&](int64_t j, const T* k, int64_t stride, float* out) {
    const T* qj = q + j * D;
    Vec acc[4];
    for (int r = 0; r < 4; ++r)
      acc[r].v = _mm512_dpbf16_ps(_mm512_setzero_ps(), row(qj, 0), row(k + r * stride, 0));
    for (int i = 1; i < NP; ++i)
      for (int r = 0; r < 4; ++r)
        acc[r].v = _mm512_dpbf16_ps(acc[r].v, row(qj, i), row(k + r * stride, i));
    Vec::sum4(acc, out);
  };
  const auto dot1 = [&](int64_t j, const T* k) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < NP; ++i) acc = _mm512_dpbf16_ps(acc, row(q + j * D, i), row(k, i));
    return _mm512_reduce_add_ps(acc);
  };
  score_keys<D>(k_cache, table, seq_len, kvh, group, kv_heads, block_size, scores, padded, dot4,
                dot1);
}
#endif

// score_keys for the int8 cache: each query head is rounded to int16 once (its own scale,
// max |q| / 32767: ~2e-5 relative, far under the keys' own rounding), so a key's dot product
// is integer multiply-adds of its int8 values widened to int16 (vpmaddwd, or vpdpwssd where
// VNNI has it), exact in int32, then times the query's and the key row's scales. Widening the
// keys to fp32 for each query head instead left the int8 cache 1.12x faster than bf16 at 32
// x 176 keys, on half the bytes.
template <int D, typename T>
void scores_int8(const T* q, float scale, const int8_t* k_cache, const int64_t* table,
                 int64_t seq_len, int64_t kvh, int64_t group, int64_t kv_heads,
                 int64_t block_size, float* scores, int64_t padded) {
#if defined(__AVX512BW__)
  constexpr int kLanes = 32;  // int16 lanes a register
  using IVec = __m512i;
  const auto load_q = [](const int16_t* p) { return _mm512_loadu_si512(p); };
  const auto load_k = [](const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const auto madd = [](IVec acc, IVec a, IVec b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
  };
  const auto to_vec = [](IVec v) { return Vec{_mm512_cvtepi32_ps(v)}; };
  const IVec zero = _mm512_setzero_si512();
#else
  constexpr int kLanes = 16;
  using IVec = __m256i;
  const auto load_q = [](const int16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  const auto load_k = [](const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  const auto madd = [](IVec acc, IVec a, IVec b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  };
  const auto to_vec = [](IVec v) { return Vec{_mm256_cvtepi32_ps(v)}; };
  const IVec zero = _mm256_setzero_si256();
#endif
  static_assert(D % kLanes == 0, "whole registers of a row");
  constexpr int NI = D / kLanes;
  // Each head as one group of act_quant.h's int16 rounding (widened first: q may be bf16).
  std::vector<int16_t> q_int(group * D);
  std::vector<float> q_scale(group);
  float row[D];
  for (int64_t j = 0; j < group; ++j) {
    for (int64_t d = 0; d < D; ++d) row[d] = widen(q[j * D + d]);
    quantise_group_scalar<int16_t, 32767>(row, D, q_int.data() + j * D, &q_scale[j], nullptr);
    q_scale[j] *= scale;
  }
  const auto dot4 = [&](int64_t j, const int8_t* k, int64_t stride, float* out) {
    const int16_t* qj = q_int.data() + j * D;
    IVec acc[4] = {zero, zero, zero, zero};
    for (int i = 0; i < NI; ++i) {
      const IVec qv = load_q(qj + i * kLanes);
      for (int r = 0; r < 4; ++r) acc[r] = madd(acc[r], load_k(k + r * stride + i * kLanes), qv);
    }
    const Vec sums[4] = {to_vec(acc[0]), to_vec(acc[1]), to_vec(acc[2]), to_vec(acc[3])};
    Vec::sum4(sums, out);
    for (int r = 0; r < 4; ++r) out[r] *= q_scale[j] * kv_row_scale(k + r * stride, D);
  };
  const auto dot1 = [&](int64_t j, const int8_t* k) {
    const int16_t* qj = q_int.data() + j * D;
    IVec acc = zero;
    for (int i = 0; i < NI; ++i) acc = madd(acc, load_k(k + i * kLanes), load_q(qj + i * kLanes));
    return to_vec(acc).sum() * q_scale[j] * kv_row_scale(k, D);
  };
  score_keys<D>(k_cache, table, seq_len, kvh, group, kv_heads, block_size, scores, padded, dot4,
                dot1);
}

// One KV head's g query heads over `seq_len` keys from `table`'s first block, into `out`
// (q's dtype) normalised; or, given `partial`, into it as [max (g), exp sum (g), unnormalised
// values (g x D)] in fp32, for merge_splits.
template <int D, typename T, typename C>
void decode_one_vec(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                    int64_t seq_len, int64_t kvh, int64_t group, int64_t kv_heads,
                    int64_t block_size, float scale, T* out, float* partial) {
  constexpr int NV = D / Vec::N;
  // Query heads whose value accumulators fit in registers together.
  constexpr int kHeads = kAccRegs / NV > 0 ? kAccRegs / NV : 1;
  const int64_t padded = (seq_len + Vec::N - 1) / Vec::N * Vec::N;
  std::vector<float> all_scores(group * padded);
  // Scores of all g heads, one pass over the keys; left unscaled by the bf16 pass, which the
  // softmax then applies (score_scale).
  float score_scale = 1.0f;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<C, c10::BFloat16> && D % 32 == 0) {
    scores_bf16_pairs<D>(q, k_cache, table, seq_len, kvh, group, kv_heads, block_size,
                         all_scores.data(), padded);
    score_scale = scale;
  } else
#endif
  if constexpr (std::is_same_v<C, int8_t>) {
    scores_int8<D>(q, scale, k_cache, table, seq_len, kvh, group, kv_heads, block_size,
                   all_scores.data(), padded);
  } else {
    scores_widened<D>(q, scale, k_cache, table, seq_len, kvh, group, kv_heads, block_size,
                      all_scores.data(), padded);
  }
  // Softmax per head (max subtracted: exp never overflows). Padding lanes hold -inf, whose
  // exp is clamped to ~1e-38: nothing against a sum of at least 1.
  std::vector<float> inv_sum(group);
  for (int64_t j = 0; j < group; ++j) {
    float* scores = all_scores.data() + j * padded;
    if (score_scale != 1.0f)
      for (int64_t t = 0; t < padded; t += Vec::N)
        (Vec::load(scores + t) * Vec::set1(score_scale)).store(scores + t);
    for (int64_t t = seq_len; t < padded; ++t) scores[t] = -INFINITY;
    // A vector max: a scalar max_element is one dependent compare per key (a quarter of
    // this kernel's time at 176 keys).
    Vec mx = Vec::load(scores);
    for (int64_t t = Vec::N; t < padded; t += Vec::N) mx = Vec::max(mx, Vec::load(scores + t));
    const float m = mx.max();
    const Vec mv = Vec::set1(m);
    Vec sum = Vec::set1(0.0f);
    for (int64_t t = 0; t < padded; t += Vec::N) {
      const Vec e = (Vec::load(scores + t) - mv).exp();
      e.store(scores + t);
      sum = sum + e;
    }
    const float total = sum.sum();
    inv_sum[j] = partial ? 1.0f : 1.0f / total;
    if (partial) {
      partial[j] = m;
      partial[group + j] = total;
    }
  }
  // Weighted values: each value row is widened once for up to kHeads heads at a time.
  for (int64_t j0 = 0; j0 < group; j0 += kHeads) {
    const float* p = all_scores.data() + j0 * padded;
    const float* inv = inv_sum.data() + j0;
    const int g = static_cast<int>(std::min<int64_t>(kHeads, group - j0));
    if (partial)
      values_pass<D, C, float>(g, p, padded, inv, v_cache, table, seq_len, kvh, kv_heads,
                               block_size, j0 == 0, partial + 2 * group + j0 * D);
    else
      values_pass<D, C, T>(g, p, padded, inv, v_cache, table, seq_len, kvh, kv_heads, block_size,
                           j0 == 0, out + j0 * D);
  }
}

// Splits of one (request, KV head) merged into `out`: each split's values rescaled from its
// own max to the overall one, as the online softmax does between blocks.
template <typename T>
void merge_splits(const float* partials, int64_t splits, int64_t stride, int64_t group,
                  int64_t head_dim, T* out) {
  std::vector<float> acc(head_dim);
  for (int64_t j = 0; j < group; ++j) {
    float m = -INFINITY;
    for (int64_t p = 0; p < splits; ++p) m = std::max(m, partials[p * stride + j]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < splits; ++p) {
      const float* part = partials + p * stride;
      const float w = std::exp(part[j] - m);
      total += w * part[group + j];
      const float* values = part + 2 * group + j * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * values[d];
    }
    for (int64_t d = 0; d < head_dim; ++d) out[j * head_dim + d] = static_cast<T>(acc[d] / total);
  }
}
#endif

// A request's context longer than this is attended in splits of about this many keys (whole
// blocks) that run as units of their own and are merged: one long request's 3 KV heads on 2
// threads left one thread idle a third of the time. The splits depend on the request's own
// length only, so a row's output does not depend on its batch (--deterministic relies on it).
constexpr int64_t kSplitKeys = 512;

// Blocks a split of a `len`-key context spans, and the context's splits.
int64_t split_blocks(int64_t len, int64_t block_size) {
  const int64_t blocks = (len + block_size - 1) / block_size;
  const int64_t want = (len + kSplitKeys - 1) / kSplitKeys;
  return (blocks + want - 1) / want;
}
int64_t splits_of(int64_t len, int64_t block_size) {
  const int64_t per = split_blocks(len, block_size);
  return ((len + block_size - 1) / block_size + per - 1) / per;
}

// T: the queries' and output's dtype; C: the cache's (T, or int8).
template <typename T, typename C>
void run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
         const int64_t* lens, at::Tensor& out, int64_t heads, int64_t head_dim,
         int64_t block_size, int64_t kv_heads, float scale) {
  const int64_t batch = q.size(0), group = heads / kv_heads, max_blocks = tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = cache.data_ptr<C>();
  const C* v_ptr = k_ptr + cache.stride(0);
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  // One query row's heads for one KV head over `len` keys from `table`'s first block.
  auto attend = [&](int64_t offset, const int64_t* table, int64_t len, int64_t kvh,
                    float* partial) {
#if HEADRACE_VEC
    if (head_dim == 64)
      return decode_one_vec<64>(q_ptr + offset, k_ptr, v_ptr, table, len, kvh, group, kv_heads,
                                block_size, scale, out_ptr + offset, partial);
    if (head_dim == 128)
      return decode_one_vec<128>(q_ptr + offset, k_ptr, v_ptr, table, len, kvh, group, kv_heads,
                                 block_size, scale, out_ptr + offset, partial);
#endif
    decode_one(q_ptr + offset, k_ptr, v_ptr, table, len, kvh, group, kv_heads, block_size,
               head_dim, scale, out_ptr + offset);
  };
  // Work items: request b's are [first[b], first[b + 1]), its KV heads' splits in order. The
  // generic loop (other head sizes, no vector unit) has no partial form: whole contexts.
  const bool splits_ok = HEADRACE_VEC && (head_dim == 64 || head_dim == 128);
  std::vector<int64_t> first(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    first[b + 1] = first[b] + (splits_ok ? splits_of(lens[b], block_size) : 1) * kv_heads;
  const int64_t items = first[batch], stride = group * (2 + head_dim);
  std::vector<float> partials(items > batch * kv_heads ? items * stride : 0);
  // Where an item's keys are: request b (found from `b` on), KV head kvh, its split's first
  // block and length, and whether it is the whole context (no partial to merge).
  struct Item {
    int64_t b, kvh, block0, len;
    bool whole;
  };
  auto locate = [&](int64_t item, int64_t b) {
    while (item >= first[b + 1]) ++b;
    const int64_t splits = (first[b + 1] - first[b]) / kv_heads;
    const int64_t kvh = (item - first[b]) / splits, split = (item - first[b]) % splits;
    if (splits == 1) return Item{b, kvh, 0, lens[b], true};
    const int64_t per = split_blocks(lens[b], block_size), block0 = split * per;
    const int64_t len = std::min(lens[b], (block0 + per) * block_size) - block0 * block_size;
    return Item{b, kvh, block0, len, false};
  };
  // Each thread takes a run of items holding an even share of the keys: an even share of
  // the items (parallel_for's split) gave one thread a long context's splits and the other
  // short requests' items (4,000 + 7 x 40 keys, 30 layers: 17.2-18.8 ms a step against
  // 10.1-10.5 split by keys). kItemKeys stands for an item's fixed cost, a guess: its set-up
  // is small beside a block's keys.
  constexpr int64_t kItemKeys = 16;
  std::vector<int64_t> keys_before(items + 1, 0);
  for (int64_t item = 0, b = 0; item < items; ++item) {
    const Item it = locate(item, b);
    b = it.b;
    keys_before[item + 1] = keys_before[item] + it.len + kItemKeys;
  }
  parallel_even_runs(keys_before, [&](int64_t begin, int64_t end) {
    const int64_t b0 = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    Item it = locate(begin, b0);
    for (int64_t item = begin; item < end; ++item) {
      // Located once: this item's `next` is the following item's `it`.
      const Item next = item + 1 < end ? locate(item + 1, it.b) : it;
#if HEADRACE_VEC
      // The first block of the next item's keys and values, fetched while this item
      // computes: each item's passes started on a cold block otherwise.
      if (item + 1 < end) {
        const int64_t width = kv_row_width<C>(head_dim), token_stride = kv_heads * width;
        const int64_t at = table_ptr[next.b * max_blocks + next.block0] * block_size *
                               token_stride + next.kvh * width;
        const int64_t n = std::min(block_size, next.len);
        prefetch_rows(k_ptr + at, n, token_stride, width);
        prefetch_rows(v_ptr + at, n, token_stride, width);
      }
#endif
      const int64_t offset = (it.b * heads + it.kvh * group) * head_dim;
      const int64_t* table = table_ptr + it.b * max_blocks + it.block0;
      attend(offset, table, it.len, it.kvh, it.whole ? nullptr : partials.data() + item * stride);
      it = next;
    }
  });
#if HEADRACE_VEC
  if (partials.empty()) return;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / kv_heads, kvh = unit % kv_heads;
      const int64_t splits = (first[b + 1] - first[b]) / kv_heads;
      if (splits == 1) continue;
      merge_splits(partials.data() + (first[b] + kvh * splits) * stride, splits, stride, group,
                   head_dim, out_ptr + (b * heads + kvh * group) * head_dim);
    }
  });
#endif
}

}  // namespace

// The ops, also called from C++ by fused_decode.cpp (declared in ops.h).
namespace headrace::ops {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q [B, H, D], kv_cache [2, N, S, KVH, D]");
  TORCH_CHECK(kv_cache_serves(kv_cache.scalar_type(), q.scalar_type()),
              "kv_cache must have q's dtype, or be int8");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  // A copy of a non-contiguous cache would cost more than the gather this kernel avoids.
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  const at::Tensor qc = q.contiguous();
  const at::Tensor& cache = kv_cache;
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t batch = qc.size(0), heads = qc.size(1), head_dim = qc.size(2);
  const int64_t num_blocks = cache.size(1), block_size = cache.size(2), kv_heads = cache.size(3);
  checked_kv_row_width(cache, head_dim);
  TORCH_CHECK(heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one table and length per row");
  const int64_t max_blocks = tables.size(1);
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  // Checked here, once, so that the kernel never reads outside the cache.
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= max_blocks * block_size,
                "seq_lens out of range of the block table");
    for (int64_t i = 0; i < (len_ptr[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = table_ptr[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range of the cache");
    }
  }
  at::Tensor out = at::empty_like(qc);
  const float s = static_cast<float>(scale);
  const bool int8 = cache.scalar_type() == at::kChar;
  const auto go = [&](auto kernel) {
    kernel(qc, cache, tables, len_ptr, out, heads, head_dim, block_size, kv_heads, s);
  };
  if (qc.scalar_type() == at::kFloat) {
    go(int8 ? run<float, int8_t> : run<float, float>);
  } else if (qc.scalar_type() == at::kBFloat16) {
    go(int8 ? run<c10::BFloat16, int8_t> : run<c10::BFloat16, c10::BFloat16>);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: fp32 or bf16 only, got ", qc.scalar_type());
  }
  return out;
}

}  // namespace headrace::ops

TORCH_LIBRARY(headrace, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("paged_decode_attention", &headrace::ops::paged_decode_attention);
}
