/* Attention whose result for a query depends on nothing but that query, its visible keys and values.
 *
 * Each query row walks its visible cache slots in slot order, one at a time: scores, their maximum,
 * then exp, the running sum and the value accumulation in that order; the float operations a query
 * gets are fixed by its key list alone, not by how many queries share the call, the batch, the key
 * window's length or a token tree around it. A tree node's ancestors sit at scratch slots in node
 * order (parents precede children), so it sees the keys of its own path in position order, as the
 * chain along that path does. Built by `models/native.py`, called once per layer per forward.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 8

/* q . k over hd (a multiple of LANES): LANES running sums, then a fixed pairwise tree. */
static float dot(const float *q, const float *k, int64_t hd) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < hd; d += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += q[d + l] * k[d + l];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/*
 * q    [B, nh, T, hd] at strides (qb, qh, qt, 1)
 * k, v [B, nkv, S, hd] at strides (kb, kh, hd, 1) (the layer's cache rows; v shares k's strides)
 * mask [B, T, S] bytes, contiguous, nonzero = attend
 * out  [B, T, nh, hd] contiguous (the layout the output projection reads)
 * Returns 0, or -1 if memory ran out.
 */
int specdec_attend(const float *q, int64_t qb, int64_t qh, int64_t qt,
                   const float *k, const float *v, int64_t kb, int64_t kh,
                   const uint8_t *mask, int64_t B, int64_t nh, int64_t nkv, int64_t T, int64_t S,
                   int64_t hd, float scale, float *out) {
    int64_t g = nh / nkv;
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(S > 0 ? S : 1));
    float *score = malloc(sizeof(float) * (size_t)(S > 0 ? S : 1));
    if (!slots || !score) {
        free(slots);
        free(score);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *m = mask + (b * T + t) * S;
            int64_t n = 0;
            for (int64_t s = 0; s < S; s++)
                if (m[s]) slots[n++] = s;
            for (int64_t h = 0; h < nh; h++) {
                const float *qr = q + b * qb + h * qh + t * qt;
                const float *kr = k + b * kb + (h / g) * kh;
                const float *vr = v + b * kb + (h / g) * kh;
                float *o = out + ((b * T + t) * nh + h) * hd;
                for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
                if (n == 0) continue;
                float top = -INFINITY;
                for (int64_t i = 0; i < n; i++) {
                    score[i] = dot(qr, kr + slots[i] * hd, hd) * scale;
                    if (score[i] > top) top = score[i];
                }
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) {
                    float p = expf(score[i] - top);
                    const float *vs = vr + slots[i] * hd;
                    sum += p;
                    for (int64_t d = 0; d < hd; d++) o[d] += p * vs[d];
                }
                for (int64_t d = 0; d < hd; d++) o[d] /= sum;
            }
        }
    }
    free(slots);
    free(score);
    return 0;
}
