/* Block-wise symmetric int8 and int4 kernels for transport/codecs.py.
 *
 * transport/_native/__init__.py compiles this file on first use and calls it through
 * ctypes. Every function writes exactly the bytes of the codec's torch path
 * (tests/transport/test_codecs.py checks it), so either path decodes the other's
 * frames identically. One pass per block: absmax, scale, round; single-threaded, and
 * written for the auto-vectoriser (no intrinsics) so one source builds anywhere.
 *
 * Rounding mirrors torch: scale = absmax / qmax in float32, clamped to [floor, ceil];
 * values rint(x * (1 / scale) + zero_point) in the default rounding mode (half to
 * even), saturated as fbgemm's quantize does: NaN and +inf to 127, -inf to -128.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) \
    && !defined(ACTORPIPE_NO_CLONES)
/* One build serves every x86-64 machine: the dynamic loader picks the widest clone
 * the CPU runs. x86-64-v4 (AVX-512 with byte ops) makes int8 stores one instruction. */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

#define CANONICAL_NAN_BITS 0x7fc00000u
#define INF_BITS 0x7f800000u

/* max |x| of a block as float32 bits: for non-negative floats the unsigned bit order
 * is the numeric order, inf included, and any NaN compares above inf. Integer max
 * vectorises without fast-math flags. */
static inline uint32_t absmax_bits(const float *restrict x, int64_t n) {
    uint32_t max_bits = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bits &= 0x7fffffffu;
        max_bits = bits > max_bits ? bits : max_bits;
    }
    return max_bits;
}

static inline float block_scale(uint32_t max_bits, float qmax, float floor_, float ceil_) {
    float scale;
    if (max_bits > INF_BITS) {  /* torch's amax and clamp propagate NaN, canonicalised */
        uint32_t nan_bits = CANONICAL_NAN_BITS;
        memcpy(&scale, &nan_bits, sizeof scale);
        return scale;
    }
    memcpy(&scale, &max_bits, sizeof scale);
    scale /= qmax;
    scale = scale < floor_ ? floor_ : scale;
    return scale > ceil_ ? ceil_ : scale;
}

/* The slow path for a block holding inf or NaN, where values leave int8's range. */
static inline uint8_t saturate(float v) {
    if (v != v || v >= 127.0f) return 127;
    if (v <= -128.0f) return (uint8_t)(int8_t)-128;
    return (uint8_t)(int8_t)(int32_t)rintf(v);
}

static inline int64_t block_length(int64_t numel, int64_t block, int64_t index) {
    int64_t rest = numel - index * block;
    return rest < block ? rest : block;
}

/* values: numel int8 of rint(x / scale), scales: one per block. In a block of finite
 * values |x / scale| <= 127 * (1 + 2**-22), so the fast loop needs no clamp. */
VECTOR_CLONES
void actorpipe_encode_int8(const float *restrict x, int64_t numel, int64_t block, float floor_,
                           float ceil_, int8_t *restrict values, float *restrict scales) {
    int64_t num_blocks = (numel + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; b++) {
        const float *restrict xb = x + b * block;
        int8_t *restrict vb = values + b * block;
        int64_t n = block_length(numel, block, b);
        uint32_t max_bits = absmax_bits(xb, n);
        float scale = block_scale(max_bits, 127.0f, floor_, ceil_);
        float inv = 1.0f / scale;
        scales[b] = scale;
        if (max_bits < INF_BITS) {
            for (int64_t i = 0; i < n; i++) vb[i] = (int8_t)(int32_t)rintf(xb[i] * inv);
        } else {
            for (int64_t i = 0; i < n; i++) vb[i] = (int8_t)saturate(xb[i] * inv);
        }
    }
}

VECTOR_CLONES
void actorpipe_decode_int8(const int8_t *restrict values, const float *restrict scales,
                           int64_t numel, int64_t block, float *restrict out) {
    int64_t num_blocks = (numel + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int8_t *restrict vb = values + b * block;
        float *restrict ob = out + b * block;
        int64_t n = block_length(numel, block, b);
        float scale = scales[b];
        for (int64_t i = 0; i < n; i++) ob[i] = (float)vb[i] * scale;
    }
}

/* The torch path packs a pair of offset values (lo, hi) as the low byte of w | w >> 4,
 * w = lo | hi << 8; for in-range values 1..15 that is lo | hi << 4. */
static inline uint8_t pack_pair(uint8_t lo, uint8_t hi) {
    return (uint8_t)(lo | lo >> 4 | hi << 4);
}

/* packed: (numel + 1) / 2 bytes of nibbles rint(x / scale) + 8, even element low. An
 * odd numel pads one zero element, which quantizes like any other. block is even. */
VECTOR_CLONES
void actorpipe_encode_int4(const float *restrict x, int64_t numel, int64_t block, float floor_,
                           float ceil_, uint8_t *restrict packed, float *restrict scales) {
    int64_t num_blocks = (numel + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; b++) {
        const float *restrict xb = x + b * block;
        uint8_t *restrict pb = packed + b * (block / 2);
        int64_t n = block_length(numel, block, b);
        uint32_t max_bits = absmax_bits(xb, n);
        float scale = block_scale(max_bits, 7.0f, floor_, ceil_);
        float inv = 1.0f / scale;
        int64_t num_pairs = n / 2;
        scales[b] = scale;
        if (max_bits < INF_BITS) {
            for (int64_t j = 0; j < num_pairs; j++) {
                int32_t lo = (int32_t)rintf(xb[2 * j] * inv + 8.0f);
                int32_t hi = (int32_t)rintf(xb[2 * j + 1] * inv + 8.0f);
                pb[j] = (uint8_t)(lo | hi << 4);
            }
        } else {
            for (int64_t j = 0; j < num_pairs; j++) {
                pb[j] = pack_pair(saturate(xb[2 * j] * inv + 8.0f),
                                  saturate(xb[2 * j + 1] * inv + 8.0f));
            }
        }
        if (n % 2) {
            pb[num_pairs] = pack_pair(saturate(xb[n - 1] * inv + 8.0f), saturate(0.0f * inv + 8.0f));
        }
    }
}

VECTOR_CLONES
void actorpipe_decode_int4(const uint8_t *restrict packed, const float *restrict scales,
                           int64_t numel, int64_t block, float *restrict out) {
    int64_t num_blocks = (numel + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *restrict pb = packed + b * (block / 2);
        float *restrict ob = out + b * block;
        int64_t n = block_length(numel, block, b);
        int64_t num_pairs = n / 2;
        float scale = scales[b];
        for (int64_t j = 0; j < num_pairs; j++) {
            ob[2 * j] = (float)((pb[j] & 0x0f) - 8) * scale;
            ob[2 * j + 1] = (float)((pb[j] >> 4) - 8) * scale;
        }
        if (n % 2) ob[n - 1] = (float)((pb[num_pairs] & 0x0f) - 8) * scale;
    }
}
