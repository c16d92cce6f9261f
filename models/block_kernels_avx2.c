// Block matmuls for several activation rows on AVX2 hosts (no AVX-512 VNNI), the way llama.cpp's AVX2 path multiplies
// 4-bit weights with 8-bit activations: `vpmaddubsw` (u8 x s8 -> pairs summed to int16) then `vpmaddwd` by ones
// (-> int32), with the per-block scales applied in float. y[M, N] = x[M, K] . W[N, K]^T (+ b), W in GGUF's Q4_1 / Q8_0
// blocks of 32 (layouts in cpu_kernels.c); the same arithmetic as block_kernels_vnni.c (and quant.py's torch twin).
//
// As there, a tile of W's rows (8 here: eight 32-bit lanes of a 256-bit vector) is unpacked once per call,
// interleaved so that lane i of 32-bit chunk j holds row i's weights 4j .. 4j + 3; each group's dot of 8 rows then
// ends in one vector: one convert and one scaled add per 8 rows, not per row.
// - Q4_1 (q in 0..15): `vpmaddubsw` pairs stay below 2 * 15 * 128, so the 8 chunks of a group add up in int16
//   (< 32767) and one `vpmaddwd` ends the group (llama.cpp's trick).
// - Q8_0 (signed q), 8-bit activations: `vpmaddubsw` needs one unsigned side: |q| against x with q's sign
//   (`vpsignb`; llama.cpp takes |x| against q, wrong for a GGUF's q = -128); pairs reach 2 * 128 * 127, so each
//   chunk is widened to int32 at once. With
//   15-bit activations a Q8_0 tile is unpacked to int16 instead and multiplied in one `vpmaddwd` pass (the two
//   sign-trick passes measured 1.25x slower than the int16 kernels at 16 rows; this one 0.98x, 0.8x at 31).
// Activations: 15 bits per group as two int8 halves (xq = 128 hi + lo) recombined exactly, or one 8-bit pass.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define OMNIVOX_AVX2_ROWS 1
#endif

int avx2_rows_available(void) {
#ifdef OMNIVOX_AVX2_ROWS
    return 1;
#else
    return 0;
#endif
}

#ifdef OMNIVOX_AVX2_ROWS
enum { TILE8 = 8, ACT_MAX15 = 127 * 128 };

static inline float fp16_f32(uint16_t h) { return _cvtsh_ss(h); }

// x [M, K] -> hi, lo int8 (xq = 128 hi + lo; passes == 1: hi = xq), dx [M, G], sx [M, G]: as quant.quantize_activations
// (nearest even) and block_kernels_vnni.c's quantize_rows.
static void quantize_rows8(const float *x, int8_t *hi, int8_t *lo, int16_t *q16, float *dx, float *sx, int M, int K,
                           int passes) {
    const int G = K / 32;
    const float levels = passes == 2 ? (float)ACT_MAX15 : 127.f;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            const float *xs = x + (size_t)r * K + g * 32;
            float a = 0.f, total = 0.f;
            for (int i = 0; i < 32; i++) {
                a = fmaxf(a, fabsf(xs[i]));
                total += xs[i];
            }
            const float d = a / levels, id = d > 0.f ? 1.f / d : 0.f;
            int8_t *h = hi + (size_t)r * K + g * 32, *l = lo + (size_t)r * K + g * 32;
            for (int i = 0; i < 32; i++) {
                const int q = (int)lrintf(xs[i] * id);
                q16[(size_t)r * K + g * 32 + i] = (int16_t)q;
                if (passes == 2) {
                    const int qh = (q + 64) >> 7;  // arithmetic shift: the nearest multiple of 128, the rest in [-64, 64]
                    h[i] = (int8_t)qh;
                    l[i] = (int8_t)(q - qh * 128);
                } else {
                    h[i] = (int8_t)q;
                }
            }
            dx[(size_t)r * G + g] = d;
            sx[(size_t)r * G + g] = total;
        }
    }
}

// 16 bytes at p of each of 8 rows -> c[j] lane i = row i's bytes 4j .. 4j + 3 (rows i, i + 4 to a vector, then a
// 4 x 4 transpose of 32-bit words in each 128-bit half).
static inline void transpose_4x8(const uint8_t *p, size_t row_bytes, __m256i c[4]) {
    __m256i a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_loadu2_m128i((const __m128i *)(p + (i + 4) * row_bytes), (const __m128i *)(p + i * row_bytes));
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    c[0] = _mm256_unpacklo_epi64(t0, t2);
    c[1] = _mm256_unpackhi_epi64(t0, t2);
    c[2] = _mm256_unpacklo_epi64(t1, t3);
    c[3] = _mm256_unpackhi_epi64(t1, t3);
}

// Rows n0 .. n0 + 7 of W (rows past N are zero) -> per group: 256 bytes of weights (Q4_1 q unsigned, Q8_0 q signed),
// then d [8] and m [8] (Q4_1 offset; 0 for Q8_0).
static void unpack_tile8(const uint8_t *W, int is_q4, int n0, int N, int G, uint8_t *wq, float *d, float *m) {
    const int bytes = is_q4 ? 20 : 34;
    const size_t row_bytes = (size_t)G * bytes;
    const int full = n0 + TILE8 <= N;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < G; g++) {
        uint8_t *out = wq + (size_t)g * 256;
        const uint8_t *base = W + (size_t)n0 * row_bytes + (size_t)g * bytes;
        if (n0 + 2 * TILE8 <= N)  // the next tile's rows arrive while this one is computed
            for (int i = 0; i < TILE8; i++) _mm_prefetch((const char *)(base + (TILE8 + i) * row_bytes), _MM_HINT_T1);
        for (int i = 0; i < TILE8; i++) {
            uint16_t dh = 0, mh = 0;
            if (n0 + i < N) {
                memcpy(&dh, base + i * row_bytes, 2);
                if (is_q4) memcpy(&mh, base + i * row_bytes + 2, 2);
            }
            d[(size_t)g * TILE8 + i] = fp16_f32(dh);
            m[(size_t)g * TILE8 + i] = fp16_f32(mh);
        }
        if (full && is_q4) {  // byte j of a row holds weight j (low nibble) and weight j + 16 (high nibble)
            __m256i c[4];
            transpose_4x8(base + 4, row_bytes, c);
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_si256((__m256i *)(out + j * 32), _mm256_and_si256(c[j], low4));
                _mm256_storeu_si256((__m256i *)(out + (j + 4) * 32), _mm256_and_si256(_mm256_srli_epi16(c[j], 4), low4));
            }
        } else if (full) {
            __m256i c[4];
            for (int h = 0; h < 2; h++) {  // weights 0..15, then 16..31
                transpose_4x8(base + 2 + 16 * h, row_bytes, c);
                for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(out + (4 * h + j) * 32), c[j]);
            }
        } else {  // the last, partial tile: row by row, zero weights past N
            for (int i = 0; i < TILE8; i++) {
                uint8_t vals[32] = {0};
                const uint8_t *blk = base + i * row_bytes;
                for (int j = 0; j < 32 && n0 + i < N; j++)
                    vals[j] = is_q4 ? (j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4) : blk[2 + j];
                for (int j = 0; j < 8; j++) memcpy(out + j * 32 + i * 4, vals + 4 * j, 4);
            }
        }
    }
}

// Q8_0 rows n0 .. n0 + 7 for 15-bit activations -> per group 512 bytes: lane i of 32-bit chunk j = row i's weights
// 2j, 2j + 1 as int16 (then d [8]). 15-bit activations fit int16 whole, so one `vpmaddwd` pass replaces the two
// sign-trick passes over int8 halves (products up to 127 * 16256: exact in int32 over a group).
static void unpack_tile8_q8_wide(const uint8_t *W, int n0, int N, int G, int16_t *wq, float *d) {
    const size_t row_bytes = (size_t)G * 34;
    for (int g = 0; g < G; g++) {
        int16_t *out = wq + (size_t)g * 256;
        const uint8_t *base = W + (size_t)n0 * row_bytes + (size_t)g * 34;
        if (n0 + 2 * TILE8 <= N)
            for (int i = 0; i < TILE8; i++) _mm_prefetch((const char *)(base + (TILE8 + i) * row_bytes), _MM_HINT_T1);
        for (int i = 0; i < TILE8; i++) {
            uint16_t dh = 0;
            int16_t vals[32] = {0};
            if (n0 + i < N) {
                memcpy(&dh, base + i * row_bytes, 2);
                const __m128i *q = (const __m128i *)(base + i * row_bytes + 2);
                _mm256_storeu_si256((__m256i *)vals, _mm256_cvtepi8_epi16(_mm_loadu_si128(q)));
                _mm256_storeu_si256((__m256i *)(vals + 16), _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1)));
            }
            d[(size_t)g * TILE8 + i] = fp16_f32(dh);
            for (int j = 0; j < 16; j++) memcpy(out + (j * TILE8 + i) * 2, vals + 2 * j, 4);
        }
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// One pass of a group's activations (32 int8 at a) against the tile's 8 chunks: the int32 dots of 8 rows.
static inline __m256i group_dot(const uint8_t *w, const int8_t *a, int is_q4) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (is_q4) {  // 8 chunks summed in int16 (< 8 * 2 * 15 * 128), widened once
        __m256i s0 = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)w), bcast4(a));
        __m256i s1 = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w + 32)), bcast4(a + 4));
        for (int j = 2; j < 8; j += 2) {
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * j)), bcast4(a + 4 * j)));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * j + 32)), bcast4(a + 4 * j + 4)));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
    }
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
    // |q| (unsigned) against x with q's sign: pairs up to 2 * 128 * 127, widened per chunk. This way round a GGUF's
    // q = -128 is exact (vpsignb leaves it 0x80, which vpmaddubsw reads as 128); activations are within +-127, so
    // negating them never overflows. The other way (|x| against q with x's sign) turned -128 into -128 where x < 0.
    for (int j = 0; j < 8; j += 2) {
        const __m256i x0 = bcast4(a + 4 * j), x1 = bcast4(a + 4 * j + 4);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32 * j + 32));
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0)), ones));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1)), ones));
    }
    return _mm256_add_epi32(acc0, acc1);
}

// A group's 32 int16 activations against the wide Q8_0 tile's 16 chunks: the int32 dots of 8 rows.
static inline __m256i group_dot_wide(const int16_t *w, const int16_t *a) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
    for (int j = 0; j < 16; j += 2) {
        int32_t x0, x1;
        memcpy(&x0, a + 2 * j, 4);
        memcpy(&x1, a + 2 * j + 2, 4);
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 * j)), _mm256_set1_epi32(x0)));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 * j + 16)), _mm256_set1_epi32(x1)));
    }
    return _mm256_add_epi32(acc0, acc1);
}

// R activation rows (1..4, a constant after inlining) against one unpacked tile: out[r][0..7].
static inline __attribute__((always_inline)) void tile8_rows(const uint8_t *wq, const float *d, const float *m,
                                                             int is_q4, const int8_t *hi, const int8_t *lo,
                                                             const int16_t *q16, const float *dx, const float *sx,
                                                             int K, int G, float *out, const int R, const int P) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *w = wq + (size_t)g * 256;
        const __m256 dv = _mm256_loadu_ps(d + (size_t)g * TILE8), mv = _mm256_loadu_ps(m + (size_t)g * TILE8);
        for (int r = 0; r < R; r++) {
            const size_t ao = (size_t)r * K + g * 32, rg = (size_t)r * G + g;
            __m256i dot;
            if (!is_q4 && P == 2) {  // the wide Q8_0 tile (unpack_tile8_q8_wide): one pass of int16 activations
                dot = group_dot_wide((const int16_t *)wq + (size_t)g * 256, q16 + ao);
            } else {
                dot = group_dot(w, hi + ao, is_q4);
                if (P == 2) dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 7), group_dot(w, lo + ao, is_q4));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, _mm256_set1_ps(dx[rg])), acc[r]);
            if (is_q4) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[rg]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * TILE8, acc[r]);
}

static void tile8_all_rows(const uint8_t *wq, const float *d, const float *m, int is_q4, const int8_t *hi,
                           const int8_t *lo, const int16_t *q16, const float *dx, const float *sx, const float *b,
                           float *y, int M, int N, int K, int n0, int passes) {
    const int G = K / 32, cols = N - n0 < TILE8 ? N - n0 : TILE8;
    for (int r0 = 0; r0 < M; r0 += 4) {
        const int R = M - r0 < 4 ? M - r0 : 4;
        float out[4 * TILE8];
        const int8_t *h = hi + (size_t)r0 * K, *l = lo + (size_t)r0 * K;
        const int16_t *q = q16 + (size_t)r0 * K;
        const float *dr = dx + (size_t)r0 * G, *sr = sx + (size_t)r0 * G;
#define TILE8_ROWS(Q4, RR)                                                          \
    do {                                                                            \
        if (passes == 2)                                                            \
            tile8_rows(wq, d, m, Q4, h, l, q, dr, sr, K, G, out, RR, 2);               \
        else                                                                        \
            tile8_rows(wq, d, m, Q4, h, l, q, dr, sr, K, G, out, RR, 1);               \
    } while (0)
        if (is_q4) {
            switch (R) {
                case 1: TILE8_ROWS(1, 1); break;
                case 2: TILE8_ROWS(1, 2); break;
                case 3: TILE8_ROWS(1, 3); break;
                default: TILE8_ROWS(1, 4); break;
            }
        } else {
            switch (R) {
                case 1: TILE8_ROWS(0, 1); break;
                case 2: TILE8_ROWS(0, 2); break;
                case 3: TILE8_ROWS(0, 3); break;
                default: TILE8_ROWS(0, 4); break;
            }
        }
#undef TILE8_ROWS
        for (int r = 0; r < R; r++)
            for (int c = 0; c < cols; c++) y[(size_t)(r0 + r) * N + n0 + c] = out[r * TILE8 + c] + (b ? b[n0 + c] : 0.f);
    }
}
#endif

// y [M, N] = x [M, K] W^T (+ b), W as N rows of K / 32 Q4_1 (is_q4) or Q8_0 blocks, K % 32 == 0; tiles of 8 rows of W
// split over threads. Call only when avx2_rows_available().
void block_matmul_avx2(const uint8_t *W, int is_q4, const float *x, const float *b, float *y, int M, int N, int K,
                       int passes, int num_threads) {
#ifdef OMNIVOX_AVX2_ROWS
    const int G = K / 32, tiles = (N + TILE8 - 1) / TILE8;
    int8_t *hi = (int8_t *)malloc((size_t)M * K), *lo = (int8_t *)malloc((size_t)M * K);
    int16_t *q16 = (int16_t *)malloc(sizeof(int16_t) * (size_t)M * K);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G), *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    quantize_rows8(x, hi, lo, q16, dx, sx, M, K, passes);
    const int wide = !is_q4 && passes == 2;
#pragma omp parallel num_threads(num_threads)
    {
        uint8_t *wq = (uint8_t *)aligned_alloc(32, (size_t)G * 512);
        float *d = (float *)malloc(sizeof(float) * (size_t)G * TILE8), *m = (float *)malloc(sizeof(float) * (size_t)G * TILE8);
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            if (wide) {
                unpack_tile8_q8_wide(W, t * TILE8, N, G, (int16_t *)wq, d);
                memset(m, 0, sizeof(float) * (size_t)G * TILE8);
            } else {
                unpack_tile8(W, is_q4, t * TILE8, N, G, wq, d, m);
            }
            tile8_all_rows(wq, d, m, is_q4, hi, lo, q16, dx, sx, b, y, M, N, K, t * TILE8, passes);
        }
        free(wq);
        free(d);
        free(m);
    }
    free(hi);
    free(lo);
    free(q16);
    free(dx);
    free(sx);
#else
    (void)W, (void)is_q4, (void)x, (void)b, (void)y, (void)M, (void)N, (void)K, (void)passes, (void)num_threads;
    abort();  // callers check avx2_rows_available() first
#endif
}
