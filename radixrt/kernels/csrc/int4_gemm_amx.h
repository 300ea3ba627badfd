// The int4 / 8-bit-code GEMMs of int4_gemm.cpp on AMX tiles, for CPUs with AMX-BF16 (Sapphire Rapids and
// later). Included by int4_gemm.cpp; compiled only where -march=native enables AMX (__AMX_BF16__).
//
// Why: on such a CPU vdpbf16ps reaches ~62 GFLOP/s a core, so at 8-16 rows the AVX512-BF16 kernel is bound by
// its dot products (16 vdpbf16ps per 32 x 16 weights at 16 rows), while one tdpbf16ps multiplies a 16-row
// tile by 32 x 16 weights. The arithmetic is the AVX-512 kernel's, exactly: a group's codes become the bf16
// values 128 + q (int4: one OR; 8-bit: a conversion), the tile's fp32 dot over the group's 32 k is read out
// and scaled once per group, s * dot + zb * sx. So both kernels give the same result up to fp32 summation order.
//
// The packed layouts are already AMX's: a B tile of bf16 holds, in row r, the pair (k0 + 2r, k0 + 2r + 1) of
// each of 16 columns (VNNI order), and one 32-byte int4 quad of the packed layout widens to the pair rows
// 2j (low nibbles) and 2j + 1 (high nibbles); one 32-byte u8 pair chunk widens to one pair row.
//
// Tiles: 0 and 1 the fp32 dots of two groups in flight (rows x 16 columns), 2 and 3 the activations
// (rows x 32 k), 4 and 5 the weights (16 pair rows x 16 columns). Accumulators stay in registers (one per
// row); each thread owns whole 16-column blocks.

#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <utility>

#define RADIXRT_INT4_AMX 1

namespace amx {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;

// Linux hands out AMX's 8 KB tile state only on request (once per process). Returns whether it did.
inline bool request_tiles() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// GCC's tile intrinsics are volatile asm without a memory clobber: it does not know that a tile load reads the
// widened weights or that a tile store writes the dots, so a barrier orders the plain loads and stores.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

inline void configure(int rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {  // dots and activations: `rows` rows of 64 bytes
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {  // weights: 16 pair rows of 16 columns
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 32 k of int4 codes (8 quads of 32 bytes) -> the 16 pair rows of a B tile, values 128 + q.
inline void widen_int4(const uint8_t* src, uint16_t* dst) {
  const __m512i low_mask = _mm512_set1_epi16(0x000F);
  const __m512i bias = _mm512_set1_epi16(0x4300);
  for (int j = 0; j < 8; ++j) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * j)));
    _mm512_store_si512(dst + 64 * j, _mm512_or_si512(_mm512_and_si512(w, low_mask), bias));
    _mm512_store_si512(dst + 64 * j + 32, _mm512_or_si512(_mm512_srli_epi16(w, 4), bias));
  }
}

// 32 k of 8-bit codes (16 pair chunks of 32 bytes) -> the 16 pair rows of a B tile, values u.
inline void widen_u8(const uint8_t* src, uint16_t* dst) {
  for (int j = 0; j < 16; ++j) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * j))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * j + 16))));
    _mm512_store_si512(dst + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Scale and zero of one group for the 16 columns of a block, in fp32: (s, zb = z - 136 s).
inline void group_scale(const uint16_t* line, __m512& s, __m512& zb) {
  s = bf16x16_to_f32(line);
  zb = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, bf16x16_to_f32(line + 16));
}
inline void group_scale(const float* line, __m512& s, __m512& zb) {
  s = _mm512_loadu_ps(line);
  zb = _mm512_loadu_ps(line + 16);
}

// One group's dot for rows [0, MB) into tile C, over `steps` 32-k steps starting at k0, weights widened into
// `wbuf` (1 KB per step; the B tile is loaded from there). The tile intrinsics take literal tile numbers, so
// the two variants (tiles 0, 2, 4 and 1, 3, 5) are spelled out by a macro.
#define RADIXRT_AMX_GROUP_DOT(NAME, C, A, B)                                                                \
  template <bool U8>                                                                                      \
  inline void NAME(const uint16_t* x, int64_t ldx, int64_t k0, int64_t steps, const uint8_t* codes,       \
                   uint16_t* wbuf) {                                                                      \
    _tile_zero(C);                                                                                        \
    for (int64_t t = 0; t < steps; ++t) {                                                                 \
      const int64_t k = k0 + 32 * t;                                                                      \
      _tile_loadd(A, x + k, ldx * 2);                                                                     \
      if constexpr (U8) {                                                                                 \
        widen_u8(codes + (k / 2) * 32, wbuf);                                                             \
      } else {                                                                                            \
        widen_int4(codes + (k / 4) * 32, wbuf);                                                           \
      }                                                                                                   \
      memory_barrier();                                                                                   \
      _tile_loadd(B, wbuf, 64);                                                                           \
      _tile_dpbf16ps(C, A, B);                                                                            \
    }                                                                                                     \
  }
RADIXRT_AMX_GROUP_DOT(group_dot0, 0, 2, 4)
RADIXRT_AMX_GROUP_DOT(group_dot1, 1, 3, 5)
#undef RADIXRT_AMX_GROUP_DOT

template <int MB>
inline void add_scaled(__m512 (&acc)[MB], const float* part, const float* sx, int64_t groups, int64_t g,
                       __m512 s, __m512 zb) {
  for (int i = 0; i < MB; ++i) {
    acc[i] = _mm512_fmadd_ps(_mm512_load_ps(part + 16 * i), s, acc[i]);
    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(sx[i * groups + g]), zb, acc[i]);
  }
}

// Rows [0, MB) of x against one 16-column block over `planes` planes; writes the bf16 result rows.
template <int MB, bool U8, typename SzT>
void block(const uint16_t* x, int64_t ldx, const float* sx, int64_t groups, int64_t group_size,
           const uint8_t* codes, int64_t plane_code_stride, const SzT* sz, int64_t plane_sz_stride, int64_t planes,
           uint16_t* out, int64_t ldo) {
  alignas(64) uint16_t wbuf[2][16 * 32];
  alignas(64) float part[2][16 * 16];
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t steps = group_size / 32;
  for (int64_t p = 0; p < planes; ++p) {
    const uint8_t* cp = codes + p * plane_code_stride;
    const SzT* szp = sz + p * plane_sz_stride;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {  // two groups in flight on tiles 0 and 1
      group_dot0<U8>(x, ldx, g * group_size, steps, cp, wbuf[0]);
      group_dot1<U8>(x, ldx, (g + 1) * group_size, steps, cp, wbuf[1]);
      _tile_stored(0, part[0], 64);
      _tile_stored(1, part[1], 64);
      memory_barrier();
      __m512 s, zb;
      group_scale(szp + g * 32, s, zb);
      add_scaled<MB>(acc, part[0], sx, groups, g, s, zb);
      group_scale(szp + (g + 1) * 32, s, zb);
      add_scaled<MB>(acc, part[1], sx, groups, g + 1, s, zb);
    }
    if (g < groups) {
      group_dot0<U8>(x, ldx, g * group_size, steps, cp, wbuf[0]);
      _tile_stored(0, part[0], 64);
      memory_barrier();
      __m512 s, zb;
      group_scale(szp + g * 32, s, zb);
      add_scaled<MB>(acc, part[0], sx, groups, g, s, zb);
    }
  }
  for (int i = 0; i < MB; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo), (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

template <bool U8, typename SzT>
using AmxBlockFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, int64_t, const uint8_t*, int64_t,
                            const SzT*, int64_t, int64_t, uint16_t*, int64_t);

template <bool U8, typename SzT, size_t... I>
constexpr std::array<AmxBlockFn<U8, SzT>, sizeof...(I)> block_table(std::index_sequence<I...>) {
  return {&block<static_cast<int>(I) + 1, U8, SzT>...};
}

// The block kernel for a pass of `rows` (1-16) rows.
template <bool U8, typename SzT>
AmxBlockFn<U8, SzT> block_for(int rows) {
  static constexpr auto table = block_table<U8, SzT>(std::make_index_sequence<16>{});
  return table[std::min(rows, 16) - 1];
}

// y = x @ W.T on tiles: `code_block_stride` / `sz_block_stride` the bytes / values of one 16-column block of
// one plane (planes follow each other as blocks of the same plane). Threads split the column blocks.
template <bool U8, typename SzT>
void gemm(const uint16_t* xp, int64_t m, int64_t k, int64_t group_size, const uint8_t* cp,
          int64_t code_block_stride, const SzT* szp, int64_t sz_block_stride, int64_t planes, int64_t nblocks,
          uint16_t* op) {
  const int64_t groups = k / group_size;
  const int64_t n = nblocks * 16;
  const std::vector<float> sx = group_sums(xp, m, k, group_size);
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), nblocks));
#pragma omp parallel num_threads(nthreads)
  {
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m - r0));
        if (rows != configured) {
          configure(rows);
          configured = rows;
        }
        block_for<U8, SzT>(rows)(xp + r0 * k, k, sx.data() + r0 * groups, groups, group_size,
                                 cp + b * code_block_stride, nblocks * code_block_stride, szp + b * sz_block_stride,
                                 nblocks * sz_block_stride, planes, op + r0 * n + b * 16, n);
      }
    }
    if (configured) _tile_release();
  }
}

}  // namespace amx

#endif
