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
