// qdot_input.h: x [rows, K] float32 -> the int8 (or 15-bit) input the qdot kernel reads: a
// scale per block of columns, the rows of a pass laid out together. Included by qdot.h.
//
// References: llama.cpp `ggml-cpu/arch/x86/quants.c` (`quantize_row_q8_0`: x / (max|x| / 127)
// rounded to nearest).

#ifndef LLMQ_QDOT_INPUT_H
#define LLMQ_QDOT_INPUT_H

#include <stdint.h>
#include <string.h>

#include <vector>

#include "vec16.h"

namespace llmq {

constexpr int64_t QDOT_BLOCK = 32;  // columns of x sharing one int8 scale (`qdot`, `qdot16`)
constexpr int64_t QDOT_FINE_BLOCK = 16;  // ... in the `qdot_b16` form
constexpr int QDOT_ROWS = 4;  // rows of x a pass computes at once (accumulators in registers)

// Where row m's columns [k, k + 4) of x lie in QdotInput's q and lo (k a multiple of 4): rows
// in passes of QDOT_ROWS, a pass's bytes [K / 4][its rows][4], so a pass reads its rows' x at
// one pointer's offsets. NOTE: row by row, the tile kernel held a pointer a row and spilt
// them out of the registers: reloading them was a fifth of a batch's time.
inline int64_t qdot_x_at(int64_t rows, int64_t K, int64_t m, int64_t k) {
    const int64_t m0 = m - m % QDOT_ROWS;
    const int64_t in_pass = rows - m0 < QDOT_ROWS ? rows - m0 : QDOT_ROWS;
    return m0 * K + k * in_pass + (m - m0) * 4;
}

// x [rows, K] float32 as one call of the qdot kernel reads it: rounded to int8 (X16 false),
// or to 15 bits held as two int8 halves, q * 256 + lo (X16: the `qdot16` form, the same
// tiles against x 128x finer, for the LM head's tolerance; two products a weight); a scale
// per `block` columns, 32, or 16 (the `qdot_b16` form: int8 x with ~0.47% error where blocks
// of 32 give ~0.53%, as a smaller block's largest |x| sets a finer step; the same products,
// a float multiply-add more per 16 columns of a group of 32).
struct QdotInput {
    int64_t block = QDOT_BLOCK;
    std::vector<int8_t> q;  // at qdot_x_at: round(x / xs) in -127..127; X16: the high half
    std::vector<int8_t> lo;  // X16: at qdot_x_at, round(x / xs) - 256 * q, in -128..127
    std::vector<float> scale;  // [rows, K / block]: xs = max |x| / (127 | 16383) of a block
    std::vector<float> xsum;  // [rows, groups]: the sum of xs * (q | q * 256 + lo) a group
    // [rows, K / cell] where the tiles hold q + zero: - zero * the sum of round(x / xs) a cell
    std::vector<int32_t> zq;
};

typedef int8_t b16 __attribute__((vector_size(16)));

// 16 int8 of columns [k, k + 16) of row m to their places (qdot_x_at), 4 at a time
inline void qdot_x_put(int8_t* to, int64_t rows, int64_t K, int64_t m, int64_t k, b16 v) {
    for (int j = 0; j < 16; j += 4) memcpy(to + qdot_x_at(rows, K, m, k + j), (int8_t*)&v + j, 4);
}

// 16 int32 in -128..127 (HV vectors of LANES) -> 16 int8, in order
inline b16 narrow_b16(const Lanes<LANES>::I* v) {
#ifdef __AVX512F__
    return __builtin_convertvector(v[0], b16);
#elif defined(__AVX2__)
    // int16 [v0 0-3, v1 0-3 | v0 4-7, v1 4-7], the quarters into order, then int8
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32((__m256i)v[0], (__m256i)v[1]),
                                               0xD8);
    return (b16)_mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
#else
    b16 out;
    for (int i = 0; i < 16; ++i) out[i] = (int8_t)v[i / LANES][i % LANES];
    return out;
#endif
}

// x [rows, K] -> `in`: per block of 32 columns, its two halves of 16 in native vectors (a
// call's fixed cost: at 128 rows, as a loop of scalars, it was a third of a 512-row slice's
// product, which is what form_choice.py times; in 16-lane vectors without AVX-512, 2% of a
// lone decode's step on Zen 3)
inline void qdot_quantize(const float* x, int64_t x_stride, int64_t rows, int64_t K,
                          int64_t group, bool x16, int64_t block, int zero, QdotInput& in) {
    typedef Lanes<LANES>::I I;
    constexpr int HV = 16 / LANES;  // vectors a half of 16 columns
    // NOTE: 32 columns a pass; with blocks of 16, each half its own scale
    const int64_t blocks = K / QDOT_BLOCK, groups = K / group;
    const bool halves = block == QDOT_FINE_BLOCK;
    const float top = x16 ? 16383.0f : 127.0f;
    in.block = block;
    in.q.resize((size_t)(rows * K));
    if (x16) in.lo.resize((size_t)(rows * K));
    in.scale.resize((size_t)(rows * (K / block)));
    in.xsum.assign((size_t)(rows * groups), 0.0f);
    const int64_t cell = group < block ? group : block;  // 16 or 32 (qdot_supports)
    if (zero) in.zq.resize((size_t)(rows * (K / cell)));
    const vf magic = splat<vf>(12582912.0f);  // 1.5 * 2^23: adding it rounds to nearest, even
    for (int64_t m = 0; m < rows; ++m) {
        const float* xm = x + m * x_stride;
        float* xsum = in.xsum.data() + m * groups;
        for (int64_t b = 0; b < blocks; ++b) {
            vf v[2][HV], top_abs[2];  // [half][vector]; the largest |x| a lane
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < HV; ++i) {
                    v[h][i] = load_vf(xm + b * QDOT_BLOCK + 16 * h + LANES * i);
                    const vf a = v[h][i] < 0.0f ? -v[h][i] : v[h][i];
                    top_abs[h] = i == 0 ? a : a > top_abs[h] ? a : top_abs[h];
                }
            const vf both = top_abs[0] > top_abs[1] ? top_abs[0] : top_abs[1];
            const float amax_lo = hmax(halves ? top_abs[0] : both);
            const float amax_hi = halves ? hmax(top_abs[1]) : amax_lo;
            const float inv[2] = {amax_lo > 0.0f ? top / amax_lo : 0.0f,
                                  amax_hi > 0.0f ? top / amax_hi : 0.0f};
            const float scale_lo = amax_lo / top, scale_hi = amax_hi / top;
            float sums[2];  // of round(x / xs) a half: exact (small integers)
            for (int h = 0; h < 2; ++h) {
                // round(x / xs) as floats (exact integers in -top..top), then int8 (halves)
                I r[HV];
                vf sum = {};
                for (int i = 0; i < HV; ++i) {
                    const vf rounded = fused(v[h][i], splat<vf>(inv[h]), magic) - magic;
                    sum += rounded;
                    r[i] = __builtin_convertvector(rounded, I);
                }
                sums[h] = hsum(sum);
                const int64_t k = b * QDOT_BLOCK + 16 * h;
                if (x16) {  // high half floor((v + 128) / 256) in -64..64, low v - 256 * high
                    I high[HV], low[HV];
                    for (int i = 0; i < HV; ++i) {
                        high[i] = (r[i] + 128) >> 8;
                        low[i] = r[i] - high[i] * 256;
                    }
                    qdot_x_put(in.q.data(), rows, K, m, k, narrow_b16(high));
                    qdot_x_put(in.lo.data(), rows, K, m, k, narrow_b16(low));
                } else {
                    qdot_x_put(in.q.data(), rows, K, m, k, narrow_b16(r));
                }
            }
            const float sum_lo = sums[0], sum_hi = sums[1];
            if (halves) {
                in.scale[(m * blocks + b) * 2] = scale_lo;
                in.scale[(m * blocks + b) * 2 + 1] = scale_hi;
            } else {
                in.scale[m * blocks + b] = scale_lo;
            }
            // NOTE: the sum of x as quantized, not of x: the offset term then meets the same
            // x as the integer term, and their rounding errors cancel as the weights' terms
            // do (q * scale of a 4-bit type is all positive, ~8x the offset-corrected
            // weight's size)
            if (zero) {  // the zero's term, in integers (qdot.h, "Arithmetic")
                int32_t* zq = in.zq.data() + m * (K / cell);
                if (cell == 16) {
                    zq[2 * b] = -zero * (int32_t)sum_lo;
                    zq[2 * b + 1] = -zero * (int32_t)sum_hi;
                } else {
                    zq[b] = -zero * (int32_t)(sum_lo + sum_hi);
                }
            }
            if (group == 16) {
                xsum[2 * b] = scale_lo * sum_lo;
                xsum[2 * b + 1] = scale_hi * sum_hi;
            } else {
                xsum[b * QDOT_BLOCK / group] +=
                    halves ? scale_lo * sum_lo + scale_hi * sum_hi : scale_lo * (sum_lo + sum_hi);
            }
        }
    }
}

}  // namespace llmq

#endif  // LLMQ_QDOT_INPUT_H
