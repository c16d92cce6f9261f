/* The SNAC decoder's element-wise hot spots on CPU, float32, one thread each call (codecs/codec_kernels.py).
 * Compiled with -ffast-math so that sinf vectorises (glibc's libmvec, 8 or 16 lanes). */
#include <math.h>
#include <stdint.h>

/* Snake, y = x + inv_alpha[c] * sin(alpha[c] * x)^2, in one pass over (rows x channels x steps): ~6x the eager torch
 * form (five passes over memory, one of them a scalar-rate sin), within ~1e-6 of it. */

void snake_f32(const float *x, float *y, const float *alpha, const float *inv_alpha, int64_t rows, int64_t channels,
               int64_t steps) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < channels; c++) {
            const float a = alpha[c], ia = inv_alpha[c];
            const float *xi = x + (r * channels + c) * steps;
            float *yi = y + (r * channels + c) * steps;
#pragma omp simd
            for (int64_t t = 0; t < steps; t++) {
                const float s = sinf(a * xi[t]);
                yi[t] = xi[t] + ia * (s * s);
            }
        }
}

/* Depthwise Conv1d, stride 1: y[r,c,t] = b[c] + sum_j w[c,j] * xp[r,c,t + j*d], xp = x zero-padded by `pad` each side;
 * x (rows x C x T), y (rows x C x T_out), T_out = T + 2 pad - d (k - 1). The same sums in the same order as
 * snac_fast.ShiftedDepthwise's k shifted multiply-adds, in one pass per channel row that stays in cache (3-4x). */
void depthwise_f32(const float *x, float *y, const float *w, const float *b, int64_t rows, int64_t channels,
                   int64_t steps, int64_t k, int64_t d, int64_t pad) {
    const int64_t out_len = steps + 2 * pad - d * (k - 1);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < channels; c++) {
            const float *xi = x + (r * channels + c) * steps;
            float *yi = y + (r * channels + c) * out_len;
            const float *wc = w + c * k;
            const float bc = b[c];
            for (int64_t t = 0; t < out_len; t++) yi[t] = bc;
            for (int64_t j = 0; j < k; j++) {
                const float wj = wc[j];
                /* output t reads input s = t + j*d - pad, valid for 0 <= s < steps */
                int64_t lo = pad - j * d; if (lo < 0) lo = 0;
                int64_t hi = steps + pad - j * d; if (hi > out_len) hi = out_len;
                const float *xs = xi + (j * d - pad);
#pragma omp simd
                for (int64_t t = lo; t < hi; t++) yi[t] += wj * xs[t];
            }
        }
}
