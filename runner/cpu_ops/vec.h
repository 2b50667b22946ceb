// 16-lane fp32 loads and stores from fp32 or bf16 memory (AVX-512), shared by the kernels.
// A bf16 store rounds to nearest even, as torch's bf16 conversion does.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace headrace {

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);  // round to nearest even for bf16, as torch does
}

// exp(x) = 2^n * p(r), n = round(x * log2 e), r = x - n ln2 (ln2 in two parts, for the
// rounding of n * ln2), |r| <= ln2 / 2; p is the degree-6 Taylor polynomial (relative error
// ~2e-7). Constants shared by the 16- and 8-lane versions.
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-6f;
constexpr float kExpPoly[] = {1.3888889e-3f, 8.3333333e-3f, 4.1666667e-2f, 1.6666667e-1f,
                              0.5f,          1.0f,          1.0f};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  // Round to nearest even on the bit pattern; NaN keeps a quiet NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i out = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(out);
#endif
}
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}

// The value a store to T then a load would give: where the eager reference rounds.
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

// One vector of fp32 lanes, the widest this build has: the elementwise kernels are written
// once against it. HEADRACE_VEC is 0 where neither AVX-512 nor AVX2+FMA is available (the
// kernels' scalar loops then do all the work).
#if defined(__AVX512F__)
#define HEADRACE_VEC 1
struct Vec {
  static constexpr int N = 16;
  __m512 v;
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  template <typename T>
  static Vec load(const T* p) { return {load16(p)}; }
  // 16 int8 values widened to fp32 (exact).
  static Vec load(const int8_t* p) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed))};
  }
  template <typename T>
  void store(T* p) const { store16(p, v); }
  // Rounded to nearest even and narrowed to int8 (the values must fit).
  void store(int8_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  Vec abs() const { return {_mm512_abs_ps(v)}; }
  // The value a store to T then a load would give: where the eager formulas round.
  template <typename T>
  Vec rounded(const T* tag) const { return {round_to(v, tag)}; }
  Vec exp() const { return {exp16(v)}; }
  // 1 / v: a 14-bit estimate and one Newton step (~23 bits); a division costs 3-4x more.
  Vec rcp() const {
    const __m512 r = _mm512_rcp14_ps(v);
    return {_mm512_mul_ps(r, _mm512_fnmadd_ps(v, r, _mm512_set1_ps(2.0f)))};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  // The sums of four vectors into out[0..4): pairs added within 128-bit lanes, then the
  // four lanes, ~12 instructions where four separate reductions take ~32.
  static void sum4(const Vec (&a)[4], float* out) {
    // Per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of two vectors a, b.
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0].v, a[1].v),
                                    _mm512_unpackhi_ps(a[0].v, a[1].v));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2].v, a[3].v),
                                    _mm512_unpackhi_ps(a[2].v, a[3].v));
    // Per 128-bit lane: the four vectors' partial sums, in order.
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 half = _mm256_add_ps(
        _mm512_castps512_ps256(abcd),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  }
  float max() const { return _mm512_reduce_max_ps(v); }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define HEADRACE_VEC 1
struct Vec {
  static constexpr int N = 8;
  __m256 v;
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16))};
  }
  static Vec load(const int8_t* p) {
    const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  __m128i bf16() const {
    // Round to nearest even on the bit pattern; NaN keeps a quiet NaN.
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    // packus works within 128-bit halves: keep qwords 0 and 2, one copy of each half.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
  }
  void store(c10::BFloat16* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16());
  }
  // Rounded to nearest even and narrowed to int8 (the values must fit).
  void store(int8_t* p) const {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  Vec abs() const { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)}; }
  Vec rounded(const float*) const { return *this; }
  Vec rounded(const c10::BFloat16*) const {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16()), 16))};
  }
  Vec exp() const {
    // As exp16, with 2^n built from the exponent bits (AVX2 has no scalef).
    const __m256 x =
        _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(p, _mm256_castsi256_ps(e))};
  }
  Vec rcp() const {
    const __m256 r = _mm256_rcp_ps(v);
    return {_mm256_mul_ps(r, _mm256_fnmadd_ps(v, r, _mm256_set1_ps(2.0f)))};
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
  }
  // The sums of four vectors into out[0..4): one hadd tree for the four, not three
  // dependent steps each.
  static void sum4(const Vec (&a)[4], float* out) {
    const __m256 ab = _mm256_hadd_ps(a[0].v, a[1].v), cd = _mm256_hadd_ps(a[2].v, a[3].v);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: a, b, c, d partial sums
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  float max() const {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
};
#else
#define HEADRACE_VEC 0
#endif

#if HEADRACE_VEC
// silu(gate) * up of values of T (`tag`): silu's output is rounded to T before the product,
// as F.silu's output is. The one formula of silu_and_mul and of the fused gate/up ops
// (amx_gemm.cpp, tile_driver.h), which promise its bits.
template <typename T>
inline Vec silu_times(Vec gate, Vec up, const T* tag) {
  const Vec one = Vec::set1(1.0f), zero = Vec::set1(0.0f);
  return (gate * (one + (zero - gate).exp()).rcp()).rounded(tag) * up;
}
#endif

}  // namespace headrace
