/* Native kernels of decoding and verification forwards, built by `models/native.py`, called through ctypes.
 *
 * Attention: each query row walks its visible cache slots in slot order, one at a time: scores, their
 * maximum, then exp, the running sum and the value accumulation in that order; the float operations a
 * query gets are fixed by its key list alone, not by how many queries share the call, the batch, the key
 * window's length or a token tree around it. A tree node's ancestors sit at scratch slots in node order
 * (parents precede children), so it sees the keys of its own path in position order, as the chain along
 * that path does. One call per layer also applies q/k norms and rope and writes the cache.
 * RMSNorm (with the residual add before it) and an 8-bit (Q8_0) LM head: every row the same operations
 * whatever the rows around it.
 */
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

/* The LANES running sums of a reduction, added in a fixed pairwise tree. */
static inline float tree8(const float acc[LANES]) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* q . k over hd (a multiple of LANES): LANES running sums, then the tree. */
static float dot(const float *q, const float *k, int64_t hd) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < hd; d += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += q[d + l] * k[d + l];
    return tree8(acc);
}

/* 1 / sqrt(mean(x^2) + eps) over n values: the sum of squares in LANES running sums (a tail past the last
 * whole LANES into the first), then the tree. */
static float rms_inverse(const float *x, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[d + l] * x[d + l];
    for (; d < n; d++) acc[0] += x[d] * x[d];
    return 1.0f / sqrtf(tree8(acc) / (float)n + eps);
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = { (uint32_t)h << 16 };
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {            /* round to nearest even, as torch does */
    union { float f; uint32_t u; } c = { f };
    if ((c.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((c.u >> 16) | 0x40);   /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fff + ((c.u >> 16) & 1)) >> 16);
}

/* exp(x) for x <= 0 by Cephes' expf polynomial (within 2 ulp of expf): branch-free, so the softmax loop
 * vectorises (libm's expf does not without -ffast-math). Below -86 it returns exp(-86) (about 4e-38,
 * still a normal float: no slow denormals), which no softmax weight beside exp(0) can tell from 0. */
static inline float exp_neg(float x) {
    x = x < -86.0f ? -86.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;          /* round(x / ln 2) */
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;                                     /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* One query token's attention for the g query heads sharing a kv head: qs [g][hd] against the n visible
 * slots (in slot order) of kr, vr (rows of hd floats); o [g][hd] float. score: [g][n] scratch. */
static void attend_group(const float *qs, int64_t g, const float *kr, const float *vr, const int64_t *slots,
                         int64_t n, int64_t hd, float scale, float *score, float *o) {
    for (int64_t x = 0; x < g * hd; x++) o[x] = 0.0f;
    if (n == 0) return;
    int64_t i0 = 0;
#ifdef __AVX2__
    if (hd == 64)                                         /* 8 keys at a time, each dot as `dot` computes it */
        for (; i0 + 8 <= n; i0 += 8)
            for (int64_t h = 0; h < g; h++) {
                const float *q = qs + h * hd;
                __m256 lanes[8];                          /* key j: lane l sums q k over d = l, l + 8, ... */
                for (int j = 0; j < 8; j++) {
                    const float *ks = kr + slots[i0 + j] * hd;
                    __m256 acc = _mm256_setzero_ps();
                    for (int c = 0; c < 8; c++)
                        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(ks + 8 * c)));
                    lanes[j] = acc;
                }
                /* tree8 of each key's lanes, 8 keys at once: hadd pairs adjacent lanes, so two rounds give
                 * (a0 + a1) + (a2 + a3) in the low half and (a4 + a5) + (a6 + a7) in the high half */
                __m256 h01 = _mm256_hadd_ps(_mm256_hadd_ps(lanes[0], lanes[1]), _mm256_hadd_ps(lanes[2], lanes[3]));
                __m256 h45 = _mm256_hadd_ps(_mm256_hadd_ps(lanes[4], lanes[5]), _mm256_hadd_ps(lanes[6], lanes[7]));
                __m256 lo = _mm256_permute2f128_ps(h01, h45, 0x20), hi = _mm256_permute2f128_ps(h01, h45, 0x31);
                __m256 dots = _mm256_add_ps(lo, hi);         /* keys i0 .. i0 + 7 in order */
                _mm256_storeu_ps(score + h * n + i0, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
            }
#endif
    for (int64_t i = i0; i < n; i++) {
        const float *ks = kr + slots[i] * hd;
        for (int64_t h = 0; h < g; h++) score[h * n + i] = dot(qs + h * hd, ks, hd) * scale;
    }
    for (int64_t h = 0; h < g; h++) {
        float *sh = score + h * n, top = -INFINITY;
        for (int64_t i = 0; i < n; i++)
            if (sh[i] > top) top = sh[i];
        for (int64_t i = 0; i < n; i++) sh[i] = exp_neg(sh[i] - top);
    }
    for (int64_t h = 0; h < g; h++) {                     /* o[h] = sum over slots of p v, in slot order */
        const float *sh = score + h * n;
        float *oh = o + h * hd, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += sh[i];
        int64_t d0 = 0;
#ifdef __AVX2__
        for (; d0 + 64 <= hd; d0 += 64) {                 /* 64 outputs in 8 registers across all the slots */
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i++) {
                const __m256 p = _mm256_set1_ps(sh[i]);
                const float *vs = vr + slots[i] * hd + d0;
                for (int c = 0; c < 8; c++) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(p, _mm256_loadu_ps(vs + 8 * c)));
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(oh + d0 + 8 * c, acc[c]);
        }
#endif
        for (int64_t i = 0; i < n; i++) {                 /* the same sums in plain C (no AVX2, or hd % 64) */
            const float p = sh[i], *vs = vr + slots[i] * hd;
            for (int64_t d = d0; d < hd; d++) oh[d] += p * vs[d];
        }
        for (int64_t d = 0; d < hd; d++) oh[d] /= sum;
    }
}

/*
 * A layer's attention from its fused q, k, v projection, for the B*T tokens of a forward:
 * qkv    [B*T, (nh + 2 nkv) * hd] bfloat16 (qkv_bf16) or float32, rows qkv_stride elements apart
 * cos, ssin [B*T, hd] float32 (the tokens' rope rows; ssin = [-sin first half | sin second half]); with pos
 *        (not NULL: [B*T] int64 positions), the whole tables [pos_limit, hd] instead, token r's rows at pos[r]
 * q_norm, k_norm [hd] float32 RMSNorm weights applied per head before rope, or NULL (eps for both)
 * kc, vc the layer's cache [R, nkv, Smax, hd] float32: token t of row b writes its key and value at
 *        kc + row_off[b] + j * head_stride + (at[b] + t) * hd, and attends over slots s < S of that row
 *        where mask [B, T, S] (bytes) is nonzero; mask NULL: a causal chain, slots s <= at[b] + t
 * out    [B*T, nh * hd] bfloat16 (out_bf16) or float32
 * In two steps, so a caller can split the second over threads (`layers.cpp`): specdec_attend_rope, then
 * specdec_attend_heads over any partition of the B*T*nh (token, query head) pairs; each pair gets the same
 * operations whichever range it falls in.
 */
typedef struct {
    const void *qkv; int qkv_bf16; int64_t qkv_stride;
    const float *cos, *ssin, *q_norm, *k_norm; float eps;
    float *kc, *vc; const int64_t *row_off, *at; int64_t head_stride;
    const uint8_t *mask; int64_t S, B, T, nh, nkv, hd; float scale;
    void *out; int out_bf16;
    const int64_t *pos; int64_t pos_limit;
} attend_call;

/* 1. queries (normed, roped) into rows [B*T, nh, hd] float32; keys roped and values copied into the cache.
 * Returns 0, -1 if memory ran out, -2 if nh / nkv > 64, -3 if a position is outside the rope tables. */
int specdec_attend_rope(const attend_call *a, float *rows) {
    const int64_t hd = a->hd, half = hd / 2, nh = a->nh, nkv = a->nkv, width = nh + 2 * nkv;
    if (nh / nkv > 64) return -2;
    if (a->pos)
        for (int64_t r = 0; r < a->B * a->T; r++)
            if (a->pos[r] < 0 || a->pos[r] >= a->pos_limit) return -3;
    float *head = malloc(sizeof(float) * (size_t)hd);
    if (!head) return -1;
    for (int64_t b = 0; b < a->B; b++) {
        for (int64_t t = 0; t < a->T; t++) {
            int64_t r = b * a->T + t;
            const int64_t at = a->pos ? a->pos[r] : r;                       /* the token's rope rows */
            const float *c = a->cos + at * hd, *sn = a->ssin + at * hd;
            for (int64_t j = 0; j < width; j++) {
                for (int64_t d = 0; d < hd; d++) {
                    int64_t e = r * a->qkv_stride + j * hd + d;
                    head[d] = a->qkv_bf16 ? bf16_to_f32(((const uint16_t *)a->qkv)[e]) : ((const float *)a->qkv)[e];
                }
                float *dst;
                int64_t slot = a->row_off[b] + (a->at[b] + t) * hd;
                if (j < nh) dst = rows + (r * nh + j) * hd;
                else if (j < nh + nkv) dst = a->kc + slot + (j - nh) * a->head_stride;
                else {
                    dst = a->vc + slot + (j - nh - nkv) * a->head_stride;
                    for (int64_t d = 0; d < hd; d++) dst[d] = head[d];
                    continue;
                }
                const float *w = j < nh ? a->q_norm : a->k_norm;
                if (w) {
                    float inv = rms_inverse(head, hd, a->eps);
                    for (int64_t d = 0; d < hd; d++) head[d] = head[d] * inv * w[d];
                }
                for (int64_t d = 0; d < half; d++) {
                    dst[d] = head[d] * c[d] + head[d + half] * sn[d];
                    dst[d + half] = head[d + half] * c[d + half] + head[d] * sn[d + half];
                }
            }
        }
    }
    free(head);
    return 0;
}

/* 2. the (token, query head) pairs w0 .. w1 - 1 (token-major: pair r * nh + h) of the roped queries `rows`, each
 * over its visible slots in slot order, into out. The heads of a kv group in the range share one pass over its
 * keys. Returns 0, or -1 if memory ran out. */
int specdec_attend_heads(const attend_call *a, const float *rows, int64_t w0, int64_t w1) {
    const int64_t nh = a->nh, hd = a->hd, g = nh / a->nkv, S = a->S > 0 ? a->S : 1;
    float *o = malloc(sizeof(float) * (size_t)(g * hd));
    float *score = malloc(sizeof(float) * (size_t)(g * S));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)S);
    if (!o || !score || !slots) {
        free(o); free(score); free(slots);
        return -1;
    }
    for (int64_t r = w0 / nh; r * nh < w1; r++) {
        int64_t b = r / a->T, n = 0;
        if (a->mask) {
            const uint8_t *m = a->mask + r * a->S;
            for (int64_t s = 0; s < a->S; s++)
                if (m[s]) slots[n++] = s;
        } else {                                                        /* causal: up to the token's own slot */
            for (int64_t s = 0, end = a->at[b] + r % a->T; s <= end && s < a->S; s++)
                slots[n++] = s;
        }
        for (int64_t j = 0; j < a->nkv; j++) {
            int64_t h0 = r * nh + j * g, h1 = h0 + g;                   /* this group's pairs, within the range */
            h0 = h0 < w0 ? w0 : h0;
            h1 = h1 > w1 ? w1 : h1;
            if (h0 >= h1) continue;
            const float *kr = a->kc + a->row_off[b] + j * a->head_stride, *vr = a->vc + a->row_off[b] + j * a->head_stride;
            attend_group(rows + h0 * hd, h1 - h0, kr, vr, slots, n, hd, a->scale, score, o);
            if (a->out_bf16)
                for (int64_t x = 0; x < (h1 - h0) * hd; x++) ((uint16_t *)a->out)[h0 * hd + x] = f32_to_bf16(o[x]);
            else
                for (int64_t x = 0; x < (h1 - h0) * hd; x++) ((float *)a->out)[h0 * hd + x] = o[x];
        }
    }
    free(o); free(score); free(slots);
    return 0;
}

/* Both steps on the calling thread (`native.Attend`). Returns 0, -1 if memory ran out, -2 if nh / nkv > 64, -3 if
 * a position is outside the rope tables. */
int specdec_qkv_attend(const void *qkv, int qkv_bf16, int64_t qkv_stride, const float *cos, const float *ssin,
                       const float *q_norm, const float *k_norm, float eps, float *kc, float *vc,
                       const int64_t *row_off, const int64_t *at, int64_t head_stride,
                       const uint8_t *mask, int64_t S, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                       int64_t hd, float scale, void *out, int out_bf16, const int64_t *pos, int64_t pos_limit) {
    const attend_call a = {qkv, qkv_bf16, qkv_stride, cos, ssin, q_norm, k_norm, eps, kc, vc, row_off, at,
                           head_stride, mask, S, B, T, nh, nkv, hd, scale, out, out_bf16, pos, pos_limit};
    float *rows = malloc(sizeof(float) * (size_t)(B * T * nh * hd));          /* roped queries */
    if (!rows) return -1;
    int rc = specdec_attend_rope(&a, rows);
    if (!rc) rc = specdec_attend_heads(&a, rows, 0, B * T * nh);
    free(rows);
    return rc;
}

/* ---- An 8-bit LM head (GGUF Q8_0: per block of 32 weights along K, a scale d and 32 int8 codes) ----
 * out[m, n] = sum over blocks b of d[n, b] * (sum over the block of x[m, k] * q[n, k]), kept in 16 running
 * sums (lane l adds d * (x q at l + x q at 16 + l) of every block, in block order) and a fixed pairwise
 * tree at the end: every (m, n) gets the same operations whatever M, the thread count or the split, so
 * rows keep their bits by construction. */

#define QB 32

typedef struct {
    const float *x; int64_t M, K; const int8_t *q; const float *d; int64_t n0, n1; float *out; int64_t N;
} q8_job;

static void *q8_rows(void *arg) {
    const q8_job *j = arg;
    int64_t nb = j->K / QB;
    float *acc = malloc(sizeof(float) * (size_t)(j->M * 16));
    if (!acc) return (void *)1;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const int8_t *qn = j->q + n * j->K;
        const float *dn = j->d + n * nb;
        for (int64_t e = 0; e < j->M * 16; e++) acc[e] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float w[QB];
            const float db = dn[b];
            for (int i = 0; i < QB; i++) w[i] = (float)qn[b * QB + i];
            for (int64_t m = 0; m < j->M; m++) {
                const float *restrict xb = j->x + m * j->K + b * QB;
                float *restrict am = acc + m * 16;
                for (int l = 0; l < 16; l++) am[l] += db * (xb[l] * w[l] + xb[16 + l] * w[16 + l]);
            }
        }
        for (int64_t m = 0; m < j->M; m++) {
            const float *a = acc + m * 16;
            j->out[m * j->N + n] = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])))
                                 + (((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15])));
        }
    }
    free(acc);
    return NULL;
}

/* x [M, K] bfloat16 (x_bf16) or float32; q [N, K] int8 codes; d [N, K / 32] float32 scales -> out [M, N]
 * float32. Output rows are split over `threads` threads. Returns 0, -1 if memory or threads ran out. */
int specdec_q8_0_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *q, const float *d,
                        int64_t N, float *out, int threads) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -1;
    for (int64_t e = 0; e < M * K; e++)
        xf[e] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[e]) : ((const float *)x)[e];
    q8_job jobs[64];
    pthread_t tid[64];
    int64_t per = (N + threads - 1) / threads;
    int started = 0, rc = 0;
    for (int t = 0; t < threads; t++) {
        int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        jobs[t] = (q8_job){xf, M, K, q, d, n0, n1 > n0 ? n1 : n0, out, N};
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, q8_rows, &jobs[t]) != 0) { rc = -1; break; }
        started = t;
    }
    if (rc) {                                             /* could not start them all: the rest here */
        rc = 0;
        for (int t = started + 1; t < threads; t++)
            if (q8_rows(&jobs[t])) rc = -1;
    }
    if (q8_rows(&jobs[0])) rc = -1;
    for (int t = 1; t <= started; t++) {
        void *r = NULL;
        pthread_join(tid[t], &r);
        if (r) rc = -1;
    }
    free(xf);
    return rc;
}

/* ---- The 8-bit LM head with 8-bit activations (llama.cpp's Q8_0 x Q8_0 dot) ----
 * Each input row is quantized per block of 32 as Q8_0 does: dx = max|x| / 127, codes round(x / dx). A block's
 * 32 products are summed as 8 exact integer lanes of 4 (lane l: inputs 4l..4l+3); lane l's float running
 * sum adds (float)lane * (d[n][b] * dx_b) block by block, and the 8 sums meet in the fixed tree. Integer sums
 * are exact whatever instructions form them, so every output is the same operations for any row count,
 * thread count or instruction set: the AVX2 path and the plain C one give the same bits. The weights are
 * memory-bound for one row: the AVX2 path prefetches the rows 32 ahead. */
#ifdef __AVX2__

/* The 32 products of a block summed into 8 int32 lanes: |w| * sign(x, w) pairs (maddubs cannot overflow:
 * |codes| <= 127), then pairs of those. */
static inline __m256i block_dot8(__m256i w, __m256i x) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#endif

typedef struct {
    const int8_t *xq; const float *dx; const int32_t *xc; int64_t M, K; const int8_t *q; const float *d;
    int64_t n0, n1; float *out; int64_t N; int isa;
} q8x8_job;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_512 1
/* AVX-512 VNNI: 2 outputs per register (lanes 0-7 row n, 8-15 row n + 1), 4 outputs per step, the weights
 * of a block loaded once for up to 8 input rows. vpdpbusd takes unsigned x signed bytes: the codes offset
 * by 128 (w ^ 0x80), and each lane starts from -128 times its 4 inputs' sum (xc), so it ends at the same
 * exact integer as the other paths' lanes. Returns the first output row it did not compute. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static inline __m512i pair_codes(const int8_t *q, int64_t K, int64_t n, int64_t b) {
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + n * K + b * QB))),
                                   _mm256_loadu_si256((const __m256i *)(q + (n + 1) * K + b * QB)), 1);
    return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static inline __m512 pair_scales(const float *d, int64_t nb, int64_t n, int64_t b) {
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castps_si512(_mm512_set1_ps(d[n * nb + b])),
                                                  _mm256_castps_si256(_mm256_set1_ps(d[(n + 1) * nb + b])), 1));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static int64_t q8x8_pairs512(const q8x8_job *j, int64_t n, int64_t n1) {
    const int64_t nb = j->K / QB;
    for (; n + 4 <= n1; n += 4)                            /* two pairs: the inputs' loads serve both */
        for (int64_t m0 = 0; m0 < j->M; m0 += 8) {
            const int mc = j->M - m0 < 8 ? (int)(j->M - m0) : 8;
            __m512 acc[8][2];
            for (int c = 0; c < 8; c++) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                if (m0 == 0 && (b & 1) == 0)                 /* the rows 32 ahead, a cache line per 2 blocks */
                    for (int r = 0; r < 4; r++)
                        _mm_prefetch((const char *)(j->q + (n + 32 + r) * j->K + b * QB), _MM_HINT_T0);
                const __m512i w0 = pair_codes(j->q, j->K, n, b), w1 = pair_codes(j->q, j->K, n + 2, b);
                const __m512 d0 = pair_scales(j->d, nb, n, b), d1 = pair_scales(j->d, nb, n + 2, b);
                for (int c = 0; c < mc; c++) {
                    const int64_t m = m0 + c;
                    __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(j->xq + m * j->K + b * QB)));
                    __m512i xc = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(j->xc + (m * nb + b) * LANES)));
                    __m512 dx = _mm512_set1_ps(j->dx[m * nb + b]);
                    acc[c][0] = _mm512_add_ps(acc[c][0], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(xc, w0, xv)),
                                                                       _mm512_mul_ps(d0, dx)));
                    acc[c][1] = _mm512_add_ps(acc[c][1], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(xc, w1, xv)),
                                                                       _mm512_mul_ps(d1, dx)));
                }
            }
            for (int c = 0; c < mc; c++)
                for (int h = 0; h < 2; h++) {
                    float a[16];
                    _mm512_storeu_ps(a, acc[c][h]);
                    j->out[(m0 + c) * j->N + n + 2 * h] = tree8(a);
                    j->out[(m0 + c) * j->N + n + 2 * h + 1] = tree8(a + 8);
                }
        }
    return n;
}
#endif

static void *q8x8_rows(void *arg) {
    const q8x8_job *j = arg;
    const int64_t nb = j->K / QB;
    int64_t n = j->n0;
#ifdef HAVE_512
    if (j->isa >= 2) n = q8x8_pairs512(j, n, j->n1);
#endif
#ifdef __AVX2__
    if (j->isa >= 1)
    for (; n + 4 <= j->n1; n += 4)
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *xm = j->xq + m * j->K;
            const float *dxm = j->dx + m * nb;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t b = 0; b < nb; b++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xm + b * QB));
                if (m == 0 && (b & 1) == 0)                  /* the rows 32 ahead, a cache line per 2 blocks */
                    for (int r = 0; r < 4; r++)
                        _mm_prefetch((const char *)(j->q + (n + 32 + r) * j->K + b * QB), _MM_HINT_T0);
                for (int r = 0; r < 4; r++) {
                    __m256i s = block_dot8(_mm256_loadu_si256((const __m256i *)(j->q + (n + r) * j->K + b * QB)), xv);
                    __m256 sc = _mm256_set1_ps(j->d[(n + r) * nb + b] * dxm[b]);
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(s), sc));
                }
            }
            for (int r = 0; r < 4; r++) {
                float a[8];
                _mm256_storeu_ps(a, acc[r]);
                j->out[m * j->N + n + r] = tree8(a);
            }
        }
#endif
    for (; n < j->n1; n++)                               /* the same sums in plain C (no AVX2, or a tail) */
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *xm = j->xq + m * j->K, *qn = j->q + n * j->K;
            float acc[LANES] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const float sc = j->d[n * nb + b] * j->dx[m * nb + b];
                for (int l = 0; l < LANES; l++) {
                    int32_t lane = 0;
                    for (int i = 4 * l; i < 4 * l + 4; i++) lane += (int32_t)qn[b * QB + i] * (int32_t)xm[b * QB + i];
                    acc[l] = acc[l] + (float)lane * sc;
                }
            }
            j->out[m * j->N + n] = tree8(acc);
        }
    return NULL;
}

/* The instructions q8x8 may use, at most `isa` (0: plain C, 1: AVX2, 2: AVX-512 VNNI): what this CPU and
 * this build have. Every level gives the same bits. */
int specdec_q8x8_isa(int isa) {
#ifndef __AVX2__
    if (isa > 0) isa = 0;
#endif
#ifdef HAVE_512
    if (isa >= 2 && !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                      && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")))
        isa = 1;
#else
    if (isa > 1) isa = 1;
#endif
    return isa;
}

/* x [M, K] bfloat16 (x_bf16) or float32; q [N, K] int8 codes; d [N, K / 32] float32 scales -> out [M, N]
 * float32, x quantized to Q8_0 first. Output rows split over `threads` threads, instructions up to `isa`
 * (see specdec_q8x8_isa). 0, or -1: out of memory. */
int specdec_q8_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                        int32_t *xs8);

int specdec_q8_0_q8_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *q, const float *d,
                           int64_t N, float *out, int threads, int isa) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    isa = specdec_q8x8_isa(isa);
    const int64_t nb = K / QB;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb)), *sx = malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *xs8 = malloc(sizeof(int32_t) * (size_t)(M * nb));
    int32_t *xc = malloc(sizeof(int32_t) * (size_t)(M * nb * LANES));
    if (!xq || !dx || !sx || !xs8 || !xc) { free(xq); free(dx); free(sx); free(xs8); free(xc); return -1; }
    specdec_q8_quantize(x, x_bf16, M, K, xq, dx, sx, xs8);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < LANES; l++) {              /* -128 x each lane's input sum (the VNNI path) */
                int32_t sum = 0;
                for (int i = 4 * l; i < 4 * l + 4; i++) sum += xq[m * K + b * QB + i];
                xc[(m * nb + b) * LANES + l] = -128 * sum;
            }
    free(sx);
    free(xs8);
    q8x8_job jobs[64];
    pthread_t tid[64];
    int64_t per = ((N + threads - 1) / threads + 3) / 4 * 4;  /* whole groups of 4 outputs per thread */
    int started = 0, rc = 0;
    for (int t = 0; t < threads; t++) {
        int64_t n0 = t * per < N ? t * per : N, n1 = n0 + per < N ? n0 + per : N;
        jobs[t] = (q8x8_job){xq, dx, xc, M, K, q, d, n0, n1, out, N, isa};
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, q8x8_rows, &jobs[t]) != 0) break;
        started = t;
    }
    for (int t = started + 1; t < threads; t++) q8x8_rows(&jobs[t]);   /* threads that did not start */
    q8x8_rows(&jobs[0]);
    for (int t = 1; t <= started; t++) pthread_join(tid[t], NULL);
    free(xq);
    free(dx);
    free(xc);
    return rc;
}

/* ---- RMSNorm of the residual stream, optionally after adding a layer's output to it ----
 * x [N, D] and o [N, D] (o NULL: nothing added) in bfloat16 (bf16) or float32; xo = x + o rounded to that
 * dtype (skipped without o), h = (x' / sqrt(mean(x'^2) + eps)) * w in that dtype, x' the float of xo. Each
 * row's sum of squares runs in 8 running sums and a fixed pairwise tree: a row's bits are its own. */
int specdec_add_rms_norm(const void *x, const void *o, int bf16, int64_t N, int64_t D, const float *w,
                         float eps, void *xo, void *h) {
    float *row = malloc(sizeof(float) * (size_t)D);
    if (!row) return -1;
    for (int64_t r = 0; r < N; r++) {
        for (int64_t d = 0; d < D; d++) {
            int64_t e = r * D + d;
            float v = bf16 ? bf16_to_f32(((const uint16_t *)x)[e]) : ((const float *)x)[e];
            if (o) {
                v += bf16 ? bf16_to_f32(((const uint16_t *)o)[e]) : ((const float *)o)[e];
                if (bf16) {
                    uint16_t b = f32_to_bf16(v);
                    ((uint16_t *)xo)[e] = b;
                    v = bf16_to_f32(b);
                } else {
                    ((float *)xo)[e] = v;
                }
            }
            row[d] = v;
        }
        float inv = rms_inverse(row, D, eps);
        for (int64_t d = 0; d < D; d++) {
            float y = row[d] * inv * w[d];
            if (bf16) ((uint16_t *)h)[r * D + d] = f32_to_bf16(y);
            else ((float *)h)[r * D + d] = y;
        }
    }
    free(row);
    return 0;
}

/* ---- 4-bit linear layers with 8-bit activations (llama.cpp's Q4 x Q8 dot, row-invariant) ----
 * Weights in groups of 16 output rows. Per block of 32 inputs each row has 4-bit codes q in [0, 16), a scale
 * and a zero (w = (q - 8) scale + zero: Q4_1 and Q4_K alike, see int4.Blocks4), laid out as
 *   codes [N / 16][nb][4][64]: in part p of a block (its inputs 8p..8p+7), byte 4r + j holds the code of
 *                              row r, input 8p + j in its low nibble and of input 8p + 4 + j in its high one;
 *   scale, zero [N / 16][nb][16] float32.
 * Inputs are quantized per row and block of 32 as Q8_0 does (dx = max|x| / 127, xq = round(x / dx); xs = the
 * sum of xq, sx = dx * xs). Output (m, n) is, over the blocks in order,
 *   acc = acc + (float)(sum of q xq - 8 xs) * (scale dx);  acc = acc + zero * sx
 * The integer sums are exact whatever instructions form them (vpdpbusd, maddubs + madd, plain C), so every
 * output is the same float operations for any row count, thread count or instruction set. One block's codes
 * serve up to 8 (AVX-512) or 4 (AVX2) input rows: verifying K drafts costs far less than K + 1 rows. */

#define Q4G 16

/* x [M, K] (bfloat16 or float32) -> xq [M, K], dx, sx [M, K / 32] float32, xs8 [M, K / 32] = 8 * the block's code sum */
int specdec_q8_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                        int32_t *xs8) {
    const int64_t nb = K / QB;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            float v[QB], amax = 0.0f;
            for (int i = 0; i < QB; i++) {
                int64_t e = m * K + b * QB + i;
                v[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[e]) : ((const float *)x)[e];
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < QB; i++) {
                int8_t c = (int8_t)roundf(v[i] * inv);
                xq[m * K + b * QB + i] = c;
                sum += c;
            }
            dx[m * nb + b] = db;
            sx[m * nb + b] = db * (float)sum;
            xs8[m * nb + b] = 8 * sum;
        }
    return 0;
}

static inline void q4_store(void *out, int out_bf16, int64_t at, const float *v, int n) {
    for (int i = 0; i < n; i++) {
        if (out_bf16) ((uint16_t *)out)[at + i] = f32_to_bf16(v[i]);
        else ((float *)out)[at + i] = v[i];
    }
}

typedef struct {
    const int8_t *xq; const float *dx, *sx; const int32_t *xs8; int64_t M, K;
    const uint8_t *codes; const float *scale, *zero; int64_t N; void *out; int out_bf16;
} q4_job;

/* Prefetch distance of the 4-bit kernels: 4 blocks ahead (codes 1 KB, scales and zeros 256 B each). The
 * hardware prefetchers leave a weight stream that is not in cache partly exposed, the more so the more rows
 * share each block; on an Intel Xeon (family 6, model 167) a [1536 x 576] layer read from memory took 16%
 * less for 1 row and 29% less for 5 with these hints (benchmarks.md, "Prefetching the 4-bit weights"). */
#define Q4_AHEAD 4

/* (a macro: as an inline function, gcc 12 dropped these hints from the AVX-512 and AVX2 loops) */
#define Q4_PREFETCH(j, g, b) do {                                                                            \
        const int64_t at_ = (g) * ((j)->K / QB) + (b) + Q4_AHEAD;                                          \
        for (int line_ = 0; line_ < 4; line_++)                                                            \
            _mm_prefetch((const char *)((j)->codes + at_ * 256 + 64 * line_), _MM_HINT_T0);                \
        _mm_prefetch((const char *)((j)->scale + at_ * Q4G), _MM_HINT_T0);   /* past the end: a hint, no fault */ \
        _mm_prefetch((const char *)((j)->zero + at_ * Q4G), _MM_HINT_T0);                                  \
    } while (0)

#ifdef HAVE_512
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void q4_group512(const q4_job *j, int64_t g) {
    const int64_t nb = j->K / QB;
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t m0 = 0; m0 < j->M; m0 += 8) {
        const int mc = j->M - m0 < 8 ? (int)(j->M - m0) : 8;
        __m512 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = j->codes + (g * nb + b) * 256;
            if (m0 == 0) Q4_PREFETCH(j, g, b);
            __m512i q[8];
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * p));
                q[2 * p] = _mm512_and_si512(v, low);
                q[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            const __m512 sv = _mm512_loadu_ps(j->scale + (g * nb + b) * Q4G);
            const __m512 zv = _mm512_loadu_ps(j->zero + (g * nb + b) * Q4G);
            for (int c = 0; c < mc; c++) {
                const int64_t m = m0 + c, mb = m * nb + b;
                const int32_t *x4 = (const int32_t *)(j->xq + m * j->K + b * QB);
                __m512i s = _mm512_set1_epi32(-j->xs8[mb]);            /* the codes' offset of 8, then the products */
                for (int i = 0; i < 8; i++) s = _mm512_dpbusd_epi32(s, q[i], _mm512_set1_epi32(x4[i]));
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                                                             _mm512_mul_ps(sv, _mm512_set1_ps(j->dx[mb]))));
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(zv, _mm512_set1_ps(j->sx[mb])));
            }
        }
        for (int c = 0; c < mc; c++) {
            float a[Q4G];
            _mm512_storeu_ps(a, acc[c]);
            q4_store(j->out, j->out_bf16, (m0 + c) * j->N + g * Q4G, a, Q4G);
        }
    }
}
#endif

#ifdef __AVX2__
/* Up to Q4_PASS rows per pass over a group's weights: each block of codes is loaded and unpacked once per pass,
 * both halves (outputs 0-7, 8-15) at once, so the weight stream runs without pause (a pass per 4 rows and per half
 * re-read the group from cache while no memory request was in flight). A row's 8-bit products add up in 16 bits:
 * codes <= 15 and |xq| <= 127 make a pair sum at most 3810 in size, a block's 30480, so one widening per row and
 * block, not eight. Every output gets the same float operations in block order as in the plain C kernel. */
#define Q4_PASS 8
static void q4_group256(const q4_job *j, int64_t g) {
    const int64_t nb = j->K / QB;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t m0 = 0; m0 < j->M; m0 += Q4_PASS) {
        const int mc = j->M - m0 < Q4_PASS ? (int)(j->M - m0) : Q4_PASS;
        __m256 acc[Q4_PASS][2];
        for (int c = 0; c < mc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (m0 == 0) Q4_PREFETCH(j, g, b);
            for (int h = 0; h < 2; h++) {
                const uint8_t *wb = j->codes + (g * nb + b) * 256 + 32 * h;
                __m256i q[8];
                for (int p = 0; p < 4; p++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * p));
                    q[2 * p] = _mm256_and_si256(v, low);
                    q[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                const __m256 sv = _mm256_loadu_ps(j->scale + (g * nb + b) * Q4G + 8 * h);
                const __m256 zv = _mm256_loadu_ps(j->zero + (g * nb + b) * Q4G + 8 * h);
                for (int c = 0; c < mc; c++) {
                    const int64_t m = m0 + c, mb = m * nb + b;
                    const int32_t *x4 = (const int32_t *)(j->xq + m * j->K + b * QB);
                    __m256i p[8];
                    for (int i = 0; i < 8; i++) p[i] = _mm256_maddubs_epi16(q[i], _mm256_set1_epi32(x4[i]));
                    const __m256i t = _mm256_add_epi16(
                        _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                        _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
                    const __m256i s = _mm256_sub_epi32(_mm256_madd_epi16(t, ones), _mm256_set1_epi32(j->xs8[mb]));
                    acc[c][h] = _mm256_add_ps(acc[c][h], _mm256_mul_ps(_mm256_cvtepi32_ps(s),
                                                                       _mm256_mul_ps(sv, _mm256_set1_ps(j->dx[mb]))));
                    acc[c][h] = _mm256_add_ps(acc[c][h], _mm256_mul_ps(zv, _mm256_set1_ps(j->sx[mb])));
                }
            }
        }
        for (int c = 0; c < mc; c++)
            for (int h = 0; h < 2; h++) {
                float a[8];
                _mm256_storeu_ps(a, acc[c][h]);
                q4_store(j->out, j->out_bf16, (m0 + c) * j->N + g * Q4G + 8 * h, a, 8);
            }
    }
}
#endif

static void q4_group_c(const q4_job *j, int64_t g) {    /* the same operations in plain C */
    const int64_t nb = j->K / QB;
    for (int64_t m = 0; m < j->M; m++) {
        float acc[Q4G] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = j->codes + (g * nb + b) * 256;
            const int8_t *xb = j->xq + m * j->K + b * QB;
            const int64_t mb = m * nb + b;
            for (int r = 0; r < Q4G; r++) {
                int32_t s = 0;
                for (int p = 0; p < 4; p++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = wb[64 * p + 4 * r + i];
                        s += (int32_t)(byte & 15) * xb[8 * p + i] + (int32_t)(byte >> 4) * xb[8 * p + 4 + i];
                    }
                const int64_t at = (g * nb + b) * Q4G + r;
                acc[r] = acc[r] + (float)(s - j->xs8[mb]) * (j->scale[at] * j->dx[mb]);
                acc[r] = acc[r] + j->zero[at] * j->sx[mb];
            }
        }
        q4_store(j->out, j->out_bf16, m * j->N + g * Q4G, acc, Q4G);
    }
}

/* ---- The 8-bit (Q8_0) LM head in groups of 16 rows, against 8-bit inputs ----
 * The head's codes as 16-row groups laid out like the 4-bit kernel's (native.q8_rows_layout):
 *   codes [N / 16][nb][8][64]: in part c of a block (inputs 4c..4c+3), byte 4r + j is row r's code of input 4c + j;
 *   d     [N / 16][nb][16] float32.
 * Inputs quantized by specdec_q8_quantize. Output (m, n), over the blocks in order:
 *   acc = acc + (float)(sum of q xq) * (d dx)
 * Exact integer block sums (vpdpbusd over the codes offset by 128, less 128 xs; maddubs over |q| and xq signed
 * by q, then madd; plain C), so every path and row count gives the same bits. `scale` is d, `zero` unused: the
 * 4-bit kernel's job and signature. */
#ifdef HAVE_512
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void q8r_group512(const q4_job *j, int64_t g) {
    const int64_t nb = j->K / QB;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t m0 = 0; m0 < j->M; m0 += 8) {
        const int mc = j->M - m0 < 8 ? (int)(j->M - m0) : 8;
        __m512 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = j->codes + (g * nb + b) * 512;
            if (m0 == 0) _mm_prefetch((const char *)(wb + 512 * 4), _MM_HINT_T0);
            __m512i q[8];
            for (int p = 0; p < 8; p++) q[p] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wb + 64 * p)), flip);
            const __m512 dv = _mm512_loadu_ps(j->scale + (g * nb + b) * Q4G);
            for (int c = 0; c < mc; c++) {
                const int64_t m = m0 + c, mb = m * nb + b;
                const int32_t *x4 = (const int32_t *)(j->xq + m * j->K + b * QB);
                __m512i s = _mm512_set1_epi32(-16 * j->xs8[mb]);              /* -128 xs */
                for (int p = 0; p < 8; p++) s = _mm512_dpbusd_epi32(s, q[p], _mm512_set1_epi32(x4[p]));
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                                                             _mm512_mul_ps(dv, _mm512_set1_ps(j->dx[mb]))));
            }
        }
        for (int c = 0; c < mc; c++) {
            float a[Q4G];
            _mm512_storeu_ps(a, acc[c]);
            q4_store(j->out, j->out_bf16, (m0 + c) * j->N + g * Q4G, a, Q4G);
        }
    }
}
#endif

#ifdef __AVX2__
/* halves: a scale per 16 inputs (ROWS_Q8H, `scale` [N / 16][nb][32]), else per 32 (`scale` [N / 16][nb][16]); rows in
 * passes of up to Q4_PASS over the weights, both halves of a block at once, as q4_group256 */
static void q8r_group256(const q4_job *j, int64_t g, int halves) {
    const int64_t nb = j->K / QB, stride = halves ? 2 * Q4G : Q4G;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m0 = 0; m0 < j->M; m0 += Q4_PASS) {
        const int mc = j->M - m0 < Q4_PASS ? (int)(j->M - m0) : Q4_PASS;
        __m256 acc[Q4_PASS][2];
        for (int c = 0; c < mc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (halves && m0 == 0) _mm_prefetch((const char *)(j->codes + (g * nb + b) * 512 + 512 * 4), _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                const uint8_t *wb = j->codes + (g * nb + b) * 512 + 32 * h;
                __m256i q[8];
                for (int p = 0; p < 8; p++) q[p] = _mm256_loadu_si256((const __m256i *)(wb + 64 * p));
                const float *sb = j->scale + (g * nb + b) * stride + 8 * h;
                const __m256 lo = _mm256_loadu_ps(sb), hi = halves ? _mm256_loadu_ps(sb + Q4G) : lo;
                for (int c = 0; c < mc; c++) {
                    const int64_t m = m0 + c, mb = m * nb + b;
                    const int32_t *x4 = (const int32_t *)(j->xq + m * j->K + b * QB);
                    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                    for (int p = 0; p < 8; p++) {              /* |q| <= 128, |xq| <= 127: no 16-bit saturation */
                        __m256i xv = _mm256_set1_epi32(x4[p]);
                        s[p >> 2] = _mm256_add_epi32(s[p >> 2], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(_mm256_sign_epi8(q[p], q[p]), _mm256_sign_epi8(xv, q[p])), ones));
                    }
                    const __m256 dx = _mm256_set1_ps(j->dx[mb]);
                    if (!halves) {                             /* the whole block's exact integer sum, one scale */
                        acc[c][h] = _mm256_add_ps(acc[c][h], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[0], s[1])),
                                                                           _mm256_mul_ps(lo, dx)));
                        continue;
                    }
                    acc[c][h] = _mm256_add_ps(acc[c][h], _mm256_mul_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(lo, dx)));
                    acc[c][h] = _mm256_add_ps(acc[c][h], _mm256_mul_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(hi, dx)));
                }
            }
        }
        for (int c = 0; c < mc; c++)
            for (int h = 0; h < 2; h++) {
                float a[8];
                _mm256_storeu_ps(a, acc[c][h]);
                q4_store(j->out, j->out_bf16, (m0 + c) * j->N + g * Q4G + 8 * h, a, 8);
            }
    }
}
#endif

static void q8r_group_c(const q4_job *j, int64_t g, int halves) {
    const int64_t nb = j->K / QB, stride = halves ? 2 * Q4G : Q4G;
    for (int64_t m = 0; m < j->M; m++) {
        float acc[Q4G] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *wb = (const int8_t *)j->codes + (g * nb + b) * 512;
            const int8_t *xb = j->xq + m * j->K + b * QB;
            const float *sb = j->scale + (g * nb + b) * stride, dx = j->dx[m * nb + b];
            for (int r = 0; r < Q4G; r++) {
                int32_t s[2] = {0, 0};
                for (int p = 0; p < 8; p++)
                    for (int i = 0; i < 4; i++) s[p >> 2] += (int32_t)wb[64 * p + 4 * r + i] * xb[4 * p + i];
                if (!halves) {
                    acc[r] = acc[r] + (float)(s[0] + s[1]) * (sb[r] * dx);
                    continue;
                }
                acc[r] = acc[r] + (float)s[0] * (sb[r] * dx);
                acc[r] = acc[r] + (float)s[1] * (sb[Q4G + r] * dx);
            }
        }
        q4_store(j->out, j->out_bf16, m * j->N + g * Q4G, acc, Q4G);
    }
}

/* ---- 8-bit codes with a scale per 16 inputs (Q6_K: codes q in [-32, 32), scale d sc_j per 16) ----
 * The codes laid out as the 8-bit head's (native.q8_rows_layout); `scale` [N / 16][nb][32] float32: for each
 * block the 16 rows' scales of inputs 0-15, then of inputs 16-31. Output (m, n), over the blocks in order:
 *   acc = acc + (float)(sum of q xq over inputs 0-15) * (s_lo dx);  acc = acc + (float)(sum over 16-31) * (s_hi dx)
 * Exact integer half-block sums (maddubs over |q| and xq signed by q, then madd: q8h_group512 below, and the 8-bit
 * head's AVX2 and plain C loops above with `halves`): every path and row count gives the same bits. */
#ifdef HAVE_512
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void q8h_group512(const q4_job *j, int64_t g) {
    const int64_t nb = j->K / QB;
    const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
    for (int64_t m0 = 0; m0 < j->M; m0 += 8) {
        const int mc = j->M - m0 < 8 ? (int)(j->M - m0) : 8;
        __m512 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = j->codes + (g * nb + b) * 512;
            if (m0 == 0) _mm_prefetch((const char *)(wb + 512 * 4), _MM_HINT_T0);
            __m512i a[8];
            __mmask64 neg[8];
            for (int p = 0; p < 8; p++) {                  /* lane r of part p: row r's codes of inputs 4p..4p+3 */
                const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * p));
                a[p] = _mm512_abs_epi8(v);
                neg[p] = _mm512_movepi8_mask(v);
            }
            const float *sb = j->scale + (g * nb + b) * 2 * Q4G;
            const __m512 lo = _mm512_loadu_ps(sb), hi = _mm512_loadu_ps(sb + Q4G);
            for (int c = 0; c < mc; c++) {
                const int64_t m = m0 + c, mb = m * nb + b;
                const int32_t *x4 = (const int32_t *)(j->xq + m * j->K + b * QB);
                __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int p = 0; p < 8; p++) {                  /* |q| <= 128, |xq| <= 127: no 16-bit saturation */
                    const __m512i xv = _mm512_set1_epi32(x4[p]);
                    s[p >> 2] = _mm512_add_epi32(s[p >> 2], _mm512_madd_epi16(
                        _mm512_maddubs_epi16(a[p], _mm512_mask_sub_epi8(xv, neg[p], zero, xv)), ones));
                }
                const __m512 dx = _mm512_set1_ps(j->dx[mb]);
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(lo, dx)));
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(s[1]), _mm512_mul_ps(hi, dx)));
            }
        }
        for (int c = 0; c < mc; c++) {
            float a[Q4G];
            _mm512_storeu_ps(a, acc[c]);
            q4_store(j->out, j->out_bf16, (m0 + c) * j->N + g * Q4G, a, Q4G);
        }
    }
}
#endif

/* Groups [g0, g1) of 16 output rows from inputs quantized by specdec_q8_quantize, by `kind`: ROWS_Q4 the 4-bit
 * kernel, ROWS_Q8 the 8-bit head's, ROWS_Q8H 8-bit codes with half-block scales; out [M, N] bfloat16
 * (out_bf16) or float32; instructions up to `isa` (specdec_q8x8_isa). */
enum { ROWS_Q4, ROWS_Q8, ROWS_Q8H };
static void rows_matmul(int kind, const q4_job *j, int64_t g0, int64_t g1, int isa) {
    isa = specdec_q8x8_isa(isa);
    const int halves = kind == ROWS_Q8H;
    for (int64_t g = g0; g < g1; g++) {
#ifdef HAVE_512
        if (isa >= 2) { (kind == ROWS_Q4 ? q4_group512 : halves ? q8h_group512 : q8r_group512)(j, g); continue; }
#endif
#ifdef __AVX2__
        if (isa >= 1) {
            if (kind == ROWS_Q4) q4_group256(j, g);
            else q8r_group256(j, g, halves);
            continue;
        }
#endif
        if (kind == ROWS_Q4) q4_group_c(j, g);
        else q8r_group_c(j, g, halves);
    }
}

/* The kernels as entries of one signature (the layer loop splits their groups over torch's threads): each takes
 * xq, dx, sx, xs8 from specdec_q8_quantize, M, K, the weights (codes, scale, zero), N, out, out_bf16, the groups
 * [g0, g1) and the instruction limit `isa`. */
#define ROWS_ENTRY(name, kind)                                                                                    \
    int name(const int8_t *xq, const float *dx, const float *sx, const int32_t *xs8, int64_t M, int64_t K,        \
             const uint8_t *codes, const float *scale, const float *zero, int64_t N, void *out, int out_bf16,     \
             int64_t g0, int64_t g1, int isa) {                                                                   \
        const q4_job j = {xq, dx, sx, xs8, M, K, codes, scale, zero, N, out, out_bf16};                           \
        rows_matmul(kind, &j, g0, g1, isa);                                                                       \
        return 0;                                                                                                 \
    }
ROWS_ENTRY(specdec_q4_q8_matmul, ROWS_Q4)
ROWS_ENTRY(specdec_q8r_q8_matmul, ROWS_Q8)
ROWS_ENTRY(specdec_q8h_q8_matmul, ROWS_Q8H)

/* One of them whole (`kind`: ROWS_Q4, ROWS_Q8, ROWS_Q8H), on one thread (where the layer loop is not built):
 * x [M, K] (bfloat16 or float32) -> out [M, N]. 0, or -1: out of memory. */
int specdec_rows_linear(int kind, const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                        const float *scale, const float *zero, int64_t N, void *out, int out_bf16, int isa) {
    const int64_t nb = K / QB;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb)), *sx = malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *xs8 = malloc(sizeof(int32_t) * (size_t)(M * nb));
    int rc = 0;
    if (!xq || !dx || !sx || !xs8) rc = -1;
    else {
        specdec_q8_quantize(x, x_bf16, M, K, xq, dx, sx, xs8);
        const q4_job j = {xq, dx, sx, xs8, M, K, codes, scale, zero, N, out, out_bf16};
        rows_matmul(kind, &j, 0, N / Q4G, isa);
    }
    free(xq); free(dx); free(sx); free(xs8);
    return rc;
}

/* The first index of the largest of each row of x [M, N] float32, a NaN counting as the largest (numpy's argmax,
 * `sampling.argmax`): top [M]. The maximum first (with any NaN noted), then the first element equal to it (or the
 * first NaN): exact comparisons only, so the same index at every instruction level. */
void specdec_row_top(const float *x, int64_t M, int64_t N, int64_t *top) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * N;
        float best = r[0];
        int nan = best != best;
        int64_t i = 1;
#ifdef __AVX2__
        if (N >= 16) {
            __m256 acc = _mm256_loadu_ps(r), odd = _mm256_setzero_ps();
            for (i = 8; i + 8 <= N; i += 8) {
                const __m256 v = _mm256_loadu_ps(r + i);
                odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                acc = _mm256_max_ps(v, acc);             /* a NaN v keeps acc; NaNs are found by `odd` */
            }
            float lanes[LANES];
            _mm256_storeu_ps(lanes, acc);
            nan = _mm256_movemask_ps(_mm256_or_ps(odd, _mm256_cmp_ps(acc, acc, _CMP_UNORD_Q))) != 0;
            for (int l = 0; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
        }
#endif
        for (; i < N; i++) {
            nan |= r[i] != r[i];
            best = r[i] > best ? r[i] : best;
        }
        int64_t at = 0;
#ifdef __AVX2__
        const __m256 b = _mm256_set1_ps(best);
        for (; at + 8 <= N; at += 8) {                   /* the block of 8 holding the first match */
            const __m256 v = _mm256_loadu_ps(r + at);
            if (_mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, b, _CMP_EQ_OQ))) break;
        }
#endif
        if (nan) {
            while (r[at] == r[at]) at++;
        } else {
            while (r[at] != best) at++;
        }
        top[m] = at;
    }
}
