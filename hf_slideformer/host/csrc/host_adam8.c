/* The host AdamW with 8-bit block-wise moments (the scheme of Dettmers et al., "8-bit Optimizers via
 * Block-wise Quantization", as bitsandbytes' blockwise 8-bit Adam runs it on the CPU), one pass per block.
 *
 * State of n parameters, in blocks of 256 (a parameter's blocks start at its own first element):
 *   master      fp32 or bf16 (n,)
 *   q1, q2      uint8 (n,): codes into the signed / unsigned dynamic maps `code1`, `code2` (256 floats)
 *   a1, a2      fp32 (blocks,): each block's absmax, the scale of its codes
 * For each block, with m = code1[q1] * a1, v = code2[q2] * a2 (dequantized) and per element:
 *   g = widen(grad) * (gmul * gclip * sign)     (gclip: the clip factor, as bitsandbytes' gnorm_scale)
 *   m = fma(g, 1 - beta1, m * beta1)            (torch's m.mul_(beta1).add_(g, alpha=1 - beta1))
 *   v = v * beta2 + ((1 - beta2) * g) * g       (v.mul_(beta2).addcmul_(g, g, value=1 - beta2))
 *   p = master * wd_mul                          (decoupled weight decay, 1 - lr * wd)
 *   p = p + neg_step * (m / (sqrt(v) / bc2 + eps))        (neg_step = -lr / (1 - beta1^t))
 * then the block's new absmax of m and of v, and each value requantized to the code nearest on the
 * 65536-point grid of [-1, 1] (bitsandbytes' CPU rounding: lut[(x / absmax + 1) / 2 * 65535 + 0.5]).
 * The table `slide_q8_table` (quant_maps.code_search_table) holds that rounding table and its
 * bucket form: with AVX-512 VBMI the codes of 32 indices at a time come from byte permutes of
 * buckets held in registers and a few comparisons against the buckets' thresholds, the same code
 * for every index (checked exhaustively when the table is built); elsewhere a load from the table.
 * An all-zero block has absmax 0 and codes 0. The update uses the unquantized m and v of this step,
 * as the reference does; only what is stored is quantized.
 *
 * A bf16 master is rounded stochastically: the 16 low bits of the fp32 result are added to a
 * uniform 16-bit number and truncated, which is unbiased (E[round(x)] = x) for finite x. The
 * number is a counter-based hash of (seed, step, ctr + i): reproducible for a seed and the same for
 * any thread count or split of the range into calls. out16 (optional) receives the bf16 weights
 * (rounded to nearest even from an fp32 master; the master itself for a bf16 one).
 *
 * Built with -ffp-contract=off like host_adam.c: the only fused multiply-add is the explicit one.
 */
#include "bf16.h"
#include <math.h>
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SLIDE_Q8_VBMI 1
#endif
#include <stdint.h>
#include <string.h>

#define Q_BLOCK 256

typedef struct {
    float gmul, gclip, sign, wd_mul, beta1, c1, beta2, c2, bc2, eps, neg_step;
    int32_t pad_;
    uint64_t seed;    /* stochastic rounding: the hash's key (seed and step mixed by the caller) */
} slide_adam8_hp;


/* The rounding table and its bucket form (layout: quant_maps.code_search_table). */
#define Q_LEVELS 3
#define Q_ROWS 5
typedef struct {
    uint8_t lut[65536];
    uint8_t rows[Q_LEVELS][Q_ROWS][256];     /* per level: base code, then thresholds */
    uint8_t k[Q_LEVELS + 1];                 /* thresholds used per level */
    uint8_t planes[4][256];                  /* byte b of each code of the map (fp32, little-endian) */
} slide_q8_table;
static const int q_shift[Q_LEVELS] = {8, 5, 0};
static const int q_origin[Q_LEVELS] = {0, 32768 - 4096, 32768 - 128};

#ifdef SLIDE_Q8_VBMI
/* row[key] for 64 byte lanes of keys, from a 256-byte row: two 128-byte permutes, bit 7 picks. */
static inline __m512i row_lookup(__m512i key, const uint8_t *row) {
    const __m512i a = _mm512_permutex2var_epi8(_mm512_loadu_si512(row), key, _mm512_loadu_si512(row + 64));
    const __m512i b = _mm512_permutex2var_epi8(_mm512_loadu_si512(row + 128), key, _mm512_loadu_si512(row + 192));
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(key), a, b);
}

/* The low bytes of 2 x 32 word lanes, in order. */
static inline __m512i low_bytes(__m512i w0, __m512i w1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)), _mm512_cvtepi16_epi8(w1), 1);
}

/* The codes of 64 grid indices (2 x 32 word lanes, 0..65535): the finest level holding each answers. */
static inline __m512i search64(__m512i i0, __m512i i1, const slide_q8_table *t) {
    __m512i code = _mm512_setzero_si512();
    for (int l = 0; l < Q_LEVELS; l++) {
        const int s = q_shift[l];
        const __m512i org = _mm512_set1_epi16((short)q_origin[l]), mask = _mm512_set1_epi16((short)((1 << s) - 1));
        const __m512i o0 = _mm512_sub_epi16(i0, org), o1 = _mm512_sub_epi16(i1, org);
        const __m512i key = low_bytes(_mm512_srli_epi16(o0, s), _mm512_srli_epi16(o1, s));
        __m512i c = row_lookup(key, t->rows[l][0]);
        if (t->k[l]) {
            const __m512i lo = low_bytes(_mm512_and_si512(o0, mask), _mm512_and_si512(o1, mask));
            for (int j = 0; j < t->k[l]; j++) {       /* byte adds: mod 256, the bucket form's arithmetic */
                const __mmask64 up = _mm512_cmpge_epu8_mask(lo, row_lookup(key, t->rows[l][1 + j]));
                c = _mm512_mask_add_epi8(c, up, c, _mm512_set1_epi8(1));
            }
        }
        if (s == 8) {             /* level 0 covers the whole grid; a finer one its 256 << s points */
            code = c;
        } else {
            const __m512i width = _mm512_set1_epi16((short)(256 << s));
            const __mmask64 in = _mm512_kunpackd((__mmask64)_mm512_cmplt_epu16_mask(o1, width),
                                                 (__mmask64)_mm512_cmplt_epu16_mask(o0, width));
            code = _mm512_mask_mov_epi8(code, in, c);
        }
    }
    return code;
}
#endif

#ifdef SLIDE_Q8_VBMI
/* The positions the four byte planes' unpacks put 64 values at (see dequantize): position
 * 16 L + 4 k + i holds value 16 k + 4 L + i. */
static inline __m512i unpack_order(void) {
    uint8_t o[64];
    for (int pos = 0; pos < 64; pos++) o[pos] = (uint8_t)(16 * ((pos >> 2) & 3) + 4 * (pos >> 4) + (pos & 3));
    return _mm512_loadu_si512(o);
}
#endif

/* out[j] = map[q[j]] * s: the codes' values from the table's byte planes, 64 at a time (four byte
 * lookups from registers, interleaved back into fp32 by unpacks), instead of a gathered load each. */
static inline void dequantize(const unsigned char *restrict q, float *restrict out, int64_t len,
                              const float *restrict map, const slide_q8_table *restrict t, float s) {
    int64_t j = 0;
#ifdef SLIDE_Q8_VBMI
    const __m512i order = unpack_order();
    const __m512 vs = _mm512_set1_ps(s);
    for (; j + 64 <= len; j += 64) {
        const __m512i key = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(q + j));
        const __m512i b0 = row_lookup(key, t->planes[0]), b1 = row_lookup(key, t->planes[1]);
        const __m512i b2 = row_lookup(key, t->planes[2]), b3 = row_lookup(key, t->planes[3]);
        const __m512i wl = _mm512_unpacklo_epi8(b0, b1), wh = _mm512_unpackhi_epi8(b0, b1);
        const __m512i xl = _mm512_unpacklo_epi8(b2, b3), xh = _mm512_unpackhi_epi8(b2, b3);
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(wl, xl)), vs));
        _mm512_storeu_ps(out + j + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(wl, xl)), vs));
        _mm512_storeu_ps(out + j + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(wh, xh)), vs));
        _mm512_storeu_ps(out + j + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(wh, xh)), vs));
    }
#else
    (void)t;
#endif
    for (; j < len; j++) out[j] = map[q[j]] * s;
}

/* q[j] = code of grid index x[j] (0 for every j when zero: an all-zero block). */
static inline void requantize(const int32_t *restrict x, unsigned char *restrict q, int64_t len,
                              const slide_q8_table *restrict t, int zero) {
    int64_t j = 0;
    if (zero) {
        memset(q, 0, (size_t)len);
        return;
    }
#ifdef SLIDE_Q8_VBMI
    for (; j + 64 <= len; j += 64) {
        __m512i w[2];
        for (int h = 0; h < 2; h++)
            w[h] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_loadu_si512(x + j + 32 * h))),
                                      _mm512_cvtepi32_epi16(_mm512_loadu_si512(x + j + 32 * h + 16)), 1);
        _mm512_storeu_si512(q + j, search64(w[0], w[1], t));
    }
#endif
    for (; j < len; j++) q[j] = t->lut[x[j]];
}

/* A keyed 32-bit integer hash (a Weyl multiply, then one round of "lowbias32" multiply-xorshift):
 * vectorizes with 32-bit multiplies. Element counters are unit offsets (< 2^32 in every unit). */
static inline uint32_t hash32(uint32_t x, uint32_t k1, uint32_t k2) {
    x = (x ^ k1) * 0x9e3779b1u;
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x ^ k2;
}

static inline uint16_t f2b_stochastic(float f, uint64_t key, uint64_t idx) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = hash32((uint32_t)idx, (uint32_t)key, (uint32_t)(key >> 32)) & 0xffffu;
    uint32_t t = u + r;
    /* inf / NaN stay as they are; a carry into the exponent of inf truncates instead */
    if ((u & 0x7f800000u) == 0x7f800000u || (t & 0x7f800000u) == 0x7f800000u) t = u;
    return (uint16_t)(t >> 16);
}

/* The rounding table's index of x / absmax: (clamp(x * inv, -1, 1) + 1) / 2 * 65535 + 0.5, truncated. */
static inline int32_t lut_index(float x, float inv) {
    float y = x * inv;
    y = y < -1.0f ? -1.0f : (y > 1.0f ? 1.0f : y);
    y = (y + 1.0f) * 0.5f;
    y = y * 65535.0f;
    y = y + 0.5f;
    return (int32_t)y;
}

static inline __attribute__((always_inline)) void adam8_block(
        void *restrict master_, unsigned char *restrict q1, unsigned char *restrict q2, float *restrict a1,
        float *restrict a2, const void *restrict grad_, uint16_t *restrict out16, int64_t lo, int64_t hi,
        const float *restrict code1, const float *restrict code2, const slide_q8_table *restrict lut1,
        const slide_q8_table *restrict lut2, const slide_adam8_hp *hp, uint64_t ctr, const int64_t goff, const int gbf, const int mbf, const int o16) {
    float m[Q_BLOCK], v[Q_BLOCK];
    const int64_t len = hi - lo;
    const int64_t b = lo / Q_BLOCK;
    const float s1 = a1[b], s2 = a2[b];
    float mx1 = 0.0f, mx2 = 0.0f;
    /* one factor for the gradient: gmul * gclip * sign (each 1 or -1 but for a loss scale or clipping) */
    const float gscale = hp->gmul * hp->gclip * hp->sign, wd_mul = hp->wd_mul, beta1 = hp->beta1,
                c1 = hp->c1, beta2 = hp->beta2, c2 = hp->c2, bc2 = hp->bc2, eps = hp->eps, neg_step = hp->neg_step;
    float *restrict m32 = (float *)master_;
    uint16_t *restrict m16 = (uint16_t *)master_;
    const float *restrict g32 = (const float *)grad_;
    const uint16_t *restrict g16 = (const uint16_t *)grad_;
    dequantize(q1 + lo, m, len, code1, lut1, s1);
    dequantize(q2 + lo, v, len, code2, lut2, s2);
    _Pragma("omp simd reduction(max:mx1, mx2)")
    for (int64_t j = 0; j < len; j++) {
        const int64_t i = lo + j;
        const float g = (gbf ? bf16_to_f32(g16[i - goff]) : g32[i - goff]) * gscale;
        float mm = m[j];
        float vv = v[j];
        mm = fmaf(g, c1, mm * beta1);
        vv = fmaf(c2 * g, g, vv * beta2);
        m[j] = mm;
        v[j] = vv;
        const float am = fabsf(mm), av = fabsf(vv);
        mx1 = mx1 < am ? am : mx1;                 /* std::max's order, as the reference */
        mx2 = mx2 < av ? av : mx2;
        float p = (mbf ? bf16_to_f32(m16[i]) : m32[i]) * wd_mul;
        p = p + (neg_step * mm) / (sqrtf(vv) / bc2 + eps);
        if (mbf) {
            uint16_t w = f2b_stochastic(p, hp->seed, ctr + (uint64_t)i);
            m16[i] = w;
            if (o16) out16[i] = w;
        } else {
            m32[i] = p;
            if (o16) out16[i] = f32_to_bf16(p);
        }
    }
    a1[b] = mx1;
    a2[b] = mx2;
    /* Requantize: the indices in one vector loop, then the table's bytes (a load each). */
    const float i1 = mx1 > 0.0f ? 1.0f / mx1 : 0.0f, i2 = mx2 > 0.0f ? 1.0f / mx2 : 0.0f;
    int32_t x1[Q_BLOCK], x2[Q_BLOCK];
    _Pragma("omp simd")
    for (int64_t j = 0; j < len; j++) {
        x1[j] = lut_index(m[j], i1);
        x2[j] = lut_index(v[j], i2);
    }
    requantize(x1, q1 + lo, len, lut1, !(mx1 > 0.0f));      /* an all-zero block: codes 0 */
    requantize(x2, q2 + lo, len, lut2, !(mx2 > 0.0f));
}

/* Blocks handed to the threads about 64 Ki elements at a time, as in host_adam.c. */
#define Q_CHUNK 256
#define ADAM8_IMPL(NAME, GBF, MBF)                                                               \
    static void NAME(void *master, unsigned char *q1, unsigned char *q2, float *a1, float *a2,   \
                     const void *grad, uint16_t *out16, int64_t n, const float *code1,            \
                     const float *code2, const slide_q8_table *lut1, const slide_q8_table *lut2,    \
                     const slide_adam8_hp *hp, uint64_t ctr, int threads) {                       \
        int64_t nb = (n + Q_BLOCK - 1) / Q_BLOCK;                                                 \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, Q_CHUNK) if(nb > Q_CHUNK)") \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            int64_t lo = b * Q_BLOCK, hi = lo + Q_BLOCK < n ? lo + Q_BLOCK : n;                   \
            if (out16) adam8_block(master, q1, q2, a1, a2, grad, out16, lo, hi, code1, code2, lut1, lut2, \
                                   hp, ctr, 0, GBF, MBF, 1);                                        \
            else adam8_block(master, q1, q2, a1, a2, grad, out16, lo, hi, code1, code2, lut1, lut2, hp, \
                             ctr, 0, GBF, MBF, 0);                                                  \
        }                                                                                        \
    }
ADAM8_IMPL(adam8_g32_m32, 0, 0)
ADAM8_IMPL(adam8_g16_m32, 1, 0)
ADAM8_IMPL(adam8_g32_m16, 0, 1)
ADAM8_IMPL(adam8_g16_m16, 1, 1)

/* One update of n parameters from a block boundary: q1, q2, master, grad, out16 point at the
 * range's first element, a1, a2 at its first block. grad_bf16 / master_bf16 pick the dtypes; ctr
 * is the counter of the range's first element for the stochastic rounding. */
void slide_adamw8(void *master, unsigned char *q1, unsigned char *q2, float *a1, float *a2, const void *grad,
                  uint16_t *out16, int64_t n, const float *code1, const float *code2, const slide_q8_table *lut1,
                  const slide_q8_table *lut2, const slide_adam8_hp *hp, uint64_t ctr, int grad_bf16,
                  int master_bf16, int threads) {
    if (n <= 0) return;
    if (threads < 1) threads = 1;
    if (grad_bf16 && master_bf16) adam8_g16_m16(master, q1, q2, a1, a2, grad, out16, n, code1, code2, lut1, lut2, hp, ctr, threads);
    else if (grad_bf16) adam8_g16_m32(master, q1, q2, a1, a2, grad, out16, n, code1, code2, lut1, lut2, hp, ctr, threads);
    else if (master_bf16) adam8_g32_m16(master, q1, q2, a1, a2, grad, out16, n, code1, code2, lut1, lut2, hp, ctr, threads);
    else adam8_g32_m32(master, q1, q2, a1, a2, grad, out16, n, code1, code2, lut1, lut2, hp, ctr, threads);
}

/* The 8-bit update of some rows of a (V, h) table whose rows are whole blocks (h % Q_BLOCK == 0):
 * for row k of [0, n_rows), r = rows[k], each block of row r takes the flat kernel's update with
 * the gradient grad[r] (fp32), plus sums[k] when given, and grad[r] is cleared after when
 * zero_grad and it holds a value. master, q1, q2, grad point at the table's first element, a1, a2
 * at its first block; the stochastic rounding counts from the table's first element (ctr 0), so
 * a table updated in two sets of rows equals one update of the whole table. Rows distinct. */
void slide_adamw8_rows(void *master, unsigned char *q1, unsigned char *q2, float *a1, float *a2, float *grad,
                       const int64_t *rows, int64_t n_rows, int64_t h, const float *sums, int zero_grad,
                       const float *code1, const float *code2, const slide_q8_table *lut1, const slide_q8_table *lut2,
                       const slide_adam8_hp *hp, int master_bf16, int threads) {
    if (n_rows <= 0 || h <= 0 || h % Q_BLOCK) return;
    if (threads < 1) threads = 1;
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")
    for (int64_t k = 0; k < n_rows; k++) {
        const int64_t r = rows[k];
        float *restrict gr = grad + r * h;
        float tmp[Q_BLOCK];
        for (int64_t c = 0; c < h; c += Q_BLOCK) {
            const int64_t lo = r * h + c;
            const float *g = gr + c;
            int64_t goff = lo;
            if (sums) {
                const float *restrict s0 = sums + k * h + c;
                _Pragma("omp simd")
                for (int j = 0; j < Q_BLOCK; j++) tmp[j] = gr[c + j] + s0[j];
                g = tmp;
            }
            if (master_bf16) adam8_block(master, q1, q2, a1, a2, g, 0, lo, lo + Q_BLOCK, code1, code2, lut1, lut2,
                                         hp, 0, goff, 0, 1, 0);
            else adam8_block(master, q1, q2, a1, a2, g, 0, lo, lo + Q_BLOCK, code1, code2, lut1, lut2, hp, 0, goff,
                             0, 0, 0);
        }
        if (zero_grad) {
            const uint32_t *restrict w = (const uint32_t *)gr;
            uint32_t any = 0;
            _Pragma("omp simd reduction(|:any)")
            for (int64_t i = 0; i < h; i++) any |= w[i];
            if (any) memset(gr, 0, (size_t)h * sizeof(float));
        }
    }
}

/* out[i] = bf16(x[i]) rounded stochastically with the kernel's hash (key, ctr + i): the rounding a
 * bf16 master takes, for tests and for loading an fp32 value into a bf16 master. */
void slide_round_bf16_stochastic(const float *x, uint16_t *out, int64_t n, uint64_t key, uint64_t ctr, int threads) {
    if (threads < 1) threads = 1;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(n > 65536)")
    for (int64_t i = 0; i < n; i++) out[i] = f2b_stochastic(x[i], key, ctr + (uint64_t)i);
}
