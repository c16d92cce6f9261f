// Block matmuls for several activation rows (decode steps of 3+ rows, prefill chunks) with AVX-512 VNNI `vpdpbusd`:
// y[M, N] = x[M, K] . W[N, K]^T (+ b) for W in GGUF's Q4_1 / Q8_0 blocks of 32 (layouts in cpu_kernels.c).
//
// Why a second kernel: the int16 kernels in cpu_kernels.c unpack a weight block per row of W and reduce each group
// of 32 across a vector (`vpmaddwd` + convert + scaled add per row, block and activation row): at 16 rows they were
// compute-bound at ~2x the float32 FMA roof, and from 32 rows a layer was dequantised for float32 GEMM instead.
// Here a tile of 16 rows of W is unpacked once per call into a small buffer interleaved as llama.cpp's repacked Q4_0
// GEMM does (4 consecutive weights of row i in 32-bit lane i), so 8 `vpdpbusd` (u8 weights x s8 activations) leave
// the whole group's dot of 16 rows in one vector: one convert and one scaled add per 16 rows, not per row.
// 512-bit vectors: Zen 4 executes them as two 256-bit halves, but the front end issues half the instructions (a tile
// of 8 rows in 256-bit vectors measured 1.4x slower at 128 rows).
//
// Activations keep 15 bits per group of 32, split into two int8 halves (xq = 128 hi + lo, |xq| <= 127 * 128,
// lo in [-64, 64]): two `vpdpbusd` per 4 weights, combined exactly in int32. One int8 pass (act_bits 8, llama.cpp's
// Q8_1) is ~1.5x as fast but costs quality (BENCHMARKS.md); 15 bits are within ~3e-5 of float activations.
// Q8_0 weights enter `vpdpbusd` as unsigned (q + 128); the 128 * sum(xq) this adds is subtracted per group.
// Built only where the compiler targets AVX-512 VNNI + VL; elsewhere `vnni_available()` says 0 and the int16 / float
// paths serve. With -DOMNIVOX_SCALAR_INTRINSICS it builds against intrinsics_scalar.h instead (tests on every host).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(OMNIVOX_SCALAR_INTRINSICS)  // the same kernel on scalar intrinsics, for tests on any host
#include "intrinsics_scalar.h"
#define OMNIVOX_VNNI 1
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define OMNIVOX_VNNI 1
#endif

int vnni_available(void) {
#ifdef OMNIVOX_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef OMNIVOX_VNNI
enum { TILE = 16, HI_SCALE = 128, ACT_MAX = 127 * 128 };

// x [M, K] float -> hi, lo [M, K] int8 (xq = 128 hi + lo; passes == 1: hi = xq, 8 bits), dx [M, G] scale, sq [M, G]
// sum of xq, sx [M, G] sum of x. Rounding to nearest even, as the torch twin (quant.quantize_activations).
static void quantize_rows(const float *x, int8_t *hi, int8_t *lo, float *dx, int32_t *sq, float *sx, int M, int K,
                          int passes) {
    const int G = K / 32;
    const float levels = passes == 2 ? (float)ACT_MAX : 127.f;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            const float *xs = x + (size_t)r * K + g * 32;
            __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xs + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
                sum = _mm256_add_ps(sum, v[j]);
            }
            float am[8], su[8];
            _mm256_storeu_ps(am, amax);
            _mm256_storeu_ps(su, sum);
            float a = 0.f, total = 0.f;
            for (int i = 0; i < 8; i++) {
                a = fmaxf(a, am[i]);
                total += su[i];
            }
            const float d = a / levels, id = d > 0.f ? 1.f / d : 0.f;
            int8_t *h = hi + (size_t)r * K + g * 32, *l = lo + (size_t)r * K + g * 32;
            __m256i qsum = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
                qsum = _mm256_add_epi32(qsum, q);
                if (passes == 2) {  // arithmetic shift: the nearest multiple of 128, and the rest in [-64, 64]
                    const __m256i qh = _mm256_srai_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(64)), 7);
                    _mm_storel_epi64((__m128i *)(h + 8 * j), _mm256_cvtepi32_epi8(qh));
                    _mm_storel_epi64((__m128i *)(l + 8 * j), _mm256_cvtepi32_epi8(_mm256_sub_epi32(q, _mm256_slli_epi32(qh, 7))));
                } else {
                    _mm_storel_epi64((__m128i *)(h + 8 * j), _mm256_cvtepi32_epi8(q));
                }
            }
            int32_t qs[8], s = 0;
            _mm256_storeu_si256((__m256i *)qs, qsum);
            for (int i = 0; i < 8; i++) s += qs[i];
            dx[(size_t)r * G + g] = d;
            sq[(size_t)r * G + g] = s;
            sx[(size_t)r * G + g] = total;
        }
    }
}

// 16 bytes at p of each of 16 rows (row_bytes apart) -> c[j] lane i = row i's bytes 4j .. 4j + 3: rows i, i + 4,
// i + 8, i + 12 to a vector, then a 4 x 4 transpose of 32-bit words in each 128-bit quarter.
static inline void transpose_4x16(const uint8_t *p, size_t row_bytes, __m512i c[4]) {
    __m512i a[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + i * row_bytes)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (i + 4) * row_bytes)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (i + 8) * row_bytes)), 2);
        a[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (i + 12) * row_bytes)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    // lanes come out as rows 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
    c[0] = _mm512_unpacklo_epi64(t0, t2);
    c[1] = _mm512_unpackhi_epi64(t0, t2);
    c[2] = _mm512_unpacklo_epi64(t1, t3);
    c[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Rows n0 .. n0 + 15 of W (rows past N are zero) -> per group: 512 bytes of weights, lane i of 32-bit chunk j = row i's
// weights 4j .. 4j + 3 (unsigned: Q4_1 q, Q8_0 q + 128), then d [8] and m [8] (Q4_1 offset; 0 for Q8_0).
// A full tile transposes 16 bytes of 16 rows at a time in registers (a scalar copy cost 0.3 ns a weight, `vpgatherdd`
// ~0.1: as much as the dots of 8 activation rows), and prefetches the next tile's rows: 16 strided streams defeat the
// hardware prefetcher (at 8 rows the model's layers took 30 ms without, 25 with; the Q8_0 lm_head 6.8 and 3.9).
static void unpack_tile(const uint8_t *W, int is_q4, int n0, int N, int G, uint8_t *wq, float *d, float *m) {
    const int bytes = is_q4 ? 20 : 34;
    const size_t row_bytes = (size_t)G * bytes;
    const int full = n0 + TILE <= N;
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    for (int g = 0; g < G; g++) {
        uint8_t *out = wq + (size_t)g * 512;
        float *dg = d + (size_t)g * TILE, *mg = m + (size_t)g * TILE;
        const uint8_t *base = W + (size_t)n0 * row_bytes + (size_t)g * bytes;
        if (n0 + 2 * TILE <= N)  // the next tile's rows arrive while this one is computed (16 strided streams)
            for (int i = 0; i < TILE; i++) _mm_prefetch((const char *)(base + (TILE + i) * row_bytes), _MM_HINT_T1);
        uint16_t dh[TILE] = {0}, mh[TILE] = {0};
        for (int i = 0; i < TILE && n0 + i < N; i++) {
            memcpy(dh + i, base + i * row_bytes, 2);
            if (is_q4) memcpy(mh + i, base + i * row_bytes + 2, 2);
        }
        _mm512_storeu_ps(dg, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)));
        _mm512_storeu_ps(mg, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mh)));
        if (full && is_q4) {  // byte j of a row holds weight j (low nibble) and weight j + 16 (high nibble)
            __m512i c[4];
            transpose_4x16(base + 4, row_bytes, c);
            for (int j = 0; j < 4; j++) {
                _mm512_storeu_si512(out + j * 64, _mm512_and_si512(c[j], low4));
                _mm512_storeu_si512(out + (j + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(c[j], 4), low4));
            }
        } else if (full) {
            __m512i c[4];
            for (int h = 0; h < 2; h++) {  // weights 0..15, then 16..31
                transpose_4x16(base + 2 + 16 * h, row_bytes, c);
                for (int j = 0; j < 4; j++)  // q + 128 as u8
                    _mm512_storeu_si512(out + (4 * h + j) * 64, _mm512_xor_si512(c[j], flip));
            }
        } else {  // the last, partial tile: row by row, zero weights past N
            for (int i = 0; i < TILE; i++) {
                uint8_t vals[32];
                const uint8_t *blk = base + i * row_bytes;
                for (int j = 0; j < 32; j++) {
                    if (n0 + i >= N)
                        vals[j] = is_q4 ? 0 : 128;
                    else if (is_q4)
                        vals[j] = j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4;
                    else
                        vals[j] = blk[2 + j] ^ 0x80;
                }
                for (int j = 0; j < 8; j++) memcpy(out + j * 64 + i * 4, vals + 4 * j, 4);
            }
        }
    }
}

static inline __m512i bcast4x16(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// R activation rows (1..4, a constant after inlining) against one unpacked tile: out[r][0..7].
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *wq, const float *d, const float *m,
                                                            int is_q4, const int8_t *hi, const int8_t *lo,
                                                            const float *dx, const int32_t *sq, const float *sx, int K,
                                                            int G, float *out, const int R, const int P) {
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i corr = _mm512_set1_epi32(is_q4 ? 0 : 128);
    for (int g = 0; g < G; g++) {
        __m512i w[8];
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(wq + (size_t)g * 512 + j * 64);
        const __m512 dv = _mm512_loadu_ps(d + (size_t)g * TILE), mv = _mm512_loadu_ps(m + (size_t)g * TILE);
        for (int r = 0; r < R; r++) {
            const int8_t *h = hi + (size_t)r * K + g * 32, *l = lo + (size_t)r * K + g * 32;
            // two accumulators a half: `vpdpbusd` has a latency of several cycles, 8 in one chain would wait on it
            __m512i ah0 = _mm512_setzero_si512(), al0 = ah0, ah1 = ah0, al1 = ah0;
            for (int j = 0; j < 8; j += 2) {
                ah0 = _mm512_dpbusd_epi32(ah0, w[j], bcast4x16(h + 4 * j));
                ah1 = _mm512_dpbusd_epi32(ah1, w[j + 1], bcast4x16(h + 4 * j + 4));
                if (P == 2) {
                    al0 = _mm512_dpbusd_epi32(al0, w[j], bcast4x16(l + 4 * j));
                    al1 = _mm512_dpbusd_epi32(al1, w[j + 1], bcast4x16(l + 4 * j + 4));
                }
            }
            const __m512i ah = _mm512_add_epi32(ah0, ah1), al = _mm512_add_epi32(al0, al1);
            const size_t rg = (size_t)r * G + g;
            // 128 hi + lo, minus Q8_0's 128 * sum(xq): the exact integer dot of the group
            __m512i dot = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(ah, 7), al) : ah;
            dot = _mm512_sub_epi32(dot, _mm512_mullo_epi32(corr, _mm512_set1_epi32(sq[rg])));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(dx[rg])), acc[r]);
            if (is_q4) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[rg]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

static void tile_all_rows(const uint8_t *wq, const float *d, const float *m, int is_q4, const int8_t *hi,
                          const int8_t *lo, const float *dx, const int32_t *sq, const float *sx, const float *b,
                          float *y, int M, int N, int K, int n0, int passes) {
    const int G = K / 32, cols = N - n0 < TILE ? N - n0 : TILE;
    for (int r0 = 0; r0 < M; r0 += 4) {
        const int R = M - r0 < 4 ? M - r0 : 4;
        float out[4 * TILE];
        const size_t ao = (size_t)r0 * K, so = (size_t)r0 * G;
#define TILE_ROWS(Q4, RR)                                                                                 \
    do {                                                                                                  \
        if (passes == 2)                                                                                  \
            tile_rows(wq, d, m, Q4, hi + ao, lo + ao, dx + so, sq + so, sx + so, K, G, out, RR, 2);       \
        else                                                                                              \
            tile_rows(wq, d, m, Q4, hi + ao, lo + ao, dx + so, sq + so, sx + so, K, G, out, RR, 1);       \
    } while (0)
        if (is_q4) {
            switch (R) {
                case 1: TILE_ROWS(1, 1); break;
                case 2: TILE_ROWS(1, 2); break;
                case 3: TILE_ROWS(1, 3); break;
                default: TILE_ROWS(1, 4); break;
            }
        } else {
            switch (R) {
                case 1: TILE_ROWS(0, 1); break;
                case 2: TILE_ROWS(0, 2); break;
                case 3: TILE_ROWS(0, 3); break;
                default: TILE_ROWS(0, 4); break;
            }
        }
#undef TILE_ROWS
        for (int r = 0; r < R; r++)
            for (int c = 0; c < cols; c++) y[(size_t)(r0 + r) * N + n0 + c] = out[r * TILE + c] + (b ? b[n0 + c] : 0.f);
    }
}
#endif

// y [M, N] = x [M, K] W^T (+ b), W as N rows of K / 32 Q4_1 (is_q4) or Q8_0 blocks, K % 32 == 0; tiles of 16 rows of W
// split over threads. Call only when vnni_available().
void block_matmul_vnni(const uint8_t *W, int is_q4, const float *x, const float *b, float *y, int M, int N, int K,
                       int passes, int num_threads) {
#ifdef OMNIVOX_VNNI
    const int G = K / 32, tiles = (N + TILE - 1) / TILE;
    int8_t *hi = (int8_t *)malloc((size_t)M * K), *lo = (int8_t *)malloc((size_t)M * K);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G), *sx = (float *)malloc(sizeof(float) * (size_t)M * G);
    int32_t *sq = (int32_t *)malloc(sizeof(int32_t) * (size_t)M * G);
    quantize_rows(x, hi, lo, dx, sq, sx, M, K, passes);
#pragma omp parallel num_threads(num_threads)
    {
        uint8_t *wq = (uint8_t *)aligned_alloc(64, (size_t)G * 512);
        float *d = (float *)malloc(sizeof(float) * (size_t)G * TILE), *m = (float *)malloc(sizeof(float) * (size_t)G * TILE);
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            unpack_tile(W, is_q4, t * TILE, N, G, wq, d, m);
            tile_all_rows(wq, d, m, is_q4, hi, lo, dx, sq, sx, b, y, M, N, K, t * TILE, passes);
        }
        free(wq);
        free(d);
        free(m);
    }
    free(hi);
    free(lo);
    free(dx);
    free(sx);
    free(sq);
#else
    (void)W, (void)is_q4, (void)x, (void)b, (void)y, (void)M, (void)N, (void)K, (void)passes, (void)num_threads;
    abort();  // callers check vnni_available() first
#endif
}
