// Scalar versions of the x86 intrinsics block_kernels_vnni.c uses, with the instructions' exact integer semantics
// (wrapping adds, truncating vpmovdb, unsigned x signed vpdpbusd, round-to-nearest-even conversion, fused multiply-add).
// block_kernels_vnni.c compiled with -DOMNIVOX_SCALAR_INTRINSICS includes this instead of <immintrin.h>, so its tile
// layout, transposes, two-pass activations and corrections are tested on every host, AVX-512 VNNI or not
// (cpu_kernels.vnni_emulation, tests/models/test_quant.py). Slow; never used to serve.
#ifndef OMNIVOX_INTRINSICS_SCALAR_H
#define OMNIVOX_INTRINSICS_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef union { int8_t i8[16]; uint8_t u8[16]; uint16_t u16[8]; int32_t i32[4]; uint32_t u32[4]; int64_t i64[2]; } __m128i;
typedef union { int8_t i8[32]; uint8_t u8[32]; uint16_t u16[16]; int32_t i32[8]; uint32_t u32[8]; int64_t i64[4]; } __m256i;
typedef union { int8_t i8[64]; uint8_t u8[64]; uint16_t u16[32]; int32_t i32[16]; uint32_t u32[16]; int64_t i64[8]; } __m512i;
typedef struct { float f[8]; } __m256;
typedef struct { float f[16]; } __m512;

#define _MM_HINT_T1 2
#define _mm_prefetch(p, hint) ((void)(p), (void)(hint))

static inline uint32_t omnivox_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float omnivox_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float omnivox_half(uint16_t h) {  // IEEE fp16 -> float, as vcvtph2ps
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        const float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return omnivox_float(sign | 0x7f800000 | (man << 13));
    return omnivox_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

// ---- 128-bit integers
static inline __m128i _mm_loadu_si128(const __m128i *p) { __m128i r; memcpy(&r, p, 16); return r; }
static inline void _mm_storel_epi64(__m128i *p, __m128i a) { memcpy(p, &a, 8); }

// ---- 256-bit floats
static inline __m256 _mm256_loadu_ps(const float *p) { __m256 r; memcpy(r.f, p, 32); return r; }
static inline void _mm256_storeu_ps(float *p, __m256 a) { memcpy(p, a.f, 32); }
static inline __m256 _mm256_setzero_ps(void) { __m256 r; memset(&r, 0, sizeof r); return r; }
static inline __m256 _mm256_set1_ps(float v) { __m256 r; for (int i = 0; i < 8; i++) r.f[i] = v; return r; }
static inline __m256 _mm256_add_ps(__m256 a, __m256 b) { for (int i = 0; i < 8; i++) a.f[i] += b.f[i]; return a; }
static inline __m256 _mm256_mul_ps(__m256 a, __m256 b) { for (int i = 0; i < 8; i++) a.f[i] *= b.f[i]; return a; }
static inline __m256 _mm256_max_ps(__m256 a, __m256 b) {  // vmaxps: the second operand unless the first is greater
    for (int i = 0; i < 8; i++) a.f[i] = a.f[i] > b.f[i] ? a.f[i] : b.f[i];
    return a;
}
static inline __m256 _mm256_andnot_ps(__m256 a, __m256 b) {
    for (int i = 0; i < 8; i++) b.f[i] = omnivox_float(~omnivox_bits(a.f[i]) & omnivox_bits(b.f[i]));
    return b;
}
static inline __m256i _mm256_cvtps_epi32(__m256 a) {  // round to nearest even (the default MXCSR mode)
    __m256i r;
    for (int i = 0; i < 8; i++) r.i32[i] = (int32_t)nearbyintf(a.f[i]);
    return r;
}

// ---- 256-bit integers
static inline __m256i _mm256_loadu_si256(const __m256i *p) { __m256i r; memcpy(&r, p, 32); return r; }
static inline void _mm256_storeu_si256(__m256i *p, __m256i a) { memcpy(p, &a, 32); }
static inline __m256i _mm256_setzero_si256(void) { __m256i r; memset(&r, 0, sizeof r); return r; }
static inline __m256i _mm256_set1_epi32(int32_t v) { __m256i r; for (int i = 0; i < 8; i++) r.i32[i] = v; return r; }
static inline __m256i _mm256_add_epi32(__m256i a, __m256i b) { for (int i = 0; i < 8; i++) a.u32[i] += b.u32[i]; return a; }
static inline __m256i _mm256_sub_epi32(__m256i a, __m256i b) { for (int i = 0; i < 8; i++) a.u32[i] -= b.u32[i]; return a; }
static inline __m256i _mm256_slli_epi32(__m256i a, int n) { for (int i = 0; i < 8; i++) a.u32[i] <<= n; return a; }
static inline __m256i _mm256_srai_epi32(__m256i a, int n) {  // arithmetic: floor division by 2^n
    for (int i = 0; i < 8; i++) a.i32[i] = a.i32[i] < 0 ? ~(~a.i32[i] >> n) : a.i32[i] >> n;
    return a;
}
static inline __m128i _mm256_cvtepi32_epi8(__m256i a) {  // vpmovdb: truncation, upper 8 bytes zero
    __m128i r;
    memset(&r, 0, sizeof r);
    for (int i = 0; i < 8; i++) r.u8[i] = (uint8_t)a.u32[i];
    return r;
}

// ---- 512-bit floats
static inline __m512 _mm512_loadu_ps(const float *p) { __m512 r; memcpy(r.f, p, 64); return r; }
static inline void _mm512_storeu_ps(float *p, __m512 a) { memcpy(p, a.f, 64); }
static inline __m512 _mm512_setzero_ps(void) { __m512 r; memset(&r, 0, sizeof r); return r; }
static inline __m512 _mm512_set1_ps(float v) { __m512 r; for (int i = 0; i < 16; i++) r.f[i] = v; return r; }
static inline __m512 _mm512_mul_ps(__m512 a, __m512 b) { for (int i = 0; i < 16; i++) a.f[i] *= b.f[i]; return a; }
static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    for (int i = 0; i < 16; i++) a.f[i] = fmaf(a.f[i], b.f[i], c.f[i]);
    return a;
}
static inline __m512 _mm512_cvtepi32_ps(__m512i a) { __m512 r; for (int i = 0; i < 16; i++) r.f[i] = (float)a.i32[i]; return r; }
static inline __m512 _mm512_cvtph_ps(__m256i a) { __m512 r; for (int i = 0; i < 16; i++) r.f[i] = omnivox_half(a.u16[i]); return r; }

// ---- 512-bit integers
static inline __m512i _mm512_loadu_si512(const void *p) { __m512i r; memcpy(&r, p, 64); return r; }
static inline void _mm512_storeu_si512(void *p, __m512i a) { memcpy(p, &a, 64); }
static inline __m512i _mm512_setzero_si512(void) { __m512i r; memset(&r, 0, sizeof r); return r; }
static inline __m512i _mm512_set1_epi8(char v) { __m512i r; memset(&r, (unsigned char)v, 64); return r; }
static inline __m512i _mm512_set1_epi32(int32_t v) { __m512i r; for (int i = 0; i < 16; i++) r.i32[i] = v; return r; }
static inline __m512i _mm512_and_si512(__m512i a, __m512i b) { for (int i = 0; i < 8; i++) a.i64[i] &= b.i64[i]; return a; }
static inline __m512i _mm512_xor_si512(__m512i a, __m512i b) { for (int i = 0; i < 8; i++) a.i64[i] ^= b.i64[i]; return a; }
static inline __m512i _mm512_add_epi32(__m512i a, __m512i b) { for (int i = 0; i < 16; i++) a.u32[i] += b.u32[i]; return a; }
static inline __m512i _mm512_sub_epi32(__m512i a, __m512i b) { for (int i = 0; i < 16; i++) a.u32[i] -= b.u32[i]; return a; }
static inline __m512i _mm512_mullo_epi32(__m512i a, __m512i b) { for (int i = 0; i < 16; i++) a.u32[i] *= b.u32[i]; return a; }
static inline __m512i _mm512_slli_epi32(__m512i a, int n) { for (int i = 0; i < 16; i++) a.u32[i] <<= n; return a; }
static inline __m512i _mm512_srli_epi16(__m512i a, int n) { for (int i = 0; i < 32; i++) a.u16[i] >>= n; return a; }
static inline __m512i _mm512_castsi128_si512(__m128i a) {  // upper lanes undefined in the instruction; zero here
    __m512i r;
    memset(&r, 0, sizeof r);
    memcpy(&r, &a, 16);
    return r;
}
static inline __m512i _mm512_inserti32x4(__m512i v, __m128i a, int lane) { memcpy(v.u8 + 16 * lane, &a, 16); return v; }
// Unpacks interleave within each 128-bit lane: lo takes elements 0, 1 (32-bit) or 0 (64-bit), hi the upper ones.
static inline __m512i _mm512_unpacklo_epi32(__m512i a, __m512i b) {
    __m512i r;
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 2; i++) r.u32[4 * l + 2 * i] = a.u32[4 * l + i], r.u32[4 * l + 2 * i + 1] = b.u32[4 * l + i];
    return r;
}
static inline __m512i _mm512_unpackhi_epi32(__m512i a, __m512i b) {
    __m512i r;
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 2; i++)
            r.u32[4 * l + 2 * i] = a.u32[4 * l + 2 + i], r.u32[4 * l + 2 * i + 1] = b.u32[4 * l + 2 + i];
    return r;
}
static inline __m512i _mm512_unpacklo_epi64(__m512i a, __m512i b) {
    __m512i r;
    for (int l = 0; l < 4; l++) r.i64[2 * l] = a.i64[2 * l], r.i64[2 * l + 1] = b.i64[2 * l];
    return r;
}
static inline __m512i _mm512_unpackhi_epi64(__m512i a, __m512i b) {
    __m512i r;
    for (int l = 0; l < 4; l++) r.i64[2 * l] = a.i64[2 * l + 1], r.i64[2 * l + 1] = b.i64[2 * l + 1];
    return r;
}
// vpdpbusd: each 32-bit lane plus the four products of a's unsigned bytes with b's signed bytes (wrapping)
static inline __m512i _mm512_dpbusd_epi32(__m512i src, __m512i a, __m512i b) {
    for (int i = 0; i < 16; i++) {
        int32_t s = 0;
        for (int j = 0; j < 4; j++) s += (int32_t)a.u8[4 * i + j] * (int32_t)b.i8[4 * i + j];
        src.u32[i] += (uint32_t)s;
    }
    return src;
}

#endif
