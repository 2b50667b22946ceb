// Every decoder layer of a decode step as one call.
//
// At batch 1 the weights of a 135M model stream in ~5.5 ms a token, and the Python that
// calls a layer's dozen ops (views, norms, RoPE, the KV write, attention, four linears)
// cost ~3 ms more: a decode step was a third Python. This op calls the same C++ ops in
// the same order as runner/models/decoder.py does layer by layer, each linear through the
// kernel its Linear would take for this many rows, so its result is the layer-by-layer
// forward's bit for bit (the tests check equality, not closeness); only the interpreter
// between the ops is gone.
//
//   decode_layers(x [B, hidden], weights (kPerLayer per layer, below), kinds (4 per layer),
//                 kv_caches [L], cos [B, D], sin [B, D], slots [B], block_tables [B, M],
//                 seq_lens [B], heads, kv_heads, head_dim, eps, scale, stop)
//       -> (mlp_out [B, hidden], residual [B, hidden])
//
// The caller adds mlp_out to residual under the final norm (as after the last layer).
// `stop` (optional, one uint8 another thread may set: runner/step_interrupt.py) is read
// before each layer; once it is set the op returns two [0, hidden] tensors instead,
// leaving the step's KV half written (the scheduler takes the step back).
// Per layer: input norm weight, post-attention norm weight, then three slots for each of
// QKV, o_proj, gate/up, down, read by that linear's kind (empty tensor: no bias):
//   kRows     int8 rows, scales, bias          (int8_weight_linear)
//   kAmx      AMX int8 tiles, scales, bias     (amx_int8_linear)
//   kDot/kWiden  packed int8, scales, bias     (batched_int8_linear)
//   kQ4       packed 4-bit blocks, scales, bias (q4_linear)
//   kOnednn   oneDNN weight, bias (bf16 or fp32) (mkldnn _linear_pointwise, inputs cast to
//             the weight's dtype)
//   kDense    weight, bias                     (at::linear)
//   kAmxBf16  bf16 AMX tiles, fp32 bias         (amx_bf16_linear, inputs cast to bf16)
//   kQ4Gemv   4-bit blocks for few rows, bias   (q4_gemv)
// Each linear's N comes from the model's shape (heads, head_dim, hidden, intermediate), not
// from its weights, so a kernel whose blocks pad N needs no case of its own.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <tuple>

#include "ops.h"

namespace {

using namespace headrace::ops;

constexpr int64_t kLinears = 4, kSlots = 3, kPerLayer = 2 + kLinears * kSlots;
enum Kind : int64_t {
  kRows = 0,
  kAmx = 1,
  kDot = 2,
  kWiden = 3,
  kOnednn = 4,
  kDense = 5,
  kQ4 = 6,
  kAmxBf16 = 7,
  kQ4Gemv = 8
};

c10::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  const at::Tensor y = op.call(x.to(w.scalar_type()), w, optional_of(bias), "none",
                               c10::List<std::optional<at::Scalar>>(), "");
  return y.to(x.scalar_type());
}

// x @ W^T (+ bias), N outputs, through the kernel `kind` names, its weights in w[0..kSlots).
at::Tensor linear_of_kind(const at::Tensor& x, const at::Tensor* w, int64_t kind, int64_t n) {
  switch (kind) {
    case kRows:
      return int8_weight_linear(x, w[0], w[1], optional_of(w[2]));
    case kAmx:
      return amx_int8_linear(x, w[0], w[1], optional_of(w[2]), n);
    case kDot:
    case kWiden:
      return batched_int8_linear(x, w[0], w[1], optional_of(w[2]), n,
                                 kind == kDot ? "dot" : "widen");
    case kQ4:
      return q4_linear(x, w[0], w[1], optional_of(w[2]), n);
    case kOnednn:
      return onednn_linear(x, w[0], w[1]);
    case kDense:
      return at::linear(x, w[0], optional_of(w[1]));
    case kQ4Gemv:
      return q4_gemv(x, w[0], optional_of(w[1]), n);
    case kAmxBf16:
      return amx_bf16_linear(x.to(at::kBFloat16), w[0], optional_of(w[1]), n)
          .to(x.scalar_type());
    default:
      TORCH_CHECK(false, "decode_layers: unknown linear kind ", kind);
  }
}

// The same, checking that the weights gave the N the model's shape says (`what` names the
// linear and `layer` its layer in the message).
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t kind, int64_t n,
                  const char* what, int64_t layer) {
  at::Tensor y = linear_of_kind(x, w, kind, n);
  TORCH_CHECK(y.size(1) == n, "decode_layers: ", what, " width of layer ", layer);
  return y;
}

// silu(gate) * up of the gate/up linear: one pass where it takes the AMX tiles (the same
// bits as the two steps, without the [B, 2I] round trip), else the linear then silu_and_mul.
at::Tensor gate_up_silu_mul(const at::Tensor& x, const at::Tensor* w, int64_t kind, int64_t n,
                            int64_t layer) {
  if (kind == kAmxBf16 && !w[1].numel() && n % 32 == 0 && x.scalar_type() == at::kBFloat16)
    return amx_bf16_silu_mul(x, w[0], n);
  if ((kind == kDot || kind == kWiden) && !w[2].numel() && n % (2 * w[0].size(2)) == 0)
    return batched_int8_silu_mul(x, w[0], w[1], n, kind == kDot ? "dot" : "widen");
  return silu_and_mul(linear(x, w, kind, n, "gate/up", layer));
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef kinds,
    at::TensorList kv_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
    double scale, const std::optional<at::Tensor>& stop) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(kinds.size()) == layers * kLinears,
              "decode_layers: ", kPerLayer, " weights and ", kLinears,
              " kinds per layer, one KV cache per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: x [B, hidden]");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const uint8_t* stop_flag = nullptr;
  if (stop.has_value() && stop->defined()) {
    TORCH_CHECK(stop->scalar_type() == at::kByte && stop->numel() == 1 && stop->is_contiguous(),
                "decode_layers: stop is one uint8");
    stop_flag = stop->data_ptr<uint8_t>();
  }
  at::Tensor x = x_in, residual;
  for (int64_t l = 0; l < layers; ++l) {
    // Set from another thread while this one runs: an atomic read, so it is seen.
    if (stop_flag != nullptr && __atomic_load_n(stop_flag, __ATOMIC_RELAXED) != 0) {
      return {x_in.new_empty({0, x_in.size(1)}), x_in.new_empty({0, x_in.size(1)})};
    }
    const at::Tensor* w = weights.data() + l * kPerLayer;
    const int64_t* kind = kinds.data() + l * kLinears;
    const at::Tensor* lin = w + 2;  // kSlots tensors per linear from here
    at::Tensor h;
    if (l == 0) {
      h = rms_norm(x, w[0], eps);
      residual = x;
    } else {
      add_rms_norm_(x, residual, w[0], eps);
      h = x;
    }
    const at::Tensor qkv = linear(h, lin, kind[0], q_size + 2 * kv_size, "QKV", l);
    // Q and K rotate as one [B, H + KVH, D] view of the QKV rows, as the layer does.
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, heads + kv_heads, head_dim});
    rotary_(qk, cos, sin);
    at::Tensor cache = kv_caches[l];
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    write_kv_(cache, qk.narrow(1, heads, kv_heads), v, slots);
    const at::Tensor attn =
        paged_decode_attention(qk.narrow(1, 0, heads), cache, block_tables, seq_lens, scale);
    at::Tensor o = linear(attn.view({rows, q_size}), lin + kSlots, kind[1], hidden, "o_proj", l);
    add_rms_norm_(o, residual, w[1], eps);
    const at::Tensor act = gate_up_silu_mul(o, lin + 2 * kSlots, kind[2], 2 * intermediate, l);
    x = linear(act, lin + 3 * kSlots, kind[3], hidden, "down", l);
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headrace, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, int[] kinds, Tensor[] kv_caches, Tensor cos, "
      "Tensor sin, Tensor slots, Tensor block_tables, Tensor seq_lens, int heads, "
      "int kv_heads, int head_dim, int intermediate, float eps, float scale, Tensor? stop=None) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(headrace, CPU, m) { m.impl("decode_layers", &decode_layers); }
// oneDNN's packed bf16 weights are MkldnnCPU tensors: among the weights, they make the call
// dispatch there.
TORCH_LIBRARY_IMPL(headrace, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
