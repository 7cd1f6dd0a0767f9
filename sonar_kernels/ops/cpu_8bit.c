/* AdamW with 8-bit moments on the CPU, one pass over memory: the rule of sonar_kernels/rules/update.py
 * (adamw_update_ with 8-bit moments: dequantize, AdamW in the "fp64" arithmetic of rules/adamw.py,
 * requantize with rules/moments_8bit.py's closed form; the master kinds of rules/master_weights.py) written
 * once more in C, operation for operation, for sonar_kernels/ops/cpu_8bit.py, which compiles it with the
 * machine's C compiler (no contraction into fused multiply-adds, no unsafe math) and checks it against the
 * rule (tests/test_cpu_8bit.py: bit for bit).
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

/* rules/moments_8bit.py's quantize_blocks on one block: codes and the scale (table: kind's entries). */
static inline void quantize(const float *x, int signed_codes, const float *table, int8_t *m_out,
                            uint8_t *v_out, float *scale_out) {
    float mag[BLOCK];
    float scale = -INFINITY;
    for (int i = 0; i < BLOCK; i++) {
        mag[i] = fabsf(x[i]);
        scale = (mag[i] > scale || mag[i] != mag[i]) ? mag[i] : scale; /* amax propagates a NaN */
    }
    int nonzero = scale > 0.0f;
    float divisor = nonzero ? scale : 1.0f;
    int top = signed_codes ? 127 : 255;
    for (int i = 0; i < BLOCK; i++) {
        float n = nonzero ? mag[i] / divisor : 0.0f;
        uint32_t bits = f2u(n);
        int32_t exponent = ((int32_t)bits >> 23) - 127; /* arithmetic, as torch's int32 shift */
        float mantissa = u2f((bits & 0x7FFFFFu) | 0x3F800000u);
        int32_t count = 1;
        /* fp32(2 ** (r / 8)) for r in 1..7: rules/moments_8bit.py's _EIGHTHS */
        count += mantissa >= 0x1.172b84p+0f;
        count += mantissa >= 0x1.306fe0p+0f;
        count += mantissa >= 0x1.4bfdaep+0f;
        count += mantissa >= 0x1.6a09e6p+0f;
        count += mantissa >= 0x1.8ace54p+0f;
        count += mantissa >= 0x1.ae89fap+0f;
        count += mantissa >= 0x1.d5818ep+0f;
        int32_t above = top + 8 * exponent + count;
        if (signed_codes)
            above = above < 1 ? 1 : (above > 128 ? 128 : above);
        else
            above = above < 0 ? 0 : (above > 256 ? 256 : above);
        int32_t lo = above - 1 < 0 ? 0 : above - 1;
        int32_t hi = above > top ? top : above;
        int32_t index = (n - table[lo] > table[hi] - n) ? hi : lo;
        if (signed_codes)
            m_out[i] = (int8_t)(x[i] < 0.0f ? -index : index);
        else
            v_out[i] = (uint8_t)index;
    }
    *scale_out = scale;
}

/* The update of blocks [first_block, last_block). weight_kind: 0 fp32, 1 bf16 (rounded to nearest even), 2 bf16 with an int16 remainder (the fp32 master
 * split), 3 bf16 rounded stochastically (seed, step, first_index: the stream of element 0 of the call's
 * tensors). grad_bf16: the gradient is bf16, else fp32. hyper: [5] fp64; scalars: [2] fp32 (step_size,
 * bc2_sqrt); tables: [384] fp32 (exp_avg's 128 magnitudes, exp_avg_sq's 256 levels). */
static inline __attribute__((always_inline)) void update(
    int64_t first_block, int64_t last_block, void *weight, const int weight_kind, const void *grad,
    const int grad_bf16, int8_t *m_codes, float *m_scales, uint8_t *v_codes, float *v_scales, int16_t *remainder,
    const int64_t *seed, const float *step, int64_t first_index, const double *hyper, const float *scalars,
    const float *tables) {
    const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], weight_decay = hyper[4];
    const double decay = lr * weight_decay, one_minus_beta1 = 1.0 - beta1, one_minus_beta2 = 1.0 - beta2;
    const float step_size = scalars[0], bc2_sqrt = scalars[1];
    const float *m_table = tables, *v_table = tables + 128;
    uint32_t stream = 0;
    if (weight_kind == 3)
        stream = hash32(hash32((uint32_t)*seed) ^ (uint32_t)(int64_t)*step);
    for (int64_t b = first_block; b < last_block; b++) {
        const int64_t base = b * BLOCK;
        float p[BLOCK], m[BLOCK], v[BLOCK];
        const float m_scale = m_scales[b], v_scale = v_scales[b];
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
            int32_t mk = m_codes[base + i];
            float mq = (mk < 0 ? -m_table[-mk] : m_table[mk]) * m_scale;
            float vq = v_table[v_codes[base + i]] * v_scale;
            if (weight_decay != 0.0) {
                double w64 = w;
                w = (float)(w64 - decay * w64);
            }
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
            } else if (weight_kind == 2) { /* rules/master_weights.py's split */
                int64_t bits = (int32_t)f2u(p[i]);
                int64_t high = (bits + (1 << 15)) >> 16;
                ((uint16_t *)weight)[base + i] = (uint16_t)high;
                remainder[base + i] = (int16_t)(bits - high * 65536);
            } else { /* rules/master_weights.py's stochastic_round */
                uint32_t u = hash32((uint32_t)(first_index + base + i) ^ stream) >> 16;
                int64_t high = ((int64_t)(int32_t)f2u(p[i]) + u) >> 16;
                ((uint16_t *)weight)[base + i] = p[i] != p[i] ? 0x7FC0 : (uint16_t)high;
            }
        }
        quantize(m, 1, m_table, m_codes + base, 0, m_scales + b);
        quantize(v, 0, v_table, 0, v_codes + base, v_scales + b);
    }
}

/* update() with its kinds as constants, so that each one compiles to a loop of its own. */
#define UPDATE(kind, bf16)                                                                                    \
    update(first_block, last_block, weight, kind, grad, bf16, m_codes, m_scales, v_codes, v_scales, remainder, \
           seed, step, first_index, hyper, scalars, tables)

void sonar_adamw_8bit(int64_t first_block, int64_t last_block, void *weight, int weight_kind,
                      const void *grad, int grad_bf16, int8_t *m_codes, float *m_scales, uint8_t *v_codes,
                      float *v_scales, int16_t *remainder, const int64_t *seed, const float *step,
                      int64_t first_index, const double *hyper, const float *scalars, const float *tables) {
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
