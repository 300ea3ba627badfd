// Weight-only int4 GEMM for small batches on AVX512-BF16 (and on AMX tiles where the CPU has them:
// int4_gemm_amx.h): y[M, N] = x[M, K] (bf16) @ W.T, where W is stored
// as 4-bit codes per group of G input columns with a float scale and zero per (column, group) and plane:
// W[n, k] = sum_p (q_p[n, k] - 8) * s_p[n, g] + z_p[n, g].
//
// Registered as the torch operator radixrt_int4::mm (radixrt/kernels/int4_gemm.py builds and loads it), so
// compiled decode graphs call it without Python. Why not torch's _weight_int4pack_mm_for_cpu: it widens
// every code to fp32 and multiplies in fp32 FMAs (~300 GFLOP/s on 2 cores at any batch size); here the
// codes become exact bf16 values in registers and the products run on vdpbf16ps (two multiply-adds per
// fp32 lane per instruction), with the group's scale applied once per group to an fp32 partial sum.
//
// The code -> bf16 step is one OR: the 16-bit pattern 0x4300 | q is the bf16 value 128 + q exactly, so a
// group's partial sum is dot = sum_k x[k] * (128 + q[k]) and its contribution
//     s * (dot - 136 * sx) + z * sx = s * dot + (z - 136 * s) * sx,   sx = sum_k x[k]  (fp32),
// with zb = z - 136 * s formed in fp32 per group. Every product is exact in fp32 (8-bit by 8-bit significands);
// the result differs from an fp32 matmul by the dequantized weight only in rounding order (tested).
//
// Packed layout (radixrt/kernels/int4_gemm.py: pack): for plane p, column block b (16 columns) and input
// quad j (4 consecutive k), 32 bytes; byte w = 2 * c + t holds column 16 b + c: its low nibble the code at
// k = 4 j + t, its high nibble the code at k = 4 j + 2 + t. One vpmovzxbw of the 32 bytes gives, after an
// AND or a shift, 16 lanes of (k, k+1) bf16 pairs, the operand vdpbf16ps pairs with x[m, k:k+2].
// Scales and zeros: bf16 [P, N / 16, K / G, 2, 16] (the block's 16 scales, then its 16 zeros: one 64-byte
// line per group), the values torch's kernel dequantizes with in bf16; 0.625 bytes a weight in all.
//
// radixrt_int4::mm_u8 multiplies by 8-bit codes u in 0..255 with one scale and zero per group,
// W[n, k] = (u[n, k] - 136) * s[n, g] + z[n, g]: the two-plane weights whose high plane's scale is 16 times the
// low plane's (GGUF's Q8_0, Q5_*: u = 16 hi + lo) in one pass, so each product is one vdpbf16ps instead of two.
// u becomes an exact bf16 value by a widening, an int -> fp32 conversion and a bf16 pack (every u < 256 is
// exact in bf16). Layout: for column block b and input pair j (k = 2 j, 2 j + 1), 32 bytes, byte 2 c + t the
// code of column 16 b + c at k = 2 j + t; scales and zb = z - 136 s in fp32 [N / 16, K / G, 2, 16] (one
// 128-byte line per block and group: 1.25 bytes a weight at G = 32, as the two planes' layout), or, where
// every scale and zero is a bf16 value (what a bf16 model's linears hold), the scales and zeros in bf16 as the
// int4 layout's (one 64-byte line: 1.125 bytes a weight; decode streams the LM head from memory every step).

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Rows [0, MB) of x (row stride ldx, bf16 bits) against CB consecutive 16-column blocks, accumulating into
// the fp32 tile acc[MB][CB * 16] (zeroed by the caller). Every (row, block) pair has its own partial-sum
// register for the current group, so MB * CB independent vdpbf16ps chains hide the instruction's latency;
// the group's scale and zero are applied into the tile (in L1) once per group.
template <int MB, int CB>
inline void block_kernel(const uint16_t* x, int64_t ldx, const float* sx, int64_t groups,
                         const uint8_t* codes, int64_t block_code_stride, const uint16_t* sz,
                         int64_t block_sz_stride, int64_t group_size, float* acc) {
  const __m512i low_mask = _mm512_set1_epi16(0x000F);
  const __m512i bias = _mm512_set1_epi16(0x4300);
  const int64_t quads = group_size / 4;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[MB][CB];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < CB; ++c) part[i][c] = _mm512_setzero_ps();
    const int64_t k0 = g * group_size;
    for (int64_t j = 0; j < quads; ++j) {
      const int64_t k = k0 + 4 * j;
      for (int c = 0; c < CB; ++c) {
        const uint8_t* src = codes + c * block_code_stride + (g * quads + j) * 32;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        const __m512bh lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(w, low_mask), bias);
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), bias);
        for (int i = 0; i < MB; ++i) {
          // x[i, k:k+2] and x[i, k+2:k+4] as bf16 pairs broadcast to every lane (loads, not registers)
          int32_t lo_bits, hi_bits;
          std::memcpy(&lo_bits, x + i * ldx + k, 4);
          std::memcpy(&hi_bits, x + i * ldx + k + 2, 4);
          part[i][c] = _mm512_dpbf16_ps(part[i][c], lo, (__m512bh)_mm512_set1_epi32(lo_bits));
          part[i][c] = _mm512_dpbf16_ps(part[i][c], hi, (__m512bh)_mm512_set1_epi32(hi_bits));
        }
      }
    }
    for (int c = 0; c < CB; ++c) {
      const uint16_t* line = sz + c * block_sz_stride + g * 32;
      const __m512 s = bf16x16_to_f32(line);
      const __m512 zb = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, bf16x16_to_f32(line + 16));
      for (int i = 0; i < MB; ++i) {
        float* dst = acc + i * CB * 16 + c * 16;
        __m512 a = _mm512_fmadd_ps(part[i][c], s, _mm512_loadu_ps(dst));
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_set1_ps(sx[i * groups + g]), zb, a));
      }
    }
  }
}

// The 8-bit-code analog of block_kernel: rows [0, MB) against CB blocks of the mm_u8 layout; `sz` holds the
// fp32 scale and zb lines (SzT float) or the bf16 scale and zero lines (SzT uint16_t: zb = z - 136 s formed
// here, as block_kernel does; 136 s is exact in fp32, so zb is the fp32 layout's value bit for bit).
template <int MB, int CB, typename SzT>
inline void block_kernel_u8(const uint16_t* x, int64_t ldx, const float* sx, int64_t groups,
                            const uint8_t* codes, int64_t block_code_stride, const SzT* sz,
                            int64_t block_sz_stride, int64_t group_size, float* acc) {
  const int64_t pairs = group_size / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[MB][CB];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < CB; ++c) part[i][c] = _mm512_setzero_ps();
    const int64_t k0 = g * group_size;
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t k = k0 + 2 * j;
      for (int c = 0; c < CB; ++c) {
        const uint8_t* src = codes + c * block_code_stride + (g * pairs + j) * 32;
        // columns 0-7 (bytes 0-15) become the low 16 bf16 lanes, columns 8-15 the high ones
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
        const __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
        const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
        for (int i = 0; i < MB; ++i) {
          int32_t bits;
          std::memcpy(&bits, x + i * ldx + k, 4);
          part[i][c] = _mm512_dpbf16_ps(part[i][c], w, (__m512bh)_mm512_set1_epi32(bits));
        }
      }
    }
    for (int c = 0; c < CB; ++c) {
      const SzT* line = sz + c * block_sz_stride + g * 32;
      __m512 s, zb;
      if constexpr (std::is_same_v<SzT, float>) {
        s = _mm512_loadu_ps(line);
        zb = _mm512_loadu_ps(line + 16);
      } else {
        s = bf16x16_to_f32(line);
        zb = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, bf16x16_to_f32(line + 16));
      }
      for (int i = 0; i < MB; ++i) {
        float* dst = acc + i * CB * 16 + c * 16;
        __m512 a = _mm512_fmadd_ps(part[i][c], s, _mm512_loadu_ps(dst));
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_set1_ps(sx[i * groups + g]), zb, a));
      }
    }
  }
}

constexpr int kMaxRows = 16;  // rows of x per pass
constexpr int kMaxBlocks = 8;

template <typename SzT>
using BlockFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, const SzT*,
                         int64_t, int64_t, float*);

// Column blocks per pass of `rows` rows: enough (row, block) chains to cover vdpbf16ps latency within the 32
// vector registers (parts rows * blocks, the x pairs 2 * rows, the weight operands).
constexpr int blocks_for_rows(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }

// The kernel for a pass of `rows` rows over blocks_for_rows(rows) blocks (wide) or one block.
template <typename SzT, template <int, int> class K>
BlockFn<SzT> kernel_for(int rows, bool wide) {
  switch (rows) {
    case 1: return wide ? K<1, 8>::run : K<1, 1>::run;
    case 2: return wide ? K<2, 4>::run : K<2, 1>::run;
    case 3: return wide ? K<3, 2>::run : K<3, 1>::run;
    case 4: return wide ? K<4, 2>::run : K<4, 1>::run;
    case 5: return K<5, 1>::run;
    case 6: return K<6, 1>::run;
    case 7: return K<7, 1>::run;
    case 8: return K<8, 1>::run;
    case 9: return K<9, 1>::run;
    case 10: return K<10, 1>::run;
    case 11: return K<11, 1>::run;
    case 12: return K<12, 1>::run;
    case 13: return K<13, 1>::run;
    case 14: return K<14, 1>::run;
    case 15: return K<15, 1>::run;
    default: return K<16, 1>::run;
  }
}

template <int MB, int CB>
struct Int4Kernel {
  static constexpr auto run = block_kernel<MB, CB>;
};
template <int MB, int CB>
struct U8Kernel {
  static constexpr auto run = block_kernel_u8<MB, CB, float>;
};
template <int MB, int CB>
struct U8KernelBf16 {
  static constexpr auto run = block_kernel_u8<MB, CB, uint16_t>;
};

// sx[r, g]: each row's sum over each group, fp32 (the zero's contribution).
std::vector<float> group_sums(const uint16_t* xp, int64_t m, int64_t k, int64_t group_size) {
  const int64_t groups = k / group_size;
  std::vector<float> sx(static_cast<size_t>(m * groups));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = xp + r * k + g * group_size;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t t = 0; t < group_size; t += 16) acc = _mm512_add_ps(acc, bf16x16_to_f32(xg + t));
      sx[r * groups + g] = _mm512_reduce_add_ps(acc);
    }
  }
  return sx;
}

// y = x @ W.T over `planes` planes of `nblocks` 16-column blocks: each (row pass, block pass) accumulates every
// plane into an fp32 tile, then rounds it to bf16 once. Threads split the column blocks.
template <typename SzT, template <int, int> class K>
void run_gemm(const uint16_t* xp, int64_t m, int64_t k, int64_t group_size, const uint8_t* cp,
              int64_t block_code_stride, const SzT* szp, int64_t block_sz_stride, int64_t planes, int64_t nblocks,
              uint16_t* op) {
  const int64_t groups = k / group_size;
  const int64_t n = nblocks * 16;
  const std::vector<float> sx = group_sums(xp, m, k, group_size);
  const int rows_per_pass = static_cast<int>(std::min<int64_t>(kMaxRows, m));
  const int cb = blocks_for_rows(rows_per_pass);
  const int64_t supers = (nblocks + cb - 1) / cb;
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), supers));

#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t sb = 0; sb < supers; ++sb) {
    alignas(64) float tile[kMaxRows * kMaxBlocks * 16];
    const int64_t b0 = sb * cb;
    const int blocks = static_cast<int>(std::min<int64_t>(cb, nblocks - b0));
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      // A short last pass of rows or of blocks runs block by block.
      const bool wide = blocks == cb && blocks_for_rows(rows) == cb && cb > 1;
      const int pass_cb = wide ? cb : 1;
      const BlockFn<SzT> fn = kernel_for<SzT, K>(rows, wide);
      for (int64_t bb = b0; bb < b0 + blocks; bb += pass_cb) {
        std::memset(tile, 0, sizeof(float) * rows * pass_cb * 16);
        for (int64_t p = 0; p < planes; ++p) {
          const int64_t code_off = (p * nblocks + bb) * block_code_stride;
          const int64_t sz_off = (p * nblocks + bb) * block_sz_stride;
          fn(xp + r0 * k, k, sx.data() + r0 * groups, groups, cp + code_off, block_code_stride, szp + sz_off,
             block_sz_stride, group_size, tile);
        }
        for (int i = 0; i < rows; ++i) {
          for (int c = 0; c < pass_cb; ++c) {
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(tile + (i * pass_cb + c) * 16));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + (r0 + i) * n + (bb + c) * 16), (__m256i)v);
          }
        }
      }
    }
  }
}

}  // namespace

#include "int4_gemm_amx.h"

namespace {

// Batches of at least this many rows run on AMX tiles (where compiled in and granted; 0: never). Python sets
// it at load (radixrt/kernels/int4_gemm.py: AMX_MIN_ROWS_DEFAULT, RADIXRT_INT4_AMX_MIN_ROWS).
int64_t g_amx_min_rows = 3;

bool use_amx(int64_t m, int64_t group_size) {
#ifdef RADIXRT_INT4_AMX
  return g_amx_min_rows > 0 && m >= g_amx_min_rows && group_size % 32 == 0 && amx::request_tiles();
#else
  (void)m;
  (void)group_size;
  return false;
#endif
}

// The AMX row threshold: sets it when `rows` >= 0 (0: off) and returns the one in force; -1 where this build or
// this process cannot use AMX tiles.
int64_t amx_rows(int64_t rows) {
#ifdef RADIXRT_INT4_AMX
  if (!amx::request_tiles()) return -1;
  if (rows >= 0) g_amx_min_rows = rows;
  return g_amx_min_rows;
#else
  (void)rows;
  return -1;
#endif
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous 2-D bfloat16 tensor");
}

int64_t checked_groups(int64_t k, int64_t group_size, const char* op) {
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && k % group_size == 0, op,
              ": group_size must be a multiple of 16 dividing K");
  return k / group_size;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t group_size) {
  check_x(x, "radixrt_int4::mm");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(3) == 32,
              "radixrt_int4::mm: codes must be contiguous uint8 [P, N/16, K/4, 32]");
  TORCH_CHECK(sz.dim() == 5 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.size(3) == 2 &&
                  sz.size(4) == 16,
              "radixrt_int4::mm: sz must be contiguous bfloat16 [P, N/16, K/G, 2, 16]");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t planes = codes.size(0), nblocks = codes.size(1);
  const int64_t groups = checked_groups(k, group_size, "radixrt_int4::mm");
  TORCH_CHECK(codes.size(2) * 4 == k && sz.size(0) == planes && sz.size(1) == nblocks && sz.size(2) == groups,
              "radixrt_int4::mm: codes / scales do not match x's K and the group size");
  at::Tensor out = at::empty({m, nblocks * 16}, x.options());
  if (m == 0 || nblocks == 0) return out;
#ifdef RADIXRT_INT4_AMX
  if (use_amx(m, group_size)) {
    amx::gemm<false, uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k, group_size,
                               codes.data_ptr<uint8_t>(), (k / 4) * 32,
                               reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()), groups * 32, planes,
                               nblocks, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    return out;
  }
#endif
  run_gemm<uint16_t, Int4Kernel>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k, group_size,
                                 codes.data_ptr<uint8_t>(), (k / 4) * 32,
                                 reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()), groups * 32,
                                 planes, nblocks, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

at::Tensor u8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t group_size) {
  check_x(x, "radixrt_int4::mm_u8");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(2) == 32,
              "radixrt_int4::mm_u8: codes must be contiguous uint8 [N/16, K/2, 32]");
  const bool bf16_sz = sz.scalar_type() == at::kBFloat16;
  TORCH_CHECK(sz.dim() == 4 && (sz.scalar_type() == at::kFloat || bf16_sz) && sz.is_contiguous() &&
                  sz.size(2) == 2 && sz.size(3) == 16,
              "radixrt_int4::mm_u8: sz must be contiguous float32 (scale, zb) or bfloat16 (scale, zero) "
              "[N/16, K/G, 2, 16]");
  const int64_t m = x.size(0), k = x.size(1), nblocks = codes.size(0);
  const int64_t groups = checked_groups(k, group_size, "radixrt_int4::mm_u8");
  TORCH_CHECK(codes.size(1) * 2 == k && sz.size(0) == nblocks && sz.size(1) == groups,
              "radixrt_int4::mm_u8: codes / scales do not match x's K and the group size");
  at::Tensor out = at::empty({m, nblocks * 16}, x.options());
  if (m == 0 || nblocks == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* szh = bf16_sz ? reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()) : nullptr;
#ifdef RADIXRT_INT4_AMX
  if (use_amx(m, group_size)) {
    if (bf16_sz) {
      amx::gemm<true, uint16_t>(xp, m, k, group_size, cp, (k / 2) * 32, szh, groups * 32, 1, nblocks, op);
    } else {
      amx::gemm<true, float>(xp, m, k, group_size, cp, (k / 2) * 32, sz.data_ptr<float>(), groups * 32, 1, nblocks,
                             op);
    }
    return out;
  }
#endif
  if (bf16_sz) {
    run_gemm<uint16_t, U8KernelBf16>(xp, m, k, group_size, cp, (k / 2) * 32, szh, groups * 32, 1, nblocks, op);
  } else {
    run_gemm<float, U8Kernel>(xp, m, k, group_size, cp, (k / 2) * 32, sz.data_ptr<float>(), groups * 32, 1, nblocks,
                              op);
  }
  return out;
}

// Per-row symmetric int8 quantization of bf16 activations: xq = round(x / sx) with sx = absmax / 127 (1 for a
// zero row), in fp32, rounding half to even; one pass over x per row, rows split over threads.
std::tuple<at::Tensor, at::Tensor> quant_rows(const at::Tensor& x) {
  check_x(x, "radixrt_int4::quant_rows");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m, 1}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = sx.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = xp + r * k;
      float amax = 0.f;
      int64_t t = 0;
      __m512 vmax = _mm512_setzero_ps();
      for (; t + 16 <= k; t += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(bf16x16_to_f32(row + t)));
      amax = _mm512_reduce_max_ps(vmax);
      for (; t < k; ++t) {
        uint32_t bits = static_cast<uint32_t>(row[t]) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        amax = std::max(amax, std::fabs(v));
      }
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      sp[r] = s;
      const __m512 vs = _mm512_set1_ps(s);
      int8_t* out = qp + r * k;
      for (t = 0; t + 16 <= k; t += 16) {
        const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(bf16x16_to_f32(row + t), vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + t), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
      }
      for (; t < k; ++t) {
        uint32_t bits = static_cast<uint32_t>(row[t]) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        out[t] = static_cast<int8_t>(std::nearbyint(v / s));
      }
    }
  });
  return {xq, sx};
}

// y[m, n] (bf16) = acc[m, n] (int32) * sx[m] * ws[n], in fp32, rounded once to bf16.
at::Tensor dequant_rows(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& ws) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "radixrt_int4::dequant_rows: acc must be a contiguous 2-D int32 tensor");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == m && ws.scalar_type() == at::kFloat &&
                  ws.is_contiguous() && ws.numel() == n,
              "radixrt_int4::dequant_rows: sx must be float32 [M], ws float32 [N]");
  at::Tensor y = at::empty({m, n}, acc.options().dtype(at::kBFloat16));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sp = sx.data_ptr<float>();
  const float* wp = ws.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 s = _mm512_set1_ps(sp[r]);
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(ap + r * n + t)), s),
                                       _mm512_loadu_ps(wp + t));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + r * n + t), (__m256i)_mm512_cvtneps_pbh(v));
      }
      for (; t < n; ++t) {
        const float v = static_cast<float>(ap[r * n + t]) * sp[r] * wp[t];
        at::BFloat16 b(v);
        std::memcpy(yp + r * n + t, &b, 2);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(radixrt_int4, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor sz, int group_size) -> Tensor");
  m.def("mm_u8(Tensor x, Tensor codes, Tensor sz, int group_size) -> Tensor");
  m.def("quant_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("dequant_rows(Tensor acc, Tensor sx, Tensor ws) -> Tensor");
  m.def("amx_rows(int rows) -> int");
}

TORCH_LIBRARY_IMPL(radixrt_int4, CPU, m) {
  m.impl("mm", &int4_mm);
  m.impl("mm_u8", &u8_mm);
  m.impl("quant_rows", &quant_rows);
  m.impl("dequant_rows", &dequant_rows);
}

TORCH_LIBRARY_IMPL(radixrt_int4, CatchAll, m) { m.impl("amx_rows", &amx_rows); }
