/* Block-wise symmetric int8, int4 and float8 (e4m3) kernels for transport/codecs.py.
 *
 * transport/_native/__init__.py compiles this file on first use and calls it through
 * ctypes. The functions write the bytes of the codec's torch path (blocks holding NaN
 * aside, which decode to NaN either way; tests/transport/test_codecs.py checks it).
 * Single-threaded, and written for the auto-vectoriser, so one source builds anywhere;
 * intrinsics appear only for the optional non-temporal stores.
 *
 * Rounding mirrors torch: scale = absmax / qmax in float32, clamped to [floor, ceil];
 * values rint(x * (1 / scale)) in the default rounding mode (half to even). Blocks
 * holding inf or NaN saturate as fbgemm's quantize does (NaN and +inf to 127, -inf to
 * -128), and int4 then clamps to [-7, 7]; int4 adds its offset of 8 after rounding.
 * Build with -ffp-contract=off: a fused x * inv + c would round differently.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_STREAMING_STORES 1
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) \
    && !defined(ACTORPIPE_NO_CLONES)
/* One build serves every x86-64 machine: the dynamic loader picks the widest clone
 * the CPU runs. x86-64-v4 (AVX-512 with byte ops) makes int8 stores one instruction. */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

#define INF_BITS 0x7f800000u
/* Blocks are encoded GROUP at a time: the absmax pass of each, then their scales in one
 * vectorised division, then the rounding pass, which finds the group (16 KiB at the
 * default block) still in L1. ~20% faster than a block at a time, where each block's
 * two dependent scalar divisions stall the pipeline. */
#define GROUP 16
/* Adding 1.5 * 2**23 rounds a float of magnitude < 2**22 to an integer, half to even,
 * which then sits in the low mantissa bits: one add instead of round and convert. */
#define ROUNDER 12582912.0f
#define ROUNDER_BITS 0x4b400000
/* Decoding stages STAGE floats in an L1 buffer when it streams them out. */
#define STAGE 256

static inline int64_t block_length(int64_t numel, int64_t block, int64_t index) {
    int64_t rest = numel - index * block;
    return rest < block ? rest : block;
}

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

/* The absmax bits of `count` blocks from `first`, and their scales (into scales[first..])
 * and inverse scales (into inv[0..]). A NaN absmax gives the canonical quiet NaN. */
static inline void group_scales(const float *restrict x, int64_t numel, int64_t block,
                                int64_t first, int64_t count, float qmax, float floor_,
                                float ceil_, uint32_t *restrict max_bits,
                                float *restrict scales, float *restrict inv) {
    for (int64_t k = 0; k < count; k++) {
        max_bits[k] = absmax_bits(x + (first + k) * block, block_length(numel, block, first + k));
    }
    for (int64_t k = 0; k < count; k++) {
        float scale;
        memcpy(&scale, &max_bits[k], sizeof scale);
        scale /= qmax;
        scale = scale < floor_ ? floor_ : scale;
        scale = scale > ceil_ ? ceil_ : scale;
        scale = max_bits[k] > INF_BITS ? NAN : scale;
        scales[first + k] = scale;
        inv[k] = 1.0f / scale;
    }
}

/* rint(v) for |v| < 2**22. */
static inline int32_t round_small(float v) {
    float shifted = v + ROUNDER;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return bits - ROUNDER_BITS;
}

/* rint(v) saturated to [-128, 127], NaN to 127: values of blocks holding inf or NaN. */
static inline int32_t saturate(float v) {
    if (v != v || v >= 127.0f) return 127;
    if (v <= -128.0f) return -128;
    return (int32_t)rintf(v);
}

/* values: numel int8 of rint(x / scale); scales: one per block. In a block of finite
 * values |x / scale| <= 127 * (1 + 2**-22), so the fast loop needs no clamp. */
VECTOR_CLONES
void actorpipe_encode_int8(const float *restrict x, int64_t numel, int64_t block, float floor_,
                           float ceil_, int8_t *restrict values, float *restrict scales) {
    int64_t num_blocks = (numel + block - 1) / block;
    uint32_t max_bits[GROUP];
    float inv[GROUP];
    for (int64_t first = 0; first < num_blocks; first += GROUP) {
        int64_t count = num_blocks - first < GROUP ? num_blocks - first : GROUP;
        group_scales(x, numel, block, first, count, 127.0f, floor_, ceil_, max_bits, scales, inv);
        for (int64_t k = 0; k < count; k++) {
            const float *restrict xb = x + (first + k) * block;
            int8_t *restrict vb = values + (first + k) * block;
            int64_t n = block_length(numel, block, first + k);
            float scale_inv = inv[k];
            if (max_bits[k] < INF_BITS) {
                for (int64_t i = 0; i < n; i++) vb[i] = (int8_t)round_small(xb[i] * scale_inv);
            } else {
                for (int64_t i = 0; i < n; i++) vb[i] = (int8_t)saturate(xb[i] * scale_inv);
            }
        }
    }
}

/* The int4 nibble of a scaled value from a block holding inf or NaN. */
static inline uint8_t saturate_int4(float v) {
    int32_t q = saturate(v);
    return (uint8_t)((q < -7 ? -7 : q > 7 ? 7 : q) + 8);
}

/* packed: (numel + 1) / 2 bytes of nibbles rint(x / scale) + 8, even element low. An
 * odd numel pads one zero element, which quantizes like any other. block is even. */
VECTOR_CLONES
void actorpipe_encode_int4(const float *restrict x, int64_t numel, int64_t block, float floor_,
                           float ceil_, uint8_t *restrict packed, float *restrict scales) {
    int64_t num_blocks = (numel + block - 1) / block;
    uint32_t max_bits[GROUP];
    float inv[GROUP];
    for (int64_t first = 0; first < num_blocks; first += GROUP) {
        int64_t count = num_blocks - first < GROUP ? num_blocks - first : GROUP;
        group_scales(x, numel, block, first, count, 7.0f, floor_, ceil_, max_bits, scales, inv);
        for (int64_t k = 0; k < count; k++) {
            const float *restrict xb = x + (first + k) * block;
            uint8_t *restrict pb = packed + (first + k) * (block / 2);
            int64_t n = block_length(numel, block, first + k);
            int64_t num_pairs = n / 2;
            float scale_inv = inv[k];
            if (max_bits[k] < INF_BITS) {
                /* The nibbles a stage at a time as bytes, then packed in pairs: two loops the
                 * vectoriser runs at full width (~35% faster on AVX2 than one loop reading
                 * the floats in pairs, and than packing them as 16-bit words). */
                for (int64_t start = 0; start < 2 * num_pairs; start += STAGE) {
                    int64_t m = 2 * num_pairs - start < STAGE ? 2 * num_pairs - start : STAGE;
                    uint8_t nibbles[STAGE] __attribute__((aligned(64)));
                    for (int64_t i = 0; i < m; i++) {
                        nibbles[i] = (uint8_t)(round_small(xb[start + i] * scale_inv) + 8);
                    }
                    for (int64_t j = 0; j < m / 2; j++) {
                        pb[start / 2 + j] = (uint8_t)(nibbles[2 * j] | nibbles[2 * j + 1] << 4);
                    }
                }
            } else {
                for (int64_t j = 0; j < num_pairs; j++) {
                    pb[j] = (uint8_t)(saturate_int4(xb[2 * j] * scale_inv)
                                      | saturate_int4(xb[2 * j + 1] * scale_inv) << 4);
                }
            }
            if (n % 2) {
                pb[num_pairs] = (uint8_t)(saturate_int4(xb[n - 1] * scale_inv)
                                          | saturate_int4(0.0f * scale_inv) << 4);
            }
        }
    }
}

/* The e4m3fn byte of a scaled value (float8_e4m3fn: bias 7, 3 mantissa bits, no inf,
 * S.1111.111 NaN), rounded half to even as torch's CPU cast rounds, which saturates:
 * magnitudes from 448 (the largest finite value) up, inf included, give 448, and NaN gives
 * NaN; below 2**-6 the subnormals, multiples of 2**-9. */
static inline uint8_t to_e4m3(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    uint32_t sign = (bits >> 24) & 0x80u;
    /* Integer min and max order non-negative floats: saturate at 448.0f (a NaN too, which
     * the last line restores), and clamp the exponent the rounding uses at 2**-6, where
     * e4m3's subnormals begin and its step stays 2**-9. */
    int32_t magnitude = (int32_t)(bits & 0x7fffffffu);
    int32_t clamped = magnitude < 0x43e00000 ? magnitude : 0x43e00000;
    int32_t exponent = (clamped > 0x3c800000 ? clamped : 0x3c800000) & 0x7f800000;
    /* The FPU rounds: adding 2**(e + 20) to a value below 2**(e + 1) keeps 23 - 20 = 3 of
     * its mantissa bits, half to even, and leaves the sum's mantissa holding the rounded
     * value in steps of 2**(e - 3): 8..16 for a normal (16 when it rounds up a binade),
     * 0..8 for a subnormal. The sum's exponent bits shifted to bit 3 then give the e4m3
     * exponent once rebiased by 127 + 20 - 6 (the step count adds the leading 1's 8). */
    int32_t magic_bits = exponent + (20 << 23), clamped_bits = clamped;
    float magic, absolute;
    memcpy(&magic, &magic_bits, sizeof magic);
    memcpy(&absolute, &clamped_bits, sizeof absolute);
    float sum = magic + absolute;
    int32_t sum_bits;
    memcpy(&sum_bits, &sum, sizeof sum_bits);
    int32_t byte = (sum_bits >> 20) + (sum_bits & 0x1f) - ((127 + 20 - 6) << 3);
    /* NaN: 0x7f (byte is at most 0x7e, so OR-ing 0x7f gives 0x7f). The masks keep the loop
     * free of branches, which an AVX2 build would otherwise run one value at a time. */
    byte |= -(int32_t)(magnitude > 0x7f800000) & 0x7f;
    return (uint8_t)(sign | (uint32_t)byte);
}

/* values: numel e4m3fn bytes of x / scale, scale = absmax / 448; scales: one per block. */
VECTOR_CLONES
void actorpipe_encode_fp8(const float *restrict x, int64_t numel, int64_t block, float floor_,
                          float ceil_, uint8_t *restrict values, float *restrict scales) {
    int64_t num_blocks = (numel + block - 1) / block;
    uint32_t max_bits[GROUP];
    float inv[GROUP];
    for (int64_t first = 0; first < num_blocks; first += GROUP) {
        int64_t count = num_blocks - first < GROUP ? num_blocks - first : GROUP;
        group_scales(x, numel, block, first, count, 448.0f, floor_, ceil_, max_bits, scales, inv);
        for (int64_t k = 0; k < count; k++) {
            const float *restrict xb = x + (first + k) * block;
            uint8_t *restrict vb = values + (first + k) * block;
            int64_t n = block_length(numel, block, first + k);
            float scale_inv = inv[k];
            for (int64_t i = 0; i < n; i++) vb[i] = to_e4m3(xb[i] * scale_inv);
        }
    }
}

#ifdef HAVE_STREAMING_STORES
/* Copies of n floats with non-temporal stores, one per vector width: writing an output
 * larger than the caches then skips reading each line first. 16-byte stores measured
 * ~20% slower than 64-byte ones on the same CPU, hence the dispatch. */
#define DEFINE_STREAM_COPY(name, isa, width, store, load)                                    \
    __attribute__((target(isa))) static void name(float *restrict dst,                      \
                                                  const float *restrict src, int64_t n) {    \
        int64_t i = 0;                                                                      \
        for (; i < n && ((uintptr_t)(dst + i) & (width * 4 - 1)); i++) dst[i] = src[i];     \
        for (; i + width <= n; i += width) store(dst + i, load(src + i));                   \
        for (; i < n; i++) dst[i] = src[i];                                                 \
    }
DEFINE_STREAM_COPY(stream_copy_avx512, "avx512f", 16, _mm512_stream_ps, _mm512_loadu_ps)
DEFINE_STREAM_COPY(stream_copy_avx, "avx", 8, _mm256_stream_ps, _mm256_loadu_ps)
DEFINE_STREAM_COPY(stream_copy_sse, "sse", 4, _mm_stream_ps, _mm_loadu_ps)
#endif

static inline void store_streaming(float *restrict dst, const float *restrict src, int64_t n) {
#ifdef HAVE_STREAMING_STORES
    if (__builtin_cpu_supports("avx512f")) stream_copy_avx512(dst, src, n);
    else if (__builtin_cpu_supports("avx")) stream_copy_avx(dst, src, n);
    else stream_copy_sse(dst, src, n);
#else
    memcpy(dst, src, (size_t)n * sizeof *dst);
#endif
}

static inline void finish_streaming(void) {
#ifdef HAVE_STREAMING_STORES
    _mm_sfence();  /* order the streamed stores before anything the caller does next */
#endif
}

static inline void dequantize_int8(const int8_t *restrict v, float scale, int64_t n,
                                   float *restrict out) {
    for (int64_t i = 0; i < n; i++) out[i] = (float)v[i] * scale;
}

/* out: numel float32 values * scale. stream: write with non-temporal stores. */
VECTOR_CLONES
void actorpipe_decode_int8(const int8_t *restrict values, const float *restrict scales,
                           int64_t numel, int64_t block, float *restrict out, int32_t stream) {
    int64_t num_blocks = (numel + block - 1) / block;
    float staged[STAGE] __attribute__((aligned(64)));
    for (int64_t b = 0; b < num_blocks; b++) {
        const int8_t *restrict vb = values + b * block;
        float *restrict ob = out + b * block;
        int64_t n = block_length(numel, block, b);
        if (!stream) {
            dequantize_int8(vb, scales[b], n, ob);
            continue;
        }
        for (int64_t start = 0; start < n; start += STAGE) {
            int64_t m = n - start < STAGE ? n - start : STAGE;
            dequantize_int8(vb + start, scales[b], m, staged);
            store_streaming(ob + start, staged, m);
        }
    }
    if (stream) finish_streaming();
}

/* n values from packed pairs; n is even, or the end of the tensor. */
static inline void dequantize_int4(const uint8_t *restrict p, float scale, int64_t n,
                                   float *restrict out) {
    int64_t num_pairs = n / 2;
    for (int64_t start = 0; start < num_pairs; start += STAGE / 2) {
        int64_t m = num_pairs - start < STAGE / 2 ? num_pairs - start : STAGE / 2;
        uint8_t nibbles[STAGE] __attribute__((aligned(64)));
        for (int64_t j = 0; j < m; j++) {
            nibbles[2 * j] = p[start + j] & 0x0f;
            nibbles[2 * j + 1] = p[start + j] >> 4;
        }
        for (int64_t i = 0; i < 2 * m; i++) out[2 * start + i] = (float)(nibbles[i] - 8) * scale;
    }
    if (n % 2) out[n - 1] = (float)((p[num_pairs] & 0x0f) - 8) * scale;
}

/* 2**-8 times the value of an e4m3fn byte, exactly (the codec's torch path reads the byte
 * as that float16 and multiplies by scale * 256, so this does the same, and any frame, a
 * corrupt one's huge scale too, decodes to the same floats); a NaN byte, which only a
 * corrupt frame holds, reads as 480 * 2**-8, as there.
 *
 * Without a branch or a table, so that the loop vectorises: a normal byte's exponent e
 * and mantissa m become a float32's, rebiased by 127 - 7 - 8 = 112. A subnormal (e = 0)
 * is m * 2**-17: built as if its exponent were 1, 2**-14 * (1 + m / 8), then less
 * 2**-14, both exact; every float involved is normal, so a thread that flushes
 * subnormals decodes it the same. */
static inline float from_e4m3_over_256(uint8_t byte) {
    uint32_t b = byte;
    uint32_t sign = (b & 0x80u) << 24;
    uint32_t subnormal = -(uint32_t)((b & 0x78u) == 0);  /* all ones where e = 0 */
    uint32_t bits = ((b & 0x7fu) << 20) + (112u << 23) + (subnormal & (1u << 23));
    float value, less = 0.0f;
    memcpy(&value, &bits, sizeof value);
    uint32_t less_bits = subnormal & 0x38800000u;  /* 2**-14 */
    memcpy(&less, &less_bits, sizeof less);
    value -= less;
    uint32_t out_bits;
    memcpy(&out_bits, &value, sizeof out_bits);
    out_bits |= sign;
    memcpy(&value, &out_bits, sizeof value);
    return value;
}

static inline void dequantize_fp8(const uint8_t *restrict v, float scale, int64_t n, float *restrict out) {
    float scale_256 = scale * 256.0f;
    for (int64_t i = 0; i < n; i++) out[i] = from_e4m3_over_256(v[i]) * scale_256;
}

VECTOR_CLONES
void actorpipe_decode_fp8(const uint8_t *restrict values, const float *restrict scales,
                          int64_t numel, int64_t block, float *restrict out, int32_t stream) {
    int64_t num_blocks = (numel + block - 1) / block;
    float staged[STAGE] __attribute__((aligned(64)));
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *restrict vb = values + b * block;
        float *restrict ob = out + b * block;
        int64_t n = block_length(numel, block, b);
        if (!stream) {
            dequantize_fp8(vb, scales[b], n, ob);
            continue;
        }
        for (int64_t start = 0; start < n; start += STAGE) {
            int64_t m = n - start < STAGE ? n - start : STAGE;
            dequantize_fp8(vb + start, scales[b], m, staged);
            store_streaming(ob + start, staged, m);
        }
    }
    if (stream) finish_streaming();
}

VECTOR_CLONES
void actorpipe_decode_int4(const uint8_t *restrict packed, const float *restrict scales,
                           int64_t numel, int64_t block, float *restrict out, int32_t stream) {
    int64_t num_blocks = (numel + block - 1) / block;
    float staged[STAGE] __attribute__((aligned(64)));
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *restrict pb = packed + b * (block / 2);
        float *restrict ob = out + b * block;
        int64_t n = block_length(numel, block, b);
        if (!stream) {
            dequantize_int4(pb, scales[b], n, ob);
            continue;
        }
        for (int64_t start = 0; start < n; start += STAGE) {  /* STAGE is even */
            int64_t m = n - start < STAGE ? n - start : STAGE;
            dequantize_int4(pb + start / 2, scales[b], m, staged);
            store_streaming(ob + start, staged, m);
        }
    }
    if (stream) finish_streaming();
}
