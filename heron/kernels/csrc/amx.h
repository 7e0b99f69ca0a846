// AMX tile state for heron's tile kernels (int_linear.cpp's int8 tiles, tile_linear.cpp's bfloat16 ones).
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace heron {

// Linux hands out AMX state only to processes that ask for it (once; oneDNN asks the same way). HERON_AMX=0 keeps
// heron's kernels off the tiles (to compare: the integer kernel gives the same bits either way).
inline bool amx_usable() {
  static const bool usable = std::string(std::getenv("HERON_AMX") ? std::getenv("HERON_AMX") : "1") != "0" &&
                             syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return usable;
}

// Tile registers 0-7: rows[t] rows of colsb[t] bytes each.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A thread's tiles, configured for the scope's tile multiplies (oneDNN loads its own configuration) and released
// at its end: tile state left in use costs every later context switch its 8 KiB, and can keep the core from its
// idle states and the frequency of its non-tile code (Intel's guidance: TILERELEASE after tile work).
class TileScope {
 public:
  explicit TileScope(const TileConfig& c) {
    // GCC 12's _tile_loadconfig declares a read of 8 bytes only, and drops the stores to the rest as dead
    asm volatile("ldtilecfg %0" : : "m"(c));
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace heron
#endif
