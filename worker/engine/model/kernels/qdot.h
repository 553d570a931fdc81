// qdot.h: y = x W^T for a block-quantized W against x quantized to int8 per 32 columns, in
// integer dot products (the `qdot` form; layer_kernels.cpp `quant_mm` calls it for a QMat
// with `dot` set). Included by layer_kernels.cpp.
//
// Why: the float32 kernel (layer_kernels.cpp `quant_tile`) spends a multiply-add on every
// weight of every row: a lone decode of a 1B model is bound by those instructions, not by
// reading the weights. One AVX-512 VNNI `vpdpbusd` multiplies and sums 64 byte pairs (16 rows x
// 4 columns), ~4x fewer instructions a weight, as llama.cpp's `ggml_vec_dot_q4_K_q8_K` does
// against its Q8_K activations.
//
// References: llama.cpp `ggml-cpu/arch/x86/quants.c` (`quantize_row_q8_0`: x / (max|x| / 127)
// rounded to nearest; `ggml_vec_dot_q4_0_q8_0`: the unsigned nibbles against the signed
// activations, the offset term through the activations' sums), oneDNN's u8s8 VNNI GEMM.
//
// Tiles of 16 weight rows, as the float kernel's, with its scales and offsets ([groups][16] a
// tile) in float16 (in units of a power of two per matrix: QdotWeights), the integers laid
// out for `vpdpbusd` (each 32-bit lane: one row's four bytes, unsigned: `vpdpbusd` multiplies
// unsigned by signed; a type's zero, ZERO below, comes back out in integers):
// - BITS 4, [K / 8][16][4] bytes, byte j of row r in entry e holding q[r][8e + j] in the low
//   nibble and q[r][8e + 4 + j] in the high one (q in 0..15);
// - BITS 6 (q in -32..31: Q6_K, the Q5 types, a fused QKV of Q4_K and Q6_K rows), 16 columns
//   in 192 bytes [K / 16][3][16][4]: byte j of row r in vector i (0..2) holding u = q + 32 of
//   column 16e + 4i + j in its low 6 bits, and bits 2i, 2i + 1 of column 16e + 12 + j's u in
//   its top two (0.75 bytes a weight, where BITS 8 takes 1: a lone decode reads every byte);
// - BITS 8, [K / 4][16][4] bytes, q[r][4e + j] + 128.
//
// Arithmetic: per cell of min(group, 32) columns, the row's integer dot product (exact; less
// ZERO * the sum of the cell's x integers), then in float32 acc += float(dot) * (scale[g] *
// xs[cell's block]) (cells of 16 without offsets in x's blocks of 32: a pair's two products
// with their scales summed, then times xs, qdot_scale_pair); per group, with offsets, acc +=
// offset[g] * (the sum of the group's xs * q). NOTE: the zero's term in integers, one add a
// row, tile and cell, where taken out with the offsets it was a float multiply-add a row, tile
// and group: in cells of 16 (Q6_K's groups) a fifth of the vector work (Zen 4, 32 rows: the
// 1B's Q6_K matrices in 0.88-0.89 of the time; no change at one row). The same operations in
// the same order for a row whatever shares its call, so a row's products are the same bits
// alone or in a call of any size (batch invariance, as the float kernel's).

#ifndef LLMQ_QDOT_H
#define LLMQ_QDOT_H

#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "qdot_input.h"
#include "vec16.h"

namespace llmq {

constexpr int QDOT_FEW_ROWS = 8;  // a call of fewer rows is a decode step's: bound by reading W

// tiles a pass of QDOT_ROWS rows computes at once. NOTE: two with AVX2's 16 registers too,
// though a pair's accumulators and products spilt there in one loop (qdot_lanes_in_phases
// splits it): Zen 3, the 1B's projections at 32 rows (bench/projection_sweep.py) in 863 ms a
// sweep, one tile a pass 1,017
constexpr int QDOT_PAIR = 2;

// acc (int32 lanes) += per lane the sum of 4 products of w's unsigned bytes by x's signed
// ones (x: 4 bytes, the same in every lane). WIDE: w's bytes may pass 127 (BITS 8's q + 128);
// otherwise they are at most 63 (BITS 4, BITS 6 and its unpacked lanes).
#if defined(__AVX512VNNI__)
template <bool WIDE>
inline i16 dot4(i16 acc, i16 w, int32_t x) {
    return (i16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x));
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
// NOTE: vpmaddubsw sums a pair of u8 x s8 products in int16, saturating: exact for bytes up
// to 63 (|2 * 63 * -128| < 32768); WIDE bytes go in as their two nibbles (each exact), the
// high one's pair sums weighted by 16 as they widen to int32. Where this was a scalar loop,
// layer_kernels.cpp took 282 s to compile on Zen 3.
template <bool WIDE>
inline i8x dot4(i8x acc, i8x w, int32_t x) {
    const __m256i xs = _mm256_set1_epi32(x), ones = _mm256_set1_epi16(1);
    if (!WIDE)
        return (i8x)_mm256_add_epi32(
            (__m256i)acc, _mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)w, xs), ones));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256((__m256i)w, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16((__m256i)w, 4), nibble);
    const __m256i sum = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xs), ones),
        _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xs), _mm256_set1_epi16(16)));
    return (i8x)_mm256_add_epi32((__m256i)acc, sum);
}
#endif

// AVX2 has no instruction that sums u8 x s8 products into int32 lanes: `dot4` above takes
// three (vpmaddubsw, vpmaddwd by ones, vpaddd), two of them multiplies. Where the sums stay
// small, the pass loops below add vpmaddubsw's int16 pair sums in int16 (`sum16`) and widen
// them to int32 once a cell (`widen16`): one multiply a product group, not two.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool QDOT_SUM16 = true;
// acc (16 int16 lanes) += w's u8 by x's s8 bytes, in pairs: each lane's sum exact while it
// stays within int16 (the caller bounds how many it adds)
inline i8x sum16(i8x acc, i8x w, int32_t x) {
    return (i8x)_mm256_add_epi16(
        (__m256i)acc, _mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(x)));
}
// the int16 lanes summed in pairs, times `factor`, as int32 lanes (one row's each)
inline i8x widen16(i8x acc, int16_t factor) {
    return (i8x)_mm256_madd_epi16((__m256i)acc, _mm256_set1_epi16(factor));
}
// q x (x's 4 bytes) summed in int32 lanes, for q signed (-128..127): vpmaddubsw takes |q|
// and x with q's sign, exact (|2 * 128 * 127| < 32768; x is never -128, whose sign flip would
// wrap: qdot rounds x to -127..127); two multiplies where WIDE's nibbles take four
inline i8x dot4_signed(i8x acc, i8x abs_q, i8x q, int32_t x) {
    const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(x), (__m256i)q);
    return (i8x)_mm256_add_epi32(
        (__m256i)acc, _mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)abs_q, signed_x),
                                        _mm256_set1_epi16(1)));
}
inline i8x abs8(i8x q) { return (i8x)_mm256_abs_epi8((__m256i)q); }
#else
constexpr bool QDOT_SUM16 = false;
// declared for the branches other builds discard (`if constexpr` on QDOT_SUM16), never run
template <typename I> inline I sum16(I, I, int32_t) { __builtin_unreachable(); }
template <typename I> inline I widen16(I, int16_t) { __builtin_unreachable(); }
template <typename I> inline I dot4_signed(I, I, I, int32_t) { __builtin_unreachable(); }
template <typename I> inline I abs8(I) { __builtin_unreachable(); }
#endif

#if !defined(__AVX512VNNI__) && !(defined(__AVX2__) && !defined(__AVX512F__))
template <bool WIDE, typename I>
inline I dot4(I acc, I w, int32_t x) {
    constexpr int L = sizeof(I) / 4;
    uint8_t wb[4 * L];
    int8_t xb[4];
    memcpy(wb, &w, sizeof(I));
    memcpy(xb, &x, 4);
    for (int r = 0; r < L; ++r)
        for (int j = 0; j < 4; ++j) acc[r] += (int32_t)wb[4 * r + j] * xb[j];
    return acc;
}
#endif

template <typename I> inline I load_lanes(const uint8_t* p) { I v; memcpy(&v, p, sizeof(I)); return v; }
inline int32_t load_x4(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

inline float half_to_float(uint16_t h) {  // float16 (IEEE half) -> float
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    float f;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | ((exp == 31 ? 255 : exp + 112) << 23) | (man << 13);
    memcpy(&f, &bits, 4);
    return f;
}

// L float16 -> L floats (F: Lanes<L>::F)
template <typename F> inline F load_halves(const uint16_t* p) {
#ifdef __AVX512F__
    if constexpr (sizeof(F) == 64) return (F)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#endif
#ifdef __F16C__
    if constexpr (sizeof(F) == 32) return (F)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#endif
    F v;
    for (int i = 0; i < (int)(sizeof(F) / 4); ++i) v[i] = half_to_float(p[i]);
    return v;
}

// A matrix in the qdot layout (QMat with `dot` set): scales and offsets [tiles][groups][16]
// float16, in units of `unit` (a power of two, so a model's range of scales fits float16's
// normal numbers; the product is multiplied by it at the end, exactly).
struct QdotWeights {
    const uint8_t* q;
    const uint16_t* scales;
    const uint16_t* offsets;  // or null: all zero
    int64_t N, K, group;
    float unit;
};

// Bytes of `columns` columns of a tile of 16 rows.
constexpr int64_t qdot_bytes(int BITS, int64_t columns) { return columns * BITS * 2; }

// The integer a type's stored byte holds at q = 0 (its products carry ZERO * the sum of x).
constexpr int qdot_zero(int BITS) { return BITS == 8 ? 128 : BITS == 6 ? 32 : 0; }

constexpr int64_t QDOT_SIX_COLUMNS = 16, QDOT_SIX_BYTES = qdot_bytes(6, QDOT_SIX_COLUMNS);

// BITS 6's 16 columns (192 bytes, three vectors) -> its four entries of BITS 8's lanes, each
// byte u = q + 32: the three vectors' low 6 bits, and the fourth entry from their top 2 bits.
// L lanes: the rows [0, L) from `p`, so p + 4 * row0 for the rows from row0.
template <int L>
inline void qdot_six(const uint8_t* p, typename Lanes<L>::I w[4]) {
    typedef typename Lanes<L>::I I;
    typedef typename Lanes<L>::U U;
    const I a = load_lanes<I>(p), b = load_lanes<I>(p + 64), c = load_lanes<I>(p + 128);
    const I six = (I){} + 0x3F3F3F3F;
    w[0] = a & six;
    w[1] = b & six;
    w[2] = c & six;
    // NOTE: 32-bit shifts: what crosses into a byte from its neighbour is masked off
    w[3] = ((I)((U)a >> 6) & 0x03030303) | ((I)((U)b >> 4) & 0x0C0C0C0C) |
           ((I)((U)c >> 2) & 0x30303030);
}

// A BITS 6 tile (its K columns) -> BITS 8's lanes in `out`, holding u = q + 32; `next`: the
// next tile's bytes, fetched into L2 meanwhile, or null.
inline void qdot_unpack_six(const uint8_t* tile, int64_t K, const uint8_t* next, uint8_t* out) {
    for (int64_t c = 0; c < K; c += QDOT_SIX_COLUMNS) {
        const int64_t from = qdot_bytes(6, c), to = qdot_bytes(8, c);
        for (int64_t b = 0; next && b < QDOT_SIX_BYTES; b += 64)
            __builtin_prefetch(next + from + b, 0, 2);
        for (int r0 = 0; r0 < 16; r0 += LANES) {
            typename Lanes<LANES>::I v[4];
            qdot_six<LANES>(tile + from + 4 * r0, v);
            // NOTE: a vector at a time: one copy of the four went through the stack
            for (int i = 0; i < 4; ++i) memcpy(out + to + 64 * i + 4 * r0, &v[i], sizeof(v[i]));
        }
    }
}

// Whether cells of CELL columns may go in pairs (qdot_scale_pair, where x's blocks are 32).
// NOTE: not with offsets (the 1B's fused QKV, 6-bit where its V is Q6_K): paired, it ran 1.27x
// the time at 32 rows (Zen 4, a C++ harness), where the Q6_K down ran 0.90-0.95x.
constexpr bool qdot_pairs(int cell, bool offsets) { return cell == 16 && !offsets; }

// Cells of 16 in x's blocks of 32 (Q6_K's groups in the `qdot` and `qdot16` forms) share x's
// scale in pairs: M rows' float step against T parts, acc += (float(dot0) * scale0 +
// float(dot1) * scale1) * x's scale, the first cell's product parked in `part` (`second`
// false), where each cell alone took acc += float(dot) * (scale * x's scale): three
// multiplies a row and part where the two cells took four, on the pipes vpdpbusd shares
// (docs/performance.md, seventeenth session). The same operations for a row whatever M.
template <int M, int T, typename F>
inline void qdot_scale_pair(const F (&sums)[M][T], const F (&sc)[T], const float* xs,
                            int64_t blocks, int64_t block, bool second, F (&part)[M][T],
                            F (&acc)[M][T]) {
    if (!second) {
        for (int m = 0; m < M; ++m)
            for (int i = 0; i < T; ++i) part[m][i] = sums[m][i] * sc[i];
        return;
    }
    for (int m = 0; m < M; ++m) {
        const F x_scale = splat<F>(xs[m * blocks + block]);
        for (int i = 0; i < T; ++i)
            acc[m][i] = fused(fused(sums[m][i], sc[i], part[m][i]), x_scale, acc[m][i]);
    }
}

// AVX2 (QDOT_SUM16): one cell's integer products, M rows of x against T parts of L rows of
// the tiles (`q_stride` apart), as int32 lanes in `sums`. BITS 4: vpmaddubsw's pair sums of
// the nibble products added in int16 (`sum16`) over the whole cell (|2 * 15 * 127| a pair, 8
// pairs a lane in a cell of 32: 30,480 < 32,768) and widened once; BITS 8 with ZERO 32 (6-bit
// tiles unpacked for a batch, bytes q + 32 up to 63): two pair sums at a time (2 * 2 * 63 *
// 127 = 32,004). NOTE: the empty asm holds each row's sum in a register as it is updated:
// without it GCC computed most of an entry's products before adding any, and spilt 5 of the
// 8 sums of 4 rows x 2 tiles to the stack (Zen 3: the batch passes' 4-bit matrices ~5% slower).
template <int M, int T, int BITS, int ZERO, int CELL, int L>
inline void qdot_cell_sums(const uint8_t* qc, int64_t q_stride, const int8_t* xq, int64_t k0,
                           typename Lanes<L>::I (&sums)[M][T]) {
    typedef typename Lanes<L>::I I;
    typedef typename Lanes<L>::U U;
    static_assert(BITS == 4 || (BITS == 8 && ZERO == 32), "products summed in int16");
    if constexpr (BITS == 4) {
        const I low = (I){} + 0x0F0F0F0F;
        I d16[M][T] = {};  // int16 lanes
#pragma GCC unroll 1
        for (int64_t e = 0; e < CELL / 8; ++e) {
            I lo[T], hi[T];
            for (int i = 0; i < T; ++i) {
                const I v = load_lanes<I>(qc + i * q_stride + e * 64);
                lo[i] = v & low;
                hi[i] = (I)((U)v >> 4) & low;
            }
            const int64_t k = k0 + 8 * e;
            for (int m = 0; m < M; ++m) {
                const int32_t a = load_x4(xq + k * M + 4 * m);
                const int32_t b = load_x4(xq + (k + 4) * M + 4 * m);
                for (int i = 0; i < T; ++i) {
                    d16[m][i] = sum16(sum16(d16[m][i], lo[i], a), hi[i], b);
                    __asm__("" : "+x"(d16[m][i]));
                }
            }
        }
        for (int m = 0; m < M; ++m)
            for (int i = 0; i < T; ++i) sums[m][i] = widen16(d16[m][i], 1);
    } else {
        for (int m = 0; m < M; ++m)
            for (int i = 0; i < T; ++i) sums[m][i] = (I){};
#pragma GCC unroll 1
        for (int64_t e = 0; e < CELL / 4; e += 2) {
            I v[T], v_next[T];  // entries e and e + 1
            for (int i = 0; i < T; ++i) {
                v[i] = load_lanes<I>(qc + i * q_stride + e * 64);
                v_next[i] = load_lanes<I>(qc + i * q_stride + e * 64 + 64);
            }
            const int64_t k = k0 + 4 * e;
            for (int m = 0; m < M; ++m) {
                const int32_t a = load_x4(xq + k * M + 4 * m);
                const int32_t b = load_x4(xq + (k + 4) * M + 4 * m);
                for (int i = 0; i < T; ++i) {
                    sums[m][i] += widen16(sum16(sum16((I){}, v[i], a), v_next[i], b), 1);
                    __asm__("" : "+x"(sums[m][i]));
                }
            }
        }
    }
}

// cells a batch pass on AVX2 sums (`qdot_cell_sums`) before it adds them up in floats
constexpr int QDOT_CHUNK_CELLS = 16;

// qdot_lanes (below) for AVX2's batch passes over 4-bit and unpacked 6-bit tiles, in two
// phases a chunk of cells at a time: every cell's integer products into `sums`, then their
// float accumulation, the same floats added in the same order as in one loop. NOTE: in one
// loop the 8 int16 sums of 4 rows x 2 tiles, the 8 float accumulators and the tiles' bytes
// wanted more than AVX2's 16 registers: GCC spilt the sums inside the product loop and the
// accumulators around it (Zen 3, in phases: the 1B's projections at 32 rows in 0.85 of the
// time, SmolLM2's 4-bit matrices at 64 rows 0.84-0.86; bench/results/
// qdot-avx2-zen3-2026-12-05.txt). NOTE: its cells' fetches, scales, offsets and output, and
// qdot_cell_sums' nibbles, repeat qdot_lanes' lines: shared through helpers (the fetches and
// the nibbles tried), GCC inlined otherwise across the whole AVX-512 build (40-58 of its 219
// functions changed, attention's among them), which no host here can measure.
template <int M, int T, int BITS, bool OFF, int ZERO, int CELL, int L>
void qdot_lanes_in_phases(const QdotInput& in, int64_t m0, const QdotWeights& w, int64_t t,
                          const uint8_t* q, int64_t q_stride, float* y, int64_t y_stride,
                          int64_t rows, const uint8_t* q_next, bool few, int row0) {
    typedef typename Lanes<L>::F F;
    typedef typename Lanes<L>::I I;
    constexpr int64_t cell = CELL, cell_bytes = qdot_bytes(BITS, CELL);
    const int64_t K = w.K, group = w.group;
    const int64_t per_group = group / cell, blocks = K / in.block, groups = K / group;
    const int64_t chunk_groups = QDOT_CHUNK_CELLS / per_group, cells = K / cell;
    const int block_shift = cell < in.block ? 1 : 0;
    const uint16_t* scales = w.scales + t * groups * 16 + row0;
    const uint16_t* offsets = OFF ? w.offsets + t * groups * 16 + row0 : nullptr;
    const int8_t* xq = in.q.data() + m0 * K;
    const float* xs = in.scale.data() + m0 * blocks;
    const int32_t* zq = ZERO ? in.zq.data() + m0 * cells : nullptr;
    const int64_t part_scales = groups * 16;
    constexpr bool PAIRS = qdot_pairs(CELL, OFF);
    F acc[M][T] = {}, part[M][T];
    I sums[QDOT_CHUNK_CELLS][M][T];
    for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
        const int64_t g1 = g0 + chunk_groups < groups ? g0 + chunk_groups : groups;
        const int64_t c0 = g0 * per_group;
        for (int64_t c = c0; c < g1 * per_group; ++c) {
            if (q_next)  // the next tiles' cell, as qdot_lanes asks for it
                for (int i = 0; i < T; ++i)
#pragma GCC unroll 8
                    for (int64_t b = 0; b < cell_bytes; b += 64) {
                        const uint8_t* ahead = q_next + i * q_stride + c * cell_bytes + b;
                        if (few) __builtin_prefetch(ahead, 0, 2);
                        else __builtin_prefetch(ahead, 0, 3);
                    }
            qdot_cell_sums<M, T, BITS, ZERO, CELL, L>(q + c * cell_bytes + 4 * row0, q_stride,
                                                      xq, c * cell, sums[c - c0]);
        }
        for (int64_t g = g0; g < g1; ++g) {
            F sc[T];
            for (int i = 0; i < T; ++i) sc[i] = load_halves<F>(scales + part_scales * i + g * 16);
            if (few && q_next && (g & 1) == 0) {
                __builtin_prefetch(scales + (T * groups + g) * 16, 0, 2);
                if (OFF) __builtin_prefetch(offsets + (T * groups + g) * 16, 0, 2);
            }
            for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
                const int64_t block = c >> block_shift;
                if constexpr (PAIRS) {  // as qdot_lanes
                    if (block_shift) {
                        F products[M][T];
                        for (int m = 0; m < M; ++m)
                            for (int i = 0; i < T; ++i) {
                                I s = sums[c - c0][m][i];
                                if (ZERO) s += zq[m * cells + c];
                                products[m][i] = __builtin_convertvector(s, F);
                            }
                        qdot_scale_pair<M, T>(products, sc, xs, blocks, block, c & 1, part, acc);
                        continue;
                    }
                }
                for (int m = 0; m < M; ++m) {
                    const float x_scale = xs[m * blocks + block];
                    for (int i = 0; i < T; ++i) {
                        I s = sums[c - c0][m][i];
                        if (ZERO) s += zq[m * cells + c];
                        acc[m][i] = fused(__builtin_convertvector(s, F), sc[i] * x_scale,
                                          acc[m][i]);
                    }
                }
            }
            if (OFF)
                for (int i = 0; i < T; ++i) {
                    const F off = load_halves<F>(offsets + part_scales * i + g * 16);
                    for (int m = 0; m < M; ++m)
                        acc[m][i] = fused(off, splat<F>(in.xsum[(m0 + m) * groups + g]), acc[m][i]);
                }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int i = 0; i < T; ++i) {
            const F out = acc[m][i] * w.unit;
            float* ym = y + m * y_stride + 16 * i + row0;
            const int64_t left = rows - row0;  // of the tile's rows
            if (left >= L) memcpy(ym, &out, sizeof(F));
            else for (int64_t r = 0; r < left; ++r) ym[r] = out[r];
        }
}

// qdot_tile (below): T tiles of 16 weight rows (t, t + 1, ..., their bytes from `q`, `q_stride`
// apart) against the pass of rows [m0, m0 + M) of x: y[m][0..16 T) of the tiles; q_next: the next
// tiles' bytes, fetched ahead, or null; few: a decode step's call (fewer than QDOT_FEW_ROWS rows).
// X16: each product twice, against x's high and low halves, joined in integers (exact: a cell's
// high sum is at most 32 * 255 * 64, times 256 < 2^31). CELL: min(group, x's block), 16 or 32 (a
// constant: the loops over a cell's bytes unrolled, where as loops they were half of a lone row's
// instructions). T 2 where M is QDOT_ROWS: each load of x feeds both tiles' products, and each
// tile's bytes serve 4 rows.
// qdot_lanes: the rows [row0, row0 + L) of those tiles (L: LANES); qdot_tile runs it for
// each such part of its 16 rows. HALVES: its T (2) parts are instead one tile's two halves of
// L (8) rows, `q_stride` (4 L bytes) apart in each 64-byte entry.
template <int M, int T, int BITS, bool OFF, bool X16, int ZERO, int CELL, int L,
          bool HALVES = false>
void qdot_lanes(const QdotInput& in, int64_t m0, const QdotWeights& w, int64_t t,
                const uint8_t* q, int64_t q_stride, float* y, int64_t y_stride, int64_t rows,
                const uint8_t* q_next, bool few, int row0) {
    typedef typename Lanes<L>::F F;
    typedef typename Lanes<L>::I I;
    typedef typename Lanes<L>::U U;
    constexpr int64_t cell = CELL, cell_bytes = qdot_bytes(BITS, CELL);
    const int64_t K = w.K, group = w.group;
    const int64_t per_group = group / cell, blocks = K / in.block, groups = K / group;
    // a cell's block of x: the cell's own, or (cells of 16 in blocks of 32) every second one's
    const int block_shift = cell < in.block ? 1 : 0;
    const uint16_t* scales = w.scales + t * groups * 16 + row0;
    const uint16_t* offsets = OFF ? w.offsets + t * groups * 16 + row0 : nullptr;
    // x's pass (qdot_x_at): row m's columns [k, k + 4) at xq + k * M + 4 * m
    const int8_t* xq = in.q.data() + m0 * K;
    const int8_t* xl = X16 ? in.lo.data() + m0 * K : nullptr;
    const float* xs = in.scale.data() + m0 * blocks;
    const int64_t cells = K / cell;
    const int32_t* zq = ZERO ? in.zq.data() + m0 * cells : nullptr;
    // NOTE: two chains of products a row where few rows share the tile (the nibbles' low and
    // high halves), so the adds' latency overlaps; with 4 rows or more theirs do, and one
    // chain a row saves an add a row and cell
    constexpr int CHAINS = BITS != 8 && M < 4 && !X16 && !(QDOT_SUM16 && BITS == 4) ? 2 : 1;
    constexpr bool WIDE = BITS == 8 && ZERO == 128;  // q + 128: bytes up to 255
    // AVX2 (`sum16`): a cell's nibble products (|2 * 15 * 127| a pair, 8 pairs a lane in a
    // cell of 32) summed in int16 whole; 6-bit ones (|2 * 63 * 127|) two pairs at a time; WIDE
    // bytes as their signed q (`dot4_signed`: no ZERO term). Not X16: its low halves reach -128.
    constexpr bool SUM4 = QDOT_SUM16 && BITS == 4 && !X16;
    constexpr bool SUM6 = QDOT_SUM16 && BITS == 8 && !WIDE && !X16;
    constexpr bool SIGNED = QDOT_SUM16 && WIDE && !X16;
    if constexpr ((SUM4 || SUM6) && !HALVES)
        if (per_group <= QDOT_CHUNK_CELLS)
            return qdot_lanes_in_phases<M, T, BITS, OFF, ZERO, CELL, L>(
                in, m0, w, t, q, q_stride, y, y_stride, rows, q_next, few, row0);
    constexpr bool PAIRS = qdot_pairs(CELL, OFF);
    F acc[M][T] = {}, part[M][T];
    constexpr int tiles = HALVES ? 1 : T;
    // where part i's scales and offsets lie from part 0's
    const int64_t part_scales = HALVES ? L : groups * 16;
    // NOTE: groups outer, their cells inner: no division in the loop (two a cell cost ~10%)
    for (int64_t g = 0; g < groups; ++g) {
        F sc[T];
        for (int i = 0; i < T; ++i) sc[i] = load_halves<F>(scales + part_scales * i + g * 16);
        if (few && q_next && (g & 1) == 0) {  // the next tile's scales, offsets: a line 2 groups
            __builtin_prefetch(scales + (tiles * groups + g) * 16, 0, 2);
            if (OFF) __builtin_prefetch(offsets + (tiles * groups + g) * 16, 0, 2);
        }
        for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
            const int64_t k0 = c * cell;
            const uint8_t* qc = q + c * cell_bytes + 4 * row0;  // row r's 4 bytes: 4 r in 64
            // NOTE: the next tile's cell, asked for while this one computes. Where few rows
            // share the tile (a decode), into L2 (locality 2): a tile ahead is 9-96 KiB, past
            // L1's 32; into L1 the lone decode's sweep of a 1B model's projections took 44-61
            // ms, into L2 37-41 (median of 16, interleaved). A batch's tile, read by every
            // pass, into L1 as before (into L2 its sweep at 256 rows was ~7% slower).
            if (q_next)
                for (int i = 0; i < tiles; ++i)
#pragma GCC unroll 8
                    for (int64_t b = 0; b < cell_bytes; b += 64) {
                        const uint8_t* ahead = q_next + i * q_stride + c * cell_bytes + b;
                        if (few) __builtin_prefetch(ahead, 0, 2);
                        else __builtin_prefetch(ahead, 0, 3);
                    }
            // d: the products a row and tile; dl: X16's with the low halves
            I d[M][T][CHAINS] = {}, dl[M][T] = {};
            // NOTE: AVX2's paths by `if constexpr`, so AVX-512's code stays as it was compiled
            // before them (with plain `if`s, GCC allocated its registers otherwise)
            if constexpr (SUM4 || SUM6) {
                I sums[M][T];
                qdot_cell_sums<M, T, BITS, ZERO, CELL, L>(qc, q_stride, xq, k0, sums);
                for (int m = 0; m < M; ++m)
                    for (int i = 0; i < T; ++i) d[m][i][0] = sums[m][i];
            } else if (BITS == 4) {
                const I low = (I){} + 0x0F0F0F0F;
#pragma GCC unroll 4
                for (int64_t e = 0; e < cell / 8; ++e) {
                    I lo[T], hi[T];
                    for (int i = 0; i < T; ++i) {
                        const I v = load_lanes<I>(qc + i * q_stride + e * 64);
                        lo[i] = v & low;
                        hi[i] = (I)((U)v >> 4) & low;
                    }
                    const int64_t k = k0 + 8 * e;
                    for (int m = 0; m < M; ++m) {
                        const int32_t a = load_x4(xq + k * M + 4 * m);
                        const int32_t b = load_x4(xq + (k + 4) * M + 4 * m);
                        for (int i = 0; i < T; ++i) d[m][i][0] = dot4<WIDE>(d[m][i][0], lo[i], a);
                        for (int i = 0; i < T; ++i)
                            d[m][i][CHAINS - 1] = dot4<WIDE>(d[m][i][CHAINS - 1], hi[i], b);
                        if (X16) {
                            const int32_t la = load_x4(xl + k * M + 4 * m);
                            const int32_t lb = load_x4(xl + (k + 4) * M + 4 * m);
                            for (int i = 0; i < T; ++i)
                                dl[m][i] = dot4<WIDE>(dot4<WIDE>(dl[m][i], lo[i], la), hi[i], lb);
                        }
                    }
                }
            } else if (BITS == 6) {
#pragma GCC unroll 2
                for (int64_t u = 0; u < cell / QDOT_SIX_COLUMNS; ++u) {
                    I v[T][4];
                    for (int i = 0; i < T; ++i)
                        qdot_six<L>(qc + i * q_stride + u * QDOT_SIX_BYTES, v[i]);
                    const int64_t k = k0 + QDOT_SIX_COLUMNS * u;
                    for (int m = 0; m < M; ++m)
                        for (int j = 0; j < 4; ++j) {
                            const int32_t a = load_x4(xq + (k + 4 * j) * M + 4 * m);
                            for (int i = 0; i < T; ++i)
                                d[m][i][j % CHAINS] = dot4<WIDE>(d[m][i][j % CHAINS], v[i][j], a);
                            if (X16) {
                                const int32_t la = load_x4(xl + (k + 4 * j) * M + 4 * m);
                                for (int i = 0; i < T; ++i) dl[m][i] = dot4<WIDE>(dl[m][i], v[i][j], la);
                            }
                        }
                }
            } else if constexpr (SIGNED) {
#pragma GCC unroll 1
                for (int64_t e = 0; e < cell / 4; ++e) {
                    I q8[T], abs_q[T];  // q = the stored byte - 128
                    for (int i = 0; i < T; ++i) {
                        q8[i] = (I)((U)load_lanes<I>(qc + i * q_stride + e * 64) ^ 0x80808080u);
                        abs_q[i] = abs8(q8[i]);
                    }
                    const int64_t k = k0 + 4 * e;
                    for (int m = 0; m < M; ++m) {
                        const int32_t a = load_x4(xq + k * M + 4 * m);
                        for (int i = 0; i < T; ++i)
                            d[m][i][0] = dot4_signed(d[m][i][0], abs_q[i], q8[i], a);
                    }
                }
            } else {
#pragma GCC unroll 8
                for (int64_t e = 0; e < cell / 4; ++e) {
                    I v[T];
                    for (int i = 0; i < T; ++i) v[i] = load_lanes<I>(qc + i * q_stride + e * 64);
                    const int64_t k = k0 + 4 * e;
                    for (int m = 0; m < M; ++m) {
                        const int32_t a = load_x4(xq + k * M + 4 * m);
                        for (int i = 0; i < T; ++i) d[m][i][0] = dot4<WIDE>(d[m][i][0], v[i], a);
                        if (X16) {
                            const int32_t la = load_x4(xl + k * M + 4 * m);
                            for (int i = 0; i < T; ++i) dl[m][i] = dot4<WIDE>(dl[m][i], v[i], la);
                        }
                    }
                }
            }
            const int64_t block = c >> block_shift;
            // NOTE: `if constexpr`, and the unpaired step below as it was before pairs: written
            // once for both (through a lambda), GCC allocated the registers of passes that never
            // pair otherwise, and the 1B's fused QKV ran ~5% slower at 32 rows (Zen 4)
            if constexpr (PAIRS) {
                if (block_shift) {
                    F products[M][T];
                    for (int m = 0; m < M; ++m)
                        for (int i = 0; i < T; ++i) {
                            I s = CHAINS == 2 ? d[m][i][0] + d[m][i][CHAINS - 1] : d[m][i][0];
                            if (X16) s = s * 256 + dl[m][i];
                            if (ZERO && !SIGNED) s += zq[m * cells + c];
                            products[m][i] = __builtin_convertvector(s, F);
                        }
                    qdot_scale_pair<M, T>(products, sc, xs, blocks, block, c & 1, part, acc);
                    continue;
                }
            }
            for (int m = 0; m < M; ++m) {
                const float x_scale = xs[m * blocks + block];
                for (int i = 0; i < T; ++i) {
                    I s = CHAINS == 2 ? d[m][i][0] + d[m][i][CHAINS - 1] : d[m][i][0];
                    if (X16) s = s * 256 + dl[m][i];
                    // q's own products (QdotInput's zq); SIGNED's are already q's
                    if (ZERO && !SIGNED) s += zq[m * cells + c];
                    acc[m][i] = fused(__builtin_convertvector(s, F), sc[i] * x_scale, acc[m][i]);
                }
            }
        }
        if (OFF)
            for (int i = 0; i < T; ++i) {
                const F off = load_halves<F>(offsets + part_scales * i + g * 16);
                for (int m = 0; m < M; ++m)
                    acc[m][i] = fused(off, splat<F>(in.xsum[(m0 + m) * groups + g]), acc[m][i]);
            }
    }
    for (int m = 0; m < M; ++m)
        for (int i = 0; i < T; ++i) {
            const F out = acc[m][i] * w.unit;
            float* ym = y + m * y_stride + (HALVES ? L : 16) * i + row0;
            const int64_t left = rows - row0 - (HALVES ? L * i : 0);  // of the tile's rows
            if (left >= L) memcpy(ym, &out, sizeof(F));
            else for (int64_t r = 0; r < left; ++r) ym[r] = out[r];
        }
}

template <int M, int T, int BITS, bool OFF, bool X16, int ZERO, int CELL>
void qdot_tile(const QdotInput& in, int64_t m0, const QdotWeights& w, int64_t t,
               const uint8_t* q, int64_t q_stride, float* y, int64_t y_stride, int64_t rows,
               const uint8_t* q_next, bool few) {
    // A decode of a row or two with 8 lanes (AVX2): both halves of the tile in one pass over
    // its bytes (as two parts, HALVES), each 64-byte entry read once.
    // NOTE: Zen 3, a lone decode's 30 layers of SmolLM2 projections (66 MB, a C++ harness,
    // best of interleaved runs): 4.28 ms a token in halves one after the other, 3.45 in one
    // pass (the memory's streaming rate); 6.59 and 5.15 at two rows. At four rows their
    // accumulators spill, and it gained nothing.
    if constexpr (LANES == 8 && T == 1 && M <= 2) {
        if (few) {
            qdot_lanes<M, 2, BITS, OFF, X16, ZERO, CELL, LANES, true>(
                in, m0, w, t, q, 4 * LANES, y, y_stride, rows, q_next, few, 0);
            return;
        }
    }
    // Otherwise LANES of the tile's rows at a time: its halves in turn where that is 8, the
    // second's bytes in cache from the first's. A decode's second half fetches the tile after
    // the next meanwhile, or memory would idle through it. NOTE: measured where it was a lone
    // decode's path (one row, as above): 5.23 ms a token fetching one tile ahead, 4.37 so; the
    // 3-7 rows that take it now were not measured apart.
    const uint8_t* after = few && q_next && 16 * (t + 2) < w.N ? q_next + q_stride : nullptr;
    for (int row0 = 0; row0 < 16 && row0 < rows; row0 += LANES)
        qdot_lanes<M, T, BITS, OFF, X16, ZERO, CELL, LANES>(
            in, m0, w, t, q, q_stride, y, y_stride, rows, row0 == 0 ? q_next : after, few,
            row0);
}

// NOTE: the arguments by reference: by value, each tile call copied the quantized x (its vectors)
template <int BITS, bool OFF, bool X16, int ZERO, int CELL, typename... A>
void qdot_rows(int64_t rows_x, const A&... a) {
    static_assert(BITS == 4 || BITS == 6 || BITS == 8, "a qdot layout");
    switch (rows_x) {
        case 1: qdot_tile<1, 1, BITS, OFF, X16, ZERO, CELL>(a...); break;
        case 2: qdot_tile<2, 1, BITS, OFF, X16, ZERO, CELL>(a...); break;
        case 3: qdot_tile<3, 1, BITS, OFF, X16, ZERO, CELL>(a...); break;
        case 4: qdot_tile<4, 1, BITS, OFF, X16, ZERO, CELL>(a...); break;
    }
}

constexpr int64_t QDOT_PANEL_BYTES = 256 << 10;  // of quantized x a panel holds (in L2)

// y [rows, N] = x W^T for any number of rows: tiles in pairs, each pair against every pass of
// QDOT_ROWS rows of x in turn while its bytes are in cache (W is read from memory once a
// panel, not once a pass). Panels of x's rows small enough to stay in L2 while every tile
// passes over them.
// NOTE: a prefill chunk's 1024 rows of a 2048-column x are 2 MiB of int8, fetched from beyond
// L2 again for every tile as one panel: Q4_K 8192 x 2048 ran at 252 GFLOP/s so, 262 in
// panels (Zen 4). At least 64 rows a panel: W is read once a panel.
// NOTE: pairs of tiles against 4 rows, not one tile against 8: the same products and loads of
// W a pass, half the loads of x a product, and 4 rows' accumulators where 8 spilt pointers
// (Zen 4: SmolLM2's Q4_1 3072 x 576 at 64 rows in 0.77-0.89 of the time, the 1B's matrices at
// 32 rows in 0.78-0.89).
// BITS 6: where more than QDOT_FEW_ROWS rows of x pass over a tile, it is unpacked once into
// BITS 8's lanes (in L1 or L2) and run as those (with BITS 6's zero: the same bits as unpacked
// in the tile), not again for every pass (~10 operations a 16 columns against 32 products: a
// quarter more work for a batch's Q6_K projections).
template <int BITS, bool OFF, bool X16, int CELL>
void qdot_matmul(const QdotInput& in, int64_t rows_x, const QdotWeights& w, float* y,
                 int64_t y_stride) {
    int64_t panel = QDOT_PANEL_BYTES / w.K / QDOT_ROWS * QDOT_ROWS;
    panel = panel < 64 ? 64 : panel;
    const int64_t tile_bytes = qdot_bytes(BITS, w.K), unpacked_bytes = qdot_bytes(8, w.K);
    const bool few = rows_x < QDOT_FEW_ROWS;
    thread_local std::vector<uint8_t> unpacked;
    // NOTE: the buffer's address taken once: a thread_local's every use in a shared library
    // is a call to find it
    if (BITS == 6 && !few) unpacked.resize((size_t)(QDOT_PAIR * unpacked_bytes));
    uint8_t* const buffer = unpacked.data();
    for (int64_t p0 = 0; p0 < rows_x; p0 += panel) {
        const int64_t p1 = rows_x - p0 < panel ? rows_x : p0 + panel;
        const bool unpack = BITS == 6 && p1 - p0 >= QDOT_FEW_ROWS;
        for (int64_t n = 0; n < w.N;) {
            // a pair of whole tiles where a pass has QDOT_ROWS rows, else one
            const int64_t tiles =
                p1 - p0 >= QDOT_ROWS && w.N - n >= 16 * QDOT_PAIR ? QDOT_PAIR : 1;
            const uint8_t* q = w.q + n / 16 * tile_bytes;
            const uint8_t* q_next = n + 16 * tiles < w.N ? q + tiles * tile_bytes : nullptr;
            for (int64_t i = 0; unpack && i < tiles; ++i)
                qdot_unpack_six(q + i * tile_bytes, w.K,
                                n + 16 * (i + 1) < w.N ? q + (i + 1) * tile_bytes : nullptr,
                                buffer + i * unpacked_bytes);
            // every pass of the panel over these tiles: the held ones (TB: BITS), or those
            // unpacked into the buffer (TB 8, with BITS 6's zero)
            auto passes = [&](auto tb, auto zero, const uint8_t* tile, int64_t stride,
                              const uint8_t* next) {
                constexpr int TB = decltype(tb)::value, Z = decltype(zero)::value;
                for (int64_t m0 = p0; m0 < p1; m0 += QDOT_ROWS) {
                    const int64_t m = p1 - m0 < QDOT_ROWS ? p1 - m0 : QDOT_ROWS;
                    float* ym = y + m0 * y_stride + n;
                    const uint8_t* ahead = m0 == p0 ? next : nullptr;
                    if (m == QDOT_ROWS && tiles == QDOT_PAIR) {
                        qdot_tile<QDOT_ROWS, QDOT_PAIR, TB, OFF, X16, Z, CELL>(
                            in, m0, w, n / 16, tile, stride, ym, y_stride, 16, ahead, few);
                        continue;
                    }
                    for (int64_t i = 0; i < tiles; ++i) {  // fewer rows: a tile at a time
                        const int64_t cols = w.N - n - 16 * i < 16 ? w.N - n - 16 * i : 16;
                        qdot_rows<TB, OFF, X16, Z, CELL>(
                            m, in, m0, w, n / 16 + i, tile + i * stride, stride, ym + 16 * i,
                            y_stride, cols, i + 1 == tiles ? ahead : nullptr, few);
                    }
                }
            };
            if (unpack)
                passes(std::integral_constant<int, 8>{},
                       std::integral_constant<int, qdot_zero(6)>{}, buffer, unpacked_bytes,
                       nullptr);
            else
                passes(std::integral_constant<int, BITS>{},
                       std::integral_constant<int, qdot_zero(BITS)>{}, q, tile_bytes, q_next);
            n += 16 * tiles;
        }
    }
}

// Whether the qdot kernel runs a matrix of this shape: whole 32-column passes over x, groups
// of 16 (two to a block of 32: Q6_K's) or of whole blocks.
inline bool qdot_supports(int64_t K, int64_t group, int32_t bits) {
    return (bits == 4 || bits == 6 || bits == 8) && K % QDOT_BLOCK == 0 && K % group == 0 &&
           (group == 16 || group % QDOT_BLOCK == 0);
}

template <bool X16, int CELL>
void qdot_typed(const QdotInput& in, int64_t rows, const QdotWeights& w, int32_t bits, float* y,
                int64_t y_stride) {
    if (bits == 4)
        w.offsets ? qdot_matmul<4, true, X16, CELL>(in, rows, w, y, y_stride)
                  : qdot_matmul<4, false, X16, CELL>(in, rows, w, y, y_stride);
    else if (bits == 6)
        w.offsets ? qdot_matmul<6, true, X16, CELL>(in, rows, w, y, y_stride)
                  : qdot_matmul<6, false, X16, CELL>(in, rows, w, y, y_stride);
    else
        w.offsets ? qdot_matmul<8, true, X16, CELL>(in, rows, w, y, y_stride)
                  : qdot_matmul<8, false, X16, CELL>(in, rows, w, y, y_stride);
}

// y = x W^T for any rows, x to int8 or (x16) to 15 bits, a scale per `block` (32 or 16)
// columns; false for a shape qdot_supports refuses.
inline bool qdot_mm(const float* x, int64_t x_stride, int64_t rows, const QdotWeights& w,
                    int32_t bits, bool x16, int64_t block, float* y, int64_t y_stride) {
    if (!qdot_supports(w.K, w.group, bits)) return false;
    thread_local QdotInput in;
    qdot_quantize(x, x_stride, rows, w.K, w.group, x16, block, qdot_zero(bits), in);
    const int64_t cell = w.group < block ? w.group : block;  // 16 or 32 (qdot_supports)
    if (cell == 16)
        x16 ? qdot_typed<true, 16>(in, rows, w, bits, y, y_stride)
            : qdot_typed<false, 16>(in, rows, w, bits, y, y_stride);
    else
        x16 ? qdot_typed<true, 32>(in, rows, w, bits, y, y_stride)
            : qdot_typed<false, 32>(in, rows, w, bits, y, y_stride);
    return true;
}

}  // namespace llmq

#endif  // LLMQ_QDOT_H
