// vec16.h: 16-lane float vectors and the scalar/vector helpers the CPU kernels share.
//
// GCC's vector extension (one zmm with AVX-512, two ymm with AVX2), bfloat16 <-> float32 as
// torch rounds it, horizontal sums, and exp / SiLU as branch-free polynomials so the loops
// around them vectorise. Included by layer_kernels.cpp; compiled by cpu_kernels.py.
//
// References: llama.cpp `ggml-cpu/vec.h` (`ggml_v_expf`, `ggml_vec_swiglu_f32`), Cephes `expf`
// (the polynomial).

#ifndef LLMQ_VEC16_H
#define LLMQ_VEC16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace llmq {

typedef uint16_t bf16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const bf16* p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(bf16* p, int64_t i, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
        p[i] = (bf16)((u >> 16) | 64);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as torch's .to(bfloat16)
    p[i] = (bf16)(u >> 16);
}

// 16 floats: GCC's vector extension, one zmm with AVX-512, two ymm with AVX2.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; memcpy(&v, p, 64); return v; }

// 8 lanes (one ymm with AVX2): the qdot kernel's tiles in halves where there is no AVX-512.
typedef int32_t i8x __attribute__((vector_size(32)));
typedef uint32_t u8x __attribute__((vector_size(32)));
typedef float f8x __attribute__((vector_size(32)));

#if defined(__AVX2__) && !defined(__AVX512F__)
// Two ymm of floats as the 16-lane vector GCC holds in them (register moves, no memory).
inline v16 join(__m256 lo, __m256 hi) {
    return __builtin_shufflevector((f8x)lo, (f8x)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                   13, 14, 15);
}
#endif
// f in every lane of a float vector (v16, or the 8-lane f8x). NOTE: a shuffle of lane 0 (one
// vbroadcastss), not `f + v16{}`: without -ffast-math that first adds 0.0 (which would turn
// -0.0 into +0.0), nor a loop (sixteen masked broadcasts).
template <typename F = v16> inline F splat(float f) {
    typedef int32_t lanes __attribute__((vector_size(sizeof(F))));
    F v = {f};
    return __builtin_shuffle(v, lanes{});
}
inline v16 load16(const bf16* p) {
#ifdef __AVX512F__
    // NOTE: by hand: GCC widens the vector extension's 16 halves in two 8-lane pieces and
    // joins them (five shuffle-port instructions where this is two), which was the attention
    // kernel's busiest work on a bfloat16 cache.
    const __m512i w = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
    return (v16)_mm512_castsi512_ps(w);
#else
    h16 h;
    memcpy(&h, p, 32);
    u16 w = __builtin_convertvector(h, u16) << 16;
    v16 v;
    memcpy(&v, &w, 64);
    return v;
#endif
}

// One native vector of float (or int32) lanes: 16 with AVX-512 (a zmm), 8 elsewhere (a ymm
// with AVX2). Kernels that keep arrays of accumulators loop over LANES, not 16. NOTE: GCC
// builds a 16-lane vector extension without AVX-512 from pieces (element inserts, extracts
// and spills): on Zen 3 qdot's 16-lane tile ran a 1B model's matrices at 10-12 GFLOP/s, and
// decode attention over a bfloat16 cache took as long as all the projections.
#ifdef __AVX512F__
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
template <int L> struct Lanes;  // the vector types of L lanes: F float, I int32, U uint32
template <> struct Lanes<16> { typedef v16 F; typedef i16 I; typedef u16 U; };
template <> struct Lanes<8> { typedef f8x F; typedef i8x I; typedef u8x U; };
typedef Lanes<LANES>::F vf;

// LANES floats from float32 or bfloat16.
inline vf load_vf(const float* p) { vf v; memcpy(&v, p, sizeof(vf)); return v; }
inline vf load_vf(const bf16* p) {
#ifdef __AVX512F__
    return load16(p);
#elif defined(__AVX2__)
    return (vf)_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
    typedef uint16_t h8 __attribute__((vector_size(16)));
    h8 h;
    memcpy(&h, p, 16);
    const u8x w = __builtin_convertvector(h, u8x) << 16;
    vf v;
    memcpy(&v, &w, 32);
    return v;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Whether pairs of 8-lane vectors of C are read interleaved (`load_pair`): bfloat16 on AVX2.
template <typename C> constexpr bool INTERLEAVED_PAIRS = sizeof(C) == 2;
// 16 bfloat16 as two 8-lane float vectors in an interleaved order: `lo` holds elements 0-3 and
// 8-11, `hi` 4-7 and 12-15 (each 128-bit half's words unpacked against zeros: one shuffle a
// vector, where load_vf takes a widening load and a shift). `swap_halves` restores the order.
inline void load_pair(const bf16* p, f8x& lo, f8x& hi) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p), zero = _mm256_setzero_si256();
    lo = (f8x)_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h));
    hi = (f8x)_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h));
}
// (a, b) <- (a's and b's low 128 bits, their high 128 bits): from load_pair's order to the
// elements' order, and back (it is its own inverse).
inline void swap_halves(f8x& a, f8x& b) {
    const __m256 low = _mm256_permute2f128_ps((__m256)a, (__m256)b, 0x20);
    const __m256 high = _mm256_permute2f128_ps((__m256)a, (__m256)b, 0x31);
    a = (f8x)low;
    b = (f8x)high;
}
#else
template <typename C> constexpr bool INTERLEAVED_PAIRS = false;
// declared for the branches other builds discard (`if constexpr` on INTERLEAVED_PAIRS), never run
inline void load_pair(const bf16*, vf&, vf&) { __builtin_unreachable(); }
inline void swap_halves(vf&, vf&) { __builtin_unreachable(); }
#endif

// P vectors of LANES elements from p on, in load_pair's interleaved order where a pair of C is
// read so (P 2, INTERLEAVED_PAIRS), else in the elements' order.
template <int P, typename C> inline void load_parts(const C* p, vf (&x)[P]) {
    if constexpr (P == 2 && INTERLEAVED_PAIRS<C>)
        load_pair(p, x[0], x[1]);
    else
        for (int q = 0; q < P; ++q) x[q] = load_vf(p + q * LANES);
}
// Lanes computed against load_parts' vectors <-> the elements' order (its own inverse; nothing
// to do where load_parts reads in order).
template <int P, typename C> inline void reorder_parts(vf (&x)[P]) {
    if constexpr (P == 2 && INTERLEAVED_PAIRS<C>) swap_halves(x[0], x[1]);
}

// a * b + c rounded once, as an instruction, not as GCC contracts it: on Zen 3 (8 lanes) it
// fused qdot's one-row tile's and not the two-row one's, and a row's bits changed with the
// rows sharing its call.
template <typename F> inline F fused(F a, F b, F c) {
#ifdef __AVX512F__
    if constexpr (sizeof(F) == 64) return (F)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#ifdef __FMA__
    if constexpr (sizeof(F) == 32) return (F)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
    return a * b + c;
}

// The sum of 16 lanes by halving (a shuffle tree), not lane by lane.
inline float hsum(v16 v) {
    v = v + __builtin_shuffle(v, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = v + __builtin_shuffle(v, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = v + __builtin_shuffle(v, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = v + __builtin_shuffle(v, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

// The largest of 16 lanes by halving, as hsum.
inline float hmax(v16 v) {
    v16 w = __builtin_shuffle(v, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = v > w ? v : w;
    w = __builtin_shuffle(v, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = v > w ? v : w;
    w = __builtin_shuffle(v, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = v > w ? v : w;
    w = __builtin_shuffle(v, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    v = v > w ? v : w;
    return v[0];
}

// hsum and hmax of 8 lanes, by halving as theirs of 16.
inline float hsum(f8x v) {
    v = v + __builtin_shuffle(v, (i8x){4, 5, 6, 7, 0, 1, 2, 3});
    v = v + __builtin_shuffle(v, (i8x){2, 3, 0, 1, 6, 7, 4, 5});
    v = v + __builtin_shuffle(v, (i8x){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}
inline float hmax(f8x v) {
    f8x w = __builtin_shuffle(v, (i8x){4, 5, 6, 7, 0, 1, 2, 3});
    v = v > w ? v : w;
    w = __builtin_shuffle(v, (i8x){2, 3, 0, 1, 6, 7, 4, 5});
    v = v > w ? v : w;
    w = __builtin_shuffle(v, (i8x){1, 0, 3, 2, 5, 4, 7, 6});
    v = v > w ? v : w;
    return v[0];
}

// x . y over n floats: 16 lanes at a time, then the tail.
template <typename C>
inline float dot(const float* x, const C* y, int64_t n) {
    v16 acc = {};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) acc += load16(x + d) * load16(y + d);
    float sum = hsum(acc);
    for (; d < n; ++d) sum += x[d] * load(y, d);
    return sum;
}

inline void store16(float* p, v16 x) { memcpy(p, &x, 64); }
// L floats to bfloat16: round to nearest even, NaN kept, as store() does
template <int L> inline void store_bf16(bf16* p, typename Lanes<L>::F x) {
    typedef typename Lanes<L>::U U;
    typedef uint16_t H __attribute__((vector_size(2 * L)));
    U u;
    memcpy(&u, &x, sizeof(u));
    const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const U nan = (u >> 16) | 64u;
    const U r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
    const H h = __builtin_convertvector(r, H);
    memcpy(p, &h, sizeof(h));
}
inline void store16(bf16* p, v16 x) { store_bf16<16>(p, x); }

// LANES floats to float32 or bfloat16.
inline void store_vf(float* p, vf x) { memcpy(p, &x, sizeof(vf)); }
inline void store_vf(bf16* p, vf x) { store_bf16<LANES>(p, x); }

// Call f with a null pointer of the element type a flag names: float32 (0) or bfloat16 (1).
template <typename F> void typed(int32_t is_bf16, F f) {
    if (is_bf16) f((bf16*)nullptr); else f((float*)nullptr);
}

// exp(x) for x <= 0, ~2 ulp: Cephes' range reduction and polynomial, branch-free so the
// loops around it vectorise.
inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// exp_neg on a vector of floats (v16, or vf's 8 lanes: the same polynomial); round to
// nearest by the 1.5 * 2^23 trick.
template <typename F> inline F exp_neg_lanes(F x) {
    typedef typename Lanes<sizeof(F) / 4>::I I;
    const F lo = splat<F>(-87.0f);
    x = x < lo ? lo : x;
    const F magic = splat<F>(12582912.0f);
    const F n = (x * 1.44269504088896341f + magic) - magic;
    F r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    F p = splat<F>(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    F scale;
    memcpy(&scale, &bits, sizeof(F));
    return p * scale;
}

// silu on a vector of floats (v16, or vf's 8 lanes)
template <typename F> inline F silu_lanes(F g) {
    const F neg = g < 0.0f ? g : -g;  // -|g|
    const F e = exp_neg_lanes(neg);
    return g * (g < 0.0f ? e : splat<F>(1.0f)) / (1.0f + e);
}

inline float silu(float g) {
    float e = exp_neg(g < 0.0f ? g : -g);  // e^-|g|
    return g * (g < 0.0f ? e : 1.0f) / (1.0f + e);
}

}  // namespace llmq

#endif  // LLMQ_VEC16_H
