// The arguments of the two prompt-attention kernels (amx_attention.cpp, vec_attention.cpp):
// the same paged layout and per-request rows, checked once so that neither kernel reads or
// writes outside its tensors. Each kernel adds its own dtype and head-dim rules.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kv_rows.h"

namespace headrace {

/** The checked shapes and the int64 per-request arrays of a prompt-attention call. */
struct PrefillArgs {
  int64_t tokens, heads, dim, num_blocks, block_size, kv_heads, batch, max_blocks;
  const int64_t *lens, *starts, *counts, *tables;
};

// out and q [T, H, D] (q may be a view into the fused QKV output: rows apart, heads and dims
// contiguous), kv_cache [2, N, S, KVH, D] (D + 4 in int8, kv_rows.h); per request a block table, a length, the first
// query row and the query count, all contiguous int64.
inline PrefillArgs check_prefill_args(const at::Tensor& out, const at::Tensor& q,
                                      const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& q_starts,
                                      const at::Tensor& q_lens) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && out.sizes() == q.sizes(),
              "q and out [T, H, D], kv_cache [2, N, S, KVH, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  kv_cache.is_contiguous(),
              "q with contiguous heads, out and kv_cache contiguous");
  PrefillArgs a{};
  a.tokens = q.size(0), a.heads = q.size(1), a.dim = q.size(2);
  a.num_blocks = kv_cache.size(1), a.block_size = kv_cache.size(2), a.kv_heads = kv_cache.size(3);
  checked_kv_row_width(kv_cache, a.dim);
  TORCH_CHECK(a.heads % a.kv_heads == 0, "head shapes do not match");
  for (const auto* t : {&block_tables, &seq_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tables, lengths and starts: contiguous int64");
  a.batch = seq_lens.size(0), a.max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == a.batch && q_starts.size(0) == a.batch &&
                  q_lens.size(0) == a.batch,
              "one table, length, start and query count per request");
  a.lens = seq_lens.data_ptr<int64_t>();
  a.starts = q_starts.data_ptr<int64_t>();
  a.counts = q_lens.data_ptr<int64_t>();
  a.tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < a.batch; ++b) {
    TORCH_CHECK(a.counts[b] >= 1 && a.counts[b] <= a.lens[b] &&
                    a.lens[b] <= a.max_blocks * a.block_size,
                "query count or seq_len out of range");
    TORCH_CHECK(a.starts[b] >= 0 && a.starts[b] + a.counts[b] <= a.tokens,
                "query rows out of range");
    for (int64_t i = 0; i < (a.lens[b] + a.block_size - 1) / a.block_size; ++i) {
      const int64_t block = a.tables[b * a.max_blocks + i];
      TORCH_CHECK(block >= 0 && block < a.num_blocks, "block id out of range of the cache");
    }
  }
  return a;
}

}  // namespace headrace
