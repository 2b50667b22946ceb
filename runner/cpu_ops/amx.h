// AMX plumbing shared by the tile kernels: whether this build and this process may use AMX,
// and the tile configuration they load.
#pragma once

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
