// The step's new keys and values into their paged-cache slots (the layout of
// paged_attention.cpp's header): one op for K and V instead of two index_copy_ calls. Into
// the int8 cache (kv_rows.h) each row is quantised on the way, with the formula of
// runner/kv_format.py's quantize_rows, bit for bit.
//
//   write_kv_(kv_cache [2, num_blocks, block_size, KVH, D (+ 4 in int8)], k [T, KVH, D],
//             v [T, KVH, D], slots [T] int64)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_rows.h"
#include "ops.h"
#include "vec.h"

namespace {

// One row into the int8 cache: scale = absmax / 127, values round(x * (127 / absmax)) to
// nearest even (act_quant.h's formula), an all-zero row all zeros. In vectors where the row
// is whole vectors: a value at a time, a 1,000-token prompt's rows took 0.2 ms a layer.
template <typename T>
void quantize_row(const T* src, int64_t dim, int8_t* dst) {
  using headrace::widen;
  float absmax = 0.0f;
#if HEADRACE_VEC
  using headrace::Vec;
  const bool vectors = dim % Vec::N == 0;
  if (vectors) {
    Vec m = Vec::set1(0.0f);
    for (int64_t d = 0; d < dim; d += Vec::N) m = Vec::max(m, Vec::load(src + d).abs());
    absmax = m.max();
  }
#else
  const bool vectors = false;
#endif
  if (!vectors)
    for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(widen(src[d])));
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f, scale = absmax / 127.0f;
#if HEADRACE_VEC
  if (vectors)
    for (int64_t d = 0; d < dim; d += Vec::N) (Vec::load(src + d) * Vec::set1(inv)).store(dst + d);
#endif
  if (!vectors)
    for (int64_t d = 0; d < dim; ++d)
      dst[d] = static_cast<int8_t>(std::nearbyint(widen(src[d]) * inv));
  std::memcpy(dst + dim, &scale, sizeof(scale));
}

}  // namespace

// Also called from C++ by fused_decode.cpp (declared in ops.h).
namespace headrace::ops {

// k and v may be strided views into the QKV output; their rows must be contiguous.
void write_kv_(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache [2, N, S, KVH, D]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v [T, KVH, D] with contiguous rows");
  const bool quantize = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() &&
                  (quantize ? k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16
                            : k.scalar_type() == kv_cache.scalar_type()),
              "k and v must have kv_cache's dtype (fp32 or bf16 into an int8 cache)");
  TORCH_CHECK(k.size(1) == kv_cache.size(3), "k's heads do not match the cache");
  const int64_t width = headrace::checked_kv_row_width(kv_cache, k.size(2));
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0),
              "slots must be int64, one per token");
  const at::Tensor sl = slots.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of range of the cache");
  if (quantize) {
    int8_t* cache = kv_cache.data_ptr<int8_t>();
    const int64_t half = kv_cache.stride(0);
    const auto rows = [&](auto* kp, auto* vp) {
      at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t)
          for (int64_t h = 0; h < heads; ++h) {
            int8_t* dst = cache + (sp[t] * heads + h) * width;
            quantize_row(kp + t * k.stride(0) + h * k.stride(1), dim, dst);
            quantize_row(vp + t * v.stride(0) + h * v.stride(1), dim, dst + half);
          }
      });
    };
    if (k.scalar_type() == at::kFloat)
      rows(k.data_ptr<float>(), v.data_ptr<float>());
    else
      rows(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
    return;
  }
  const int64_t es = static_cast<int64_t>(k.element_size());
  const int64_t row_bytes = dim * es, half_bytes = kv_cache.stride(0) * es;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      char* dst = cache + sp[t] * heads * row_bytes;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(dst + h * row_bytes, kp + (t * k.stride(0) + h * k.stride(1)) * es,
                    row_bytes);
        std::memcpy(dst + half_bytes + h * row_bytes,
                    vp + (t * v.stride(0) + h * v.stride(1)) * es, row_bytes);
      }
    }
  });
}

}  // namespace headrace::ops

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) { m.impl("write_kv_", &headrace::ops::write_kv_); }
