// Decode attention read straight from the paged KV cache (CPU, float32): one query token per request.
//
// The cache is [num_slots, kv_heads, head_dim] with slot = block * block_size + offset. Each (request, KV head) task
// reads its context once through the block table (no gathered copy), computes the scores of the G query heads that
// share the KV head, a softmax, and the weighted sum of values. Tasks run in parallel with OpenMP.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// q . k over D floats: 8 lanes at a time where D allows (a scalar sum is a dependent chain the compiler may not
// reorder: at 16 decode rows the scalar q.k loop was a quarter of the block kernels' time).
static inline float dot_f32(const float *a, const float *b, int D) {
#if defined(__AVX2__) && defined(__FMA__)
    if ((D & 15) == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
        }
        s0 = _mm256_add_ps(s0, s1);
        __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
        lo = _mm_hadd_ps(lo, lo);
        lo = _mm_hadd_ps(lo, lo);
        return _mm_cvtss_f32(lo);
    }
#endif
    float s = 0.f;
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

void paged_decode_attention_f32(
    const float *q,          // [B, H, D]
    const float *k_cache,    // [num_slots, KVH, D]
    const float *v_cache,    // [num_slots, KVH, D]
    const int64_t *tables,   // [B, max_blocks]
    const int64_t *lens,     // [B] context length of each request (>= 1)
    float *out,              // [B, H, D]
    int B, int H, int KVH, int D, int block_size, int max_blocks, float scale, int num_threads,
    int window) {            // > 0: a sliding window, the query sees only the last `window` keys (0: all)
    const int G = H / KVH;
#pragma omp parallel num_threads(num_threads)
    {
        size_t cap = 0;
        float *scores = NULL;  // [G, L] per thread
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++) {
            for (int kh = 0; kh < KVH; kh++) {
                const int64_t S = window > 0 && lens[b] > window ? lens[b] - window : 0;  // first key seen
                const int64_t L = lens[b] - S;
                if ((size_t)(G * L) > cap) {
                    free(scores);
                    cap = (size_t)G * L;
                    scores = (float *)malloc(cap * sizeof(float));
                }
                const float *qb = q + ((size_t)b * H + (size_t)kh * G) * D;
                const int64_t *table = tables + (size_t)b * max_blocks;
                for (int64_t t = 0; t < L; t++) {
                    const int64_t slot = table[(S + t) / block_size] * block_size + (S + t) % block_size;
                    const float *kt = k_cache + ((size_t)slot * KVH + kh) * D;
                    for (int g = 0; g < G; g++) scores[(size_t)g * L + t] = dot_f32(qb + (size_t)g * D, kt, D) * scale;
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
                    const int64_t slot = table[(S + t) / block_size] * block_size + (S + t) % block_size;
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
// Weights in groups of 32, in GGUF's own blocks byte for byte:
// - Q4_1 {fp16 d, fp16 m, 16 bytes of nibbles}: weight = d * q + m, q in 0..15; byte j holds element j (low nibble)
//   and element j + 16 (high nibble). Q4_0 converts with m = -8 d.
// - Q8_0 {fp16 d, 32 x int8}: weight = d * q.
// Activations are quantised per group of 32 to int16 (scale dx = max|x| / 32767) and the inner products are integer
// (int16 x int16 -> int32, exact), accumulated in float32 per group: y = sum_g d dx dot(q, qx) (+ m * sum_g x).
// llama.cpp uses int8 activations (Q8_0 / Q8_1) here; on SmolLM2-135M those flipped the first token of "What is the
// capital of France?" (a 0.08-logit tie between "The" and "L" at the lm_head) and 3 % of teacher-forced tokens;
// int16 activations are within ~1e-5 of float activations and cost about the same (the loop is bound by unpacking).
// A row of weights is unpacked once per group and used against up to 4 activation rows (batch-1 GEMV and small
// batches).

typedef struct {
    uint16_t d, m;  // fp16
    uint8_t qs[16];
} block_q4_1;

typedef struct {
    uint16_t d;  // fp16
    int8_t qs[32];
} block_q8_0;

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

// x [M, K] float -> qx [M, K] int16, dx and sx [M, K/32]: per group of 32, dx = max|x| / 32767, qx = round(x / dx),
// sx = the group's float sum of x (for the Q4_1 offset term).
void quantize_rows_q16(const float *x, int16_t *qx, float *dx, float *sx, int M, int K) {
    const int G = K / 32;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            const float *xs = x + (size_t)r * K + g * 32;
            float amax = 0.f, sum = 0.f;
            for (int i = 0; i < 32; i++) {
                amax = fmaxf(amax, fabsf(xs[i]));
                sum += xs[i];
            }
            const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
            int16_t *q = qx + (size_t)r * K + g * 32;
            for (int i = 0; i < 32; i++) q[i] = (int16_t)lrintf(xs[i] * id);
            dx[(size_t)r * G + g] = d;
            sx[(size_t)r * G + g] = sum;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

// 32 int16 weights (w0: elements 0..15, w1: 16..31) . 32 int16 activations -> 8 int32 partial sums, as floats.
static inline __m256 dot16(__m256i w0, __m256i w1, const int16_t *x) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpwssd_epi32(_mm256_madd_epi16(w0, x0), w1, x1));
#else
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)));
#endif
}

static inline void unpack_q4(const block_q4_1 *b, __m256i *w0, __m256i *w1) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b->qs));  // 16 bytes -> 16 x int16
    *w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));  // low nibbles: elements 0..15
    *w1 = _mm256_srli_epi16(v, 4);                        // high nibbles: elements 16..31
}

static inline void unpack_q8(const block_q8_0 *b, __m256i *w0, __m256i *w1) {
    *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->qs));
    *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b->qs + 16)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// One weight row against R (2..4, a constant after inlining) activation rows: each block unpacked once.
static inline __attribute__((always_inline)) void rows_q16(const void *row_ptr, int is_q4, const int16_t *qx,
                                                           const float *dx, const float *sx, int K, int G,
                                                           float *out, const int R) {
    const block_q4_1 *r4 = (const block_q4_1 *)row_ptr;
    const block_q8_0 *r8 = (const block_q8_0 *)row_ptr;
    __m256 acc[4];
    float mt[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        mt[r] = 0.f;
    }
    for (int g = 0; g < G; g++) {
        __m256i w0, w1;
        float d;
        if (is_q4) {
            unpack_q4(r4 + g, &w0, &w1);
            d = fp16_to_f32(r4[g].d);
            const float m = fp16_to_f32(r4[g].m);
            for (int r = 0; r < R; r++) mt[r] += m * sx[(size_t)r * G + g];
        } else {
            unpack_q8(r8 + g, &w0, &w1);
            d = fp16_to_f32(r8[g].d);
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[(size_t)r * G + g]), dot16(w0, w1, qx + (size_t)r * K + g * 32),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]) + mt[r];
}
#endif

// One weight row against R <= 4 activation rows: out[r] = sum over groups of d dx dot (+ m sx for Q4_1).
// IS_Q4 is a compile-time constant at each call, so each format gets its own loop.
static inline void block_row(const void *row_ptr, int is_q4, const int16_t *qx, const float *dx, const float *sx,
                             int R, int K, int G, float *out) {
    const block_q4_1 *r4 = (const block_q4_1 *)row_ptr;
    const block_q8_0 *r8 = (const block_q8_0 *)row_ptr;
#if defined(__AVX2__) && defined(__FMA__)
    __m256i w0, w1;
    if (R == 1) {  // batch-1 decode: two accumulators so consecutive groups do not wait on one another
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        float mt = 0.f;
        int g = 0;
        for (; g + 2 <= G; g += 2) {
            for (int h = 0; h < 2; h++) {
                float d;
                if (is_q4) {
                    unpack_q4(r4 + g + h, &w0, &w1);
                    d = fp16_to_f32(r4[g + h].d);
                    mt += fp16_to_f32(r4[g + h].m) * sx[g + h];
                } else {
                    unpack_q8(r8 + g + h, &w0, &w1);
                    d = fp16_to_f32(r8[g + h].d);
                }
                const __m256 p = dot16(w0, w1, qx + (g + h) * 32);
                if (h == 0)
                    a0 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[g + h]), p, a0);
                else
                    a1 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[g + h]), p, a1);
            }
        }
        for (; g < G; g++) {
            float d;
            if (is_q4) {
                unpack_q4(r4 + g, &w0, &w1);
                d = fp16_to_f32(r4[g].d);
                mt += fp16_to_f32(r4[g].m) * sx[g];
            } else {
                unpack_q8(r8 + g, &w0, &w1);
                d = fp16_to_f32(r8[g].d);
            }
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[g]), dot16(w0, w1, qx + g * 32), a0);
        }
        out[0] = hsum256(_mm256_add_ps(a0, a1)) + mt;
        return;
    }
    switch (R) {  // a constant row count per call: no dummy rows computed, accumulators kept in registers
        case 2: rows_q16(row_ptr, is_q4, qx, dx, sx, K, G, out, 2); return;
        case 3: rows_q16(row_ptr, is_q4, qx, dx, sx, K, G, out, 3); return;
        default: rows_q16(row_ptr, is_q4, qx, dx, sx, K, G, out, 4); return;
    }
#else
    for (int r = 0; r < R; r++) {
        float acc = 0.f, mt = 0.f;
        for (int g = 0; g < G; g++) {
            const int16_t *q = qx + (size_t)r * K + g * 32;
            int dot = 0;
            float d;
            if (is_q4) {
                for (int j = 0; j < 16; j++) dot += (r4[g].qs[j] & 15) * q[j] + (r4[g].qs[j] >> 4) * q[j + 16];
                d = fp16_to_f32(r4[g].d);
                mt += fp16_to_f32(r4[g].m) * sx[(size_t)r * G + g];
            } else {
                for (int j = 0; j < 32; j++) dot += r8[g].qs[j] * q[j];
                d = fp16_to_f32(r8[g].d);
            }
            acc += d * dx[(size_t)r * G + g] * (float)dot;
        }
        out[r] = acc + mt;
    }
#endif
}

// y[M, N] = x[M, K] . W[N, K]^T (+ b) for W as N rows of K/32 blocks (K a multiple of 32), activations already
// quantised (quantize_rows_q16). Rows of W split over threads.
static void block_matmul_q16(const uint8_t *W, int is_q4, const int16_t *qx, const float *dx, const float *sx,
                             const float *b, float *y, int M, int N, int K, int num_threads) {
    const int G = K / 32;
    const size_t row_bytes = (size_t)G * (is_q4 ? sizeof(block_q4_1) : sizeof(block_q8_0));
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = W + (size_t)n * row_bytes;
        for (int r0 = 0; r0 < M; r0 += 4) {
            const int R = M - r0 < 4 ? M - r0 : 4;
            float out[4];
            if (is_q4)
                block_row(row, 1, qx + (size_t)r0 * K, dx + (size_t)r0 * G, sx + (size_t)r0 * G, R, K, G, out);
            else
                block_row(row, 0, qx + (size_t)r0 * K, dx + (size_t)r0 * G, sx + (size_t)r0 * G, R, K, G, out);
            for (int r = 0; r < R; r++) y[(size_t)(r0 + r) * N + n] = out[r] + (b ? b[n] : 0.f);
        }
    }
}

static void block_matmul_f32(const uint8_t *W, int is_q4, const float *x, const float *b, float *y, int M, int N,
                             int K, int num_threads) {
    const int G = K / 32;
    int16_t *qx = (int16_t *)malloc(sizeof(int16_t) * (size_t)M * K);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G);
    float *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    quantize_rows_q16(x, qx, dx, sx, M, K);
    block_matmul_q16(W, is_q4, qx, dx, sx, b, y, M, N, K, num_threads);
    free(qx);
    free(dx);
    free(sx);
}

void q4_matmul_f32(const block_q4_1 *W, const float *x, const float *b, float *y, int M, int N, int K, int num_threads) {
    block_matmul_f32((const uint8_t *)W, 1, x, b, y, M, N, K, num_threads);
}

void q8_matmul_f32(const block_q8_0 *W, const float *x, const float *b, float *y, int M, int N, int K, int num_threads) {
    block_matmul_f32((const uint8_t *)W, 0, x, b, y, M, N, K, num_threads);
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
#if defined(__AVX2__) && defined(__FMA__)  // 8 weights a vector: 6x the scalar loop (prefill); mul + add as torch
            const __m128i p = _mm_loadu_si128((const __m128i *)blk->qs), low4 = _mm_set1_epi8(0x0f);
            const __m128i lo = _mm_and_si128(p, low4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), low4);
            const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), dv), mv));
#else
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(blk->qs[j] & 15) + m;
                o[j + 16] = d * (float)(blk->qs[j] >> 4) + m;
            }
#endif
        }
    }
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

// ---------------------------------------------------------------------------------------------------------------------
// A whole decode step of the Llama-family decoder layers in one call (models/fused_decode.py): M decode rows (one
// token each), every layer's norms, projections, RoPE, KV write, paged attention, SiLU (or tanh-GELU: Gemma 1) gate
// and residuals. The same arithmetic as the per-op torch path (models/decoder.py) with the same kernels; what it
// removes is ~100 torch ops and four ctypes calls per layer (~10 ms of a ~17 ms SmolLM2-135M batch-1 step at native
// precision, measured).

typedef struct {
    const void *w;      // float32 [n, k] (kind 0), Q8_0 blocks (kind 1) or Q4_1 blocks (kind 2), rows of k inputs
    const float *bias;  // [n] or NULL
    int64_t kind, n, k;  // k % 32 == 0 for blocks; kind 0 only with one row (the GEMV kernel)
    int64_t many_passes, many_min_rows;  // block layers: from many_min_rows rows, the many-row kernel (0: never)
} fused_linear;

int vnni_available(void);  // block_kernels_vnni.c
void block_matmul_vnni(const uint8_t *W, int is_q4, const float *x, const float *b, float *y, int M, int N, int K,
                       int passes, int num_threads);
void block_matmul_avx2(const uint8_t *W, int is_q4, const float *x, const float *b, float *y, int M, int N, int K,
                       int passes, int num_threads);  // block_kernels_avx2.c

typedef struct {
    fused_linear qkv, o, gate_up, down;
    const float *in_norm, *post_norm;  // [H]
    const float *q_norm, *k_norm;      // [D] per-head norms (Qwen3) or NULL
    float *k_cache, *v_cache;          // [slots, KVH, D]
    int64_t num_heads, num_kv_heads;   // this layer's attention heads (as the torch module holds them)
    float scale;                       // attention scale
    float eps;                         // RMSNorm epsilon
    int64_t window;                    // sliding window of this layer's attention (0: none)
    int64_t act;                       // MLP gate activation: 0 SiLU, 1 GELU with the tanh approximation (Gemma 1)
} fused_layer;

// GELU, tanh approximation, as torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(u)) with
// u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh u) is
// sigmoid(2u)) because expf costs what SiLU's does where tanhf made the int8 step 8% slower (measured on a
// Gemma-1-shaped model). exp overflowing to inf gives -0 there, as tanh does.
static inline float gelu_tanh(float x) {
    const float two_beta = 1.5957691216057308f;  // 2 sqrt(2 / pi)
    return x / (1.f + expf(-two_beta * (x + 0.044715f * x * x * x)));
}

static void fused_apply(const fused_linear *l, const float *x, float *y, int M, int num_threads) {
    if (l->kind == 0) {
        gemv_f32((const float *)l->w, x, l->bias, y, (int)l->n, (int)l->k);
    } else if (l->many_passes && M >= l->many_min_rows) {  // set only where a many-row kernel is built
        if (vnni_available())
            block_matmul_vnni((const uint8_t *)l->w, l->kind == 2, x, l->bias, y, M, (int)l->n, (int)l->k,
                              (int)l->many_passes, num_threads);
        else
            block_matmul_avx2((const uint8_t *)l->w, l->kind == 2, x, l->bias, y, M, (int)l->n, (int)l->k,
                              (int)l->many_passes, num_threads);
    } else {
        block_matmul_f32((const uint8_t *)l->w, l->kind == 2, x, l->bias, y, M, (int)l->n, (int)l->k, num_threads);
    }
}

// out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) for R rows of n (as RMSNorm: normalise in float32, then scale).
static void rms_norm_rows(const float *x, const float *w, float *out, int R, int n, float eps) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * n;
        float ss = 0.f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        float *o = out + (size_t)r * n;
        for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

// x [D] rotated in place by rotate_half RoPE (first half / second half), as models/layers.py apply_rotary.
static void rope_head(float *x, const float *cos, const float *sin, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

void decoder_layers_f32(const fused_layer *layers, int L, float *x, int M, int H, int D, int I, const float *cos,
                        const float *sin, const int64_t *slots, const int64_t *tables, const int64_t *lens,
                        int block_size, int max_blocks, int num_threads) {
    // x [M, H] the residual stream (in place); cos, sin [M, D]; slots [M]; tables [M, max_blocks]; lens [M]
    int max_qkv = 0, max_heads = 0;
    for (int l = 0; l < L; l++) {
        max_qkv = layers[l].qkv.n > max_qkv ? (int)layers[l].qkv.n : max_qkv;
        max_heads = layers[l].num_heads > max_heads ? (int)layers[l].num_heads : max_heads;
    }
    const int wide = H > I ? H : I;
    float *h = (float *)malloc(sizeof(float) * (size_t)M * wide);
    float *qkv = (float *)malloc(sizeof(float) * (size_t)M * max_qkv);
    float *q = (float *)malloc(sizeof(float) * (size_t)M * max_heads * D);
    float *att = (float *)malloc(sizeof(float) * (size_t)M * max_heads * D);
    float *gu = (float *)malloc(sizeof(float) * (size_t)M * 2 * I);
    float *o = (float *)malloc(sizeof(float) * (size_t)M * H);
    for (int l = 0; l < L; l++) {
        const fused_layer *ly = layers + l;
        const int NH = (int)ly->num_heads, KVH = (int)ly->num_kv_heads, QKV = (int)ly->qkv.n;
        rms_norm_rows(x, ly->in_norm, h, M, H, ly->eps);
        fused_apply(&ly->qkv, h, qkv, M, num_threads);
        for (int r = 0; r < M; r++) {
            const float *row = qkv + (size_t)r * QKV;
            float *qr = q + (size_t)r * NH * D;
            // keys and values go straight to their cache slot; keys are normed and rotated there
            float *kc = ly->k_cache + (size_t)slots[r] * KVH * D, *vc = ly->v_cache + (size_t)slots[r] * KVH * D;
            memcpy(qr, row, sizeof(float) * (size_t)NH * D);
            memcpy(kc, row + (size_t)NH * D, sizeof(float) * (size_t)KVH * D);
            memcpy(vc, row + (size_t)(NH + KVH) * D, sizeof(float) * (size_t)KVH * D);
            if (ly->q_norm) {
                rms_norm_rows(qr, ly->q_norm, qr, NH, D, ly->eps);
                rms_norm_rows(kc, ly->k_norm, kc, KVH, D, ly->eps);
            }
            for (int hh = 0; hh < NH; hh++) rope_head(qr + (size_t)hh * D, cos + (size_t)r * D, sin + (size_t)r * D, D);
            for (int hh = 0; hh < KVH; hh++) rope_head(kc + (size_t)hh * D, cos + (size_t)r * D, sin + (size_t)r * D, D);
        }
        paged_decode_attention_f32(q, ly->k_cache, ly->v_cache, tables, lens, att, M, NH, KVH, D, block_size, max_blocks,
                                   ly->scale, num_threads, (int)ly->window);
        fused_apply(&ly->o, att, o, M, num_threads);
        for (size_t i = 0; i < (size_t)M * H; i++) x[i] += o[i];
        rms_norm_rows(x, ly->post_norm, h, M, H, ly->eps);
        fused_apply(&ly->gate_up, h, gu, M, num_threads);
        for (int r = 0; r < M; r++) {
            const float *g = gu + (size_t)r * 2 * I;
            float *a = h + (size_t)r * I;
            if (ly->act == 1) {
                for (int i = 0; i < I; i++) a[i] = gelu_tanh(g[i]) * g[I + i];
            } else {
                for (int i = 0; i < I; i++) a[i] = g[i] / (1.f + expf(-g[i])) * g[I + i];
            }
        }
        fused_apply(&ly->down, h, o, M, num_threads);
        for (size_t i = 0; i < (size_t)M * H; i++) x[i] += o[i];
    }
    free(h);
    free(qkv);
    free(q);
    free(att);
    free(gu);
    free(o);
}
