/* Shared by the paged attention kernels (paged_decode.c, paged_extend.c): GNU C vector types, the 2^x
 * polynomial, lane reductions, bf16 rounding and per-thread scratch buffers. Each kernel file includes it
 * (each gets its own copy of the static helpers and buffers). */
#ifndef RADIXRT_PAGED_SIMD_H
#define RADIXRT_PAGED_SIMD_H

#include <math.h> /* INFINITY */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* bf16 dot products with the AVX512-BF16 instruction (products exact, fp32 accumulation), unless the
 * target lacks it or PAGED_PORTABLE is defined; everything else is portable GNU C. */
#if defined(__AVX512BF16__) && !defined(PAGED_PORTABLE)
#include <immintrin.h>
#define USE_DPBF16 1
#else
#define USE_DPBF16 0
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bf16 even/odd split assumes a little-endian target"
#endif

/* Floats per vector: 16 (one AVX-512 register) where the target has AVX-512, else 8 (one AVX2 register). A
 * file may define VL before including this header (paged_extend.h: 16, its register blocking's width).
 * Why 8 on AVX2: GCC has no machine mode for a 64-byte vector there, so 16-float vectors lived on the stack
 * and the decode kernel ran ~10x below the AVX2 machine's speed (and took 2 minutes to compile). */
#ifndef VL
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#endif
#define LOG2E 1.4426950408889634f

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* K/V element kinds the kernels read (the query and output are f32 or bf16): */
#define KV_F32 0
#define KV_BF16 1
#define KV_E4M3 2 /* float8_e4m3fn */
#define KV_E5M2 3 /* float8_e5m2 */

static inline int64_t kv_elem(int kt) { return kt == KV_F32 ? 4 : kt == KV_BF16 ? 2 : 1; }

typedef uint8_t vb8 __attribute__((vector_size(VL)));

/* 16 float8 codes (kt KV_E4M3 or KV_E5M2) widened to fp32 exactly, without touching fp32 subnormals (so
 * no denormal assists, and DAZ cannot change the result): the magnitude bits go under a rebiased fp32
 * exponent, which is exact for normal codes; a subnormal code m (exponent field 0) first reads as
 * 2^(1-bias) / 2 + m * ulp, and 2x - 2^(1-bias) of that is its value m * ulp. The NaN codes (never stored:
 * the pool saturates at the largest finite value) read as finite numbers. */
static inline vf fp8_to_f32(vb8 x, const int kt) {
    const int M = kt == KV_E4M3 ? 3 : 2;
    const uint32_t rebias = kt == KV_E4M3 ? (127 - 7) : (127 - 15);
    const float min_normal = kt == KV_E4M3 ? 0x1p-6f : 0x1p-14f;
    const vu u = __builtin_convertvector(x, vu);
    const vu mag = u & 0x7fu;
    const vf y = (vf)((mag << (23 - M)) + (rebias << 23));
    const vi sub = (vi)(mag < (1u << M));
    const vf z = y + (vf)((vi)(y - min_normal) & sub);
    return (vf)((vu)z | ((u & 0x80u) << 24));
}

/* 32 float8 codes at src (all readable) widened to fp32 exactly: lo = codes [0, 16), hi = [16, 32). With
 * AVX512-BW (unless PAGED_PORTABLE) the codes become float16 bit patterns (e5m2 is the top byte of a
 * float16; e4m3's magnitude bits under the float16 exponent give the value / 256, subnormals included) and
 * the hardware conversion widens them (it ignores DAZ); otherwise fp8_to_f32. */
#if defined(__AVX512BW__) && !defined(PAGED_PORTABLE)
#include <immintrin.h>
static inline __attribute__((always_inline)) void fp8x32_to_f32(const char* src, const int kt, vf* lo, vf* hi) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)src));
    if (kt == KV_E5M2) {
        w = _mm512_slli_epi16(w, 8);
    } else {
        const __m512i mag = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7f)), 7);
        w = _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
    }
    *lo = (vf)_mm512_cvtph_ps(_mm512_castsi512_si256(w));
    *hi = (vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
    if (kt == KV_E4M3) {
        *lo *= 256.0f;
        *hi *= 256.0f;
    }
}
#else
static inline __attribute__((always_inline)) void fp8x32_to_f32(const char* src, const int kt, vf* lo, vf* hi) {
    vb8 a, b;
    memcpy(&a, src, sizeof a);
    memcpy(&b, src + VL, sizeof b);
    *lo = fp8_to_f32(a, kt);
    *hi = fp8_to_f32(b, kt);
}
#endif

/* 2^x for x <= 0 (including -inf, which gives 0), vectorizable: x = n + f with n the nearest integer
 * (the 1.5 * 2^23 rounding trick) and f in [-0.5, 0.5], 2^f by a degree-6 polynomial (Cephes exp2f,
 * relative error ~2e-7), 2^n through the exponent bits. */
static inline float exp2_nonpos(float x) {
    const int tiny = x < -126.0f;
    x = tiny ? -126.0f : x;
    const float n = (x + 12582912.0f) - 12582912.0f;
    const float f = x - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return tiny ? 0.0f : p * two_n;
}

/* The vector version of exp2_nonpos. */
static inline vf exp2v(vf x) {
    const vi tiny = x < -126.0f;
    x = (vf)(((vi)x & ~tiny) | ((vi)((vf){0} - 126.0f) & tiny));
    const vf n = (x + 12582912.0f) - 12582912.0f;
    const vf f = x - n;
    vf p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~tiny);
}

static inline vf vmax(vf a, vf b) {
    const vi m = a > b;
    return (vf)(((vi)a & m) | ((vi)b & ~m));
}

/* The max / the sum of the lanes of x. */
#if VL == 16
static const vi HPERM[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                            {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                            {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                            {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#define HROUNDS 4
#else
static const vi HPERM[3] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
#define HROUNDS 3
#endif

static inline float hmax(vf x) {
    for (int r = 0; r < HROUNDS; r++) x = vmax(x, __builtin_shuffle(x, HPERM[r]));
    return x[0];
}

static inline float hadd(vf x) {
    for (int r = 0; r < HROUNDS; r++) x += __builtin_shuffle(x, HPERM[r]);
    return x[0];
}

/* Round float lanes to bf16 (nearest-even, NaN kept quiet); the result is in the high 16 bits. */
static inline vu round_bf16_high(vf x) {
    const vu u = (vu)x;
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    return (rounded & ~nan) | ((u | 0x00400000u) & 0xffff0000u & nan);
}

/* A 64-byte aligned buffer of at least `bytes`, owned by the calling thread and reused across calls
 * (kind 0: the per-thread scratch, kind 1: the caller's bookkeeping); NULL when out of memory. Reusing
 * it keeps malloc/free (and the heap trimming they trigger) out of every call. Never freed: a few KB
 * per thread that ever ran the kernel. */
static void* thread_buffer(int kind, size_t bytes) {
    static __thread void* buf[2];
    static __thread size_t cap[2];
    if (cap[kind] < bytes) {
        free(buf[kind]);
        cap[kind] = (size_t)round_up((int64_t)bytes + ((int64_t)bytes >> 1), 4096);
        buf[kind] = aligned_alloc(64, cap[kind]);
        if (!buf[kind]) cap[kind] = 0;
    }
    return buf[kind];
}

#endif /* RADIXRT_PAGED_SIMD_H */
