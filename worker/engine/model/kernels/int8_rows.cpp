// int8_rows.cpp: the int8 row kernels of Int8Matrix (int8_matrix.py says why two int8 terms a
// row), called through ctypes; cpu_kernels.py builds them with the layer kernels.

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
namespace {

// x [rows, k] float32 (rows x_stride apart) -> q [2 * rows, k] int8 and scales [2 * rows]:
// row m is s[m] * q[m] + s[rows + m] * q[rows + m], the second term quantizing the first's
// remainder. A zero row gets scale 0 and q 0. Rounding is to nearest even in both the AVX-512
// lanes and the tail; the remainder is one fused multiply-add in both.
void quantize_rows_x2(const float* x, int64_t x_stride, int64_t rows, int64_t k, int8_t* q,
                      float* scales) {
    for (int64_t m = 0; m < rows; m++) {
        const float* xr = x + m * x_stride;
        int8_t* q1 = q + m * k;
        int8_t* q2 = q + (rows + m) * k;
        float amax = 0.f;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 vmax = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16)
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xr + i)));
        amax = _mm512_reduce_max_ps(vmax);
#endif
        for (; i < k; i++) amax = fmaxf(amax, fabsf(xr[i]));
        float s1 = amax / 127.f, inv1 = amax > 0.f ? 127.f / amax : 0.f;

        float rmax = 0.f;
        i = 0;
#ifdef __AVX512F__
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512 vinv1 = _mm512_set1_ps(inv1), vs1 = _mm512_set1_ps(s1);
        __m512 vrmax = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) {
            __m512 xv = _mm512_loadu_ps(xr + i);
            __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(xv, vinv1), round);
            _mm_storeu_si128((__m128i*)(q1 + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
            vrmax = _mm512_max_ps(vrmax, _mm512_abs_ps(_mm512_fnmadd_ps(v, vs1, xv)));
        }
        rmax = _mm512_reduce_max_ps(vrmax);
#endif
        for (; i < k; i++) {
            float v = nearbyintf(xr[i] * inv1);
            q1[i] = (int8_t)v;
            rmax = fmaxf(rmax, fabsf(fmaf(-v, s1, xr[i])));
        }
        float s2 = rmax / 127.f, inv2 = rmax > 0.f ? 127.f / rmax : 0.f;

        i = 0;
#ifdef __AVX512F__
        __m512 vinv2 = _mm512_set1_ps(inv2);
        for (; i + 16 <= k; i += 16) {
            __m512 xv = _mm512_loadu_ps(xr + i);
            __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(xv, vinv1), round);
            __m512 r = _mm512_fnmadd_ps(v, vs1, xv);
            __m512 v2 = _mm512_roundscale_ps(_mm512_mul_ps(r, vinv2), round);
            _mm_storeu_si128((__m128i*)(q2 + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v2)));
        }
#endif
        for (; i < k; i++) {
            float v = nearbyintf(xr[i] * inv1);
            q2[i] = (int8_t)nearbyintf(fmaf(-v, s1, xr[i]) * inv2);
        }
        scales[m] = s1;
        scales[rows + m] = s2;
    }
}

// acc [2 * rows, n] int32 = q x Wq^T -> y [rows, n] float32 (rows y_stride apart):
// (s1 * acc[m] + s2 * acc[rows + m]) * w_scale (+ bias).
void dequantize_rows_x2(const int32_t* acc, int64_t rows, int64_t n, const float* scales,
                        const float* w_scale, const float* bias, float* y, int64_t y_stride) {
    for (int64_t m = 0; m < rows; m++) {
        const int32_t* a1 = acc + m * n;
        const int32_t* a2 = acc + (rows + m) * n;
        float s1 = scales[m], s2 = scales[rows + m];
        float* yr = y + m * y_stride;
        if (bias) {
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                yr[j] = ((float)a1[j] * s1 + (float)a2[j] * s2) * w_scale[j] + bias[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                yr[j] = ((float)a1[j] * s1 + (float)a2[j] * s2) * w_scale[j];
        }
    }
}

}  // namespace

extern "C" {

void llmq_quantize_rows_x2(const float* x, int64_t x_stride, int64_t rows, int64_t k,
                           int8_t* q, float* scales) {
    quantize_rows_x2(x, x_stride, rows, k, q, scales);
}

void llmq_dequantize_rows_x2(const int32_t* acc, int64_t rows, int64_t n, const float* scales,
                             const float* w_scale, const float* bias, float* y,
                             int64_t y_stride) {
    dequantize_rows_x2(acc, rows, n, scales, w_scale, bias, y, y_stride);
}

}
