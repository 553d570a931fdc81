// layer_kernels.cpp: the CPU kernels of a decoder layer, called through ctypes (cpu_kernels.py
// builds and binds them; see its docstring for the cache and the flags).
//
// Plain loops over raw pointers, no torch headers (no ninja, no cpp_extension); `#pragma omp
// simd` (with -fopenmp-simd, no OpenMP runtime) lets the compiler vectorise the float
// reductions. Tensors are float32 or bfloat16 (`uint16_t`, the high half of a float32's bits),
// chosen per call by flags.
//
// The attention kernels are in paged_attention.h, the int8-activation GEMM in qdot.h.
//
// References: vLLM `csrc/cpu/layernorm.cpp` (`fused_add_rms_norm`), llama.cpp `ggml-cpu/vec.h`.

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <string.h>
#include <type_traits>
#include <vector>

#include "vec16.h"
#include "qdot.h"
#include "paged_attention.h"

namespace llmq {
namespace {

// h [rows, dim] float32 (+= y first, when y is given), then out = h / rms(h) * w.
template <typename Y, typename O>
void add_rms_norm(float* h, const Y* y, const float* w, int64_t rows, int64_t dim, float eps,
                  O* out) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    // AVX2: the 16-lane sum of squares as its two native halves, added lane by lane as hsum's
    // first halving step adds them: the same floats in the same order as the 16-lane loop below
    // which GCC built from pieces through the stack (Zen 3, 64 rows of 576: 75 us a call, now
    // 14-16). NOTE: by the preprocessor, not `if constexpr`: the AVX-512 build compiles the lines
    // it did (a change here once changed 68 of its functions through GCC's inlining).
    for (int64_t r = 0; r < rows; ++r) {
        float* hr = h + r * dim;
        O* orow = out + r * dim;
        f8x low = {}, high = {};  // lanes 0-7 and 8-15 of the 16-lane sums
        float ss = 0.0f;
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16) {
            f8x a = load_vf(hr + d), b = load_vf(hr + d + 8);
            if (y) {
                a += load_vf(y + r * dim + d);
                b += load_vf(y + r * dim + d + 8);
            }
            store_vf(hr + d, a);
            store_vf(hr + d + 8, b);
            low += a * a;
            high += b * b;
        }
        for (; d < dim; ++d) {
            if (y) hr[d] += load(y + r * dim, d);
            ss += hr[d] * hr[d];
        }
        const float inv = 1.0f / sqrtf((hsum(low + high) + ss) / (float)dim + eps);
        for (d = 0; d + 8 <= dim; d += 8)
            store_vf(orow + d, load_vf(hr + d) * inv * load_vf(w + d));
        for (; d < dim; ++d) store(orow, d, hr[d] * inv * w[d]);
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
        float* hr = h + r * dim;
        O* orow = out + r * dim;
        v16 vss = {};
        float ss = 0.0f;
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16) {
            v16 x = load16(hr + d);
            if (y) x += load16(y + r * dim + d);
            store16(hr + d, x);
            vss += x * x;
        }
        for (; d < dim; ++d) {
            if (y) hr[d] += load(y + r * dim, d);
            ss += hr[d] * hr[d];
        }
        const float inv = 1.0f / sqrtf((hsum(vss) + ss) / (float)dim + eps);
        for (d = 0; d + 16 <= dim; d += 16) store16(orow + d, load16(hr + d) * inv * load16(w + d));
        for (; d < dim; ++d) store(orow, d, hr[d] * inv * w[d]);
    }
#endif
}

// gate_up [rows, 2 * dim] (gate, then up) -> out [rows, dim] = silu(gate) * up.
template <typename G, typename O>
void silu_mul(const G* gate_up, int64_t rows, int64_t dim, O* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const G* g = gate_up + r * 2 * dim;
        O* orow = out + r * dim;
        int64_t d = 0;
        // NOTE: native vectors: 16-lane ones without AVX-512 went through the stack (Zen 3:
        // ~9 cycles an element, 3% of a lone decode's layer)
        for (; d + LANES <= dim; d += LANES)
            store_vf(orow + d, silu_lanes(load_vf(g + d)) * load_vf(g + dim + d));
        for (; d < dim; ++d) store(orow, d, silu(load(g, d)) * load(g, dim + d));
    }
}

// RoPE on interleaved pairs of Q and K, then K and V into their cache slots.
// qkv [tokens, (heads + 2 * kv_heads) * head_dim], rows qkv_stride apart; cos/sin
// [positions, head_dim / 2]; q_out [tokens, heads, head_dim] float32; kv_out (optional)
// [tokens, 2 * kv_heads, head_dim] float32 holding K/V as the cache rounds them.
template <typename X, typename C>
void rope_store(const X* qkv, int64_t qkv_stride, int64_t tokens, int64_t heads,
                int64_t kv_heads, int64_t head_dim, const int64_t* positions,
                const float* cos_table, const float* sin_table, const int64_t* slots,
                C* cache, int64_t num_slots, int64_t block_size, float* q_out, float* kv_out) {
    const int64_t half = head_dim / 2;
    std::vector<float> row((size_t)head_dim);
    for (int64_t t = 0; t < tokens; ++t) {
        const X* x = qkv + t * qkv_stride;
        const float* c = cos_table + positions[t] * half;
        const float* s = sin_table + positions[t] * half;
        for (int64_t hh = 0; hh < heads + 2 * kv_heads; ++hh) {
            const X* xh = x + hh * head_dim;
            float* dst = hh < heads ? q_out + (t * heads + hh) * head_dim : row.data();
            if (hh < heads + kv_heads) {
                for (int64_t i = 0; i < half; ++i) {
                    const float x0 = load(xh, 2 * i), x1 = load(xh, 2 * i + 1);
                    dst[2 * i] = x0 * c[i] - x1 * s[i];
                    dst[2 * i + 1] = x0 * s[i] + x1 * c[i];
                }
            } else {
                for (int64_t d = 0; d < head_dim; ++d) dst[d] = load(xh, d);
            }
            if (hh < heads) continue;
            const int64_t kvh = hh - heads;  // K heads, then V heads: the cache's order too
            // K blocks are [head_dim, block_size] (transposed), V blocks [block_size, head_dim]
            const bool is_k = kvh < kv_heads;
            const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
            C* base = cache + (kvh * num_slots + block * block_size) * head_dim;
            const int64_t step = is_k ? block_size : 1;
            C* first = base + (is_k ? offset : offset * head_dim);
            for (int64_t d = 0; d < head_dim; ++d) store(first, d * step, dst[d]);
            if (kv_out) {
                float* ko = kv_out + (t * 2 * kv_heads + kvh) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) ko[d] = load((const C*)first, d * step);
            }
        }
    }
}


// 16 quantized weights -> 16 floats. NOTE: intrinsics where AVX-512 is there: GCC widens
// vector-extension bytes one byte at a time.
#ifdef __AVX512F__
inline void unpack_nibbles(const uint8_t* p, v16& lo, v16& hi) {
    // vpermps reads the low 4 bits of each index: a nibble picks its own value out of
    // 0.0 .. 15.0, one shuffle instead of a mask and a conversion
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = (v16)_mm512_permutexvar_ps(v, values);
    hi = (v16)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
}
inline v16 widen_int8(const uint8_t* p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__)
inline void unpack_nibbles(const uint8_t* p, v16& lo, v16& hi) {
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    const __m256i low = _mm256_set1_epi32(15);
    lo = join(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)),
              _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)));
    hi = join(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)),
              _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)));
}
inline v16 widen_int8(const uint8_t* p) {
    return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))));
}
#else
inline void unpack_nibbles(const uint8_t* p, v16& lo, v16& hi) {
    for (int i = 0; i < 16; ++i) lo[i] = (float)(p[i] & 15), hi[i] = (float)(p[i] >> 4);
}
inline v16 widen_int8(const uint8_t* p) {
    v16 w;
    for (int i = 0; i < 16; ++i) w[i] = (float)(int8_t)p[i];
    return w;
}
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] for a block-quantized w: per group of `group` columns,
// w = q * scale + offset. Weights come in tiles of 16 rows, vectorised across the rows (as
// torch's int4 "tinygemm" does): no horizontal sums, and one unpack serves all M rows of x.
// Tile layout: BITS 4: [K / 2][16] bytes, byte r of entry p holding q[r][2p] (low nibble) and
// q[r][2p + 1] (high nibble); BITS 8: [K][16] int8. scales, offsets: [groups][16] per tile.
// OFF false: a symmetric type's (Q6_K, Q8_0, Q5_0), whose offsets are all zero, held without
// them (a lone decode reads every byte of its tiles once a token: q8g16's 1.5 bytes a weight
// become 1.25) and with no offset term, the same bits as `+ 0 * xsum`.
// x [M, K] float32 (rows x_stride apart), xsum [M, groups] its sums per group (OFF only);
// y [M, N] float32 (rows y_stride apart). All arithmetic in float32.
//
// Every row is summed in the same order whatever M is, so a row's products are the same bits
// alone or beside 7 others (a speculative verification's rows equal the decodes they stand
// for; tests/model/test_block_quant.py). Within a group, P = 4 partial sums (entry p into
// p % 4, in increasing p), each of BITS 4 two chains (low nibbles, high nibbles: one FMA per
// weight and no adds in the loop, the inner loop's cost once a verification makes it
// compute-bound), added (lo0 + hi0) + (lo1 + hi1) + ... left to right, then scaled into the
// row's total. Only how many partial sums run at once (C) depends on M: all while their
// accumulators fit in the 32 registers (short FMA chains for a lone decode), fewer for more
// rows (then the M rows' own chains are plenty).
template <int M, int BITS, bool OFF>
void quant_tile(const float* x, int64_t x_stride, const float* xsum, const uint8_t* q,
                const float* scales, const float* offsets, int64_t K, int64_t group, float* y,
                int64_t y_stride, int64_t rows, const uint8_t* q_next, const float* scales_next,
                const float* offsets_next) {
    constexpr int P = 4;
    constexpr int C = BITS == 4 ? (M <= 2 ? 4 : (M <= 4 ? 2 : 1))
                                : (M <= 4 ? 4 : (M <= 6 ? 2 : 1));
    const int64_t groups = K / group, group_bytes = (BITS == 4 ? group / 2 : group) * 16;
    v16 acc[M] = {};
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * group;
        if (q_next) {
            // NOTE: the next tile's group, asked for while this one computes: the hardware
            // prefetcher alone left the weights' streaming and the arithmetic one after the
            // other (measured on SmolLM2: a decode step 10.3 -> 7.3 ms, a 5-row one 17.6 -> 14.1)
            const uint8_t* next = q_next + g * group_bytes;
            for (int64_t b = 0; b < group_bytes; b += 64) __builtin_prefetch(next + b);
            __builtin_prefetch(scales_next + g * 16);
            if (OFF) __builtin_prefetch(offsets_next + g * 16);
        }
        v16 sum[M];
        // NOTE: the partial-sum indices are compile-time constants (unrolled loops), so t
        // stays in registers. quant_mm takes groups of a multiple of 8: P divides group / 2.
#pragma GCC unroll 4
        for (int i0 = 0; i0 < P; i0 += C) {
            v16 t[M][C][2] = {};
            if (BITS == 4) {
                for (int64_t p0 = 0; p0 < group / 2; p0 += P) {
#pragma GCC unroll 4
                    for (int c = 0; c < C; ++c) {
                        const int64_t p = p0 + i0 + c;
                        v16 lo, hi;
                        unpack_nibbles(q + (k0 / 2 + p) * 16, lo, hi);
                        for (int m = 0; m < M; ++m) {
                            const float* xm = x + m * x_stride + k0 + 2 * p;
                            t[m][c][0] += lo * xm[0];
                            t[m][c][1] += hi * xm[1];
                        }
                    }
                }
            } else {
                for (int64_t j0 = 0; j0 < group; j0 += P) {
#pragma GCC unroll 4
                    for (int c = 0; c < C; ++c) {
                        const int64_t j = j0 + i0 + c;
                        const v16 w = widen_int8(q + (k0 + j) * 16);
                        for (int m = 0; m < M; ++m) t[m][c][0] += w * x[m * x_stride + k0 + j];
                    }
                }
            }
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c)
                for (int m = 0; m < M; ++m) {
                    const v16 part = BITS == 4 ? t[m][c][0] + t[m][c][1] : t[m][c][0];
                    sum[m] = i0 + c == 0 ? part : sum[m] + part;
                }
        }
        const v16 sc = load16(scales + g * 16);
        if (OFF) {
            const v16 off = load16(offsets + g * 16);
            for (int m = 0; m < M; ++m) acc[m] += sum[m] * sc + off * xsum[m * groups + g];
        } else {
            for (int m = 0; m < M; ++m) acc[m] += sum[m] * sc;
        }
    }
    for (int m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) y[m * y_stride + r] = acc[m][r];
}

template <int M, int BITS, bool OFF>
void quant_matmul(const float* x, int64_t x_stride, const float* xsum, const uint8_t* q,
                  const float* scales, const float* offsets, int64_t N, int64_t K,
                  int64_t group, float* y, int64_t y_stride) {
    const int64_t tile_bytes = (BITS == 4 ? K / 2 : K) * 16;
    const int64_t tile_scales = K / group * 16;
    for (int64_t n = 0; n < N; n += 16) {
        const int64_t t = n / 16;
        const bool next = n + 16 < N;
        quant_tile<M, BITS, OFF>(x, x_stride, xsum, q + t * tile_bytes,
                                 scales + t * tile_scales,
                                 OFF ? offsets + t * tile_scales : nullptr,
                                 K, group, y + n, y_stride, N - n < 16 ? N - n : 16,
                                 next ? q + (t + 1) * tile_bytes : nullptr,
                                 scales + (t + 1) * tile_scales,
                                 OFF ? offsets + (t + 1) * tile_scales : nullptr);
    }
}

template <int BITS, bool OFF, typename... A> bool quant_matmul_m(int64_t rows, A... a) {
    switch (rows) {
        case 1: quant_matmul<1, BITS, OFF>(a...); return true;
        case 2: quant_matmul<2, BITS, OFF>(a...); return true;
        case 3: quant_matmul<3, BITS, OFF>(a...); return true;
        case 4: quant_matmul<4, BITS, OFF>(a...); return true;
        case 5: quant_matmul<5, BITS, OFF>(a...); return true;
        case 6: quant_matmul<6, BITS, OFF>(a...); return true;
        case 7: quant_matmul<7, BITS, OFF>(a...); return true;
        case 8: quant_matmul<8, BITS, OFF>(a...); return true;
        default: return false;
    }
}


// A block-quantized projection as the fused decode step sees it (QuantMatrix in Python).
struct QMat {
    const uint8_t* q;
    const float* scales;
    const float* offsets;  // or null: all zero (a symmetric type's)
    const float* bias;  // or null
    int64_t out_features, in_features, group;
    int32_t bits;
    int32_t dot;  // the tiles in qdot.h's layout (float16 scales), against x in int8 (1: the
                  // `qdot` form), in 15 bits (2: `qdot16`), or in int8 per 16 columns (3:
                  // `qdot_b16`)
    float unit;  // dot: the scales' and offsets' unit (QdotWeights)
    int32_t unused;
    const QMat* next;  // or null: the next rows' block, in its own layout (a fused QKV whose
                       // V rows are another GGUF type: QuantMatrix.stacked)
};

void add_bias(const QMat& w, int64_t rows, float* y, int64_t y_stride) {
    if (w.bias)
        for (int64_t m = 0; m < rows; ++m)
            for (int64_t n = 0; n < w.out_features; ++n) y[m * y_stride + n] += w.bias[n];
}

// One block of rows of quant_mm's.
bool quant_mm_block(const float* x, int64_t x_stride, int64_t rows, const QMat& w, float* y,
                    int64_t y_stride) {
    const int64_t K = w.in_features, group = w.group, N = w.out_features;
    if (w.dot) {
        const QdotWeights qw{w.q, (const uint16_t*)w.scales, (const uint16_t*)w.offsets, N, K,
                             group, w.unit};
        if (!qdot_mm(x, x_stride, rows, qw, w.bits, w.dot == 2,
                     w.dot == 3 ? QDOT_FINE_BLOCK : QDOT_BLOCK, y, y_stride)) return false;
        add_bias(w, rows, y, y_stride);
        return true;
    }
    if (K % group || group % 8 || (w.bits != 4 && w.bits != 8)) return false;
    const int64_t groups = K / group;
    // [rows, groups]: sum of x per group, for the offsets' term (none without offsets)
    std::vector<float> xsum(w.offsets ? (size_t)(rows * groups) : 0);
    for (int64_t m = 0; m < rows && w.offsets; ++m)
        for (int64_t g = 0; g < groups; ++g) {
            float s = 0.0f;
            for (int64_t k = 0; k < group; ++k) s += x[m * x_stride + g * group + k];
            xsum[m * groups + g] = s;
        }
    // NOTE: with offsets or without is chosen once per call (a template argument), not per group
    const float* xs = xsum.data();
    const bool done = w.bits == 4
        ? (w.offsets ? quant_matmul_m<4, true>(rows, x, x_stride, xs, w.q, w.scales, w.offsets,
                                               N, K, group, y, y_stride)
                     : quant_matmul_m<4, false>(rows, x, x_stride, xs, w.q, w.scales, w.offsets,
                                                N, K, group, y, y_stride))
        : (w.offsets ? quant_matmul_m<8, true>(rows, x, x_stride, xs, w.q, w.scales, w.offsets,
                                               N, K, group, y, y_stride)
                     : quant_matmul_m<8, false>(rows, x, x_stride, xs, w.q, w.scales, w.offsets,
                                                N, K, group, y, y_stride));
    if (done) add_bias(w, rows, y, y_stride);
    return done;
}

// y = x W^T (+ bias) for rows <= 8 (any rows for a qdot matrix), block after block of W's
// rows; false for shapes with no kernel.
bool quant_mm(const float* x, int64_t x_stride, int64_t rows, const QMat& w, float* y,
              int64_t y_stride) {
    for (const QMat* block = &w; block; y += block->out_features, block = block->next)
        if (!quant_mm_block(x, x_stride, rows, *block, y, y_stride)) return false;
    return true;
}

struct DecoderLayer {
    QMat qkv, o, gate_up, down;
    const float* input_norm;
    const float* post_norm;
    void* cache;  // [2, kv_heads, num_blocks, block_size * head_dim]
};

// A whole decode step for rows <= 8 sequences, every projection block-quantized: the layers
// of llama.py's `_run_fused` in one call, no Python between the ops. h [rows, hidden] float32
// is the embedded tokens (updated in place: the residual stream); out [rows, hidden] gets the
// final-normed hidden states.
template <typename C>
bool decode_layers(const DecoderLayer* layers, int64_t num_layers, float* h, int64_t rows,
                   int64_t hidden, int64_t inter, const float* final_norm, float eps,
                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
                   int64_t block_size, const int64_t* positions, const float* cos_table,
                   const float* sin_table, const int64_t* slots, const int64_t* tables,
                   int64_t max_blocks, const int64_t* seq_lens, float scale, float* out) {
    const int64_t q_dim = heads * head_dim, qkv_dim = q_dim + 2 * kv_heads * head_dim;
    const int64_t wide = hidden > inter ? hidden : inter;
    std::vector<float> x((size_t)(rows * wide)), qkv((size_t)(rows * qkv_dim));
    std::vector<float> q((size_t)(rows * q_dim)), o((size_t)(rows * q_dim));
    std::vector<float> gate_up((size_t)(rows * 2 * inter)), y((size_t)(rows * hidden));
    add_rms_norm(h, (const float*)nullptr, layers[0].input_norm, rows, hidden, eps, x.data());
    for (int64_t l = 0; l < num_layers; ++l) {
        const DecoderLayer& L = layers[l];
        C* cache = (C*)L.cache;
        if (!quant_mm(x.data(), hidden, rows, L.qkv, qkv.data(), qkv_dim)) return false;
        rope_store(qkv.data(), qkv_dim, rows, heads, kv_heads, head_dim, positions, cos_table,
                   sin_table, slots, cache, num_blocks * block_size, block_size, q.data(),
                   (float*)nullptr);
        if (!decode_attention_g<C, float>(heads / kv_heads, q.data(), q_dim, (const C*)cache,
                                          tables, seq_lens, rows, max_blocks, heads, kv_heads,
                                          num_blocks, block_size, head_dim, scale, o.data()))
            return false;
        if (!quant_mm(o.data(), q_dim, rows, L.o, y.data(), hidden)) return false;
        add_rms_norm(h, y.data(), L.post_norm, rows, hidden, eps, x.data());
        if (!quant_mm(x.data(), hidden, rows, L.gate_up, gate_up.data(), 2 * inter)) return false;
        silu_mul(gate_up.data(), rows, inter, x.data());
        if (!quant_mm(x.data(), inter, rows, L.down, y.data(), hidden)) return false;
        const bool last = l + 1 == num_layers;
        add_rms_norm(h, y.data(), last ? final_norm : layers[l + 1].input_norm, rows, hidden,
                     eps, last ? out : x.data());
    }
    return true;
}

}  // namespace
}  // namespace llmq

using namespace llmq;  // the extern "C" entry points below call into it

extern "C" {

// Returns 0 when the group size (heads / kv_heads) has no kernel: the caller falls back.
int32_t llmq_decode_attention(const float* q, int64_t q_stride, const void* cache,
                              int32_t cache_bf16, const int64_t* tables, const int64_t* seq_lens,
                              int64_t seqs, int64_t max_blocks, int64_t heads, int64_t kv_heads,
                              int64_t num_blocks, int64_t block_size, int64_t head_dim,
                              float scale, void* out, int32_t out_bf16) {
    bool done = false;
    typed(cache_bf16, [&](auto c) { typed(out_bf16, [&](auto o) {
        using C = std::remove_pointer_t<decltype(c)>;
        using O = std::remove_pointer_t<decltype(o)>;
        done = decode_attention_g<C, O>(heads / kv_heads, q, q_stride, (const C*)cache, tables,
                                        seq_lens, seqs, max_blocks, heads, kv_heads, num_blocks,
                                        block_size, head_dim, scale, (O*)out);
    }); });
    return done ? 1 : 0;
}

// Returns 0 when the group size (heads / kv_heads) has no kernel: the caller falls back.
int32_t llmq_prompt_attention(const float* q, int64_t q_stride, const void* cache,
                              int32_t cache_bf16, const int64_t* tables, const int64_t* starts,
                              const int64_t* seq_lens, int64_t seqs, int64_t max_blocks,
                              int64_t heads, int64_t kv_heads, int64_t num_blocks,
                              int64_t block_size, int64_t head_dim, float scale, void* out,
                              int32_t out_bf16) {
    bool done = false;
    typed(cache_bf16, [&](auto c) { typed(out_bf16, [&](auto o) {
        using C = std::remove_pointer_t<decltype(c)>;
        using O = std::remove_pointer_t<decltype(o)>;
        done = prompt_attention_g<C, O>(heads / kv_heads, q, q_stride, (const C*)cache, tables,
                                        starts, seq_lens, seqs, max_blocks, heads, kv_heads,
                                        num_blocks, block_size, head_dim, scale, (O*)out);
    }); });
    return done ? 1 : 0;
}

void llmq_add_rms_norm(float* h, const void* y, int32_t y_bf16, const float* w, int64_t rows,
                       int64_t dim, float eps, void* out, int32_t out_bf16) {
    typed(y_bf16, [&](auto yt) { typed(out_bf16, [&](auto o) {
        add_rms_norm(h, (decltype(yt))y, w, rows, dim, eps, (decltype(o))out);
    }); });
}

void llmq_silu_mul(const void* gate_up, int32_t in_bf16, int64_t rows, int64_t dim, void* out,
                   int32_t out_bf16) {
    typed(in_bf16, [&](auto g) { typed(out_bf16, [&](auto o) {
        silu_mul((decltype(g))gate_up, rows, dim, (decltype(o))out);
    }); });
}

void llmq_rope_store(const void* qkv, int32_t qkv_bf16, int64_t qkv_stride, int64_t tokens,
                     int64_t heads, int64_t kv_heads, int64_t head_dim,
                     const int64_t* positions, const float* cos_table, const float* sin_table,
                     const int64_t* slots, void* cache, int32_t cache_bf16, int64_t num_slots,
                     int64_t block_size, float* q_out, float* kv_out) {
    typed(qkv_bf16, [&](auto x) { typed(cache_bf16, [&](auto c) {
        rope_store((decltype(x))qkv, qkv_stride, tokens, heads, kv_heads, head_dim, positions,
                   cos_table, sin_table, slots, (decltype(c))cache, num_slots, block_size, q_out,
                   kv_out);
    }); });
}


// Returns 0 for shapes with no kernel (rows > 8 on the float32 tiles, groups not a multiple of 8).
int32_t llmq_quant_matmul(const float* x, int64_t x_stride, int64_t rows, const QMat* w,
                          float* y, int64_t y_stride) {
    return quant_mm(x, x_stride, rows, *w, y, y_stride) ? 1 : 0;
}

// Returns 0 (having done nothing usable) when some shape has no kernel.
int32_t llmq_decode_layers(const DecoderLayer* layers, int64_t num_layers, float* h,
                           int64_t rows, int64_t hidden, int64_t inter, const float* final_norm,
                           float eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t num_blocks, int64_t block_size, int32_t cache_bf16,
                           const int64_t* positions, const float* cos_table,
                           const float* sin_table, const int64_t* slots, const int64_t* tables,
                           int64_t max_blocks, const int64_t* seq_lens, float scale,
                           float* out) {
    bool done = false;
    typed(cache_bf16, [&](auto c) {
        using C = std::remove_pointer_t<decltype(c)>;
        done = decode_layers<C>(layers, num_layers, h, rows, hidden, inter, final_norm, eps,
                                heads, kv_heads, head_dim, num_blocks, block_size, positions,
                                cos_table, sin_table, slots, tables, max_blocks, seq_lens,
                                scale, out);
    });
    return done ? 1 : 0;
}

}  // extern "C"
