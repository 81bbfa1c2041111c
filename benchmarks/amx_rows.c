/* AMX int8 tiles against the AVX-512 VNNI loops of attend.c, for the row counts of decoding and verification.
 *
 * The 4-bit layers' kernel (q4_group512) and the 8-bit LM head's (q8r_group512) against the same work through
 * AMX: the activations' block as tile A ([M, 32] int8, straight from the quantized rows), the block's codes as
 * tile B ([8, 64]: the head's Q8 codes as laid out, the 4-bit codes unpacked to bytes through a buffer), one
 * tile product per block of 32 inputs (each block has its own scales), four blocks in flight, then the same
 * float operations per row as the VNNI loop. The integer block sums are exact, so every output has the same
 * bits as the VNNI loop's (checked). Weights: 64 distinct [1536 x 576] 4-bit layers (more than the caches)
 * and one [49152 x 576] head; 1 thread, best of 7.
 *
 *   gcc -O3 -march=native -mno-avx512f -ffp-contract=off -fno-trapping-math -pthread \
 *       -o amx_rows benchmarks/amx_rows.c -lm && ./amx_rows
 *
 * Needs a CPU with AMX-INT8 and Linux 5.16 or later (the tile state is granted per process). */
#include "../src/specdec/models/attend.c"
#include <stdio.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* The C tiles 2..5 of the blocks in flight (up to 4) into cbuf[4][16 * 16] (tile numbers are immediates). */
#define STORE_TILES(cbuf, nblk) do {                       \
        if (0 < (nblk)) _tile_stored(2, (cbuf)[0], 64);    \
        if (1 < (nblk)) _tile_stored(3, (cbuf)[1], 64);    \
        if (2 < (nblk)) _tile_stored(4, (cbuf)[2], 64);    \
        if (3 < (nblk)) _tile_stored(5, (cbuf)[3], 64);    \
    } while (0)

/* The M rows' 16 outputs of group g, as the VNNI loops store them. */
__attribute__((target("avx512f")))
static void store_rows(const q4_job *j, int64_t g, const __m512 *acc, int M) {
    for (int c = 0; c < M; c++) {
        float a[Q4G];
        _mm512_storeu_ps(a, acc[c]);
        q4_store(j->out, j->out_bf16, c * j->N + g * Q4G, a, Q4G);
    }
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
static void q8r_group_amx(const q4_job *j, int64_t g) {
    const int64_t nb = j->K / QB;
    const int M = (int)j->M;
    __m512 acc[16];
    for (int c = 0; c < M; c++) acc[c] = _mm512_setzero_ps();
    int32_t cbuf[4][16 * 16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b += 4) {
        const int nblk = nb - b < 4 ? (int)(nb - b) : 4;
        /* up to 4 blocks in flight: C tiles 2..5 */
#define ONE(t, o) if (o < nblk) { _tile_loadd(0, j->xq + (b + o) * QB, j->K); _tile_loadd(1, j->codes + (g * nb + b + o) * 512, 64); _tile_zero(t); _tile_dpbssd(t, 0, 1); }
        ONE(2, 0) ONE(3, 1) ONE(4, 2) ONE(5, 3)
        STORE_TILES(cbuf, nblk);
        for (int o = 0; o < nblk; o++) {
            const __m512 dv = _mm512_loadu_ps(j->scale + (g * nb + b + o) * Q4G);
            for (int c = 0; c < M; c++) {
                const int64_t mb = c * nb + b + o;
                __m512i s = _mm512_load_si512(cbuf[o] + 16 * c);
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(j->dx[mb]))));
            }
        }
    }
    store_rows(j, g, acc, M);
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
static void q4_group_amx4(const q4_job *j, int64_t g) {
    const int64_t nb = j->K / QB;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int M = (int)j->M;
    __m512 acc[16];
    for (int c = 0; c < M; c++) acc[c] = _mm512_setzero_ps();
    int8_t wbuf[4][512] __attribute__((aligned(64)));
    int32_t cbuf[4][16 * 16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b += 4) {
        const int nblk = nb - b < 4 ? (int)(nb - b) : 4;
        for (int o = 0; o < nblk; o++) {
            const uint8_t *wb = j->codes + (g * nb + b + o) * 256;
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * p));
                _mm512_store_si512((void *)(wbuf[o] + 128 * p), _mm512_and_si512(v, low));
                _mm512_store_si512((void *)(wbuf[o] + 128 * p + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        }
#define ONE4(t, o) if (o < nblk) { _tile_loadd(0, j->xq + (b + o) * QB, j->K); _tile_loadd(1, wbuf[o], 64); _tile_zero(t); _tile_dpbsud(t, 0, 1); }
        ONE4(2, 0) ONE4(3, 1) ONE4(4, 2) ONE4(5, 3)
        STORE_TILES(cbuf, nblk);
        for (int o = 0; o < nblk; o++) {
            const __m512 sv = _mm512_loadu_ps(j->scale + (g * nb + b + o) * Q4G);
            const __m512 zv = _mm512_loadu_ps(j->zero + (g * nb + b + o) * Q4G);
            for (int c = 0; c < M; c++) {
                const int64_t mb = c * nb + b + o;
                __m512i s = _mm512_sub_epi32(_mm512_load_si512(cbuf[o] + 16 * c), _mm512_set1_epi32(j->xs8[mb]));
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_set1_ps(j->dx[mb]))));
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(zv, _mm512_set1_ps(j->sx[mb])));
            }
        }
    }
    store_rows(j, g, acc, M);
}

__attribute__((target("amx-tile,amx-int8")))
static void amx_config(int M) {
    tilecfg cfg; memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = M; cfg.colsb[0] = 32;
    cfg.rows[1] = 8; cfg.colsb[1] = 64;
    for (int t = 2; t < 6; t++) { cfg.rows[t] = M; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX permission\n"); return 1; }
    const int64_t K = 576, N = 1536, nb = K / 32, L = 64;   /* 64 distinct weights > caches */
    uint8_t *codes = malloc(L * N / 16 * nb * 256); float *sc = malloc(sizeof(float) * L * N * nb), *ze = malloc(sizeof(float) * L * N * nb);
    for (int64_t i = 0; i < L * N / 16 * nb * 256; i++) codes[i] = rand();
    for (int64_t i = 0; i < L * N * nb; i++) { sc[i] = (rand() % 1000) / 1e4f; ze[i] = (rand() % 1000 - 500) / 1e4f; }
    float x[16 * 576]; for (int i = 0; i < 16 * 576; i++) x[i] = (rand() % 2001 - 1000) / 1000.0f;
    int8_t xq[16 * 576]; float dx[16 * 18], sx[16 * 18]; int32_t xs8[16 * 18];
    specdec_q8_quantize(x, 0, 16, K, xq, dx, sx, xs8);
    float *o1 = malloc(sizeof(float) * 16 * N), *o2 = malloc(sizeof(float) * 16 * N);
    int Ms[] = {1, 2, 3, 4, 5, 8, 12, 16};
    for (int mi = 0; mi < 8; mi++) {
        int M = Ms[mi];
        amx_config(M);
        double best[2] = {1e9, 1e9};
        for (int rep = 0; rep < 7; rep++)
            for (int v = 0; v < 2; v++) {
                double t0 = now();
                for (int l = 0; l < L; l++) {
                    q4_job j = {xq, dx, sx, xs8, M, K, codes + l * N / 16 * nb * 256, sc + l * N * nb, ze + l * N * nb, N, v ? o2 : o1, 0};
                    for (int64_t g = 0; g < N / 16; g++) (v ? q4_group_amx4 : q4_group512)(&j, g);
                }
                double t = (now() - t0) / L * 1e6;
                if (t < best[v]) best[v] = t;
            }
        int same = memcmp(o1, o2, sizeof(float) * M * N) == 0;
        printf("4-bit layer [1536 x 576], M=%2d rows: vnni %7.1f us  amx %7.1f us  ratio %.2f  same bits: %s\n", M, best[0], best[1], best[1] / best[0], same ? "yes" : "NO");
    }

    {
        const int64_t NH = 49152;
        uint8_t *hc = malloc(NH / 16 * nb * 512); float *hd = malloc(sizeof(float) * NH * nb);
        for (int64_t i = 0; i < NH / 16 * nb * 512; i++) hc[i] = rand();
        for (int64_t i = 0; i < NH * nb; i++) hd[i] = (rand() % 1000) / 1e4f;
        float *h1 = malloc(sizeof(float) * 16 * NH), *h2 = malloc(sizeof(float) * 16 * NH);
        for (int mi = 0; mi < 8; mi++) {
            int M = Ms[mi];
            amx_config(M);
            double best[2] = {1e9, 1e9};
            for (int rep = 0; rep < 7; rep++)
                for (int v = 0; v < 2; v++) {
                    double t0 = now();
                    q4_job j = {xq, dx, sx, xs8, M, K, hc, hd, hd, NH, v ? h2 : h1, 0};
                    for (int64_t g = 0; g < NH / 16; g++) (v ? q8r_group_amx : q8r_group512)(&j, g);
                    double t = (now() - t0) * 1e6;
                    if (t < best[v]) best[v] = t;
                }
            int same = memcmp(h1, h2, sizeof(float) * M * NH) == 0;
            printf("8-bit head [49152 x 576], M=%2d rows: vnni %7.1f us  amx %7.1f us  ratio %.2f  same bits: %s\n", M, best[0], best[1], best[1] / best[0], same ? "yes" : "NO");
        }
    }
    return 0;
}
