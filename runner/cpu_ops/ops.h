// The kernels' ops as C++ functions, for ops that call others without going back to Python
// (fused_decode.cpp). Each is also registered as torch.ops.headrace.<name> by its own file.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace headrace::ops {

// int8_linear.cpp
at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& bias);

// amx_linear.cpp
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim);

// amx_gemm.cpp
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& tiles,
                           const c10::optional<at::Tensor>& bias, int64_t n_dim);
at::Tensor amx_bf16_silu_mul(const at::Tensor& x, const at::Tensor& tiles, int64_t n_dim);

// batched_int8.cpp
at::Tensor batched_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                               int64_t n_dim, const std::string& kernel);
at::Tensor batched_int8_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                                 const at::Tensor& scale, int64_t n_dim,
                                 const std::string& kernel);

// q4_linear.cpp
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias, int64_t n_dim);

// q4_gemv.cpp
at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, int64_t n_dim);

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// paged_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale);

// kv_write.cpp
void write_kv_(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slots);

}  // namespace headrace::ops
