/* minedraft's CPU kernels: the float32 decoder layer in a fixed order of operations.
 *
 * Every result here is a function of its own row alone, computed by one fixed sequence of IEEE operations,
 * so a row's bits do not depend on how many other rows or tokens share the call, nor on the instruction set:
 *   - matmul: each output element sums k in fixed blocks of KB: within a block one chain acc = fma(x[k],
 *     w[k][n], acc) from 0, then the block sums added in order; vectors only run several columns (and rows) side
 *     by side, never split k any other way;
 *   - dot products and sums of squares: 8 partial chains (element i feeds chain i % 8, by fma), then added
 *     ((c0+c1)+(c2+c3))+((c4+c5)+(c6+c7)); AVX2, AVX-512 and plain C all do exactly this;
 *   - exp: our own polynomial built from fmaf, not libm (whose variants may differ by machine).
 * Compiled with -ffp-contract=off so the compiler adds no fused operations of its own.
 * Weights are packed in panels of PW output columns, [N/PW][K][PW]: a panel streams once per call, whatever
 * the number of rows, and stays in cache while every row block reads it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MD_ISA 2
typedef __m512 vf;
#define VL 16
#define RB 6
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MD_ISA 1
typedef __m256 vf;
#define VL 8
#define RB 3
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#else
#define MD_ISA 0
#define VL 8
#endif
#define PW (4 * VL) /* panel width: four vectors per row */
#define PF_AHEAD 32 /* prefetch the weights this many k ahead: with rows to compute, the hardware's own prefetch
                      * fell behind (one core, 30 MLP matmuls at 5 rows: 1.36x the 1-row time, 1.0x with it) */
#define KEYS_AHEAD 4 /* attention prefetches the cache rows of the key this far ahead (within a block) */
#define KB 64      /* k is summed in fixed blocks of KB (chain within, then block sums in order): less rounding */

static int g_scalar = 0; /* tests: run the plain-C path on the same data */
static int g_prof = 0;
static double g_times[8];

int md_isa(void) { return MD_ISA; }
int md_panel_width(void) { return PW; }
void md_force_scalar(int on) { g_scalar = on; }
void md_profile(int on) { g_prof = on; }
double *md_profile_times(void) { return g_times; }

static double now(void) { /* this thread's CPU time: a shared box's other work does not count */
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define TICK(i, t0)                         \
    if (g_prof) {                           \
        double t1_ = now();                 \
        g_times[i] += t1_ - t0;             \
        t0 = t1_;                           \
    }

/* ---------------------------------------------------------------- matmul */
static void matmul_scalar(const float *x, long ldx, int M, int K, const float *wp, int N, float *y, long ldy) {
    float acc[PW], tot[PW];
    for (int p = 0; p * PW < N; p++) {
        const float *w = wp + (long)p * K * PW;
        int nc = N - p * PW < PW ? N - p * PW : PW;
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * ldx;
            for (int k0 = 0; k0 < K; k0 += KB) {
                int k1 = k0 + KB < K ? k0 + KB : K;
                for (int c = 0; c < PW; c++) acc[c] = 0.0f;
                for (int k = k0; k < k1; k++)
                    for (int c = 0; c < PW; c++) acc[c] = fmaf(xr[k], w[(long)k * PW + c], acc[c]);
                for (int c = 0; c < PW; c++) tot[c] = k0 ? tot[c] + acc[c] : acc[c];
            }
            memcpy(y + m * ldy + (long)p * PW, tot, nc * sizeof(float));
        }
    }
}

#if MD_ISA > 0
/* R rows x one panel: 4R accumulators live in registers through each block of KB k's. */
static inline __attribute__((always_inline)) void tile(const int R, const float *x, long ldx, int K,
                                                       const float *w, float *y, long ldy, int nc) {
    vf a[RB][4];
    float t[RB][PW] __attribute__((aligned(64))); /* block sums: in L1, touched once per block */
    for (int k0 = 0; k0 < K; k0 += KB) {
        int k1 = k0 + KB < K ? k0 + KB : K;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) a[r][j] = vzero();
        for (int k = k0; k < k1; k++) {
            const float *wk = w + (long)k * PW;
            for (int l = 0; l < PW; l += 16) _mm_prefetch((const char *)(wk + PF_AHEAD * PW + l), _MM_HINT_T0);
            vf w0 = vload(wk), w1 = vload(wk + VL), w2 = vload(wk + 2 * VL), w3 = vload(wk + 3 * VL);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                vf b = vset1(x[r * ldx + k]);
                a[r][0] = vfma(b, w0, a[r][0]);
                a[r][1] = vfma(b, w1, a[r][1]);
                a[r][2] = vfma(b, w2, a[r][2]);
                a[r][3] = vfma(b, w3, a[r][3]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                vstore(t[r] + j * VL, k0 ? vadd(vload(t[r] + j * VL), a[r][j]) : a[r][j]);
    }
    for (int r = 0; r < R; r++) memcpy(y + r * ldy, t[r], nc * sizeof(float));
}

static void matmul_vec(const float *x, long ldx, int M, int K, const float *wp, int N, float *y, long ldy) {
    for (int p = 0; p * PW < N; p++) {
        const float *w = wp + (long)p * K * PW;
        int nc = N - p * PW < PW ? N - p * PW : PW;
        float *yp = y + (long)p * PW;
        int m = 0;
        for (; m + RB <= M; m += RB) tile(RB, x + m * ldx, ldx, K, w, yp + m * ldy, ldy, nc);
        switch (M - m) {
        case 1: tile(1, x + m * ldx, ldx, K, w, yp + m * ldy, ldy, nc); break;
        case 2: tile(2, x + m * ldx, ldx, K, w, yp + m * ldy, ldy, nc); break;
#if RB > 3
        case 3: tile(3, x + m * ldx, ldx, K, w, yp + m * ldy, ldy, nc); break;
        case 4: tile(4, x + m * ldx, ldx, K, w, yp + m * ldy, ldy, nc); break;
        case 5: tile(5, x + m * ldx, ldx, K, w, yp + m * ldy, ldy, nc); break;
#endif
        default: break;
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ W (W packed by pack order, see the header); bias (may be NULL) added after the chain. */
void md_matmul(const float *x, long ldx, int M, int K, const float *wp, int N, const float *bias, float *y,
               long ldy) {
#if MD_ISA > 0
    if (!g_scalar)
        matmul_vec(x, ldx, M, K, wp, N, y, ldy);
    else
#endif
        matmul_scalar(x, ldx, M, K, wp, N, y, ldy);
    if (bias)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) y[m * ldy + n] += bias[n];
}

/* ---------------------------------------------------------------- fixed-order reductions */
static inline float combine8(const float *c) { return ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7])); }

static float dot(const float *a, const float *b, int n) {
    float c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
#if MD_ISA > 0
    if (!g_scalar) {
        __m256 v = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v);
        if (i == n) { /* combine8 in registers: pairs, then pairs of pairs, then halves */
            v = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));
            v = _mm256_add_ps(v, _mm256_permute_ps(v, 0x4E));
            v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
            return _mm256_cvtss_f32(v);
        }
        _mm256_storeu_ps(c, v);
    }
#endif
    for (; i < n; i++) c[i & 7] = fmaf(a[i], b[i], c[i & 7]);
    return combine8(c);
}

/* y = w * (x * 1/sqrt(mean(x^2) + eps)), as transformers' RMSNorm in float32 */
static void rmsnorm(const float *x, const float *w, int n, float eps, float *y) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

void md_rmsnorm(const float *x, long ldx, int M, const float *w, int n, float eps, float *y, long ldy) {
    for (int m = 0; m < M; m++) rmsnorm(x + m * ldx, w, n, eps, y + m * ldy);
}

/* exp(x) by x = n ln2 + r, |r| <= ln2/2, a degree-7 polynomial in fmaf, times 2^n: about 1 ulp, same bits
 * on every machine. */
static float md_expf(float x) {
    if (x < -103.0f) return 0.0f;
    if (x > 88.7f) return INFINITY;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187045e-06f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int e = (int)n;
    /* 2^e in two halves, so that e down to -149 (subnormal results) stays exact */
    int e1 = e / 2, e2 = e - e1;
    union { uint32_t u; float f; } s1 = {(uint32_t)(e1 + 127) << 23}, s2 = {(uint32_t)(e2 + 127) << 23};
    return p * s1.f * s2.f;
}

#if MD_ISA > 0
/* md_expf on 8 lanes, step for step (the same roundings, so the same bits) */
static inline __m256 expf8(__m256 x) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_cvttps_epi32(n);
    __m256i e1 = _mm256_srai_epi32(_mm256_add_epi32(e, _mm256_srli_epi32(e, 31)), 1); /* e / 2, toward 0 */
    __m256i e2 = _mm256_sub_epi32(e, e1), bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-103.0f), _CMP_LT_OQ));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
}
#endif

/* y = exp(x - shift), elementwise */
static void exp_shifted(const float *x, float shift, float *y, long n) {
    long i = 0;
#if MD_ISA > 0
    if (!g_scalar)
        for (__m256 sh = _mm256_set1_ps(shift); i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, expf8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh)));
#endif
    for (; i < n; i++) y[i] = md_expf(x[i] - shift);
}

void md_exp(const float *x, float *y, long n) { exp_shifted(x, 0.0f, y, n); }

/* g = silu(g) * u = g / (1 + exp(-g)) * u */
static void silu_mul(float *g, const float *u, int n) {
    int i = 0;
#if MD_ISA > 0
    if (!g_scalar)
        for (__m256 one = _mm256_set1_ps(1.0f); i + 8 <= n; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.0f + md_expf(-g[i])) * u[i];
}

/* ---------------------------------------------------------------- one decoder layer */
typedef struct {
    const float *ln1, *ln2;     /* [H] */
    const float *wqkv, *bqkv;   /* packed [H -> (nh + 2 nkv) D]; bias or NULL */
    const float *qnorm, *knorm; /* [D] or NULL (Qwen3) */
    const float *wo, *bo;       /* packed [nh D -> H] */
    const float *wgu;           /* packed [H -> 2 I]: gate columns, then up */
    const float *wdown;         /* packed [I -> H] */
    float *kc, *vc;             /* this layer's cache [slots, nkv, D] */
    int window;                 /* sliding window, 0 = full attention */
} md_layer_t;

typedef struct {
    int N, H, nh, nkv, D, I;
    float eps, scale;
    const float *cos, *sin;       /* [N, D] rotary tables of each token's position */
    const int32_t *row, *pos;     /* [N] each token's sequence (row of tables) and position */
    const int32_t *tables;        /* [rows, nblocks] block tables */
    int nblocks, block_size;
    float *x, *qkv, *att, *act, *tmp, *scores; /* scratch: [N,H] [N,(nh+2nkv)D] [N,nh D] [N,2I] [N,H] [nh x max len] */
} md_step_t;

static inline long slot(const md_step_t *s, int row, int p) {
    return (long)s->tables[(long)row * s->nblocks + p / s->block_size] * s->block_size + p % s->block_size;
}

static void rope(float *v, const float *cos, const float *sin, int D) {
    int h = D / 2;
    for (int i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        float ya = a * cos[i] + (-b) * sin[i];
        float yb = b * cos[i + h] + a * sin[i + h];
        v[i] = ya, v[i + h] = yb;
    }
}

/* The cache rows of positions lo..p of a sequence, walked block by block (no division per key). */
#define FOR_KEYS(s, row, lo, p, j, base)                                                                     \
    for (int j = (lo), b_ = (lo) / (s)->block_size, o_ = (lo) % (s)->block_size; j <= (p); j++)           \
        for (long base = ((long)(s)->tables[(long)(row) * (s)->nblocks + b_] * (s)->block_size + o_), once_ = 1; \
             once_; once_ = 0, ++o_ == (s)->block_size ? (o_ = 0, b_++) : 0)

/* Attention of one query token, every head: out_h[d] = sum_j e_hj v_j[d] / sum_j e_hj over the token's own keys j
 * ascending, e_hj = exp(s_hj - max_j s_hj), s_hj = dot(q_h, k_j) * scale; query head h reads kv head h / G.
 * Keys are walked once for all heads (a cache row holds every kv head: contiguous reads). */
static void attend(const md_step_t *s, const md_layer_t *L, int n, const float *q, float *out) {
    int D = s->D, nh = s->nh, G = s->nh / s->nkv, p = s->pos[n], row = s->row[n], stride = s->nkv * D;
    int lo = L->window > 0 && p - L->window + 1 > 0 ? p - L->window + 1 : 0, len = p - lo + 1;
    float *sc = s->scores;
    FOR_KEYS(s, row, lo, p, j, sl) {
        const float *k = L->kc + sl * stride;
        if (j + KEYS_AHEAD <= p && (sl % s->block_size) + KEYS_AHEAD < s->block_size) /* same block: contiguous */
            for (int l = 0; l < stride; l += 16) {
                __builtin_prefetch(k + KEYS_AHEAD * stride + l);
                __builtin_prefetch(L->vc + (sl + KEYS_AHEAD) * stride + l);
            }
        for (int h = 0; h < nh; h++) sc[h * len + j - lo] = dot(q + h * D, k + (h / G) * D, D) * s->scale;
    }
    float sum[nh];
    for (int h = 0; h < nh; h++) {
        float *sh = sc + h * len, mx = -INFINITY;
        for (int j = 0; j < len; j++) mx = sh[j] > mx ? sh[j] : mx;
        exp_shifted(sh, mx, sh, len);
        sum[h] = 0.0f;
        for (int j = 0; j < len; j++) sum[h] += sh[j];
    }
    int d0 = 0;
#if MD_ISA > 0
    if (!g_scalar) /* 64 lanes of d at a time held in registers over all keys; each lane's chain is j ascending */
        for (; d0 + 64 <= D; d0 += 64)
            for (int h = 0; h < nh; h++) {
                __m256 a[8];
                for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
                const float *e = sc + h * len, *vh = L->vc + (h / G) * D + d0;
                FOR_KEYS(s, row, lo, p, j, sl) {
                    const float *v = vh + sl * stride;
                    __m256 eb = _mm256_set1_ps(e[j - lo]);
                    for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(eb, _mm256_loadu_ps(v + 8 * t), a[t]);
                }
                for (int t = 0; t < 8; t++) _mm256_storeu_ps(out + h * D + d0 + 8 * t, a[t]);
            }
#endif
    for (int h = 0; h < nh; h++) {
        float *o = out + h * D;
        const float *e = sc + h * len, *vh = L->vc + (h / G) * D;
        for (int d = d0; d < D; d++) o[d] = 0.0f;
        if (d0 < D)
            FOR_KEYS(s, row, lo, p, j, sl) {
                const float *v = vh + sl * stride;
                for (int d = d0; d < D; d++) o[d] = fmaf(e[j - lo], v[d], o[d]);
            }
        for (int d = 0; d < D; d++) o[d] = o[d] / sum[h];
    }
}

/* h[N, H] += attention(norm(h)); h += mlp(norm(h)) */
void md_layer(const md_step_t *s, const md_layer_t *L, float *h) {
    int N = s->N, H = s->H, D = s->D, nh = s->nh, nkv = s->nkv, I = s->I;
    int nq = (nh + 2 * nkv) * D;
    double t0 = g_prof ? now() : 0;
    md_rmsnorm(h, H, N, L->ln1, H, s->eps, s->x, H);
    TICK(0, t0);
    md_matmul(s->x, H, N, H, L->wqkv, nq, L->bqkv, s->qkv, nq);
    TICK(1, t0);
    for (int n = 0; n < N; n++) {
        float *q = s->qkv + (long)n * nq;
        for (int hd = 0; hd < nh + nkv; hd++) { /* q heads, then k heads */
            float *v = q + hd * D;
            const float *w = hd < nh ? L->qnorm : L->knorm;
            if (w) rmsnorm(v, w, D, s->eps, v);
            rope(v, s->cos + (long)n * D, s->sin + (long)n * D, D);
        }
        long sl = slot(s, s->row[n], s->pos[n]) * nkv * D;
        memcpy(L->kc + sl, q + nh * D, nkv * D * sizeof(float));
        memcpy(L->vc + sl, q + (nh + nkv) * D, nkv * D * sizeof(float));
    }
    TICK(2, t0);
    for (int n = 0; n < N; n++) /* query head h reads kv head h / G, as transformers' repeat_kv pairs them */
        attend(s, L, n, s->qkv + (long)n * nq, s->att + (long)n * nh * D);
    TICK(3, t0);
    md_matmul(s->att, nh * D, N, nh * D, L->wo, H, L->bo, s->tmp, H);
    for (long i = 0; i < (long)N * H; i++) h[i] += s->tmp[i];
    TICK(1, t0);
    md_rmsnorm(h, H, N, L->ln2, H, s->eps, s->x, H);
    TICK(0, t0);
    md_matmul(s->x, H, N, H, L->wgu, 2 * I, NULL, s->act, 2 * I);
    TICK(4, t0);
    for (int n = 0; n < N; n++) /* silu(gate) * up, into the gate half */
        silu_mul(s->act + (long)n * 2 * I, s->act + (long)n * 2 * I + I, I);
    TICK(5, t0);
    md_matmul(s->act, 2 * I, N, I, L->wdown, H, NULL, s->tmp, H);
    for (long i = 0; i < (long)N * H; i++) h[i] += s->tmp[i];
    TICK(4, t0);
}
