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
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace headrace;

// Dot products of R fp32 input rows with NT consecutive int8 weight rows: out[m * NT + j].
// R and NT are template arguments so that the R x NT accumulators live in registers; NT
// rows at once give NT independent FMA chains and reuse each input load NT times.
constexpr int PF_TILES = 4;

template <int R, int NT>
inline void dot_tile(const float* x, int64_t k_dim, const int8_t* w, float* out) {
  int64_t k = 0;
#if HEADRACE_VEC
  Vec acc[R][NT];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = Vec::set1(0.0f);
  // The hardware prefetcher does not keep up with NT interleaved rows streamed from DRAM
  // (a single thread read 5.6 GB/s of weights without this, 11 GB/s with it): fetch the
  // same place PF_TILES tiles ahead, one 64-byte line per row every 64 weights.
  const int8_t* ahead = w + PF_TILES * NT * k_dim;
  for (; k + Vec::N <= k_dim; k += Vec::N) {
    if ((k & 63) == 0)
      for (int j = 0; j < NT; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * k_dim + k), _MM_HINT_T0);
    Vec wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = Vec::load(w + j * k_dim + k);
    for (int m = 0; m < R; ++m) {
      const Vec xv = Vec::load(x + m * k_dim + k);
      for (int j = 0; j < NT; ++j) acc[m][j] = Vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NT; ++j) out[m * NT + j] = acc[m][j].sum();
#else
  for (int i = 0; i < R * NT; ++i) out[i] = 0.0f;
#endif
  for (; k < k_dim; ++k)
    for (int j = 0; j < NT; ++j) {
      const float wk = static_cast<float>(w[j * k_dim + k]);
      for (int m = 0; m < R; ++m) out[m * NT + j] += x[m * k_dim + k] * wk;
    }
}

// All rows against NT weight rows, a few input rows at a time (the weight tile stays in
// L1). AVX2 has 16 vector registers, not 32: two rows there, or the accumulators spill.
#if defined(__AVX512F__)
constexpr int kRowTile = 4;
#else
constexpr int kRowTile = 2;
#endif

template <int NT>
inline void dot_rows(const float* x, int64_t rows, int64_t k_dim, const int8_t* w, float* out) {
  int64_t m = 0;
  for (; m + kRowTile <= rows; m += kRowTile)
    dot_tile<kRowTile, NT>(x + m * k_dim, k_dim, w, out + m * NT);
  if (rows - m >= 2) {
    dot_tile<2, NT>(x + m * k_dim, k_dim, w, out + m * NT);
    m += 2;
  }
  if (rows - m >= 1) dot_tile<1, NT>(x + m * k_dim, k_dim, w, out + m * NT);
}

template <typename T>
void run(const float* x, int64_t rows, int64_t k_dim, const int8_t* q, const float* scale,
         const float* bias, int64_t n_dim, T* out) {
  constexpr int NT = 4;
  // Output channels split over the threads in tiles of NT; each thread reads its slice of
  // the weight once.
  const int64_t tiles = (n_dim + NT - 1) / NT;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * NT);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * NT, nt = std::min<int64_t>(NT, n_dim - n0);
      if (nt == NT) {
        dot_rows<NT>(x, rows, k_dim, q + n0 * k_dim, sums.data());
      } else {
        for (int64_t j = 0; j < nt; ++j) {
          std::vector<float> one(rows);
          dot_rows<1>(x, rows, k_dim, q + (n0 + j) * k_dim, one.data());
          for (int64_t m = 0; m < rows; ++m) sums[m * NT + j] = one[m];
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < nt; ++j) {
          const int64_t n = n0 + j;
          out[m * n_dim + n] =
              static_cast<T>(sums[m * NT + j] * scale[n] + (bias ? bias[n] : 0.0f));
        }
    }
  });
}

}  // namespace

// The ops, also called from C++ by fused_decode.cpp (declared in ops.h).
namespace headrace::ops {

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
  // The few input rows widened to fp32 here, not by a torch op: at batch 1 a separate
  // `to(float)` cost as much dispatch time as a small layer's whole product.
  const at::Tensor xc = x.contiguous();
  std::vector<float> xf(rows * k_dim);
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(xf.data(), xc.data_ptr<float>(), xf.size() * sizeof(float));
  } else {
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < rows * k_dim; ++i) xf[i] = static_cast<float>(xb[i]);
  }
  const at::Tensor sc = scale.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim, "bias must have one entry per output channel");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({rows, n_dim}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run<float>(xf.data(), rows, k_dim, qweight.data_ptr<int8_t>(),
               sc.data_ptr<float>(), bp, n_dim, out.data_ptr<float>());
  } else {
    run<c10::BFloat16>(xf.data(), rows, k_dim, qweight.data_ptr<int8_t>(),
                       sc.data_ptr<float>(), bp, n_dim, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("int8_weight_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) { m.impl("int8_weight_linear", &headrace::ops::int8_weight_linear); }
