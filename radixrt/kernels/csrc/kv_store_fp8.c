/* Storing new K/V rows into a float8 e4m3fn pool: ((x - k_offset) / k_scale) for keys, x / v_scale for values,
 * saturated at +-448 and rounded to nearest-even, written to their slots. Bit for bit what the pool's torch
 * path stores (radixrt/kernels/fp8.py quantize_fp8: the same float32 operations, torch's rounding), in one
 * call per layer instead of a dozen small tensor operations. Built into the attention library with
 * paged_decode.c (radixrt/kernels/cpu_decode.py); plain C, no libm.
 *
 *   k, v        [T, row] bf16 (src_bf16) or f32, row i of k at k + i * k_stride elements (same for v)
 *   k_scale, k_offset [row] f32 (row = KVH * D, per channel); v_scale [KVH] f32
 *   k_buf/v_buf [num_slots, row] e4m3 codes; slots [T] int64
 * Returns 0, or 2 if a slot is out of [0, num_slots) (that row is skipped).
 */
#include <stdint.h>
#include <string.h>

/* x (finite, |x| <= 448) to the nearest e4m3fn code, ties to even. */
static inline uint8_t e4m3_code(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, sizeof a);
    if (a < 0x1p-6f) {
        /* below the smallest normal: multiples of 2^-9 (code m is m * 2^-9; m = 8 is the smallest normal).
         * Adding and subtracting 2^23 rounds to an integer, to nearest-even. */
        const float m = (a * 512.0f + 0x1p23f) - 0x1p23f;
        return (uint8_t)(sign | (uint8_t)m);
    }
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the mantissa to 3 bits, to nearest-even */
    u -= (uint32_t)(127 - 7) << 23;   /* rebias the exponent: fp32's 127 to e4m3's 7 */
    return (uint8_t)(sign | (uint8_t)(u >> 20));
}

static inline float load_elem(const void* base, int64_t i, int bf16) {
    if (!bf16) return ((const float*)base)[i];
    const uint32_t u = (uint32_t)((const uint16_t*)base)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float saturate(float y) { return y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y); }

int store_kv_e4m3(const void* k, int64_t k_stride, const void* v, int64_t v_stride, int src_bf16, int64_t T,
                  int64_t KVH, int64_t D, const float* k_scale, const float* k_offset, const float* v_scale,
                  uint8_t* k_buf, uint8_t* v_buf, const int64_t* slots, int64_t num_slots) {
    const int64_t row = KVH * D;
    int err = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if ((uint64_t)slot >= (uint64_t)num_slots) {
            err = 2;
            continue;
        }
        uint8_t* kd = k_buf + slot * row;
        uint8_t* vd = v_buf + slot * row;
        for (int64_t i = 0; i < row; i++) {
            const float kx = load_elem(k, t * k_stride + i, src_bf16) - k_offset[i];
            kd[i] = e4m3_code(saturate(kx / k_scale[i]));
            vd[i] = e4m3_code(saturate(load_elem(v, t * v_stride + i, src_bf16) / v_scale[i / D]));
        }
    }
    return err;
}
