// Fused elementwise ops of a decoder layer: one pass over memory and one dispatch instead of
// the 5-8 eager torch ops each replaces (on a CPU, a decode step of a small model spends a
// quarter of its time in such ops' per-call overhead).
//
// Every op rounds to the activation dtype exactly where the eager reference (the HF
// formulas in runner/models/) rounds, so fp32 results differ from it only by the order of
// fp32 sums, and bf16 results by at most that before each rounding.
//
//   rms_norm(x [M, N], weight [N], eps) -> [M, N]
//   add_rms_norm_(x [M, N], residual [M, N], weight, eps): residual += x; x = norm(residual)
//   silu_and_mul(gate_up [M, 2I]) -> [M, I]       silu(gate) * up
//   rotary_(x [T, H, D], cos [T, D], sin [T, D])   in place, rotate-half convention

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"
#include "vec.h"

namespace {

using namespace headrace;

// Rows per parallel chunk: at least ~16k elements each, so that a decode step of a few
// tokens does not pay a fork/join for microseconds of work.
inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / width); }

template <typename T>
void norm_row(const T* x, const T* w, float eps, int64_t n, T* out) {
  float ss = 0.0f;
  int64_t i = 0;
#if HEADRACE_VEC
  Vec acc = Vec::set1(0.0f);
  for (; i + Vec::N <= n; i += Vec::N) {
    const Vec v = Vec::load(x + i);
    acc = Vec::fmadd(v, v, acc);
  }
  ss = acc.sum();
#endif
  for (; i < n; ++i) ss += widen(x[i]) * widen(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  // HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype): normalised value rounded first.
  i = 0;
#if HEADRACE_VEC
  const Vec iv = Vec::set1(inv);
  for (; i + Vec::N <= n; i += Vec::N)
    (Vec::load(w + i) * (Vec::load(x + i) * iv).rounded(x)).store(out + i);
#endif
  for (; i < n; ++i) out[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(x[i]) * inv)));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, float eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, eps, n, op + r * n);
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& res, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = xp + r * n;
      T* rr = rp + r * n;
      // The residual sum is rounded to the dtype, as `x + attn(x)` is in the reference.
      int64_t i = 0;
#if HEADRACE_VEC
      for (; i + Vec::N <= n; i += Vec::N) (Vec::load(rr + i) + Vec::load(xr + i)).store(rr + i);
#endif
      for (; i < n; ++i) rr[i] = narrow<T>(widen(rr[i]) + widen(xr[i]));
      norm_row(rr, wp, eps, n, xr);
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gp + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
#if HEADRACE_VEC
      for (; i + Vec::N <= inter; i += Vec::N)
        silu_times(Vec::load(g + i), Vec::load(u + i), g).store(o + i);
#endif
      for (; i < inter; ++i) {
        const float gv = widen(g[i]);
        o[i] = narrow<T>(widen(narrow<T>(gv / (1.0f + std::exp(-gv)))) * widen(u[i]));
      }
    }
  });
}

template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* c = cp + t * d;
      const T* s = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * ts + h * hs;
        // x * cos + rotate_half(x) * sin, each product rounded as the eager ops round it.
        int64_t i = 0;
#if HEADRACE_VEC
        for (; i + Vec::N <= half; i += Vec::N) {
          const Vec a = Vec::load(v + i), bb = Vec::load(v + i + half);
          // rotate_half negates the upper half: RNE rounding commutes with negation.
          const Vec lo = (a * Vec::load(c + i)).rounded(v) - (bb * Vec::load(s + i)).rounded(v);
          const Vec hi = (bb * Vec::load(c + i + half)).rounded(v) +
                         (a * Vec::load(s + i + half)).rounded(v);
          lo.store(v + i);
          hi.store(v + i + half);
        }
#endif
        for (; i < half; ++i) {
          const float a = widen(v[i]), bb = widen(v[i + half]);
          const float lo = widen(narrow<T>(a * widen(c[i]))) +
                           widen(narrow<T>(-bb * widen(s[i])));
          const float hi = widen(narrow<T>(bb * widen(c[i + half]))) +
                           widen(narrow<T>(a * widen(s[i + half])));
          v[i] = narrow<T>(lo);
          v[i + half] = narrow<T>(hi);
        }
      }
    }
  });
}

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              ": fp32 or bf16 only, got ", t.scalar_type());
}

#define HEADRACE_DISPATCH(dtype, ...)                 \
  if ((dtype) == at::kFloat) {                        \
    using scalar_t = float;                           \
    __VA_ARGS__();                                    \
  } else {                                            \
    using scalar_t = c10::BFloat16;                   \
    __VA_ARGS__();                                    \
  }

}  // namespace

// The ops, also called from C++ by fused_decode.cpp (declared in ops.h).
namespace headrace::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, N] contiguous, weight [N] of x's dtype");
  at::Tensor out = at::empty_like(x);
  const at::Tensor w = weight.contiguous();
  HEADRACE_DISPATCH(x.scalar_type(),
                    [&] { rms_norm_impl<scalar_t>(x, w, static_cast<float>(eps), out); });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float(x, "add_rms_norm_");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: x and residual [M, N] contiguous, weight [N], one dtype");
  const at::Tensor w = weight.contiguous();
  HEADRACE_DISPATCH(x.scalar_type(), [&] {
    add_rms_norm_impl<scalar_t>(x, residual, w, static_cast<float>(eps));
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up [M, 2I] contiguous");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  HEADRACE_DISPATCH(gate_up.scalar_type(), [&] { silu_and_mul_impl<scalar_t>(gate_up, out); });
  return out;
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x [T, H, D] with contiguous, even D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin [T, D] contiguous, of x's dtype");
  HEADRACE_DISPATCH(x.scalar_type(), [&] { rotary_impl<scalar_t>(x, cos, sin); });
}

}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) {
  m.impl("rms_norm", &headrace::ops::rms_norm);
  m.impl("add_rms_norm_", &headrace::ops::add_rms_norm_);
  m.impl("silu_and_mul", &headrace::ops::silu_and_mul);
  m.impl("rotary_", &headrace::ops::rotary_);
}
