/* The host AdamW: one pass over a flat range, threaded with OpenMP, vectorised by the compiler.
 *
 * For each element i of [0, n):
 *   g = widen(grad[i]) * gmul / gdiv * sign        (gmul: a loss scale; gdiv: the clip factor's
 *                                                   reciprocal, as torch's fused `grad_scale`)
 *   p = master[i] * wd_mul                          (decoupled weight decay, 1 - lr * wd)
 *   m = fma(coeff, g - m, base)                     (torch's lerp: base = m, coeff = 1 - beta1)
 *   v = v * beta2 + (1 - beta2) * g * g
 *   p = p + (-step_size) * m / (sqrt(v) / sqrt(bias_correction2) + eps)
 * and optionally out16[i] = bf16(p), rounded to nearest even.
 *
 * The operations and their order are those of torch's fused CPU AdamW (ATen's FusedAdamKernel,
 * ADAMW mode), so the results are bit-identical where the compiler of that build made the same
 * contractions; neutral factors (gmul = gdiv = sign = wd_mul = 1) leave every value unchanged.
 * Built with -ffp-contract=off: the only fused multiply-add is the explicit fmaf of the lerp.
 * Every element is computed the same way whatever the vector width or thread split, so the
 * result does not depend on how a range is cut into calls.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

typedef struct {
    float gmul, gdiv, sign, wd_mul, coeff, beta2, c2, bc2_sqrt, eps, neg_step;
    int32_t lerp_base_is_m;   /* 1: base = m (|1 - beta1| < 0.5), 0: base = g, coeff = -beta1 */
    int32_t v_order;          /* 0: (v*b2) + (c2*g)*g; 1: fma(v, b2, (c2*g)*g); 2: fma(c2*g, g, v*b2) */
} slide_adam_hp;

#define SLIDE_ADAM_BODY(LOAD_G)                                                              \
    {                                                                                        \
        float g = (LOAD_G) * hp.gmul;                                                        \
        g = g / hp.gdiv;                                                                     \
        g = g * hp.sign;                                                                     \
        float p = master[i] * hp.wd_mul;                                                     \
        float m = exp_avg[i];                                                                \
        float base = hp.lerp_base_is_m ? m : g;                                              \
        m = fmaf(hp.coeff, g - m, base);                                                     \
        float v = exp_avg_sq[i];                                                             \
        float cg = hp.c2 * g;                                                                \
        if (vo == 0) v = v * hp.beta2 + cg * g;                                              \
        else if (vo == 1) v = fmaf(v, hp.beta2, cg * g);                                     \
        else v = fmaf(cg, g, v * hp.beta2);                                                  \
        exp_avg[i] = m;                                                                      \
        exp_avg_sq[i] = v;                                                                   \
        float denom = sqrtf(v) / hp.bc2_sqrt + hp.eps;                                       \
        p = p + (hp.neg_step * m) / denom;                                                   \
        master[i] = p;                                                                       \
        if (out16) out16[i] = f32_to_bf16(p);                                                \
    }

/* [0, n) in blocks of SLIDE_BLOCK elements (a multiple of 16: whole cache lines), handed to the
 * threads one at a time as each finishes its last (dynamic schedule). With one part per thread
 * (static), the call took as long as its slowest thread: a thread that shares its core with any
 * other (the process's main thread, a copy's callback) held up all the others. */
#ifndef SLIDE_BLOCK
#define SLIDE_BLOCK 65536
#endif
#define SLIDE_PARALLEL_RANGE(BODY)                                                           \
    int64_t slide_nb_ = (n + SLIDE_BLOCK - 1) / SLIDE_BLOCK;                                 \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1) if(slide_nb_ > 1)")  \
    for (int64_t slide_b_ = 0; slide_b_ < slide_nb_; slide_b_++) {                           \
        int64_t lo = slide_b_ * SLIDE_BLOCK, hi = lo + SLIDE_BLOCK < n ? lo + SLIDE_BLOCK : n; \
        BODY                                                                                 \
    }

static void adam_f32(float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq,
                     const float *restrict grad, uint16_t *restrict out16, int64_t n, slide_adam_hp hp,
                     int threads, int vo) {
    SLIDE_PARALLEL_RANGE(
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; i++) SLIDE_ADAM_BODY(grad[i])
    )
}

static void adam_bf16(float *restrict master, float *restrict exp_avg, float *restrict exp_avg_sq,
                      const uint16_t *restrict grad, uint16_t *restrict out16, int64_t n, slide_adam_hp hp,
                      int threads, int vo) {
    SLIDE_PARALLEL_RANGE(
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; i++) SLIDE_ADAM_BODY(bf16_to_f32(grad[i]))
    )
}

/* The versions below take the contraction variant as a constant, so each loop is one vector body. */
#define SLIDE_DISPATCH(FN, GT)                                                               \
    void FN(float *master, float *exp_avg, float *exp_avg_sq, const GT *grad, uint16_t *out16,   \
            int64_t n, const slide_adam_hp *hp, int threads) {                               \
        if (n <= 0) return;                                                                  \
        if (threads < 1) threads = 1;                                                        \
        if (hp->v_order == 1) IMPL_##GT(master, exp_avg, exp_avg_sq, grad, out16, n, *hp, threads, 1); \
        else if (hp->v_order == 2) IMPL_##GT(master, exp_avg, exp_avg_sq, grad, out16, n, *hp, threads, 2); \
        else IMPL_##GT(master, exp_avg, exp_avg_sq, grad, out16, n, *hp, threads, 0);        \
    }
#define IMPL_float adam_f32
#define IMPL_uint16_t adam_bf16

SLIDE_DISPATCH(slide_adamw_f32, float)
SLIDE_DISPATCH(slide_adamw_bf16, uint16_t)

/* AdamW of some rows of a (V, h) table, in place: for row k of [0, n_rows), r = rows[k],
 *   g = grad[r]                 (or grad[r] + sums[k] when sums is given: the batch's row sums)
 *   (master[r], exp_avg[r], exp_avg_sq[r]) = AdamW(master[r], exp_avg[r], exp_avg_sq[r], g)
 * and grad[r] = 0 after when zero_grad. Threaded over rows; each element is computed as the flat
 * kernel computes it, so a table updated in two sets of rows equals one whole-table update. The
 * rows must be distinct. Rows are handed out about a block (SLIDE_BLOCK elements) at a time, as
 * the flat kernel's ranges are. */
/* Whether a gradient row holds a nonzero bit: a row that is zero already is not written, so the
 * pages of a lazily mapped dense gradient that only ever reads as zeros (an untied embedding's,
 * whose batch rows' sums are added inside the update) stay unbacked. */
static inline int row_nonzero(const float *restrict gr, int64_t h) {
    const uint32_t *restrict w = (const uint32_t *)gr;
    uint32_t any = 0;
    _Pragma("omp simd reduction(|:any)")
    for (int64_t i = 0; i < h; i++) any |= w[i];
    return any != 0;
}

static void adam_rows(float *restrict tw, float *restrict tm, float *restrict tv, float *restrict grad,
                      const int64_t *restrict rows, int64_t n_rows, int64_t h, const float *restrict sums,
                      int zero_grad, slide_adam_hp hp, int threads, int vo) {
    int64_t per = h >= SLIDE_BLOCK ? 1 : SLIDE_BLOCK / h;     /* rows handed out at a time: about a block */
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, per)")
    for (int64_t k = 0; k < n_rows; k++) {
        int64_t r = rows[k];
        float *restrict master = tw + r * h, *restrict exp_avg = tm + r * h, *restrict exp_avg_sq = tv + r * h;
        float *restrict gr = grad + r * h;
        uint16_t *out16 = 0;
        if (sums) {
            const float *restrict s0 = sums + k * h;
            _Pragma("omp simd")
            for (int64_t i = 0; i < h; i++) SLIDE_ADAM_BODY(gr[i] + s0[i])
        } else {
            _Pragma("omp simd")
            for (int64_t i = 0; i < h; i++) SLIDE_ADAM_BODY(gr[i])
        }
        if (zero_grad && row_nonzero(gr, h)) memset(gr, 0, (size_t)h * sizeof(float));
    }
}

void slide_adamw_rows(float *tw, float *tm, float *tv, float *grad, const int64_t *rows, int64_t n_rows, int64_t h,
                      const float *sums, int zero_grad, const slide_adam_hp *hp, int threads) {
    if (n_rows <= 0 || h <= 0) return;
    if (threads < 1) threads = 1;
    if (hp->v_order == 1) adam_rows(tw, tm, tv, grad, rows, n_rows, h, sums, zero_grad, *hp, threads, 1);
    else if (hp->v_order == 2) adam_rows(tw, tm, tv, grad, rows, n_rows, h, sums, zero_grad, *hp, threads, 2);
    else adam_rows(tw, tm, tv, grad, rows, n_rows, h, sums, zero_grad, *hp, threads, 0);
}

/* STREAM's triad, a[i] = b[i] + s * c[i], on the same threads: the bandwidth bound of the update. */
void slide_triad(float *restrict a, const float *restrict b, const float *restrict c, float s, int64_t n,
                 int threads) {
    if (threads < 1) threads = 1;
    SLIDE_PARALLEL_RANGE(
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; i++) a[i] = b[i] + s * c[i];
    )
}

/* The forward's gather of a batch's rows in bf16: out[k] = bf16(table[ids[k]]) for k of [0, n), rows
 * of h elements, rounded to nearest even (the cast the GPU would apply to the fp32 rows). */
void slide_gather_bf16(const float *table, const int64_t *ids, int64_t n, int64_t h, uint16_t *out, int threads) {
    if (n <= 0 || h <= 0) return;
    if (threads < 1) threads = 1;
    int64_t per = h >= SLIDE_BLOCK ? 1 : SLIDE_BLOCK / h;
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, per)")
    for (int64_t k = 0; k < n; k++) {
        const float *restrict src = table + ids[k] * h;
        uint16_t *restrict dst = out + k * h;
        _Pragma("omp simd")
        for (int64_t i = 0; i < h; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

int slide_host_adam_abi(void) { return 3; }
