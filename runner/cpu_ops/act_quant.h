// Activations quantised per row and per group of kGroupWidth inputs, shared by the kernels
// that multiply integers (batched_int8.cpp "dot", q4_linear.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace headrace {

// One scale per 32 inputs, as llama.cpp's activation blocks (and GGUF's weight blocks).
constexpr int64_t kGroupWidth = 32;

// Symmetric per group of 32 inputs: q = round(x * kQMax / amax) (kQMax 127 for int8, 32767
// for int16), rounded as the torch reference rounds (nearest even); `sum` (where not null) is
// the group's sum of q, which a kernel with an offset on the other side needs. One scalar
// group (any multiple of 4 wide).
template <typename Q, int kQMax>
inline void quantise_group_scalar(const float* row, int64_t n, Q* q, float* scale, int32_t* sum) {
  float amax = 0.0f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(row[k]));
  const float inv = amax > 0.0f ? kQMax / amax : 0.0f;
  *scale = amax / kQMax;
  int32_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    const float r = std::nearbyint(row[k] * inv);
    const int v = static_cast<int>(std::min<float>(kQMax, std::max<float>(-kQMax, r)));
    q[k] = static_cast<Q>(v);
    total += v;
  }
  if (sum) *sum = total;
}

// The same for a whole row, full groups in vectors (the same products and rounding mode, so
// the same integers as the scalar loop).
template <typename Q, int kQMax>
inline void quantise_row(const float* row, int64_t width, int64_t groups, Q* q, float* scale,
                         int32_t* sum) {
  constexpr int64_t kWidth = kGroupWidth;
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t k0 = j * kWidth, n = std::min(width - k0, kWidth);
    int32_t* sj = sum ? sum + j : nullptr;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (n == kWidth) {
      const __m512 a = _mm512_loadu_ps(row + k0), b = _mm512_loadu_ps(row + k0 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float inv = amax > 0.0f ? kQMax / amax : 0.0f;
      scale[j] = amax / kQMax;
      const __m512 vi = _mm512_set1_ps(inv);
      const __m512i lo = _mm512_set1_epi32(-kQMax), hi = _mm512_set1_epi32(kQMax);
      const __m512i qa = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(a, vi))));
      const __m512i qb = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(b, vi))));
      if constexpr (sizeof(Q) == 1) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16), _mm512_cvtepi32_epi8(qb));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), _mm512_cvtepi32_epi16(qa));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0 + 16), _mm512_cvtepi32_epi16(qb));
      }
      if (sj) *sj = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      continue;
    }
#elif defined(__AVX2__)
    if (n == kWidth) {
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 v[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(row + k0 + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const float inv = amax > 0.0f ? kQMax / amax : 0.0f;
      scale[j] = amax / kQMax;
      const __m256 vi = _mm256_set1_ps(inv);
      const __m256i lo = _mm256_set1_epi32(-kQMax), hi = _mm256_set1_epi32(kQMax);
      __m256i total = _mm256_setzero_si256();
      __m256i qi[4];
      for (int i = 0; i < 4; ++i) {
        qi[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi))));
        total = _mm256_add_epi32(total, qi[i]);
      }
      // Narrowed in vectors (the packs work within 128-bit lanes; a permute puts the lanes
      // back in order), not stored a value at a time.
      const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
      if constexpr (sizeof(Q) == 1) {
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), b);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), _mm256_permute4x64_epi64(w01, 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0 + 16), _mm256_permute4x64_epi64(w23, 0xD8));
      }
      if (sj) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
        int32_t t = 0;
        for (int l = 0; l < 8; ++l) t += lanes[l];
        *sj = t;
      }
      continue;
    }
#endif
    quantise_group_scalar<Q, kQMax>(row + k0, n, q + k0, scale + j, sj);
  }
}

}  // namespace headrace
