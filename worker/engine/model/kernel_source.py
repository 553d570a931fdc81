"""SOURCE: the C++ of the CPU kernels (cpu_kernels.py builds and binds it).

Kept as a Python string so it ships inside the package like any module. Plain loops over raw
pointers, no torch headers (so it builds in about a second); `#pragma omp simd` (with
-fopenmp-simd, no OpenMP runtime) lets the compiler vectorise the float reductions. Tensors are
float32 or bfloat16 (`uint16_t`, the high half of a float32's bits), chosen per call by flags.

References: vLLM `csrc/cpu/attention.cpp` (paged decode attention reading blocks in place),
`csrc/cpu/layernorm.cpp` (`fused_add_rms_norm`), llama.cpp `ggml-cpu/vec.h` (`ggml_v_expf`,
`ggml_vec_swiglu_f32`), Cephes `expf` (the polynomial).
"""

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <vector>

namespace {

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

inline float silu(float g) {
    float e = exp_neg(g < 0.0f ? g : -g);  // e^-|g|
    return g * (g < 0.0f ? e : 1.0f) / (1.0f + e);
}

thread_local std::vector<float> scratch;

// One decode query per sequence, K/V read through the block table where they lie.
// q [seqs, heads, head_dim] float32 with rows q_stride apart; cache
// [2, kv_heads, num_blocks, block_size, head_dim]; tables [seqs, max_blocks];
// out [seqs, heads, head_dim].
template <typename C, typename O>
void decode_attention(const float* q, int64_t q_stride, const C* cache, const int64_t* tables,
                      const int64_t* seq_lens, int64_t seqs, int64_t max_blocks, int64_t heads,
                      int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                      int64_t head_dim, float scale, O* out) {
    const int64_t group = heads / kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    int64_t max_len = 0;
    for (int64_t s = 0; s < seqs; ++s) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    scratch.resize((size_t)(group * (max_len + 2 * head_dim)));
    float* scores = scratch.data();            // [group, len]
    float* qs = scores + group * max_len;      // [group, head_dim]: q * scale
    float* acc = qs + group * head_dim;        // [group, head_dim]
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t len = seq_lens[s];
        const int64_t* table = tables + s * max_blocks;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const float* qh = q + s * q_stride + h * group * head_dim;
            for (int64_t i = 0; i < group * head_dim; ++i) qs[i] = qh[i] * scale;
            const C* k_head = cache + h * head_stride;
            const C* v_head = cache + (kv_heads + h) * head_stride;
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const C* k = k_head + slot * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const float* qg = qs + g * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(k, d);
                    scores[g * len + t] = dot;
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                float* sg = scores + g * len;
                float mx = sg[0];
                for (int64_t t = 1; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; ++t) {
                    sg[t] = exp_neg(sg[t] - mx);
                    sum += sg[t];
                }
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * group * head_dim);
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const C* v = v_head + slot * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const float p = scores[g * len + t];
                    float* ag = acc + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * load(v, d);
                }
            }
            O* oh = out + (s * heads + h * group) * head_dim;
            for (int64_t i = 0; i < group * head_dim; ++i) store(oh, i, acc[i]);
        }
    }
}

// h [rows, dim] float32 (+= y first, when y is given), then out = h / rms(h) * w.
template <typename Y, typename O>
void add_rms_norm(float* h, const Y* y, const float* w, int64_t rows, int64_t dim, float eps,
                  O* out) {
    for (int64_t r = 0; r < rows; ++r) {
        float* hr = h + r * dim;
        if (y) {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) hr[d] += load(y + r * dim, d);
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; ++d) ss += hr[d] * hr[d];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t d = 0; d < dim; ++d) store(out + r * dim, d, hr[d] * inv * w[d]);
    }
}

// gate_up [rows, 2 * dim] (gate, then up) -> out [rows, dim] = silu(gate) * up.
template <typename G, typename O>
void silu_mul(const G* gate_up, int64_t rows, int64_t dim, O* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const G* g = gate_up + r * 2 * dim;
        for (int64_t d = 0; d < dim; ++d)
            store(out + r * dim, d, silu(load(g, d)) * load(g, dim + d));
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
                C* cache, int64_t num_slots, float* q_out, float* kv_out) {
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
            C* slot = cache + (kvh * num_slots + slots[t]) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) store(slot, d, dst[d]);
            if (kv_out) {
                float* ko = kv_out + (t * 2 * kv_heads + kvh) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) ko[d] = load((const C*)slot, d);
            }
        }
    }
}

}  // namespace

extern "C" {

void llmq_decode_attention(const float* q, int64_t q_stride, const void* cache,
                           int32_t cache_bf16, const int64_t* tables, const int64_t* seq_lens,
                           int64_t seqs, int64_t max_blocks, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t head_dim,
                           float scale, void* out, int32_t out_bf16) {
    typed(cache_bf16, [&](auto c) { typed(out_bf16, [&](auto o) {
        decode_attention(q, q_stride, (decltype(c))cache, tables, seq_lens, seqs, max_blocks,
                         heads, kv_heads, num_blocks, block_size, head_dim, scale,
                         (decltype(o))out);
    }); });
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
                     float* q_out, float* kv_out) {
    typed(qkv_bf16, [&](auto x) { typed(cache_bf16, [&](auto c) {
        rope_store((decltype(x))qkv, qkv_stride, tokens, heads, kv_heads, head_dim, positions,
                   cos_table, sin_table, slots, (decltype(c))cache, num_slots, q_out, kv_out);
    }); });
}

}
"""
