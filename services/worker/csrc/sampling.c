/* Sampled rows' draws (services/worker/sampler.py): min-p, top-k and top-p as vLLM applies them,
 * then a draw by inverse CDF from a uniform the caller took from the request's own generator.
 *
 * The same filters as sampler.py's torch path (`distribution`), in one call per step: after a
 * decode step has streamed the weights through the caches, each of the torch path's dozen small
 * ops per row costs ~25 us, ~0.2 ms a row for temperature alone and ~0.5 ms with top-p.
 *
 * Per row, its logits x divided by its temperature:
 *   w_i = exp(x_i - max x), the best token's 1; 0 below min_p, and 87 nats below the best
 *        (-inf, a token a constraint forbids, is exactly 0);
 *   with top-k or top-p: the candidates are the tokens with w_i above the first floor (FLOORS)
 *   whose tokens hold the top-k or top-p's mass; sorted by logit, descending, the lower id first
 *   among equal logits (so top_k=1 is exactly argmax); top-k keeps the first k; top-p the
 *   smallest prefix whose probability (among what min-p and top-k left, over the whole row)
 *   reaches p, the best always; w_i of every other token is then 0;
 *   the draw: token i in proportion to w_i, in id order (inverse CDF of the uniform u), so that
 *   it depends on the kept set only, not on how it was found (sampler.py's torch path draws the
 *   same token for the same u: one algorithm, the floors included).
 */
#include <float.h>

#include "kernels.h"

/* Weights (relative to the best token's) above which tokens are sorted, the first that holds the
 * top-k or top-p's mass: 1e-2 is 4.6 nats below the best; the last, any weight (a weight is 0 or
 * at least exp(UNDERFLOW), ~1.6e-38, above FLT_MIN). */
static const float FLOORS[] = {1e-2f, 1e-4f, 1e-8f, FLT_MIN};
#define NUM_FLOORS 4
#define UNDERFLOW (-87.0f) /* exp below this is ~1e-38: taken as 0 */

typedef struct {
    float logit;
    int64_t id;
} candidate_t;

static int by_logit_then_id(const void *a, const void *b) {
    const candidate_t *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Float sums of 1024 weights, added in double. */
static double weight_sum(const float *w, int64_t n) {
    double total = 0.0;
    for (int64_t j = 0; j < n; j += 1024) {
        const int64_t end = j + 1024 < n ? j + 1024 : n;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = j; k < end; k++) s += w[k];
        total += s;
    }
    return total;
}

/* w[i] for the row x (see above); returns the row's total weight. */
static double row_weights(const float *x, int64_t n, float min_p, float *w) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 vm = _mm512_set1_ps(m), floor = _mm512_set1_ps(min_p), under = _mm512_set1_ps(UNDERFLOW);
    for (; i + 16 <= n; i += 16) {
        const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), vm);
        __m512 e = exp16_nonpositive(d);
        const __mmask16 keep = _mm512_cmp_ps_mask(d, under, _CMP_GE_OQ) & _mm512_cmp_ps_mask(e, floor, _CMP_GE_OQ);
        _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(keep, e));
    }
#endif
    for (; i < n; i++) {
        const float d = x[i] - m, e = d >= UNDERFLOW ? expf(d) : 0.0f;
        w[i] = e >= min_p ? e : 0.0f;
    }
    return weight_sum(w, n);
}

/* The first index whose running sum of w exceeds target, else the last with any weight (a
 * rounding edge at the very top). */
static int64_t inverse_cdf(const float *w, int64_t n, double target) {
    double cum = 0.0;
    int64_t last = 0;
    for (int64_t j = 0; j < n; j += 64) { /* skip whole chunks of 64 by their sums */
        const int64_t end = j + 64 < n ? j + 64 : n;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = j; k < end; k++) s += w[k];
        if (s > 0.0f) last = end - 1;
        if (cum + s <= target) {
            cum += s;
            continue;
        }
        for (int64_t k = j; k < end; k++) {
            cum += w[k];
            if (cum > target && w[k] > 0.0f) return k;
        }
    }
    while (last > 0 && w[last] == 0.0f) last--;
    return last;
}

/* For every floor: how many tokens weigh at least that, and their total weight (float sums of
 * 1024 tokens, added in double). */
static void floor_counts(const float *w, int64_t n, int64_t *count, double *mass) {
    for (int f = 0; f < NUM_FLOORS; f++) count[f] = 0, mass[f] = 0.0;
    for (int64_t j = 0; j < n; j += 1024) {
        const int64_t end = j + 1024 < n ? j + 1024 : n;
        for (int f = 0; f < NUM_FLOORS; f++) {
            const float floor = FLOORS[f];
            int k = 0;
            float s = 0.0f;
#pragma omp simd reduction(+ : k, s)
            for (int64_t i = j; i < end; i++) {
                k += w[i] >= floor;
                s += w[i] >= floor ? w[i] : 0.0f;
            }
            count[f] += k;
            mass[f] += s;
        }
    }
}

/* More candidates than SORT_MAX (a flat row: top-p can keep tens of thousands of ids): they go
 * into buckets of 1/BUCKETS_PER_NAT nat of logit below the best, and only the bucket where the
 * top-k's count or top-p's mass is reached is sorted. */
#define SORT_MAX 512
#define BUCKETS_PER_NAT 16
#define NUM_BUCKETS (BUCKETS_PER_NAT * 90) /* the last holds anything further below */

static inline int bucket_of(float best, float logit) {
    const float b = (best - logit) * BUCKETS_PER_NAT;
    return b < NUM_BUCKETS - 1 ? (int)b : NUM_BUCKETS - 1;
}

static inline void swap_candidates(candidate_t *a, candidate_t *b) {
    const candidate_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorders c[0, count) as: the candidates of the buckets before the cut (*head of them, in no
 * order, weighing *head_mass; with top-k they are 0 and everything up to the cut is to be
 * sorted), then those of the cut's bucket; returns how many that is (the rest are filtered
 * out). The cut is the first bucket where the count reaches top_k, or without top-k where the
 * weight reaches p_mass. */
static int64_t narrow(candidate_t *c, int64_t count, const float *w, int64_t top_k, double p_mass, int64_t *head,
                      double *head_mass) {
    int64_t num[NUM_BUCKETS] = {0};
    double mass[NUM_BUCKETS] = {0};
    float best = c[0].logit;
    for (int64_t j = 1; j < count; j++) best = c[j].logit > best ? c[j].logit : best;
    for (int64_t j = 0; j < count; j++) {
        const int b = bucket_of(best, c[j].logit);
        num[b]++;
        mass[b] += w[c[j].id];
    }
    int cut = 0;
    int64_t before = 0;
    double before_mass = 0.0;
    for (; cut < NUM_BUCKETS - 1; cut++) {
        if (top_k ? before + num[cut] >= top_k : before_mass + mass[cut] >= p_mass) break;
        before += num[cut];
        before_mass += mass[cut];
    }
    int64_t lo = 0, hi;
    for (int64_t j = 0; j < count; j++)
        if (bucket_of(best, c[j].logit) < cut) swap_candidates(c + lo++, c + j);
    hi = lo;
    for (int64_t j = lo; j < count; j++)
        if (bucket_of(best, c[j].logit) == cut) swap_candidates(c + hi++, c + j);
    *head = top_k ? 0 : lo;
    *head_mass = top_k ? 0.0 : before_mass;
    return hi;
}

/* One ranked row: x its logits, w its weights (row_weights), total their sum; w keeps the weights
 * of the tokens top-k and top-p keep, the others 0. */
static void keep_ranked(const float *x, float *w, int64_t n, double total, int64_t top_k, double top_p,
                        candidate_t *c) {
    int64_t counts[NUM_FLOORS];
    double masses[NUM_FLOORS];
    floor_counts(w, n, counts, masses);
    int f = 0; /* the first floor whose tokens hold the top-k or top-p's mass, else every token with weight */
    while (f < NUM_FLOORS - 1 && !(top_k ? counts[f] >= top_k : masses[f] >= top_p * total)) f++;
    const float floor = FLOORS[f];
    int64_t count = 0, i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) /* most tokens are below the floor: 16 at a time */
        for (unsigned m = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), _mm512_set1_ps(floor), _CMP_GE_OQ); m; m &= m - 1) {
            const int64_t k = i + __builtin_ctz(m);
            c[count].logit = x[k], c[count++].id = k;
        }
#endif
    for (; i < n; i++)
        if (w[i] >= floor) c[count].logit = x[i], c[count++].id = i;
    if (!count) return; /* no token with weight: a row of -inf or NaN */
    int64_t head = 0; /* c[0, head): kept whatever their order (see narrow) */
    double head_mass = 0.0;
    if (count > SORT_MAX && (!top_k || top_k < count)) count = narrow(c, count, w, top_k, top_p * total, &head, &head_mass);
    qsort(c + head, (size_t)(count - head), sizeof *c, by_logit_then_id);
    int64_t kept = top_k && top_k < count ? top_k : count;
    double z = total; /* without top-k, top-p's probabilities are over the whole row */
    if (top_k) {
        z = 0.0;
        for (int64_t i = 0; i < kept; i++) z += w[c[i].id];
    }
    if (top_p < 1.0) { /* the best is always kept, and everything before the cut's bucket */
        int64_t i = head ? head : 1;
        double before = (head ? head_mass : w[c[0].id]) / z;
        for (; i < kept && before < top_p; i++) before += w[c[i].id] / z;
        kept = i;
    }
    int64_t last = 0; /* the lowest ranked token kept: every token ranked above it is kept too */
    for (int64_t i = 1; i < kept; i++)
        if (by_logit_then_id(c + i, c + last) > 0) last = i;
    const float worst = c[last].logit;
    const int64_t worst_id = c[last].id;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) w[i] = x[i] > worst || (x[i] == worst && i <= worst_id) ? w[i] : 0.0f;
}

/* x: [R, n] contiguous, the logits; per row its temperature (the row is divided by it first, in
 * float32 as torch's division rounds), top_k (0: none), top_p (>= 1: none), min_p (0: none) and u,
 * a uniform in [0, 1). out[r]: the drawn id. Returns 0, or -1 without memory for the scratch. */
int sample_rows_f32(const float *x, int64_t num_rows, int64_t n, const float *temperature, const int64_t *top_k,
                    const double *top_p, const double *min_p, const double *u, int64_t *out) {
    float *w = malloc(sizeof(float) * 2 * n), *scaled = w + n;
    candidate_t *c = malloc(sizeof(candidate_t) * n);
    if (!w || !c) {
        free(w);
        free(c);
        return -1;
    }
    for (int64_t r = 0; r < num_rows; r++) {
        const float *xr = x + r * n, t = temperature[r];
#pragma omp simd
        for (int64_t i = 0; i < n; i++) scaled[i] = xr[i] / t;
        const double total = row_weights(scaled, n, (float)min_p[r], w);
        const int64_t k = top_k[r] > 0 && top_k[r] < n ? top_k[r] : 0;
        double kept = total;
        if (k || top_p[r] < 1.0) {
            keep_ranked(scaled, w, n, total, k, top_p[r], c);
            kept = weight_sum(w, n);
        }
        out[r] = inverse_cdf(w, n, u[r] * kept);
    }
    free(w);
    free(c);
    return 0;
}
