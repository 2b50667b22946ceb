// Weight-only int8 linear for few rows: y = x @ (q * scale)^T + bias.
//
// A decode step with a handful of requests is bound by reading the weights, not by the
// arithmetic: int8 weights are half the bytes of bf16. Each int8 row is widened to fp32 in
// registers and multiplied by every input row while it is there, so the weights are read
// once per call whatever the number of rows; activations stay fp32 (no per-token
// quantisation, so the only error is the weights' rounding to 255 levels per channel).
//
//   x      [M, K]  fp32 or bf16
//   qweight [N, K] int8, scale [N] fp32 (one per output channel), bias [N] or empty
//   out    [M, N]  x's dtype

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
inline __m512 widen16(const int8_t* w) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed));
}
#endif

// Dot products of R fp32 input rows with one int8 weight row. R is a template argument so
// that the accumulators live in registers; two per row hide the FMA latency.
template <int R>
inline void dot_fixed(const float* x, int64_t k_dim, const int8_t* w, float* out) {
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (; k + 32 <= k_dim; k += 32) {
    const __m512 w0 = widen16(w + k), w1 = widen16(w + k + 16);
    for (int m = 0; m < R; ++m) {
      a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k_dim + k), w0, a0[m]);
      a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k_dim + k + 16), w1, a1[m]);
    }
  }
  for (; k + 16 <= k_dim; k += 16) {
    const __m512 w0 = widen16(w + k);
    for (int m = 0; m < R; ++m)
      a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k_dim + k), w0, a0[m]);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
#else
  for (int m = 0; m < R; ++m) out[m] = 0.0f;
#endif
  for (; k < k_dim; ++k) {
    const float wk = static_cast<float>(w[k]);
    for (int m = 0; m < R; ++m) out[m] += x[m * k_dim + k] * wk;
  }
}

inline void dot_rows(const float* x, int64_t rows, int64_t k_dim, const int8_t* w, float* out) {
  int64_t m = 0;
  for (; m + 8 <= rows; m += 8) dot_fixed<8>(x + m * k_dim, k_dim, w, out + m);
  if (rows - m >= 4) {
    dot_fixed<4>(x + m * k_dim, k_dim, w, out + m);
    m += 4;
  }
  if (rows - m >= 2) {
    dot_fixed<2>(x + m * k_dim, k_dim, w, out + m);
    m += 2;
  }
  if (rows - m >= 1) dot_fixed<1>(x + m * k_dim, k_dim, w, out + m);
}

template <typename T>
void run(const float* x, int64_t rows, int64_t k_dim, const int8_t* q, const float* scale,
         const float* bias, int64_t n_dim, T* out) {
  // Output channels split over the threads; each reads its slice of the weight once.
  at::parallel_for(0, n_dim, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows);
    for (int64_t n = begin; n < end; ++n) {
      dot_rows(x, rows, k_dim, q + n * k_dim, sums.data());
      const float b = bias ? bias[n] : 0.0f;
      for (int64_t m = 0; m < rows; ++m)
        out[m * n_dim + n] = static_cast<T>(sums[m] * scale[n] + b);
    }
  });
}

at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2, "x [M, K], qweight [N, K]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == qweight.size(0),
              "scale must be fp32, one per output channel");
  TORCH_CHECK(x.size(1) == qweight.size(1), "x and qweight disagree on K");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_weight_linear: fp32 or bf16 inputs only, got ", x.scalar_type());
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = qweight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // small: a few rows
  const at::Tensor sc = scale.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim, "bias must have one entry per output channel");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({rows, n_dim}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run<float>(xf.data_ptr<float>(), rows, k_dim, qweight.data_ptr<int8_t>(),
               sc.data_ptr<float>(), bp, n_dim, out.data_ptr<float>());
  } else {
    run<c10::BFloat16>(xf.data_ptr<float>(), rows, k_dim, qweight.data_ptr<int8_t>(),
                       sc.data_ptr<float>(), bp, n_dim, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("int8_weight_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) { m.impl("int8_weight_linear", &int8_weight_linear); }
