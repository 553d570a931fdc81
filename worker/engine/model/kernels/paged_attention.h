// paged_attention.h: attention over the paged KV cache, K/V read where the block tables say
// (no gather): a decode's one query a sequence (decode_attention), a prompt's rows in tiles
// sharing each block's read (prompt_attention). Included by layer_kernels.cpp, whose
// extern "C" entry points and fused decode step call them; attention.py describes the cache.
//
// References: vLLM `csrc/cpu/attention.cpp` (paged decode attention reading blocks in place,
// K blocks transposed).

#ifndef LLMQ_PAGED_ATTENTION_H
#define LLMQ_PAGED_ATTENTION_H

#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "vec16.h"

namespace llmq {
namespace {

thread_local std::vector<float> scratch;

// Asks for a block's lines a few per step of the loop that works on the block before it, so the
// requests go out among the arithmetic. Into L2 (hint 2), not L1: decode attention asks 8 blocks
// ahead, more lines than L1 has room to wait for (on a Zen 5 30 layers' batch-64 attention took
// 15.3 ms so against 17.9 ms into L1 2 blocks ahead). NOTE: all of a block's lines in one burst
// filled the core's miss buffers, and the burst's prefetch instructions then stalled the arithmetic
// behind them (Zen 3, a lone decode's profile: most of decode_attention's own time).
struct SpreadPrefetch {
    const char* next = nullptr;  // the block to fetch (none: bytes 0)
    int64_t bytes = 0, per_step = 0, done = 0;
    SpreadPrefetch() = default;
    template <typename C>
    SpreadPrefetch(const C* block, int64_t block_size, int64_t head_dim, int64_t steps)
        : next((const char*)block), bytes(block_size * head_dim * (int64_t)sizeof(C)) {
        per_step = (bytes / (steps > 0 ? steps : 1) + 63) / 64 * 64;
    }
    void step() {
        for (const int64_t end = done + per_step; done < end && done < bytes; done += 64)
            __builtin_prefetch(next + done, 0, 2);
    }
    void rest() {  // what the loop left (it ended early)
        for (; done < bytes; done += 64) __builtin_prefetch(next + done, 0, 2);
    }
};

// s[0..n) <- exp(s - max) / sum, LANES at a time.
inline void softmax(float* s, int64_t n) {
    float mx = s[0];
    int64_t i = 0;
    if (n >= LANES) {
        vf m = load_vf(s);
        for (i = LANES; i + LANES <= n; i += LANES) {
            const vf x = load_vf(s + i);
            m = x > m ? x : m;
        }
        mx = hmax(m);
    }
    for (; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
    vf vsum = {};
    float sum = 0.0f;
    for (i = 0; i + LANES <= n; i += LANES) {
        const vf e = exp_neg_lanes(load_vf(s + i) - mx);
        memcpy(s + i, &e, sizeof(vf));
        vsum += e;
    }
    for (; i < n; ++i) sum += (s[i] = exp_neg(s[i] - mx));
    const float inv = 1.0f / (hsum(vsum) + sum);
    for (i = 0; i + LANES <= n; i += LANES) {
        const vf e = load_vf(s + i) * inv;
        memcpy(s + i, &e, sizeof(vf));
    }
    for (; i < n; ++i) s[i] *= inv;
}

// Vectors of LANES a pass of block_scores (keys) or block_values (dims) takes per query head:
// 2 with 8 lanes where the 2 G accumulators leave registers over. NOTE: G chains of dependent
// multiply-adds alone wait on their latency: on Zen 3 (G 3) a lone decode's attention ran at
// ~15 GFLOP/s so. Each lane's arithmetic is the same whatever P is (a prompt's rows, which
// take the GR accumulators' P, get the floats of their decodes).
constexpr int parts_a_pass(int G) { return LANES == 8 && 2 * G <= 8 ? 2 : 1; }

// block_values' vectors a pass: with AVX-512's 32 registers, a 64-dim head's 4 vectors for up
// to 6 query heads (24 accumulators), so each key's weights feed 4 G independent multiply-adds
// where one vector a pass left G chains of one a key waiting on each other. The same floats
// (each lane's sum runs over the keys in the same order whatever P is). NOTE: Zen 4, SmolLM2's
// 30 layers at batch 64, ~147 keys: 14.5 ms against 18.0 (a C++ harness, blocks in order),
// 24.1 against 27.0 (bench/attention_pages.py, scattered, 2 MiB pages); in a step
// (bench/step_profile.py --op-by-op) 17.5 against 18.4, the 1B's 16 layers at batch 32 14.0
// against 15.2.
constexpr int value_parts(int G) {
    return LANES == 8 ? parts_a_pass(G) : G <= 6 ? 4 : G <= 12 ? 2 : 1;
}

// Scores of one block for G query heads sharing a kv head. kt [head_dim, block_size]: the
// block's keys transposed; n <= block_size of them are used; scores[g] gets n entries;
// `ahead`: the block to fetch meanwhile.
// G is a template argument so the per-head accumulators live in registers.
template <int G, typename C>
void block_scores(const float* qs, const C* kt, int64_t n, int64_t block_size,
                  int64_t head_dim, float* scores, int64_t stride,
                  SpreadPrefetch ahead = SpreadPrefetch()) {
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int64_t m = n - i0 < 16 ? n - i0 : 16;
        // NOTE: a block's last keys too (a sequence's last block is half full on average):
        // the unused slots' lanes are computed and dropped. Key by key, that last block cost
        // about as much as all the full ones (batch 64 at ~140 tokens: 16% of attention)
        if (i0 + 16 <= block_size) {  // LANES keys per multiply-add, no horizontal sums
            constexpr int P = parts_a_pass(G);
            for (int64_t j0 = 0; j0 < m; j0 += P * LANES) {
                vf s[G][P] = {};
                for (int64_t d = 0; d < head_dim; ++d) {
                    ahead.step();
                    vf k[P];  // maybe interleaved (load_parts), the scores with them
                    load_parts(kt + d * block_size + i0 + j0, k);
                    for (int g = 0; g < G; ++g) {
                        const vf qd = splat<vf>(qs[g * head_dim + d]);
                        for (int p = 0; p < P; ++p) s[g][p] = fused(qd, k[p], s[g][p]);
                    }
                }
                for (int g = 0; g < G; ++g) reorder_parts<P, C>(s[g]);
                for (int p = 0; p < P; ++p) {
                    const int64_t first = j0 + p * LANES;
                    const int64_t used = m - first < LANES ? m - first : LANES;
                    // NOTE: a whole vector's store where it is one: a variable length was a
                    // `rep movs`, a quarter of this function's time in a lone decode
                    for (int g = 0; used == LANES && g < G; ++g)
                        memcpy(scores + g * stride + i0 + first, &s[g][p], sizeof(vf));
                    for (int g = 0; used > 0 && used < LANES && g < G; ++g)
                        memcpy(scores + g * stride + i0 + first, &s[g][p], 4 * used);
                }
            }
        } else {
            for (int g = 0; g < G; ++g)
                for (int64_t i = 0; i < m; ++i) {
                    float dot = 0.0f;
                    for (int64_t d = 0; d < head_dim; ++d)
                        dot += qs[g * head_dim + d] * load(kt, d * block_size + i0 + i);
                    scores[g * stride + i0 + i] = dot;
                }
        }
    }
    ahead.rest();
}

// acc[g] += sum_i p[g][i] * v_i over one block's n rows v [block_size, head_dim], P LANES
// dims at a time with the G P accumulators in registers.
template <int G, int P, typename C>
void block_values_lanes(const float* p, int64_t stride, const C* v, int64_t n,
                        int64_t head_dim, float* acc, int64_t& d0, SpreadPrefetch& ahead) {
    // NOTE: a copy, written back at the end: through the reference, its count was stored to
    // memory every key (a tenth of this loop's perf samples on Zen 3)
    SpreadPrefetch fetch = ahead;
    fetch.per_step *= P;  // a key's step asks for P vectors' share of the block (one call, not P)
    for (; d0 + P * LANES <= head_dim; d0 += P * LANES) {
        vf a[G][P];
        // NOTE: a vector load each, not a memcpy of the array: GCC moved that through the
        // stack in 16-byte pieces (with both: one L3-resident layer 0.82 -> 0.68 ms, Zen 3)
        for (int g = 0; g < G; ++g)
            for (int q = 0; q < P; ++q) a[g][q] = load_vf(acc + g * head_dim + d0 + q * LANES);
        for (int g = 0; g < G; ++g) reorder_parts<P, C>(a[g]);  // in x's order of lanes
        for (int64_t i = 0; i < n; ++i) {
            fetch.step();
            vf x[P];
            load_parts(v + i * head_dim + d0, x);
            for (int g = 0; g < G; ++g) {
                const vf pi = splat<vf>(p[g * stride + i]);
                for (int q = 0; q < P; ++q) a[g][q] = fused(pi, x[q], a[g][q]);
            }
        }
        for (int g = 0; g < G; ++g) reorder_parts<P, C>(a[g]);
        for (int g = 0; g < G; ++g)
            for (int q = 0; q < P; ++q) store_vf(acc + g * head_dim + d0 + q * LANES, a[g][q]);
    }
    fetch.per_step /= P;
    ahead = fetch;
}

// acc[g] += sum_i p[g][i] * v_i over one block's n rows v [block_size, head_dim]; `ahead`: the
// block to fetch meanwhile.
template <int G, typename C>
void block_values(const float* p, int64_t stride, const C* v, int64_t n, int64_t head_dim,
                  float* acc, SpreadPrefetch ahead = SpreadPrefetch()) {
    int64_t d0 = 0;
    block_values_lanes<G, value_parts(G)>(p, stride, v, n, head_dim, acc, d0, ahead);
    if constexpr (value_parts(G) > 2)
        block_values_lanes<G, 2>(p, stride, v, n, head_dim, acc, d0, ahead);
    block_values_lanes<G, 1>(p, stride, v, n, head_dim, acc, d0, ahead);
    for (; d0 < head_dim; ++d0)
        for (int64_t i = 0; i < n; ++i)
            for (int g = 0; g < G; ++g)
                acc[g * head_dim + d0] += p[g * stride + i] * load(v, i * head_dim + d0);
    ahead.rest();
}

// One decode query per sequence, K/V read through the block table where they lie. q [seqs, heads,
// head_dim] float32 with rows q_stride apart; cache [2, kv_heads, num_blocks, block_size *
// head_dim] (K blocks transposed, see attention.py); tables [seqs, max_blocks]; out [seqs, heads,
// head_dim]. Two passes per (sequence, kv head): scores of every key, one softmax, then the
// weighted values. The blocks are read in one order (each pair's K blocks, then its V blocks, then
// the next pair's), and each block's work fetches the block AHEAD places after it in that order: a
// sequence's blocks lie anywhere in the cache. NOTE: counted within a pair, 8 blocks ahead skipped
// the first V blocks and the next pair's first K blocks of a sequence under 8 blocks (128 keys),
// and fetched blocks past its end. Zen 3, 30 layers of SmolLM2's attention at batch 64, ~147 keys
// (bench/attention_pages.py, 2 MiB pages): 46.9 ms so, 37.3 in this order with each block's fetch
// spread over the work before it (39.9 at 4 blocks ahead).
template <int G, typename C, typename O>
void decode_attention(const float* q, int64_t q_stride, const C* cache, const int64_t* tables,
                      const int64_t* seq_lens, int64_t seqs, int64_t max_blocks, int64_t heads,
                      int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                      int64_t head_dim, float scale, O* out) {
    constexpr int64_t AHEAD = 8;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const int64_t block_stride = block_size * head_dim;
    int64_t max_len = 0;
    for (int64_t s = 0; s < seqs; ++s) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int64_t stride = (max_len + 15) / 16 * 16;
    scratch.resize((size_t)(G * (stride + 2 * head_dim)));
    float* scores = scratch.data();              // [G, stride]
    float* qs = scores + G * stride;             // [G, head_dim]: q * scale
    float* acc = qs + G * head_dim;              // [G, head_dim]
    thread_local std::vector<const C*> order;    // every block, in the order they are read
    order.clear();
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t num_used = (seq_lens[s] + block_size - 1) / block_size;
        for (int64_t h = 0; h < kv_heads; ++h)
            for (const int64_t part : {h, kv_heads + h})  // the head's K, then its V
                for (int64_t b = 0; b < num_used; ++b)
                    order.push_back(cache + part * head_stride +
                                    tables[s * max_blocks + b] * block_stride);
    }
    const int64_t steps = block_size * head_dim / 16;  // of block_scores' and block_values' loops
    int64_t read = 0;                                  // blocks read so far
    auto ahead = [&]() {
        const int64_t i = read++ + AHEAD;
        return i < (int64_t)order.size() ? SpreadPrefetch(order[i], block_size, head_dim, steps)
                                         : SpreadPrefetch();
    };
    for (int64_t i = 0; i < AHEAD && i < (int64_t)order.size(); ++i)
        SpreadPrefetch(order[i], block_size, head_dim, 1).rest();
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t len = seq_lens[s];
        const int64_t num_used = (len + block_size - 1) / block_size;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const float* qh = q + s * q_stride + h * G * head_dim;
            for (int64_t i = 0; i < G * head_dim; ++i) qs[i] = qh[i] * scale;
            const C* const* k_blocks = order.data() + read;
            for (int64_t b = 0; b < num_used; ++b) {
                const int64_t n = len - b * block_size < block_size ? len - b * block_size
                                                                    : block_size;
                block_scores<G>(qs, k_blocks[b], n, block_size, head_dim,
                                scores + b * block_size, stride, ahead());
            }
            for (int g = 0; g < G; ++g) softmax(scores + g * stride, len);
            memset(acc, 0, sizeof(float) * G * head_dim);
            const C* const* v_blocks = order.data() + read;
            for (int64_t b = 0; b < num_used; ++b) {
                const int64_t n = len - b * block_size < block_size ? len - b * block_size
                                                                    : block_size;
                block_values<G>(scores + b * block_size, stride, v_blocks[b], n, head_dim, acc,
                                ahead());
            }
            O* oh = out + (s * heads + h * G) * head_dim;
            for (int64_t i = 0; i < G * head_dim; ++i) store(oh, i, acc[i]);
        }
    }
}

// f(std::integral_constant<int, G>{}) for the group sizes of common models (query heads per
// kv head, 1 to 8: the attention kernels' accumulators are G per row, in registers); false for
// another.
template <typename F> bool with_group(int64_t group, F f) {
    switch (group) {
        case 1: f(std::integral_constant<int, 1>{}); return true;
        case 2: f(std::integral_constant<int, 2>{}); return true;
        case 3: f(std::integral_constant<int, 3>{}); return true;
        case 4: f(std::integral_constant<int, 4>{}); return true;
        case 5: f(std::integral_constant<int, 5>{}); return true;
        case 6: f(std::integral_constant<int, 6>{}); return true;
        case 7: f(std::integral_constant<int, 7>{}); return true;
        case 8: f(std::integral_constant<int, 8>{}); return true;
        default: return false;
    }
}

template <typename C, typename O, typename... A> bool decode_attention_g(int64_t group, A... a) {
    return with_group(group, [&](auto g) { decode_attention<decltype(g)::value, C, O>(a...); });
}

// Query rows of one prompt a tile shares its K/V reads between: R rows x G heads accumulators,
// one a row and head in registers (block_scores / block_values), at most 16 with AVX-512's 32
// registers and 12 with AVX2's 16.
// NOTE: at 18 to 24 they spilled: 2,000-token prompts ran at 57 GFLOP/s so, 78 at 12 to 16,
// 64-72 row by row as decodes (Zen 4, one thread). On Zen 3 (AVX2, G 3, a 512-token prompt)
// 15 ran at 22 GFLOP/s, 12 at 26, 6 at 24.
constexpr int PROMPT_ACCUMULATORS = LANES == 16 ? 16 : 12;
constexpr int prompt_rows(int G) {
    return PROMPT_ACCUMULATORS / G < 8 ? PROMPT_ACCUMULATORS / G : 8;
}

// The query rows of prompts (prefill chunks), each row attending causally to its sequence's
// keys in the cache (this step's included). Each row's arithmetic is decode_attention's for
// that row alone, in the same order: its scores (computed for the tile's longest row, the
// lanes past its own length dropped), softmax over its own keys, then the weighted values
// with zero weights past its length (which add nothing). So a prompt attends to the same
// floats as its tokens would one by one as decodes (to rounding where one query head has a
// kv head to itself and head_dim is no multiple of 16: the compiler's scalar tails), with R
// rows reading each K/V block once where a decode reads it per row.
// q [tokens, heads, head_dim] float32 with rows q_stride apart; tables [seqs, max_blocks];
// starts [seqs + 1]: the first row of each sequence's queries (the last: the end); seq_lens
// [seqs]: keys after this step (a sequence's last row is its last key); out [tokens, heads,
// head_dim].
template <int G, typename C, typename O>
void prompt_attention(const float* q, int64_t q_stride, const C* cache, const int64_t* tables,
                      const int64_t* starts, const int64_t* seq_lens, int64_t seqs,
                      int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                      int64_t block_size, int64_t head_dim, float scale, O* out) {
    constexpr int R = prompt_rows(G), GR = G * R;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const int64_t block_stride = block_size * head_dim;
    int64_t max_len = 0;
    for (int64_t s = 0; s < seqs; ++s) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int64_t stride = (max_len + 15) / 16 * 16;
    scratch.resize((size_t)(GR * (stride + 2 * head_dim)));
    float* scores = scratch.data();              // [R][G][stride]
    float* qs = scores + GR * stride;            // [R][G][head_dim]: q * scale
    float* acc = qs + GR * head_dim;             // [R][G][head_dim]
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t rows = starts[s + 1] - starts[s];
        const int64_t first_len = seq_lens[s] - rows + 1;  // keys row 0 sees
        const int64_t* table = tables + s * max_blocks;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const C* k_head = cache + h * head_stride;
            const C* v_head = cache + (kv_heads + h) * head_stride;
            for (int64_t r0 = 0; r0 < rows; r0 += R) {
                // rows past the prompt's last repeat it (their outputs are not stored)
                int64_t lens[R];
                for (int r = 0; r < R; ++r) {
                    const int64_t row = r0 + r < rows ? r0 + r : rows - 1;
                    lens[r] = first_len + row;
                    const float* qh = q + (starts[s] + row) * q_stride + h * G * head_dim;
                    for (int64_t i = 0; i < G * head_dim; ++i)
                        qs[r * G * head_dim + i] = qh[i] * scale;
                }
                const int64_t len = lens[R - 1], num_used = (len + block_size - 1) / block_size;
                for (int64_t b = 0; b < num_used; ++b) {
                    const int64_t n = len - b * block_size < block_size ? len - b * block_size
                                                                        : block_size;
                    block_scores<GR>(qs, k_head + table[b] * block_stride, n, block_size,
                                     head_dim, scores + b * block_size, stride);
                }
                for (int r = 0; r < R; ++r)
                    for (int g = 0; g < G; ++g) {
                        float* row_scores = scores + (r * G + g) * stride;
                        softmax(row_scores, lens[r]);
                        for (int64_t i = lens[r]; i < len; ++i) row_scores[i] = 0.0f;
                    }
                memset(acc, 0, sizeof(float) * GR * head_dim);
                for (int64_t b = 0; b < num_used; ++b) {
                    const int64_t n = len - b * block_size < block_size ? len - b * block_size
                                                                        : block_size;
                    block_values<GR>(scores + b * block_size, stride,
                                     v_head + table[b] * block_stride, n, head_dim, acc);
                }
                for (int r = 0; r < R && r0 + r < rows; ++r) {
                    O* oh = out + ((starts[s] + r0 + r) * heads + h * G) * head_dim;
                    for (int64_t i = 0; i < G * head_dim; ++i)
                        store(oh, i, acc[r * G * head_dim + i]);
                }
            }
        }
    }
}

template <typename C, typename O, typename... A> bool prompt_attention_g(int64_t group, A... a) {
    return with_group(group, [&](auto g) { prompt_attention<decltype(g)::value, C, O>(a...); });
}

}  // namespace
}  // namespace llmq

#endif  // LLMQ_PAGED_ATTENTION_H
