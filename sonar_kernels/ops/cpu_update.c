/* AdamW with 8-bit moments on the CPU, one pass over memory: the rule of sonar_kernels/rules/update.py
 * (adamw_update_ with 8-bit moments: dequantize, AdamW in the "fp64" arithmetic of rules/adamw.py,
 * requantize with rules/moments_8bit.py's closed form; the master kinds of rules/master_weights.py) written
 * once more in C, operation for operation, for sonar_kernels/ops/cpu_update.py, which compiles it with the
 * machine's C compiler (no contraction into fused multiply-adds, no unsafe math) and checks it against the
 * rule (tests/test_cpu_update.py: bit for bit).
 *
 * One call updates blocks [first_block, last_block) of 32 consecutive elements; the caller splits a
 * tensor's blocks among threads. Every rounding is the rule's:
 *   p = fp32(p - lr * weight_decay * p)                 (fp64; p unchanged when weight_decay == 0)
 *   m = fp32(beta1 * m + (1 - beta1) * g)               (fp64)
 *   v = fp32(beta2 * v + (1 - beta2) * g * g)           (fp64)
 *   denom = fp32(fp32(sqrt(v) / bc2_sqrt) + eps)        (the sum in fp64)
 *   p = p - (step_size * m) / denom                     (fp32)
 * sqrtf is correctly rounded (IEEE 754), and fp32(sqrt in fp64) equals it: double rounding is innocuous
 * for the square root when the wider format has at least 2p + 2 bits (53 >= 2 * 24 + 2; Figueroa, "When
 * is double rounding innocuous?", SIGNUM 1995), which is why the rule's fp64 square root is one here.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define BLOCK 32

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* rules/master_weights.py's hash32 (lowbias32) on the low 32 bits. */
static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* torch's fp32 -> bf16 cast (c10::BFloat16, round to nearest even; a NaN becomes 0x7FC0). */
static inline uint16_t to_bf16(float x) {
    if (x != x) return 0x7FC0;
    uint32_t u = f2u(x);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp32(2 ** (r / 8)) for r in 0..8: rules/moments_8bit.py's _EIGHTHS, and 2. */
#define E0 1.0f
#define E1 0x1.172b84p+0f
#define E2 0x1.306fe0p+0f
#define E3 0x1.4bfdaep+0f
#define E4 0x1.6a09e6p+0f
#define E5 0x1.8ace54p+0f
#define E6 0x1.ae89fap+0f
#define E7 0x1.d5818ep+0f
#define E8 2.0f

/* The table entry fp32(2 ** (d / 8)) for d in [-255, 0], in closed form (a lookup does not vectorize):
 * 2 ** q * fp32(2 ** (r / 8)) with d = 8 q + r, exactly (no entry is subnormal); fp32(2 ** (r / 8)) chosen
 * by the bits of r, a tree of selects. */
static inline float entry(int32_t d) {
    int32_t q = d >> 3, r = d & 7;
    float low = (r & 1) ? E1 : E0, mid = (r & 1) ? E3 : E2, high = (r & 1) ? E5 : E4, top = (r & 1) ? E7 : E6;
    float eighth = (r & 4) ? ((r & 2) ? top : high) : ((r & 2) ? mid : low);
    return eighth * u2f((uint32_t)(q + 127) << 23);
}

/* exp_avg's magnitude of code k in 0..127 (0 for k = 0), exp_avg_sq's level of code c in 0..255. */
static inline float m_entry(int32_t k) { return k == 0 ? 0.0f : entry(k - 127); }
static inline float v_entry(int32_t c) { return entry(c - 255); }

/* rules/master_weights.py's split of the fp32 master p: the bf16 weight's bits returned, the remainder
 * stored. The rule's int64 high = (bits + 2 ** 15) >> 16 in 32 bits (vector lanes): bits >> 16 plus the
 * carry of the low half's 2 ** 15; the remainder bits - high * 2 ** 16 lies in [-2 ** 15, 2 ** 15), its
 * low 16 bits taken from the wrapping difference. */
static inline uint16_t split(float p, int16_t *remainder) {
    int32_t bits = (int32_t)f2u(p);
    int32_t high = (bits >> 16) + ((bits & 0xFFFF) >= 0x8000);
    *remainder = (int16_t)(uint16_t)((uint32_t)bits - ((uint32_t)high << 16));
    return (uint16_t)high;
}

/* rules/master_weights.py's stochastic_round of p at the stream counter index (its low 32 bits): the rule's
 * int64 (bits + u) >> 16 in 32 bits, bits >> 16 plus the carry of the low half and u (both below 2 ** 16);
 * a NaN becomes torch's bf16 NaN. */
static inline uint16_t stochastic(float p, uint32_t index, uint32_t stream) {
    uint32_t u = hash32(index ^ stream) >> 16;
    int32_t bits = (int32_t)f2u(p);
    int32_t high = (bits >> 16) + (int32_t)((((uint32_t)bits & 0xFFFFu) + u) >> 16);
    return p != p ? 0x7FC0 : (uint16_t)high;
}

/* rules/moments_8bit.py's dequantize_blocks of one block of each moment: table[code] * scale, the sign of
 * an exp_avg code applied to the entry first. With AVX2 the entry's fp32(2 ** (r / 8)) is one permutation
 * of a register (a third of the update's time in the portable selects). */
static inline void dequantize(const int8_t *m_codes, const uint8_t *v_codes, float m_scale, float v_scale,
                              float *m, float *v) {
#ifdef __AVX2__
    const __m256 eighths = _mm256_setr_ps(E0, E1, E2, E3, E4, E5, E6, E7);
    const __m256i zero = _mm256_setzero_si256(), bias = _mm256_set1_epi32(127);
    for (int j = 0; j < BLOCK; j += 8) {
        __m256i k = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(m_codes + j)));
        __m256i magnitude_code = _mm256_abs_epi32(k);
        __m256i d = _mm256_sub_epi32(magnitude_code, bias); /* 8 q + r; the permutation reads r's 3 bits */
        __m256 power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_srai_epi32(d, 3), bias), 23));
        __m256 magnitude = _mm256_mul_ps(_mm256_permutevar8x32_ps(eighths, d), power);
        magnitude = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude_code, zero)), magnitude);
        __m256 sign = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(zero, k)), _mm256_set1_ps(-0.0f));
        _mm256_storeu_ps(m + j, _mm256_mul_ps(_mm256_xor_ps(magnitude, sign), _mm256_set1_ps(m_scale)));
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(v_codes + j)));
        d = _mm256_sub_epi32(c, _mm256_set1_epi32(255));
        power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_srai_epi32(d, 3), bias), 23));
        __m256 level = _mm256_mul_ps(_mm256_permutevar8x32_ps(eighths, d), power);
        _mm256_storeu_ps(v + j, _mm256_mul_ps(level, _mm256_set1_ps(v_scale)));
    }
#else
    for (int i = 0; i < BLOCK; i++) {
        int32_t k = m_codes[i];
        float magnitude = m_entry(k < 0 ? -k : k);
        m[i] = (k < 0 ? -magnitude : magnitude) * m_scale;
        v[i] = v_entry(v_codes[i]) * v_scale;
    }
#endif
}

/* rules/moments_8bit.py's quantize_blocks on one block: the codes and the scale.
 *
 * The rule: n = fp32(|x| / scale) = f * 2 ** e (f in [1, 2)), u = offset + 8 e + count (offset 127 for
 * exp_avg, 255 for exp_avg_sq; count = 1 + #{r in 1..7: f >= E_r}) clamped, lo = u - 1 and hi = u clamped
 * to the table, hi when n - T[lo] > T[hi] - n in fp32. Where the entries around n are not clamped, T[lo] =
 * 2 ** e * E_{count-1} and T[hi] = 2 ** e * E_count (n normal: e >= -32), both differences are exact
 * (Sterbenz: entries less than a factor 2 apart) and 2 ** e times f - E_{count-1} and E_count - f, so the
 * rule picks hi exactly when f lies above the midpoint of E_{count-1} and E_count, that is when f >= H_r
 * (r = count - 1), H_r the least fp32 above that midpoint: the code is offset + 8 e + #{r in 0..7: f >=
 * H_r}, no entry read. At the ends: exp_avg below T[2] (u <= 1) gets 1 for e = -16 (n above half of T[1]
 * = 2 ** -16 * E_2) and the rule's comparison of T[0] = 0 and T[1] below; exp_avg_sq's u <= 0 gets 0;
 * n = 1 gives the top code; a NaN the top code, as the rule's clamp does. */
#define H0 0x1.0b95c4p+0f
#define H1 0x1.23cdb4p+0f
#define H2 0x1.3e36c8p+0f
#define H3 0x1.5b03ccp+0f
#define H4 0x1.7a6c1ep+0f
#define H5 0x1.9cac28p+0f
#define H6 0x1.c205c6p+0f
#define H7 0x1.eac0c8p+0f

static inline void quantize(const float *x, const int signed_codes, int8_t *m_out, uint8_t *v_out,
                            float *scale_out) {
    float mag[BLOCK];
    /* The largest magnitude as the largest bit pattern: a magnitude's bits order as its value (an integer
     * maximum vectorizes, a float one does not), and a NaN's lie above every number's (amax's NaN). */
    uint32_t largest = 0;
    for (int i = 0; i < BLOCK; i++) {
        mag[i] = fabsf(x[i]);
        largest = f2u(mag[i]) > largest ? f2u(mag[i]) : largest;
    }
    float scale = u2f(largest);
    int nonzero = scale > 0.0f;
    float divisor = nonzero ? scale : 1.0f;
    const int32_t top = signed_codes ? 127 : 255;
    const float code_one = entry(-126); /* exp_avg's T[1] */
    for (int i = 0; i < BLOCK; i++) {
        float quotient = mag[i] / divisor; /* branch-free code vectorizes: every lane computes, then selects */
        float n = nonzero ? quotient : 0.0f;
        uint32_t bits = f2u(n);
        int32_t exponent = ((int32_t)bits >> 23) - 127; /* arithmetic, as torch's int32 shift */
        float f = u2f((bits & 0x7FFFFFu) | 0x3F800000u);
        int32_t index = top + 8 * exponent + (f >= H0) + (f >= H1) + (f >= H2) + (f >= H3) + (f >= H4) +
                        (f >= H5) + (f >= H6) + (f >= H7);
        if (signed_codes) {
            int32_t tiny = exponent >= -16 ? 1 : n > code_one - n;
            index = index >= 1 ? index : tiny;
        }
        index = index < 0 ? 0 : (index > top ? top : index);
        if (signed_codes)
            m_out[i] = (int8_t)(x[i] < 0.0f ? -index : index);
        else
            v_out[i] = (uint8_t)index;
    }
    *scale_out = scale;
}

/* The update of blocks [first_block, last_block). weight_kind: 0 fp32, 1 bf16 (rounded to nearest even),
 * 2 bf16 with an int16 remainder (the fp32 master split), 3 bf16 rounded stochastically (seed, step,
 * first_index: the stream counter of element 0 of the call's tensors). grad_bf16: the gradient is bf16,
 * else fp32. hyper: [5] fp64; scalars: [2] fp32 (step_size, bc2_sqrt). */
static inline __attribute__((always_inline)) void update(
    int64_t first_block, int64_t last_block, void *weight, const int weight_kind, const void *grad,
    const int grad_bf16, int8_t *m_codes, float *m_scales, uint8_t *v_codes, float *v_scales, int16_t *remainder,
    const int64_t *seed, const float *step, int64_t first_index, const double *hyper, const float *scalars) {
    const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], weight_decay = hyper[4];
    const double decay = lr * weight_decay, one_minus_beta1 = 1.0 - beta1, one_minus_beta2 = 1.0 - beta2;
    const float step_size = scalars[0], bc2_sqrt = scalars[1];
    uint32_t stream = 0;
    if (weight_kind == 3)
        stream = hash32(hash32((uint32_t)*seed) ^ (uint32_t)(int64_t)*step);
    for (int64_t b = first_block; b < last_block; b++) {
        const int64_t base = b * BLOCK;
        float p[BLOCK], m[BLOCK], v[BLOCK];
        float m_old[BLOCK], v_old[BLOCK];
        dequantize(m_codes + base, v_codes + base, m_scales[b], v_scales[b], m_old, v_old);
        for (int i = 0; i < BLOCK; i++) {
            float w;
            if (weight_kind == 0) {
                w = ((const float *)weight)[base + i];
            } else {
                int32_t high = (int32_t)((uint32_t)((const uint16_t *)weight)[base + i] << 16);
                w = u2f((uint32_t)high);
                if (weight_kind == 2) { /* rules/master_weights.py's merge */
                    int32_t bits = (int32_t)((uint32_t)high + (uint32_t)(int32_t)remainder[base + i]);
                    w = u2f((uint32_t)(((bits < 0) != (high < 0)) ? high : bits));
                }
            }
            float g = grad_bf16 ? u2f((uint32_t)((const uint16_t *)grad)[base + i] << 16)
                                : ((const float *)grad)[base + i];
            float mq = m_old[i], vq = v_old[i];
            double w64 = w;
            float decayed = (float)(w64 - decay * w64);
            w = weight_decay != 0.0 ? decayed : w;
            double g64 = g;
            float m_new = (float)(beta1 * (double)mq + one_minus_beta1 * g64);
            float v_new = (float)(beta2 * (double)vq + one_minus_beta2 * g64 * g64);
            float denom = (float)((double)(sqrtf(v_new) / bc2_sqrt) + eps);
            p[i] = w - (step_size * m_new) / denom;
            m[i] = m_new;
            v[i] = v_new;
        }
        for (int i = 0; i < BLOCK; i++) {
            if (weight_kind == 0) {
                ((float *)weight)[base + i] = p[i];
            } else if (weight_kind == 1) {
                ((uint16_t *)weight)[base + i] = to_bf16(p[i]);
            } else if (weight_kind == 2) {
                ((uint16_t *)weight)[base + i] = split(p[i], remainder + base + i);
            } else {
                uint32_t index = (uint32_t)(first_index + base) + (uint32_t)i; /* the counter's low 32 bits */
                ((uint16_t *)weight)[base + i] = stochastic(p[i], index, stream);
            }
        }
        quantize(m, 1, m_codes + base, 0, m_scales + b);
        quantize(v, 0, 0, v_codes + base, v_scales + b);
    }
}

/* update() with its kinds as constants, so that each one compiles to a loop of its own. */
#define UPDATE(kind, bf16)                                                                                    \
    update(first_block, last_block, weight, kind, grad, bf16, m_codes, m_scales, v_codes, v_scales, remainder, \
           seed, step, first_index, hyper, scalars)

void sonar_adamw_8bit(int64_t first_block, int64_t last_block, void *weight, int weight_kind,
                      const void *grad, int grad_bf16, int8_t *m_codes, float *m_scales, uint8_t *v_codes,
                      float *v_scales, int16_t *remainder, const int64_t *seed, const float *step,
                      int64_t first_index, const double *hyper, const float *scalars) {
    switch (weight_kind * 2 + (grad_bf16 != 0)) {
    case 0: UPDATE(0, 0); break;
    case 1: UPDATE(0, 1); break;
    case 2: UPDATE(1, 0); break;
    case 3: UPDATE(1, 1); break;
    case 4: UPDATE(2, 0); break;
    case 5: UPDATE(2, 1); break;
    case 6: UPDATE(3, 0); break;
    default: UPDATE(3, 1); break;
    }
}

/* Exact moments with stochastic rounding (rules/update.py's adamw_update_ with (exp_avg, exp_avg_sq) and a
 * seed): elements [first, last) of a bf16 weight, its gradient (bf16 or fp32), exp_avg and exp_avg_sq (each
 * bf16 or fp32, read as fp32, stored rounded to nearest even), the weight rounded stochastically at the
 * stream of element 0 of the call's tensors (first_index). */
static inline __attribute__((always_inline)) void update_exact(
    int64_t first, int64_t last, uint16_t *weight, const void *grad, const int grad_bf16, void *exp_avg,
    const int m_bf16, void *exp_avg_sq, const int v_bf16, const int64_t *seed, const float *step,
    int64_t first_index, const double *hyper, const float *scalars) {
    const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], weight_decay = hyper[4];
    const double decay = lr * weight_decay, one_minus_beta1 = 1.0 - beta1, one_minus_beta2 = 1.0 - beta2;
    const float step_size = scalars[0], bc2_sqrt = scalars[1];
    const uint32_t stream = hash32(hash32((uint32_t)*seed) ^ (uint32_t)(int64_t)*step);
    for (int64_t i = first; i < last; i++) {
        float w = u2f((uint32_t)weight[i] << 16);
        float g = grad_bf16 ? u2f((uint32_t)((const uint16_t *)grad)[i] << 16) : ((const float *)grad)[i];
        float mq = m_bf16 ? u2f((uint32_t)((const uint16_t *)exp_avg)[i] << 16) : ((const float *)exp_avg)[i];
        float vq = v_bf16 ? u2f((uint32_t)((const uint16_t *)exp_avg_sq)[i] << 16) : ((const float *)exp_avg_sq)[i];
        double w64 = w;
        float decayed = (float)(w64 - decay * w64);
        w = weight_decay != 0.0 ? decayed : w;
        double g64 = g;
        float m_new = (float)(beta1 * (double)mq + one_minus_beta1 * g64);
        float v_new = (float)(beta2 * (double)vq + one_minus_beta2 * g64 * g64);
        float denom = (float)((double)(sqrtf(v_new) / bc2_sqrt) + eps);
        float p = w - (step_size * m_new) / denom;
        if (m_bf16)
            ((uint16_t *)exp_avg)[i] = to_bf16(m_new);
        else
            ((float *)exp_avg)[i] = m_new;
        if (v_bf16)
            ((uint16_t *)exp_avg_sq)[i] = to_bf16(v_new);
        else
            ((float *)exp_avg_sq)[i] = v_new;
        weight[i] = stochastic(p, (uint32_t)first_index + (uint32_t)i, stream);
    }
}

#define UPDATE_EXACT(g, m, v)                                                                                  \
    update_exact(first, last, weight, grad, g, exp_avg, m, exp_avg_sq, v, seed, step, first_index, hyper, scalars)

void sonar_adamw_stochastic(int64_t first, int64_t last, uint16_t *weight, const void *grad, int grad_bf16,
                            void *exp_avg, int m_bf16, void *exp_avg_sq, int v_bf16, const int64_t *seed,
                            const float *step, int64_t first_index, const double *hyper, const float *scalars) {
    switch ((grad_bf16 != 0) * 4 + (m_bf16 != 0) * 2 + (v_bf16 != 0)) {
    case 0: UPDATE_EXACT(0, 0, 0); break;
    case 1: UPDATE_EXACT(0, 0, 1); break;
    case 2: UPDATE_EXACT(0, 1, 0); break;
    case 3: UPDATE_EXACT(0, 1, 1); break;
    case 4: UPDATE_EXACT(1, 0, 0); break;
    case 5: UPDATE_EXACT(1, 0, 1); break;
    case 6: UPDATE_EXACT(1, 1, 0); break;
    default: UPDATE_EXACT(1, 1, 1); break;
    }
}
