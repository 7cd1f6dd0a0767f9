/* AdamW with 8-bit moments on the CPU, one pass over memory: the rule of sonar_kernels/rules/update.py
 * (adamw_update_ with 8-bit moments: dequantize, AdamW in the "fp64" arithmetic of rules/adamw.py,
 * requantize with rules/moments_8bit.py's closed form; the master kinds of rules/master_weights.py) written
 * once more in C, operation for operation, for sonar_kernels/ops/torch_backend/cpu_update.py, which compiles it with the
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
 *
 * With AVX2 (x86-64 with -march=native where the CPU has it) the dequantizer, the arithmetic and the
 * quantizer are written with intrinsics, the same operations in the same order as the portable loops
 * (tests/test_cpu_update.py builds both). Where the time goes (docs/distributed.md, "FSDP2"): the fp64
 * steps' nine conversions between fp32 and fp64 an element, the quantizer's integer steps and its two
 * divisions, the loads and stores; the divider is not the bound.
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

/* The largest magnitude of a block as the largest bit pattern: a magnitude's bits order as its value (an
 * integer maximum vectorizes, a float one does not), and a NaN's lie above every number's (amax's NaN). */
static inline float largest_magnitude(const float *x) {
    uint32_t largest = 0;
    for (int i = 0; i < BLOCK; i++)
        largest = (f2u(x[i]) & 0x7FFFFFFFu) > largest ? (f2u(x[i]) & 0x7FFFFFFFu) : largest;
    return u2f(largest);
}

#ifdef __AVX2__
/* count = 1 + #{r in 0..7: f >= H_r} from the mantissa's top 4 bits j: at most one H_r lies in each of the
 * 16 intervals [1 + j / 16, 1 + (j + 1) / 16), so count = base[j] + (mantissa >= thr[j]), thr[j] that
 * H_r's mantissa (0x800000, above every mantissa, where there is none) and base[j] one more than the number
 * of H_r below the interval: packed as thr | base << 24, 16 entries in two registers. */
#define PACK(base, thr) (int)((uint32_t)(base) << 24 | (uint32_t)(thr))
#define NONE 0x800000u
static inline __m256i quantize_indices(__m256 n, __m256i offset, const __m256i low, const __m256i high) {
    __m256i bits = _mm256_castps_si256(n);
    __m256i e8 = _mm256_slli_epi32(_mm256_srai_epi32(bits, 23), 3); /* 8 * exponent field, arithmetic */
    __m256i mantissa = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF));
    __m256i j = _mm256_srli_epi32(mantissa, 19);
    __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(j, 28)); /* j's bit 3 as the sign: which register */
    __m256i entry = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_permutevar8x32_epi32(low, j)),
                                                         _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(high, j)),
                                                         upper));
    __m256i below = _mm256_cmpgt_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFFFFFF)), mantissa);
    __m256i count = _mm256_add_epi32(_mm256_srli_epi32(entry, 24), below); /* below: -1 where thr > mantissa */
    return _mm256_add_epi32(_mm256_add_epi32(offset, e8), count);
}

/* The block's largest magnitude (largest_magnitude's) in every lane. */
static inline __m256 largest_magnitude_avx2(const float *x) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)x), magnitude);
    __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 8)), magnitude);
    __m256i c = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 16)), magnitude);
    __m256i d = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 24)), magnitude);
    __m256i largest = _mm256_max_epu32(_mm256_max_epu32(a, b), _mm256_max_epu32(c, d));
    largest = _mm256_max_epu32(largest, _mm256_permute2x128_si256(largest, largest, 1));
    largest = _mm256_max_epu32(largest, _mm256_shuffle_epi32(largest, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_castsi256_ps(_mm256_max_epu32(largest, _mm256_shuffle_epi32(largest, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* quantize() of exp_avg (m, signed codes) and exp_avg_sq (v) side by side, 8 lanes of each at a time. */
static inline void quantize_both(const float *m, const float *v, int8_t *m_out, uint8_t *v_out, float *m_scale,
                                 float *v_scale) {
    const __m256i low = _mm256_setr_epi32(PACK(1, 0x05CAE2), PACK(2, NONE), PACK(2, 0x11E6DA), PACK(3, 0x1F1B64),
                                          PACK(4, NONE), PACK(4, 0x2D81E6), PACK(5, NONE), PACK(5, 0x3D360F));
    const __m256i high = _mm256_setr_epi32(PACK(6, NONE), PACK(6, 0x4E5614), PACK(7, NONE), PACK(7, NONE),
                                           PACK(7, 0x6102E3), PACK(8, NONE), PACK(8, 0x756064), PACK(9, NONE));
    const __m256i m_offset = _mm256_set1_epi32(127 - 8 * 127), v_offset = _mm256_set1_epi32(255 - 8 * 127);
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), code_one = _mm256_set1_ps(entry(-126));
    /* scale > 0 (false for a NaN scale too: every n is then 0, as the rule's), the divisor 1 elsewhere */
    const __m256 m_largest = largest_magnitude_avx2(m), v_largest = largest_magnitude_avx2(v);
    const __m256 m_keep = _mm256_cmp_ps(m_largest, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 v_keep = _mm256_cmp_ps(v_largest, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 m_divisor = _mm256_blendv_ps(_mm256_set1_ps(1.0f), m_largest, m_keep);
    const __m256 v_divisor = _mm256_blendv_ps(_mm256_set1_ps(1.0f), v_largest, v_keep);
    __m256i m_index[4], v_index[4];
    for (int k = 0; k < 4; k++) {
        __m256 ms = _mm256_loadu_ps(m + 8 * k), vs = _mm256_loadu_ps(v + 8 * k);
        __m256 m_n = _mm256_and_ps(_mm256_div_ps(_mm256_andnot_ps(sign_bit, ms), m_divisor), m_keep);
        __m256 v_n = _mm256_and_ps(_mm256_div_ps(_mm256_andnot_ps(sign_bit, vs), v_divisor), v_keep);
        __m256i i = quantize_indices(m_n, m_offset, low, high);
        /* below code 1: 1 from 2 ** -16 up, else the comparison of n with T[1] - n. From 2 ** -16 up that
         * comparison holds too (T[1] = 2 ** -16 * E_2 < 2 n: T[1] - n, exact or negative, is below n), so it
         * alone decides; an index of 1 or more is above it, so the larger of the two. */
        __m256i tiny = _mm256_castps_si256(_mm256_cmp_ps(m_n, _mm256_sub_ps(code_one, m_n), _CMP_GT_OQ));
        i = _mm256_max_epi32(i, _mm256_and_si256(tiny, one));
        i = _mm256_min_epi32(i, _mm256_set1_epi32(127));
        __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(ms, _mm256_setzero_ps(), _CMP_LT_OQ));
        m_index[k] = _mm256_sub_epi32(_mm256_xor_si256(i, negative), negative);
        i = quantize_indices(v_n, v_offset, low, high);
        v_index[k] = _mm256_min_epi32(_mm256_max_epi32(i, zero), _mm256_set1_epi32(255));
    }
    /* 32 indices to 32 bytes: the packs interleave 128-bit lanes, the permutation restores the order. */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(m_index[0], m_index[1]),
                                       _mm256_packs_epi32(m_index[2], m_index[3]));
    _mm256_storeu_si256((__m256i *)m_out, _mm256_permutevar8x32_epi32(bytes, order));
    bytes = _mm256_packus_epi16(_mm256_packs_epi32(v_index[0], v_index[1]),
                                _mm256_packs_epi32(v_index[2], v_index[3]));
    _mm256_storeu_si256((__m256i *)v_out, _mm256_permutevar8x32_epi32(bytes, order));
    *m_scale = _mm256_cvtss_f32(m_largest);
    *v_scale = _mm256_cvtss_f32(v_largest);
}
#else
static inline void quantize(const float *x, const int signed_codes, int8_t *m_out, uint8_t *v_out,
                            float *scale_out) {
    const float scale = largest_magnitude(x);
    const int nonzero = scale > 0.0f; /* false for a NaN scale too: every n is then 0, as the rule's */
    const float divisor = nonzero ? scale : 1.0f;
    const int32_t top = signed_codes ? 127 : 255;
    const float code_one = entry(-126); /* exp_avg's T[1] */
    for (int i = 0; i < BLOCK; i++) {
        float quotient = fabsf(x[i]) / divisor; /* branch-free code vectorizes: every lane computes, then selects */
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

static inline void quantize_both(const float *m, const float *v, int8_t *m_out, uint8_t *v_out, float *m_scale,
                                 float *v_scale) {
    quantize(m, 1, m_out, 0, m_scale);
    quantize(v, 0, 0, v_out, v_scale);
}
#endif

/* The update's constants: hyper [5] fp64 (lr, beta1, beta2, eps, weight_decay), scalars [2] fp32
 * (step_size, bc2_sqrt). */
struct adamw {
    double decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
    float step_size, bc2_sqrt;
    int decays; /* weight_decay != 0: the weight decays (else it is kept as it is, -0.0 and NaN included) */
};

static inline struct adamw adamw_of(const double *hyper, const float *scalars) {
    struct adamw a = {hyper[0] * hyper[4], hyper[1], 1.0 - hyper[1], hyper[2], 1.0 - hyper[2], hyper[3],
                      scalars[0], scalars[1], hyper[4] != 0.0};
    return a;
}

#ifdef __AVX2__
/* 4 elements of a bf16 tensor as fp32 bits; of the weight as fp32 (weight_kind as update() takes it); of
 * the gradient. */
static inline __m128i load_bf16(const void *bf16, int64_t at) {
    return _mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)((const uint16_t *)bf16 + at))), 16);
}

static inline __m128 load_weight(const void *weight, const int weight_kind, const int16_t *remainder, int64_t at) {
    if (weight_kind == 0)
        return _mm_loadu_ps((const float *)weight + at);
    __m128i high = load_bf16(weight, at);
    if (weight_kind != 2)
        return _mm_castsi128_ps(high);
    /* rules/master_weights.py's merge: high where adding the remainder changes the sign */
    __m128i bits = _mm_add_epi32(high, _mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(remainder + at))));
    __m128i flipped = _mm_srai_epi32(_mm_xor_si128(bits, high), 31);
    return _mm_castsi128_ps(_mm_blendv_epi8(bits, high, flipped));
}

static inline __m128 load_grad(const void *grad, const int grad_bf16, int64_t at) {
    if (!grad_bf16)
        return _mm_loadu_ps((const float *)grad + at);
    return _mm_castsi128_ps(load_bf16(grad, at));
}
#endif

/* AdamW on one block in the "fp64" arithmetic (the file's first comment), from the weight and gradient as
 * fp32 and the dequantized moments: the new weight (before its rounding to the weight's kind) and moments.
 * With AVX2 the fp64 steps run 4 lanes at a time from 128-bit halves loaded straight into the conversion
 * (no lane extraction), the fp32 steps 8 at a time; the operations and their order are the portable
 * loop's. */
static inline __attribute__((always_inline)) void adamw_block(
    const void *weight, const int weight_kind, const int16_t *remainder, const void *grad, const int grad_bf16,
    int64_t base, const float *m_old, const float *v_old, const struct adamw *a, float *p, float *m, float *v) {
#ifdef __AVX2__
    const __m256d decay = _mm256_set1_pd(a->decay), beta1 = _mm256_set1_pd(a->beta1),
                  one_minus_beta1 = _mm256_set1_pd(a->one_minus_beta1), beta2 = _mm256_set1_pd(a->beta2),
                  one_minus_beta2 = _mm256_set1_pd(a->one_minus_beta2), eps = _mm256_set1_pd(a->eps);
    const __m256 step_size = _mm256_set1_ps(a->step_size), bc2_sqrt = _mm256_set1_ps(a->bc2_sqrt);
    for (int j = 0; j < BLOCK; j += 8) {
        __m128 w_half[2], m_half[2], v_half[2];
        for (int h = 0; h < 2; h++) {
            const int at = j + 4 * h;
            __m128 w32 = load_weight(weight, weight_kind, remainder, base + at);
            __m256d w64 = _mm256_cvtps_pd(w32), g64 = _mm256_cvtps_pd(load_grad(grad, grad_bf16, base + at));
            w_half[h] = a->decays ? _mm256_cvtpd_ps(_mm256_sub_pd(w64, _mm256_mul_pd(decay, w64))) : w32;
            m_half[h] = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(beta1, _mm256_cvtps_pd(_mm_loadu_ps(m_old + at))),
                                                      _mm256_mul_pd(one_minus_beta1, g64)));
            v_half[h] = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(beta2, _mm256_cvtps_pd(_mm_loadu_ps(v_old + at))),
                                                      _mm256_mul_pd(_mm256_mul_pd(one_minus_beta2, g64), g64)));
        }
        __m256 w = _mm256_set_m128(w_half[1], w_half[0]), m_new = _mm256_set_m128(m_half[1], m_half[0]);
        __m256 v_new = _mm256_set_m128(v_half[1], v_half[0]);
        __m256 quotient = _mm256_div_ps(_mm256_sqrt_ps(v_new), bc2_sqrt);
        __m128 denom_low = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(quotient)), eps));
        __m128 denom_high = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(quotient, 1)), eps));
        __m256 denom = _mm256_set_m128(denom_high, denom_low);
        _mm256_storeu_ps(p + j, _mm256_sub_ps(w, _mm256_div_ps(_mm256_mul_ps(step_size, m_new), denom)));
        _mm256_storeu_ps(m + j, m_new);
        _mm256_storeu_ps(v + j, v_new);
    }
#else
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
        float g = grad_bf16 ? u2f((uint32_t)((const uint16_t *)grad)[base + i] << 16) : ((const float *)grad)[base + i];
        double w64 = w;
        float decayed = (float)(w64 - a->decay * w64);
        w = a->decays ? decayed : w;
        double g64 = g;
        float m_new = (float)(a->beta1 * (double)m_old[i] + a->one_minus_beta1 * g64);
        float v_new = (float)(a->beta2 * (double)v_old[i] + a->one_minus_beta2 * g64 * g64);
        float denom = (float)((double)(sqrtf(v_new) / a->bc2_sqrt) + a->eps);
        p[i] = w - (a->step_size * m_new) / denom;
        m[i] = m_new;
        v[i] = v_new;
    }
#endif
}

/* The update of blocks [first_block, last_block). weight_kind: 0 fp32, 1 bf16 (rounded to nearest even),
 * 2 bf16 with an int16 remainder (the fp32 master split), 3 bf16 rounded stochastically (seed, step,
 * first_index: the stream counter of element 0 of the call's tensors). grad_bf16: the gradient is bf16,
 * else fp32. hyper: [5] fp64; scalars: [2] fp32 (step_size, bc2_sqrt). */
static inline __attribute__((always_inline)) void update(
    int64_t first_block, int64_t last_block, void *weight, const int weight_kind, const void *grad,
    const int grad_bf16, int8_t *m_codes, float *m_scales, uint8_t *v_codes, float *v_scales, int16_t *remainder,
    const int64_t *seed, const float *step, int64_t first_index, const double *hyper, const float *scalars) {
    const struct adamw rule = adamw_of(hyper, scalars);
    uint32_t stream = 0;
    if (weight_kind == 3)
        stream = hash32(hash32((uint32_t)*seed) ^ (uint32_t)(int64_t)*step);
    for (int64_t b = first_block; b < last_block; b++) {
        const int64_t base = b * BLOCK;
        float p[BLOCK], m[BLOCK], v[BLOCK];
        float m_old[BLOCK], v_old[BLOCK];
        dequantize(m_codes + base, v_codes + base, m_scales[b], v_scales[b], m_old, v_old);
        adamw_block(weight, weight_kind, remainder, grad, grad_bf16, base, m_old, v_old, &rule, p, m, v);
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
        quantize_both(m, v, m_codes + base, v_codes + base, m_scales + b, v_scales + b);
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
