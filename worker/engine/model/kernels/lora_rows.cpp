// lora_rows.cpp: every adapter segment's low-rank add for one projection, in one call
// (worker/engine/lora/lora_batch.py says which rows run under which adapter; cpu_kernels.py
// builds this file with the others and binds it).
//
// y[rows] += (x[rows] A) B for each segment, with its adapter's A [in, rank] (the fused parts'
// A side by side, zero columns up to a multiple of 16) and each part's B [rank_p, cols_p] added
// into that part's columns of y. In torch that is two small GEMMs (or one per part) per segment,
// a few microseconds of dispatch each: ~2,000 calls a step for 8 adapters over 30 layers,
// more than the products cost. Here it is one call per projection, each weight read once per
// block of four rows, and no product of a B's zero blocks.
//
// Reference: Punica / S-LoRA's segmented GEMM (`bgmv` / `sgmv`): a batch's rows grouped by
// adapter, each group multiplied by its own low-rank pair.

#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "vec16.h"

namespace llmq {
namespace {

// The layouts of cpu_kernels.py's `LoraBlock`, `LoraProj` and `LoraSegment` (ctypes).
struct LoraBlock {
    const float* b;  // [rank, cols] row-major, the adapter's scaling folded in
    int64_t rank_offset, rank, col_start, cols;
};
struct LoraProj {
    const float* a;  // [in, rank_padded] row-major; null: the adapter leaves this projection
    int64_t in_features, rank_padded, num_blocks;
    LoraBlock blocks[3];
};
struct LoraSegment {
    int64_t start, end;  // the rows [start, end) of x and y
    const LoraProj* table;  // the adapter's projections, by adapter.py `projection_index`
    int64_t table_len;
};

// NOTE: with AVX-512, 4 x 4 (16 accumulators, 4 weight vectors): 8 x 2, 6 x 2 and 4 x 2
// measured the same at 8 and 64 rows; a step's time goes to reading 8 adapters' weights from
// memory. With AVX2's 16 registers, 4 x 2 of its 8-lane vectors: GCC's 16-lane ones spilt
// there (see vec16.h's LANES), and on Zen 3 8 adapters' batch ran at 0.70x the base model's
// tokens/s so, 0.92x in these (bench/lora.py, 64 requests, one run after the other).
constexpr int ROWS = 4;  // rows a tile holds: each weight vector is loaded once for them
constexpr int CHUNKS = LANES == 16 ? 4 : 2;  // vectors of LANES columns a tile holds

// f(std::integral_constant<int, n>()) for a runtime n in 1..MAX: a tile's size is a template
// argument, so its accumulators stay in registers.
template <int MAX, typename F>
void with_size(int64_t n, F f) {
    if constexpr (MAX > 0) {
        if (n == MAX) f(std::integral_constant<int, MAX>());
        else with_size<MAX - 1>(n, f);
    }
}

// xa[r, c] = x[r] . A[:, c] for R rows and C LANES-column chunks of A.
template <int R, int C, typename X>
void xa_tile(const X* x, int64_t x_stride, int64_t in, const float* a, int64_t a_stride,
             float* xa, int64_t xa_stride) {
    vf acc[R][C] = {};
    for (int64_t i = 0; i < in; i++) {
        vf av[C];
        for (int c = 0; c < C; c++) av[c] = load_vf(a + i * a_stride + LANES * c);
        for (int r = 0; r < R; r++) {
            const vf xv = splat<vf>(load(x + r * x_stride, i));
            for (int c = 0; c < C; c++) acc[r][c] = fused(xv, av[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) store_vf(xa + r * xa_stride + LANES * c, acc[r][c]);
}

template <int R, typename X>
void xa_rows(const X* x, int64_t x_stride, const LoraProj& p, float* xa) {
    const int64_t chunks = p.rank_padded / LANES, stride = p.rank_padded;
    int64_t c = 0;
    for (; c + CHUNKS <= chunks; c += CHUNKS)
        xa_tile<R, CHUNKS>(x, x_stride, p.in_features, p.a + LANES * c, stride, xa + LANES * c,
                           stride);
    with_size<CHUNKS - 1>(chunks - c, [&](auto n) {
        xa_tile<R, decltype(n)::value>(x, x_stride, p.in_features, p.a + LANES * c, stride,
                                       xa + LANES * c, stride);
    });
}

// y[r, LANES C columns] += xa[r, :rank] B[:, those columns] for R rows.
template <int R, int C, typename Y>
void b_tile(const float* xa, int64_t xa_stride, int64_t rank, const float* b, int64_t b_stride,
            Y* y, int64_t y_stride) {
    vf acc[R][C] = {};
    for (int64_t k = 0; k < rank; k++) {
        vf bv[C];
        for (int c = 0; c < C; c++) bv[c] = load_vf(b + k * b_stride + LANES * c);
        for (int r = 0; r < R; r++) {
            const vf s = splat<vf>(xa[r * xa_stride + k]);
            for (int c = 0; c < C; c++) acc[r][c] = fused(s, bv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            Y* out = y + r * y_stride + LANES * c;
            store_vf(out, load_vf(out) + acc[r][c]);
        }
}

template <int R, typename Y>
void b_rows(const float* xa, int64_t xa_stride, const LoraBlock& block, Y* y, int64_t y_stride) {
    const float* xb = xa + block.rank_offset;
    Y* yb = y + block.col_start;
    int64_t j = 0;
    for (; j + LANES * CHUNKS <= block.cols; j += LANES * CHUNKS)
        b_tile<R, CHUNKS>(xb, xa_stride, block.rank, block.b + j, block.cols, yb + j, y_stride);
    for (; j + LANES <= block.cols; j += LANES)
        b_tile<R, 1>(xb, xa_stride, block.rank, block.b + j, block.cols, yb + j, y_stride);
    for (; j < block.cols; j++)  // the last columns of a width that is no multiple of LANES
        for (int r = 0; r < R; r++) {
            float sum = 0.f;
            for (int64_t k = 0; k < block.rank; k++)
                sum += xb[r * xa_stride + k] * block.b[k * block.cols + j];
            store(yb + r * y_stride, j, load(yb + r * y_stride, j) + sum);
        }
}

// Rows [0, R) of x and y: x A into xa, then each block's B into its columns.
template <int R, typename X, typename Y>
void rows_tile(const X* x, int64_t x_stride, const LoraProj& p, float* xa, Y* y,
               int64_t y_stride) {
    xa_rows<R>(x, x_stride, p, xa);
    for (int64_t i = 0; i < p.num_blocks; i++)
        b_rows<R>(xa, p.rank_padded, p.blocks[i], y, y_stride);
}

template <typename X, typename Y>
void lora_add(const X* x, int64_t x_stride, Y* y, int64_t y_stride,
              const LoraSegment* segments, int64_t num_segments, int64_t projection) {
    thread_local std::vector<float> xa;
    for (int64_t s = 0; s < num_segments; s++) {
        const LoraSegment& seg = segments[s];
        if (projection >= seg.table_len || seg.table[projection].a == nullptr) continue;
        const LoraProj& p = seg.table[projection];
        if ((int64_t)xa.size() < ROWS * p.rank_padded) xa.resize(ROWS * p.rank_padded);
        int64_t r = seg.start;
        for (; r + ROWS <= seg.end; r += ROWS)
            rows_tile<ROWS>(x + r * x_stride, x_stride, p, xa.data(), y + r * y_stride, y_stride);
        with_size<ROWS - 1>(seg.end - r, [&](auto n) {
            rows_tile<decltype(n)::value>(x + r * x_stride, x_stride, p, xa.data(),
                                          y + r * y_stride, y_stride);
        });
    }
}

}  // namespace
}  // namespace llmq

extern "C" {

// x [rows, in] and y [rows, out] float32 (0) or bfloat16 (1), rows x_stride / y_stride apart;
// `projection` indexes each segment's table. y is updated in place.
void llmq_lora_add(const void* x, int32_t x_bf16, int64_t x_stride, void* y, int32_t y_bf16,
                   int64_t y_stride, const void* segments, int64_t num_segments,
                   int64_t projection) {
    using namespace llmq;
    const LoraSegment* segs = (const LoraSegment*)segments;
    typed(x_bf16, [&](auto* xt) {
        using X = std::remove_pointer_t<decltype(xt)>;
        typed(y_bf16, [&](auto* yt) {
            using Y = std::remove_pointer_t<decltype(yt)>;
            lora_add((const X*)x, x_stride, (Y*)y, y_stride, segs, num_segments, projection);
        });
    });
}

}  // extern "C"
