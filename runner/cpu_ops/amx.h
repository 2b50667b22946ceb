// AMX plumbing shared by the tile kernels: whether this build and this process may use AMX,
// and the tile configuration they load.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define HEADRACE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HEADRACE_AMX 0
#endif

namespace headrace {

// A [N, K] row-major matrix of 8- or 16-bit elements as AMX B tiles, zero padded:
// dst [ceil(N/16)][ceil(K/32)][512]; tile (n, k) holds channels n*16.. and inputs k*32.. as
// 16 rows of input pairs, each row 16 channels x 2 inputs (one contiguous tile load).
template <typename T>
void pack_b_tiles(const T* src, int64_t n_dim, int64_t k_dim, T* dst) {
  const int64_t k_tiles = (k_dim + 31) / 32;
  for (int64_t n = 0; n < n_dim; ++n) {
    const int64_t nt = n / 16, j = n % 16;
    for (int64_t k = 0; k < k_dim; ++k) {
      const int64_t kt = k / 32, pair = (k % 32) / 2, e = k % 2;
      dst[(nt * k_tiles + kt) * 512 + pair * 32 + j * 2 + e] = src[n * k_dim + k];
    }
  }
}

// The AMX linears' shared argument checks: x's `k_dim` columns and `n_dim` outputs agree with
// B tiles from pack_b_tiles ([ceil(N/16)][ceil(K/32)][512]); `op` names the caller.
inline void check_b_tiles(const char* op, const at::Tensor& tiles, int64_t k_dim,
                          int64_t n_dim) {
  const int64_t n_tiles = tiles.size(0), k_pad = tiles.size(1) * 32;
  TORCH_CHECK(k_dim <= k_pad && k_dim > k_pad - 32, op, ": x has ", k_dim,
              " columns, the tiles were packed for ", k_pad, " (padded)");
  TORCH_CHECK(n_dim <= n_tiles * 16 && n_dim > (n_tiles - 1) * 16, op,
              ": n does not match the tiles");
}

// The bias as contiguous fp32, one per output channel (undefined where there is none).
inline at::Tensor float_bias(const char* op, const c10::optional<at::Tensor>& bias,
                             int64_t n_dim) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == n_dim, op, ": one bias per output channel");
  return bias->to(at::kFloat).contiguous();
}

// Whether this build has the AMX kernels and the kernel lets this process use AMX: Linux
// hands out the 8 KB tile state only to processes that ask (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asking again is harmless, and oneDNN may already have asked.
inline bool amx_usable() {
#if HEADRACE_AMX
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

#if HEADRACE_AMX
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles `rows` x `colsb` bytes (the kernels use full 16 x 64-byte tiles and pad
// their operands instead of reconfiguring per call). Per thread: load it in each parallel
// region, `_tile_release()` at its end.
inline void load_tile_config(uint8_t rows, uint16_t colsb) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = rows;
    cfg.colsb[t] = colsb;
  }
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace headrace
