// Decode attention read straight from the paged KV cache (CPU, float32): one query token per request.
//
// The cache is [num_slots, kv_heads, head_dim] with slot = block * block_size + offset. Each (request, KV head) task
// reads its context once through the block table (no gathered copy), computes the scores of the G query heads that
// share the KV head, a softmax, and the weighted sum of values. Tasks run in parallel with OpenMP.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_decode_attention_f32(
    const float *q,          // [B, H, D]
    const float *k_cache,    // [num_slots, KVH, D]
    const float *v_cache,    // [num_slots, KVH, D]
    const int64_t *tables,   // [B, max_blocks]
    const int64_t *lens,     // [B] context length of each request (>= 1)
    float *out,              // [B, H, D]
    int B, int H, int KVH, int D, int block_size, int max_blocks, float scale, int num_threads) {
    const int G = H / KVH;
#pragma omp parallel num_threads(num_threads)
    {
        size_t cap = 0;
        float *scores = NULL;  // [G, L] per thread
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < KVH; kh++) {
                const int64_t L = lens[b];
                if ((size_t)(G * L) > cap) {
                    free(scores);
                    cap = (size_t)G * L;
                    scores = (float *)malloc(cap * sizeof(float));
                }
                const float *qb = q + ((size_t)b * H + (size_t)kh * G) * D;
                const int64_t *table = tables + (size_t)b * max_blocks;
                for (int64_t t = 0; t < L; t++) {
                    const int64_t slot = table[t / block_size] * block_size + t % block_size;
                    const float *kt = k_cache + ((size_t)slot * KVH + kh) * D;
                    for (int g = 0; g < G; g++) {
                        const float *qg = qb + (size_t)g * D;
                        float s = 0.f;
                        for (int d = 0; d < D; d++) s += qg[d] * kt[d];
                        scores[(size_t)g * L + t] = s * scale;
                    }
                }
                for (int g = 0; g < G; g++) {
                    float *sg = scores + (size_t)g * L;
                    float m = -INFINITY;
                    for (int64_t t = 0; t < L; t++) m = sg[t] > m ? sg[t] : m;
                    float sum = 0.f;
                    for (int64_t t = 0; t < L; t++) {
                        sg[t] = expf(sg[t] - m);
                        sum += sg[t];
                    }
                    const float inv = 1.f / sum;
                    for (int64_t t = 0; t < L; t++) sg[t] *= inv;
                }
                float *ob = out + ((size_t)b * H + (size_t)kh * G) * D;
                memset(ob, 0, sizeof(float) * (size_t)G * D);
                for (int64_t t = 0; t < L; t++) {
                    const int64_t slot = table[t / block_size] * block_size + t % block_size;
                    const float *vt = v_cache + ((size_t)slot * KVH + kh) * D;
                    for (int g = 0; g < G; g++) {
                        const float p = scores[(size_t)g * L + t];
                        float *og = ob + (size_t)g * D;
                        for (int d = 0; d < D; d++) og[d] += p * vt[d];
                    }
                }
            }
        }
        free(scores);
    }
}

// Matrix-vector product for batch-1 decode: y[n] = W[n, :] . x (+ b[n]), W row-major [N, K].
// Memory-bound: each weight is read once; four rows at a time share the loads of x. On this project's 2-core AMD
// machine it streams the weights 20-30 % faster than torch's float32 linear does for a single row.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

static float dot_tail(const float *w, const float *x, int from, int K) {
    float s = 0.f;
    for (int k = from; k < K; k++) s += w[k] * x[k];
    return s;
}

void gemv_f32(const float *W, const float *x, const float *b, float *y, int N, int K) {
    int n = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const int K8 = K & ~7;
    for (; n + 4 <= N; n += 4) {
        const float *w0 = W + (size_t)n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int k = 0; k < K8; k += 8) {
            const __m256 xv = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
        }
        const __m256 acc[4] = {a0, a1, a2, a3};
        for (int r = 0; r < 4; r++) {
            __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            lo = _mm_hadd_ps(lo, lo);
            lo = _mm_hadd_ps(lo, lo);
            y[n + r] = _mm_cvtss_f32(lo) + dot_tail(W + (size_t)(n + r) * K, x, K8, K) + (b ? b[n + r] : 0.f);
        }
    }
#endif
    for (; n < N; n++) y[n] = dot_tail(W + (size_t)n * K, x, 0, K) + (b ? b[n] : 0.f);
}

// ---------------------------------------------------------------------------------------------------------------------
// 4-bit weights in groups of 32 (GGUF's Q4_1 block, byte for byte): {fp16 d, fp16 m, 16 bytes of nibbles}, weight =
// d * q + m with q in 0..15; byte j holds element j (low nibble) and element j + 16 (high nibble). Q4_0 converts with
// m = -8 d. As in llama.cpp's Q4_1 x Q8_1 dot product, activations are quantised per group of 32 to int8 (scale dx,
// and s = dx * sum(qx) for the m term) and the inner products are integer: sum(d q * dx qx) + m * s per group.
// A row of weights is unpacked once per group and used against every activation row (batch-1 GEMV and small batches).

typedef struct {
    uint16_t d, m;  // fp16
    uint8_t qs[16];
} block_q4_1;

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// x [M, K] float -> qx [M, K] int8, dx and sx [M, K/32]: per group of 32, dx = max|x| / 127, qx = round(x / dx).
void quantize_rows_q8(const float *x, int8_t *qx, float *dx, float *sx, int M, int K) {
    const int G = K / 32;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            const float *xs = x + (size_t)r * K + g * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xs[i]));
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int8_t *q = qx + (size_t)r * K + g * 32;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                q[i] = (int8_t)lrintf(xs[i] * id);
                sum += q[i];
            }
            dx[(size_t)r * G + g] = d;
            sx[(size_t)r * G + g] = d * (float)sum;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 dot_q4_q8(__m256i wq, const int8_t *xq) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, x));  // u8 x s8 -> 8 x int32
#else
    const __m256i p16 = _mm256_maddubs_epi16(wq, x);  // 16 x int16, |.| <= 2 * 15 * 127: no saturation
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}
#endif

// One weight row against R <= 4 quantised activation rows; out[r] = sum over groups of d dx dot + m sx.
static inline void q4_row(const block_q4_1 *row, const int8_t *qx, const float *dx, const float *sx, int R, int K,
                          int G, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (R == 1) {  // batch-1 decode: two accumulators so consecutive groups do not wait on one another
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        float mt = 0.f;
        int g = 0;
        for (; g + 2 <= G; g += 2) {
            const __m128i p0 = _mm_loadu_si128((const __m128i *)row[g].qs);
            const __m128i p1 = _mm_loadu_si128((const __m128i *)row[g + 1].qs);
            const __m256i w0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p0, 4), p0), low4);
            const __m256i w1 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p1, 4), p1), low4);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(row[g].d) * dx[g]), dot_q4_q8(w0, qx + g * 32), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(row[g + 1].d) * dx[g + 1]),
                                 dot_q4_q8(w1, qx + (g + 1) * 32), a1);
            mt += fp16_to_f32(row[g].m) * sx[g] + fp16_to_f32(row[g + 1].m) * sx[g + 1];
        }
        for (; g < G; g++) {
            const __m128i p0 = _mm_loadu_si128((const __m128i *)row[g].qs);
            const __m256i w0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p0, 4), p0), low4);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(row[g].d) * dx[g]), dot_q4_q8(w0, qx + g * 32), a0);
            mt += fp16_to_f32(row[g].m) * sx[g];
        }
        out[0] = hsum256(_mm256_add_ps(a0, a1)) + mt;
        return;
    }
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    float m0 = 0.f, m1 = 0.f, m2 = 0.f, m3 = 0.f;
    for (int g = 0; g < G; g++) {  // rows past R read row 0's activations again and are dropped
        const float d = fp16_to_f32(row[g].d), m = fp16_to_f32(row[g].m);
        const __m128i p = _mm_loadu_si128((const __m128i *)row[g].qs);
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low4);
        const size_t r1 = R > 1 ? 1 : 0, r2 = R > 2 ? 2 : 0, r3 = R > 3 ? 3 : 0;
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[g]), dot_q4_q8(w, qx + g * 32), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r1 * G + g]), dot_q4_q8(w, qx + r1 * K + g * 32), a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r2 * G + g]), dot_q4_q8(w, qx + r2 * K + g * 32), a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r3 * G + g]), dot_q4_q8(w, qx + r3 * K + g * 32), a3);
        m0 += m * sx[g];
        m1 += m * sx[r1 * G + g];
        m2 += m * sx[r2 * G + g];
        m3 += m * sx[r3 * G + g];
    }
    const float res[4] = {hsum256(a0) + m0, hsum256(a1) + m1, hsum256(a2) + m2, hsum256(a3) + m3};
    for (int r = 0; r < R; r++) out[r] = res[r];
#else
    for (int r = 0; r < R; r++) {
        float acc = 0.f, mt = 0.f;
        for (int g = 0; g < G; g++) {
            const int8_t *q = qx + (size_t)r * K + g * 32;
            int dot = 0;
            for (int j = 0; j < 16; j++) dot += (row[g].qs[j] & 15) * q[j] + (row[g].qs[j] >> 4) * q[j + 16];
            acc += fp16_to_f32(row[g].d) * dx[(size_t)r * G + g] * (float)dot;
            mt += fp16_to_f32(row[g].m) * sx[(size_t)r * G + g];
        }
        out[r] = acc + mt;
    }
#endif
}

// y[M, N] = x[M, K] . W[N, K]^T (+ b): W as N rows of K/32 blocks; K a multiple of 32. Rows of W split over threads.
void q4_matmul_f32(const block_q4_1 *W, const float *x, const float *b, float *y, int M, int N, int K, int num_threads) {
    const int G = K / 32;
    int8_t *qx = (int8_t *)malloc((size_t)M * K);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G);
    float *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    quantize_rows_q8(x, qx, dx, sx, M, K);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const block_q4_1 *row = W + (size_t)n * G;
        for (int r0 = 0; r0 < M; r0 += 4) {
            const int R = M - r0 < 4 ? M - r0 : 4;
            float out[4];
            q4_row(row, qx + (size_t)r0 * K, dx + (size_t)r0 * G, sx + (size_t)r0 * G, R, K, G, out);
            for (int r = 0; r < R; r++) y[(size_t)(r0 + r) * N + n] = out[r] + (b ? b[n] : 0.f);
        }
    }
    free(qx);
    free(dx);
    free(sx);
}

// Q4_1 blocks [N, K/32] -> float32 W [N, K] (the large-batch path dequantises a layer and calls float GEMM).
void q4_dequantize_f32(const block_q4_1 *W, float *out, int N, int K, int num_threads) {
    const int G = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        for (int g = 0; g < G; g++) {
            const block_q4_1 *blk = W + (size_t)n * G + g;
            const float d = fp16_to_f32(blk->d), m = fp16_to_f32(blk->m);
            float *o = out + (size_t)n * K + g * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(blk->qs[j] & 15) + m;
                o[j + 16] = d * (float)(blk->qs[j] >> 4) + m;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// 8-bit weights in groups of 32 (GGUF's Q8_0 block, byte for byte): {fp16 d, 32 x int8}, weight = d * q. Activations
// are quantised per group of 32 as above (llama.cpp's Q8_0 x Q8_0 dot product). Per-group scales on both sides keep
// the error at ~0.5 % per layer; torch's fbgemm dynamic int8 linear (one activation scale per call, 7 bits) measured
// +58 % perplexity on SmolLM2-135M, +15 % with 8-bit activations.
typedef struct {
    uint16_t d;  // fp16
    int8_t qs[32];
} block_q8_0;

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 dot_q8_q8(const int8_t *wq, const int8_t *xq) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)wq);
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i aw = _mm256_sign_epi8(w, w), sx = _mm256_sign_epi8(x, w);  // |w| * (x * sign w) = w * x
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}
#endif

static inline void q8_row(const block_q8_0 *row, const int8_t *qx, const float *dx, int R, int K, int G, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (R == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int g = 0;
        for (; g + 2 <= G; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(row[g].d) * dx[g]), dot_q8_q8(row[g].qs, qx + g * 32), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(row[g + 1].d) * dx[g + 1]),
                                 dot_q8_q8(row[g + 1].qs, qx + (g + 1) * 32), a1);
        }
        for (; g < G; g++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(row[g].d) * dx[g]), dot_q8_q8(row[g].qs, qx + g * 32), a0);
        out[0] = hsum256(_mm256_add_ps(a0, a1));
        return;
    }
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const size_t r1 = R > 1 ? 1 : 0, r2 = R > 2 ? 2 : 0, r3 = R > 3 ? 3 : 0;
    for (int g = 0; g < G; g++) {
        const float d = fp16_to_f32(row[g].d);
        const __m256i w = _mm256_loadu_si256((const __m256i *)row[g].qs);
        const __m256i aw = _mm256_sign_epi8(w, w);
#define Q8_ACC(acc, r)                                                                                  \
    {                                                                                                   \
        const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + (r) * K + g * 32));                 \
        const __m256i sx = _mm256_sign_epi8(x, w);                                                      \
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));        \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[(r) * G + g]), _mm256_cvtepi32_ps(p), acc);         \
    }
        Q8_ACC(a0, 0)
        Q8_ACC(a1, r1)
        Q8_ACC(a2, r2)
        Q8_ACC(a3, r3)
#undef Q8_ACC
    }
    const float res[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};
    for (int r = 0; r < R; r++) out[r] = res[r];
#else
    for (int r = 0; r < R; r++) {
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            const int8_t *q = qx + (size_t)r * K + g * 32;
            int dot = 0;
            for (int j = 0; j < 32; j++) dot += row[g].qs[j] * q[j];
            acc += fp16_to_f32(row[g].d) * dx[(size_t)r * G + g] * (float)dot;
        }
        out[r] = acc;
    }
#endif
}

void q8_matmul_f32(const block_q8_0 *W, const float *x, const float *b, float *y, int M, int N, int K, int num_threads) {
    const int G = K / 32;
    int8_t *qx = (int8_t *)malloc((size_t)M * K);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G);
    float *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    quantize_rows_q8(x, qx, dx, sx, M, K);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const block_q8_0 *row = W + (size_t)n * G;
        for (int r0 = 0; r0 < M; r0 += 4) {
            const int R = M - r0 < 4 ? M - r0 : 4;
            float out[4];
            q8_row(row, qx + (size_t)r0 * K, dx + (size_t)r0 * G, R, K, G, out);
            for (int r = 0; r < R; r++) y[(size_t)(r0 + r) * N + n] = out[r] + (b ? b[n] : 0.f);
        }
    }
    free(qx);
    free(dx);
    free(sx);
}

void q8_dequantize_f32(const block_q8_0 *W, float *out, int N, int K, int num_threads) {
    const int G = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        for (int g = 0; g < G; g++) {
            const block_q8_0 *blk = W + (size_t)n * G + g;
            const float d = fp16_to_f32(blk->d);
            float *o = out + (size_t)n * K + g * 32;
            for (int j = 0; j < 32; j++) o[j] = d * (float)blk->qs[j];
        }
    }
}
