// How the kernels that read or write the paged KV cache find one row (one token's keys or
// values for one KV head): D values of the model's dtype (fp32 or bf16), or, in the int8
// cache (--kv-cache-dtype int8, runner/kv_format.py), D int8 values followed by their fp32
// scale in the row's last four bytes: value = int8 * scale, scale = the row's absmax / 127.
// The scale lives inside its row so the whole cache is still one tensor and a block still
// one copy (the KV connectors, prefix caching and the block tables see no difference).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace headrace {

constexpr int64_t kKvScaleBytes = 4;

// Elements (of the cache's type C) in one row for head dim `dim`.
template <typename C>
constexpr int64_t kv_row_width(int64_t dim) {
  return std::is_same_v<C, int8_t> ? dim + kKvScaleBytes : dim;
}

// What a row's stored values are multiplied by: its scale in the int8 cache, else 1.
template <typename C>
inline float kv_row_scale(const C* row, int64_t dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float scale;
    std::memcpy(&scale, row + dim, sizeof(scale));
    return scale;
  } else {
    return 1.0f;
  }
}

// The cache's row width for head dim `dim`, checked against its last dimension.
inline int64_t checked_kv_row_width(const at::Tensor& kv_cache, int64_t dim) {
  const int64_t want = kv_cache.scalar_type() == at::kChar ? dim + kKvScaleBytes : dim;
  TORCH_CHECK(kv_cache.size(4) == want, "kv_cache rows hold ", kv_cache.size(4),
              " elements where head dim ", dim, " needs ", want);
  return want;
}

// Whether a cache of this dtype may serve queries of `q_dtype`: the same dtype, or int8.
inline bool kv_cache_serves(at::ScalarType cache, at::ScalarType q_dtype) {
  return cache == q_dtype || cache == at::kChar;
}

}  // namespace headrace
