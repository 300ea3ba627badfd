// Weight-only int4 / 8-bit-code GEMM for small batches of float32 activations on AVX2 + FMA: the float32
// sibling of int4_gemm.cpp (which needs AVX512-BF16 and bf16 activations), for CPUs without native bf16 and
// for float32 models. y[M, N] = x[M, K] (fp32) @ W.T, output fp32.
//
// Registered as the torch operators radixrt_int4_f32::mm and ::mm_u8 (radixrt/kernels/int4_gemm.py builds and
// loads them), so compiled decode graphs call them without Python. Why: torch's _weight_int4pack_mm_for_cpu
// runs a scalar loop for float32 activations, so a float32 model has had to multiply by dense fp32 weights,
// reading 4 bytes a weight per decode step where the GGUF file's blocks hold ~0.6.
//
// Arithmetic, per group of G input columns with scale s and zb = zero - bias * s (formed in fp32 at pack
// time; bias 8 for int4 codes, 136 for 8-bit codes):
//     sum_k x[k] * ((q[k] - bias) * s + zero) = s * dot(x, q) + zb * sum(x),
// every code widened exactly to fp32 (vcvtdq2ps) and multiplied with fp32 FMAs; the group's scale applied once
// to its partial sum. The result equals an fp32 matmul by the dequantized weight up to rounding order (tested
// against a float64 oracle).
//
// Layouts: the codes as int4_gemm.cpp packs them. int4 (per plane p, 16-column block b, input quad j): 32
// bytes, byte 2 c + t holds column 16 b + c, its low nibble the code at k = 4 j + t, its high nibble the code
// at k = 4 j + 2 + t; read as 16 lanes of 16 bits, lane c is (byte 2 c) | (byte 2 c + 1) << 8, so the codes of
// k = 4 j + {0, 1, 2, 3} are that lane shifted right by {0, 8, 4, 12} and masked to 4 bits. 8-bit codes (block
// b, input pair j): 32 bytes, byte 2 c + t the code of column 16 b + c at k = 2 j + t: shifts {0, 8}, mask
// 8 bits. Scales for both: float32 [P, N / 16, K / G, 2, 16] (the block's 16 scales, then its 16 zb).

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxRows = 4;  // rows of x per pass: MB * CB * 2 accumulators stay at 8 of the 16 registers
constexpr int kMaxBlocks = 4;

// Codes per 32-byte chunk: 4 input columns for int4 (shifts 0, 8, 4, 12; mask 15), 2 for 8-bit (0, 8; 255).
struct Int4Codes {
  static constexpr int kPerChunk = 4;
  static constexpr int kShift[4] = {0, 8, 4, 12};
  static constexpr int kMask = 15;
};
struct U8Codes {
  static constexpr int kPerChunk = 2;
  static constexpr int kShift[4] = {0, 8, 0, 0};
  static constexpr int kMask = 255;
};

inline __m256 codes_at(__m256i lanes, int shift, __m256i mask) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(lanes, _mm256_set1_epi32(shift)), mask));
}

// Rows [0, MB) of x (row stride ldx) against CB consecutive 16-column blocks, accumulating into the fp32 tile
// acc[MB][CB * 16] (zeroed by the caller). Each (row, block half) has its own partial-sum register per group,
// MB * CB * 2 = 8 independent FMA chains.
template <typename C, int MB, int CB>
void block_kernel(const float* x, int64_t ldx, const float* sx, int64_t groups, const uint8_t* codes,
                  int64_t block_code_stride, const float* sz, int64_t block_sz_stride, int64_t group_size,
                  float* acc) {
  const __m256i mask = _mm256_set1_epi32(C::kMask);
  const int64_t chunks = group_size / C::kPerChunk;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[MB][CB][2];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < CB; ++c) part[i][c][0] = part[i][c][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < chunks; ++j) {
      const int64_t k = g * group_size + j * C::kPerChunk;
      for (int c = 0; c < CB; ++c) {
        const uint8_t* src = codes + c * block_code_stride + (g * chunks + j) * 32;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(w));       // columns 0-7
        const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1));  // columns 8-15
        for (int t = 0; t < C::kPerChunk; ++t) {
          const __m256 q0 = codes_at(lo, C::kShift[t], mask);
          const __m256 q1 = codes_at(hi, C::kShift[t], mask);
          for (int i = 0; i < MB; ++i) {
            const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k + t);
            part[i][c][0] = _mm256_fmadd_ps(q0, xb, part[i][c][0]);
            part[i][c][1] = _mm256_fmadd_ps(q1, xb, part[i][c][1]);
          }
        }
      }
    }
    for (int c = 0; c < CB; ++c) {
      const float* line = sz + c * block_sz_stride + g * 32;
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_loadu_ps(line + 8 * h);
        const __m256 zb = _mm256_loadu_ps(line + 16 + 8 * h);
        for (int i = 0; i < MB; ++i) {
          float* dst = acc + i * CB * 16 + c * 16 + 8 * h;
          const __m256 a = _mm256_fmadd_ps(part[i][c][h], s, _mm256_loadu_ps(dst));
          _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_set1_ps(sx[i * groups + g]), zb, a));
        }
      }
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, const float*,
                         int64_t, int64_t, float*);

constexpr int blocks_for_rows(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

// The kernel for `rows` rows and `cb` blocks a pass (cb <= blocks_for_rows(rows); 1 for a short last pass).
template <typename C>
BlockFn kernel_for(int rows, int cb) {
  switch (rows) {
    case 1: return cb == 4 ? block_kernel<C, 1, 4> : cb == 2 ? block_kernel<C, 1, 2> : block_kernel<C, 1, 1>;
    case 2: return cb == 2 ? block_kernel<C, 2, 2> : block_kernel<C, 2, 1>;
    case 3: return block_kernel<C, 3, 1>;
    default: return block_kernel<C, 4, 1>;
  }
}

// Blocks a pass for m rows over nblocks column blocks on nthreads threads: the widest kernel for the rows, or
// half as wide (never under 4 accumulator chains) where that gives the busiest thread fewer blocks. Batch-1
// decode of the embedded model: 36 blocks at 4 a pass are 9 items, 5 against 4 on two threads; at 2, 9 and 9.
int balanced_blocks(int64_t m, int64_t nblocks, int nthreads) {
  const int widest = blocks_for_rows(static_cast<int>(std::min<int64_t>(kMaxRows, m)));
  const auto busiest = [&](int cb) {
    const int64_t items = (nblocks + cb - 1) / cb;
    return (items + nthreads - 1) / nthreads * cb;
  };
  const int narrower = widest / 2;
  const bool enough_chains = std::min<int64_t>(kMaxRows, m) * narrower >= 2;
  return narrower >= 1 && enough_chains && busiest(narrower) < busiest(widest) ? narrower : widest;
}

// sx[r, g]: each row's sum over each group (the zb term).
std::vector<float> group_sums(const float* xp, int64_t m, int64_t k, int64_t group_size) {
  const int64_t groups = k / group_size;
  std::vector<float> sx(static_cast<size_t>(m * groups));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = xp + r * k + g * group_size;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t t = 0; t < group_size; t += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xg + t));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      float s = 0.f;
      for (float v : lanes) s += v;
      sx[r * groups + g] = s;
    }
  }
  return sx;
}

// y = x @ W.T over `planes` planes of `nblocks` 16-column blocks; threads split the column blocks, each
// (row pass, block pass) sums every plane into an fp32 tile written once to y.
template <typename C>
void run_gemm(const float* xp, int64_t m, int64_t k, int64_t group_size, const uint8_t* cp, int64_t block_code_stride,
              const float* szp, int64_t block_sz_stride, int64_t planes, int64_t nblocks, float* op) {
  const int64_t groups = k / group_size;
  const int64_t n = nblocks * 16;
  const std::vector<float> sx = group_sums(xp, m, k, group_size);
  const int cb = balanced_blocks(m, nblocks, std::max(1, at::get_num_threads()));
  const int64_t supers = (nblocks + cb - 1) / cb;
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), supers));

#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t sb = 0; sb < supers; ++sb) {
    alignas(32) float tile[kMaxRows * kMaxBlocks * 16];
    const int64_t b0 = sb * cb;
    const int blocks = static_cast<int>(std::min<int64_t>(cb, nblocks - b0));
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      // A short last pass of rows or of blocks runs block by block.
      const bool wide = blocks == cb && cb <= blocks_for_rows(rows) && cb > 1;
      const int pass_cb = wide ? cb : 1;
      const BlockFn fn = kernel_for<C>(rows, pass_cb);
      for (int64_t bb = b0; bb < b0 + blocks; bb += pass_cb) {
        std::memset(tile, 0, sizeof(float) * rows * pass_cb * 16);
        for (int64_t p = 0; p < planes; ++p) {
          const int64_t code_off = (p * nblocks + bb) * block_code_stride;
          const int64_t sz_off = (p * nblocks + bb) * block_sz_stride;
          fn(xp + r0 * k, k, sx.data() + r0 * groups, groups, cp + code_off, block_code_stride, szp + sz_off,
             block_sz_stride, group_size, tile);
        }
        for (int i = 0; i < rows; ++i)
          std::memcpy(op + (r0 + i) * n + bb * 16, tile + i * pass_cb * 16, sizeof(float) * pass_cb * 16);
      }
    }
  }
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous 2-D float32 tensor");
}

int64_t checked_groups(int64_t k, int64_t group_size, const char* op) {
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && k % group_size == 0, op,
              ": group_size must be a multiple of 16 dividing K");
  return k / group_size;
}

// The arguments of the int4-code operators (mm, mm_q8) checked; the groups along K.
int64_t check_int4_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t group_size,
                        const char* op) {
  check_x(x, op);
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(3) == 32,
              op, ": codes must be contiguous uint8 [P, N/16, K/4, 32]");
  TORCH_CHECK(sz.dim() == 5 && sz.scalar_type() == at::kFloat && sz.is_contiguous() && sz.size(3) == 2 &&
                  sz.size(4) == 16,
              op, ": sz must be contiguous float32 [P, N/16, K/G, 2, 16]");
  const int64_t groups = checked_groups(x.size(1), group_size, op);
  TORCH_CHECK(codes.size(2) * 4 == x.size(1) && sz.size(0) == codes.size(0) && sz.size(1) == codes.size(1) &&
                  sz.size(2) == groups,
              op, ": codes / scales do not match x's K and the group size");
  return groups;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t group_size) {
  const int64_t groups = check_int4_args(x, codes, sz, group_size, "radixrt_int4_f32::mm");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t planes = codes.size(0), nblocks = codes.size(1);
  at::Tensor out = at::empty({m, nblocks * 16}, x.options());
  if (m == 0 || nblocks == 0) return out;
  run_gemm<Int4Codes>(x.data_ptr<float>(), m, k, group_size, codes.data_ptr<uint8_t>(), (k / 4) * 32,
                      sz.data_ptr<float>(), groups * 32, planes, nblocks, out.data_ptr<float>());
  return out;
}

at::Tensor u8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t group_size) {
  check_x(x, "radixrt_int4_f32::mm_u8");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 32,
              "radixrt_int4_f32::mm_u8: codes must be contiguous uint8 [N/16, K/2, 32]");
  TORCH_CHECK(sz.dim() == 4 && sz.scalar_type() == at::kFloat && sz.is_contiguous() && sz.size(2) == 2 &&
                  sz.size(3) == 16,
              "radixrt_int4_f32::mm_u8: sz must be contiguous float32 [N/16, K/G, 2, 16]");
  const int64_t m = x.size(0), k = x.size(1), nblocks = codes.size(0);
  const int64_t groups = checked_groups(k, group_size, "radixrt_int4_f32::mm_u8");
  TORCH_CHECK(codes.size(1) * 2 == k && sz.size(0) == nblocks && sz.size(1) == groups,
              "radixrt_int4_f32::mm_u8: codes / scales do not match x's K and the group size");
  at::Tensor out = at::empty({m, nblocks * 16}, x.options());
  if (m == 0 || nblocks == 0) return out;
  run_gemm<U8Codes>(x.data_ptr<float>(), m, k, group_size, codes.data_ptr<uint8_t>(), (k / 2) * 32,
                    sz.data_ptr<float>(), groups * 32, 1, nblocks, out.data_ptr<float>());
  return out;
}


// ---- int4 codes x int8 activations (radixrt_int4_f32::mm_q8) ----
//
// Each row's activations are rounded per group of G columns to int8, as llama.cpp's Q8 blocks and OpenVINO's
// dynamic quantization do: d = max|x| / 127, xq = round(x * (127 / max|x|)) (0 where the group is all zero).
// Then per group and column
//     sum_k x[k] w[k] ~= s * d * dot(xq, q) + zb * sum(x),
// the integer dot on vpmaddubsw (u8 codes x s8 activations -> pairs summed in int16), the zero term on the
// exact float sums. Why: widening each 4-bit code to fp32 costs ~0.6 instructions a multiply-add, which bounds
// the float32 kernel's batch-1 step well below the memory bandwidth on AVX2 (8.1 ms of a 20 ms step of the
// embedded model at 2 threads, against llama.cpp's 11.5 ms per token); here 32 bytes of codes (64 products)
// take ~8 instructions. Not exact: the activations' rounding adds up to d / 2 per element, as in llama.cpp.
// Bounds: a code is <= 15 and |xq| <= 127, so one vpmaddubsw lane is <= 3810 and four 32-byte chunks sum to
// <= 30480 in int16 before they are widened.

struct Q8Rows {
  std::vector<int8_t> q;   // [m, k]
  std::vector<float> d;    // [m, groups]: the dequantization scale of each row's group
};

Q8Rows quantize_rows(const float* xp, int64_t m, int64_t k, int64_t group_size) {
  const int64_t groups = k / group_size;
  Q8Rows r{std::vector<int8_t>(static_cast<size_t>(m * k)), std::vector<float>(static_cast<size_t>(m * groups))};
  for (int64_t i = 0; i < m * groups; ++i) {
    const float* xg = xp + i * group_size;
    float amax = 0.f;
    for (int64_t t = 0; t < group_size; ++t) amax = std::max(amax, std::fabs(xg[t]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    r.d[i] = amax / 127.f;
    for (int64_t t = 0; t < group_size; ++t)
      r.q[i * group_size + t] = static_cast<int8_t>(std::nearbyint(xg[t] * inv));  // ties to even
  }
  return r;
}

// One row against one 16-column block of one plane, adding into acc[16].
void q8_block(const int8_t* xq, const float* d, const float* sx, int64_t groups, int64_t group_size,
              const uint8_t* codes, const float* sz, float* acc) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const int64_t chunks = group_size / 4;
  __m256 out0 = _mm256_loadu_ps(acc), out1 = _mm256_loadu_ps(acc + 8);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i s32a = _mm256_setzero_si256(), s32b = _mm256_setzero_si256();
    const int8_t* xg = xq + g * group_size;
    const uint8_t* cg = codes + g * chunks * 32;
    for (int64_t j0 = 0; j0 < chunks; j0 += 4) {
      __m256i s16 = _mm256_setzero_si256();
      for (int64_t j = j0; j < j0 + 4; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + j * 32));
        int16_t pa, pb;  // the activation pairs (k = 4j, 4j+1) and (4j+2, 4j+3)
        std::memcpy(&pa, xg + 4 * j, 2);
        std::memcpy(&pb, xg + 4 * j + 2, 2);
        const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, _mm256_set1_epi16(pa)));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, _mm256_set1_epi16(pb)));
      }
      s32a = _mm256_add_epi32(s32a, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16)));       // columns 0-7
      s32b = _mm256_add_epi32(s32b, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16, 1)));  // columns 8-15
    }
    const float* line = sz + g * 32;
    const __m256 dg = _mm256_set1_ps(d[g]), sg = _mm256_set1_ps(sx[g]);
    out0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32a), _mm256_mul_ps(_mm256_loadu_ps(line), dg), out0);
    out1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32b), _mm256_mul_ps(_mm256_loadu_ps(line + 8), dg), out1);
    out0 = _mm256_fmadd_ps(_mm256_loadu_ps(line + 16), sg, out0);
    out1 = _mm256_fmadd_ps(_mm256_loadu_ps(line + 24), sg, out1);
  }
  _mm256_storeu_ps(acc, out0);
  _mm256_storeu_ps(acc + 8, out1);
}

at::Tensor int4_mm_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t group_size) {
  const int64_t groups = check_int4_args(x, codes, sz, group_size, "radixrt_int4_f32::mm_q8");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t planes = codes.size(0), nblocks = codes.size(1);
  at::Tensor out = at::empty({m, nblocks * 16}, x.options());
  if (m == 0 || nblocks == 0) return out;
  const float* xp = x.data_ptr<float>();
  const Q8Rows xq = quantize_rows(xp, m, k, group_size);
  const std::vector<float> sx = group_sums(xp, m, k, group_size);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* szp = sz.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t code_stride = (k / 4) * 32, sz_stride = groups * 32;
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), nblocks));

#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t r = 0; r < m; ++r) {
      alignas(32) float acc[16] = {0.f};
      for (int64_t p = 0; p < planes; ++p)
        q8_block(xq.q.data() + r * k, xq.d.data() + r * groups, sx.data() + r * groups, groups, group_size,
                 cp + (p * nblocks + b) * code_stride, szp + (p * nblocks + b) * sz_stride, acc);
      std::memcpy(op + r * nblocks * 16 + b * 16, acc, sizeof acc);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(radixrt_int4_f32, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor sz, int group_size) -> Tensor");
  m.def("mm_u8(Tensor x, Tensor codes, Tensor sz, int group_size) -> Tensor");
  m.def("mm_q8(Tensor x, Tensor codes, Tensor sz, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixrt_int4_f32, CPU, m) {
  m.impl("mm", &int4_mm);
  m.impl("mm_u8", &u8_mm);
  m.impl("mm_q8", &int4_mm_q8);
}
