/* The instructions that bound the CPU's C update (sonar_kernels/ops/torch_backend/cpu_update.c), timed on this machine:
 * nanoseconds per instruction and per lane of 8 independent chains (throughput, not latency), CPU time of
 * this thread. docs/distributed.md ("FSDP2") quotes them.
 *
 *     cc -O3 -mavx2 -o /tmp/cpu_instructions bench/cpu_instructions.c && /tmp/cpu_instructions
 *
 * The operands stay normal numbers (c / x alternates between two values; sqrt converges to 1), since a
 * subnormal operand is far slower on x86; -O3 unrolls the chains into registers (at -O2 they go through
 * memory and time the store-to-load latency). A measurement, not a test. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ROUNDS 20000000L
#define CHAINS 8

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define TIME(name, lanes, body)                                                                               \
    do {                                                                                                      \
        double start = now();                                                                                 \
        for (long i = 0; i < ROUNDS; i++)                                                                     \
            for (int k = 0; k < CHAINS; k++) {                                                                \
                body;                                                                                         \
            }                                                                                                 \
        double ns = (now() - start) / (ROUNDS * (double)CHAINS) * 1e9;                                        \
        printf("%-44s %6.3f ns per instruction, %6.3f ns per lane\n", name, ns, ns / (lanes));              \
    } while (0)

int main(void) {
    volatile float seed_f = 1.5f; /* volatile: no constant folding */
    volatile double seed_d = 1.5;
    __m256 f[CHAINS], c_f = _mm256_set1_ps(seed_f), one_f = _mm256_set1_ps(seed_f / 1.5f);
    __m256d d[CHAINS], one_d = _mm256_set1_pd(seed_d / 1.5);
    for (int k = 0; k < CHAINS; k++) {
        f[k] = _mm256_set1_ps(seed_f + k);
        d[k] = _mm256_set1_pd(seed_d + k);
    }
    TIME("vdivps ymm (fp32 division)", 8, f[k] = _mm256_div_ps(c_f, f[k]));
    TIME("vsqrtps ymm (fp32 square root)", 8, f[k] = _mm256_sqrt_ps(f[k]));
    TIME("vmulps ymm", 8, f[k] = _mm256_mul_ps(f[k], one_f));
    TIME("vmulpd ymm", 4, d[k] = _mm256_mul_pd(d[k], one_d));
    TIME("vcvtpd2ps + vcvtps2pd ymm (fp64 -> fp32 -> fp64)", 4, d[k] = _mm256_cvtps_pd(_mm256_cvtpd_ps(d[k])));
    float sink = 0;
    for (int k = 0; k < CHAINS; k++)
        sink += _mm256_cvtss_f32(f[k]) + (float)_mm256_cvtsd_f64(d[k]);
    printf("(%g)\n", sink);
    return 0;
}
