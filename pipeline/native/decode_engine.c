/* The batch decode engine of the `webdataset` backend: a whole batch made by native threads,
 * with no Python and no GIL between a sample's bytes and its slot in the batch.
 *
 * For each sample, in threads kept from batch to batch (thread_pool.h), each pulling sample
 * numbers from one atomic counter:
 *   read    one pread of the image and its label, at the offsets the shard's .idx gives (or
 *           none, where the caller holds them in memory);
 *   crop    RandomResizedCrop or the val center crop, the arithmetic of pipeline/transforms/crops.py on
 *           the uniforms of the same per-sample seeds, drawn here as numpy draws them
 *           (numpy_random.h; by Python when ColOut needs them too), so a batch does not
 *           depend on the thread count, and every backend crops alike;
 *   decode  only the crop's rows and iMCU columns (jpeg_skip_scanlines, jpeg_crop_scanline,
 *           the rows below never decoded), at the smallest allowed DCT scale M/8 that still
 *           leaves the crop at least `oversample` x the target side; a JPEG with a restart
 *           marker after every MCU (convert_wds.py's) is first cut down to the MCUs under the
 *           crop (jpeg_restarts.h), so the MCUs above and beside it are not even Huffman-decoded,
 *           and those under it are Huffman-decoded segment by segment (jpeg_huffman.h);
 *   resize  to side x side with Pillow's antialiased bilinear filter (separable: across, then down,
 *           through a uint8 intermediate; 14-bit fixed point weights: Pillow's pixels within 1 or 2);
 *   write   flipped and ColOut'ed (kept rows and columns given by Python) as RGB into the
 *           sample's slot of the caller's preallocated (N, H, W, 3) batch: uint8 (for a GPU,
 *           which normalizes after the copy) or float32 already normalized (for a CPU model:
 *           no second pass over the batch).
 * A sample libjpeg refuses (corrupt, truncated, CMYK) gets status -1 and its message; Python
 * then hands it to Pillow. Built and loaded by pipeline/decode/engine.py (ctypes releases the
 * GIL for the call).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <jpeglib.h>
#include <zlib.h>
#include "crc32_fold.h"
#include "jpeg_errors.h"
#include "jpeg_huffman.h"
#include "jpeg_restarts.h"
#include "numpy_random.h"
#include "thread_pool.h"
#ifdef __SSE4_1__
#include <immintrin.h>
#endif

#define COEFFICIENT_BITS 14        /* resampling weights in 16-bit fixed point (Pillow: 22 bits in 32) */
#define STAGES 6                   /* CPU seconds per sample in: read, entry, decode, resize across, resize down, write */
#define MOST_UNIFORMS 64           /* per sample */

typedef struct {
    int count, side, out_rows, out_cols, train, threads, oversample_x100;
    int restarts;                                 /* 1: enter JPEGs with a marker per MCU at the crop */
    unsigned scale_mask;                          /* bit M set: DCT scale M/8 allowed (M = 1..16) */
    double scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, val_crop_ratio;
    const int *fds;
    const unsigned char *const *bases;            /* per sample, the memory holding it, or NULL (or a NULL
                                                     array): read from its fd; offsets count from there */
    const long long *image_at, *image_size, *label_at;
    const unsigned *checksums;                    /* per sample, the CRC-32 of its image then label bytes as
                                                     the converter recorded it, or NULL: unchecked */
    const double *uniforms;                       /* count x uniforms_per_sample, or NULL: drawn here */
    int uniforms_per_sample;
    const long long *sample_ids;                  /* what the uniforms are drawn from, with: */
    long long seed, epoch;
    const int *keep_rows, *keep_cols;             /* count x out_rows, count x out_cols; NULL: all */
    unsigned char *out;                           /* count x out_rows x out_cols x 3, or NULL and: */
    float *out_float;                             /* the same, normalized: pixel * scale[c] + offset[c] */
    float scale[3], offset[3];
    int *labels, *status, *scale_used;
    char *messages;                               /* count x message_size */
    int message_size;
    double *stage_seconds;                        /* count x STAGES */
    int next;                                     /* the next sample to take (atomic) */
    int entropy_only;                             /* 1: only Huffman-decode the crop's MCUs into coefficients (no
                                                     IDCT, colour, resize or write): the floor a decode of that
                                                     crop cannot go below (benchmarks/loaders.py's decode_floor) */
} batch_job;

typedef struct {                                  /* resampling weights along one axis */
    int *bounds, taps;
    short *coefficients;
    int *lanes;                                   /* AVX2: per output pair and tap pair, the 8 ints of a register */
    size_t bounds_size, coefficients_size, lanes_size;
} axis_weights;

typedef struct {                                  /* one thread's decoder and growing buffers */
    struct jpeg_decompress_struct info;
    error_manager errors;
    char spare_message[JMSG_LENGTH_MAX];
    unsigned char *bytes, *region, *rows, *resized, *rgb;   /* rgb: one output row before normalizing */
    JSAMPROW *row_pointers;                                  /* into region */
    float *row_scale, *row_offset;                  /* the normalization constants along a row */
    size_t bytes_size, region_size, rows_size, resized_size, row_pointers_size, row_values_size;
    double uniforms[MOST_UNIFORMS];
    restart_index restarts;
    segment_decoder segments;                     /* decodes the MCUs of a JPEG with a restart index */
    unsigned char *cut;                           /* the JPEG of the crop's MCUs (jpeg_restarts.h) */
    size_t cut_size;
    axis_weights across, down;
    int damaged;                                  /* the sample failed its checksum: no other decoder tries it */
    int *made, made_count, made_size;             /* the samples of this batch this thread made */
} worker;

/* Stages are timed on the wall clock (tens of ns), then scaled to the thread's CPU time over the
 * batch (cpu_share): its own CPU clock is a system call, near 1 µs, 8 times a sample. */
static double clock_seconds(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double now(void) { return clock_seconds(CLOCK_MONOTONIC); }

static void *grow(void *buffer, size_t *size, size_t needed, error_manager *errors) {
    if (needed <= *size) return buffer;
    void *bigger = realloc(buffer, needed);
    if (!bigger) refuse(errors, "out of memory (%zu bytes)", needed);
    *size = needed;
    return bigger;
}

/* Sample `index`'s uniforms (train only): Python's when it drew them, else drawn into `buffer`
 * exactly as pipeline.transforms.crops.sample_uniforms draws them. */
static const double *sample_uniforms(const batch_job *job, int index, double buffer[MOST_UNIFORMS]) {
    if (!job->train) return NULL;
    if (job->uniforms) return job->uniforms + (long)index * job->uniforms_per_sample;
    numpy_uniforms(sample_seed(job->seed, job->epoch, job->sample_ids[index]), buffer, job->uniforms_per_sample);
    return buffer;
}

/* pipeline/transforms/crops.py's random_resized_crop and center_crop, operation for operation: Python's
 * round() and nearbyint() both round half to even, int() and a C cast both truncate. */
static void crop_box(const batch_job *job, const double *u, int height, int width, int box[4], int *flip) {
    *flip = 0;
    if (!job->train) {
        int side = (int)(job->val_crop_ratio * (double)(height < width ? height : width));
        if (side < 1) side = 1;
        box[0] = (height - side) / 2; box[1] = (width - side) / 2; box[2] = side; box[3] = side;
        return;
    }
    *flip = u[job->uniforms_per_sample - 1] < 0.5;
    double area = (double)height * (double)width;
    for (int attempt = 0; attempt < 10; attempt++, u += 4) {
        double target_area = area * (job->scale_lo + (job->scale_hi - job->scale_lo) * u[0]);
        double aspect = exp(job->log_ratio_lo + (job->log_ratio_hi - job->log_ratio_lo) * u[1]);
        int crop_width = (int)nearbyint(sqrt(target_area * aspect));
        int crop_height = (int)nearbyint(sqrt(target_area / aspect));
        if (0 < crop_width && crop_width <= width && 0 < crop_height && crop_height <= height) {
            box[0] = (int)(u[2] * (double)(height - crop_height + 1));
            box[1] = (int)(u[3] * (double)(width - crop_width + 1));
            box[2] = crop_height; box[3] = crop_width;
            return;
        }
    }
    double in_ratio = (double)width / (double)height;
    double ratio_lo = exp(job->log_ratio_lo), ratio_hi = exp(job->log_ratio_hi);
    int crop_width = width, crop_height = height;
    if (in_ratio < ratio_lo) crop_height = (int)nearbyint((double)width / ratio_lo);
    else if (in_ratio > ratio_hi) crop_width = (int)nearbyint((double)height * ratio_hi);
    box[0] = (height - crop_height) / 2; box[1] = (width - crop_width) / 2; box[2] = crop_height; box[3] = crop_width;
}

/* The smallest allowed M (DCT scale M/8) that leaves the crop's shorter side at least
 * oversample x side; full size (8) when none does. */
static int pick_scale(const batch_job *job, int crop_height, int crop_width) {
    int shorter = crop_height < crop_width ? crop_height : crop_width;
    for (int m = 1; m <= 8; m++)
        if ((job->scale_mask >> m & 1u) && (long)shorter * m * 100 >= (long)job->oversample_x100 * job->side * 8)
            return m;
    return 8;
}

/* Pillow's bilinear resampling weights for `out_size` outputs from the input span [in0, in1)
 * of an axis of `in_size` pixels: bounds[x] the first input of output x; `taps` coefficients
 * per output (the most any output has, rounded up to an even number; zero past an output's
 * own), in COEFFICIENT_BITS fixed point. */
static void resample_weights(axis_weights *axis, error_manager *errors, double in0, double in1, int in_size,
                             int out_size) {
    double scale = (in1 - in0) / out_size;
    double filter_scale = scale < 1.0 ? 1.0 : scale;
    double support = filter_scale;                 /* the triangle filter's support is 1 */
    int most = (int)ceil(support) * 2 + 2;         /* Pillow's window, which no output's reach exceeds */
    axis->bounds = grow(axis->bounds, &axis->bounds_size, sizeof(int) * 2 * out_size, errors);
    int *counts = axis->bounds + out_size, taps = 2;
    for (int x = 0; x < out_size; x++) {
        double center = in0 + (x + 0.5) * scale;
        int first = (int)(center - support + 0.5), last = (int)(center + support + 0.5);
        if (first < 0) first = 0;
        if (last > in_size) last = in_size;
        axis->bounds[x] = first;
        counts[x] = last - first;
        if (counts[x] > taps) taps = counts[x];
    }
    taps = (taps + 1) & ~1;                        /* two taps a multiply-add */
    axis->coefficients = grow(axis->coefficients, &axis->coefficients_size, sizeof(short) * taps * out_size, errors);
    axis->taps = taps;
    double weights[most];
    for (int x = 0; x < out_size; x++) {
        double center = in0 + (x + 0.5) * scale, total = 0.0;
        int first = axis->bounds[x], n = counts[x];
        for (int k = 0; k < n; k++) {
            double w = 1.0 - fabs((k + first - center + 0.5) / filter_scale);
            weights[k] = w > 0.0 ? w : 0.0;
            total += weights[k];
        }
        short *c = axis->coefficients + (long)x * taps;
        for (int k = 0; k < taps; k++)
            c[k] = (short)(k < n && total != 0.0 ? weights[k] / total * (1 << COEFFICIENT_BITS) + 0.5 : 0);
    }
}

static inline unsigned char clip8(int value) {
    value >>= COEFFICIENT_BITS;
    return value < 0 ? 0 : value > 255 ? 255 : (unsigned char)value;
}

/* The across axis's weights laid out as resize_row's AVX2 loop reads them: for outputs x and x+1
 * and taps k and k+1, the pair (c_k c_k+1) of output x four times, then that of x+1 four times. */
static void lane_weights(axis_weights *axis, int side, error_manager *errors) {
#ifdef __AVX2__
    int taps = axis->taps;
    axis->lanes = grow(axis->lanes, &axis->lanes_size, sizeof(int) * 8 * (size_t)(side / 2) * (taps / 2), errors);
    int *to = axis->lanes;
    for (int x = 0; x + 2 <= side; x += 2)
        for (int k = 0; k < taps; k += 2)
            for (int output = x; output < x + 2; output++) {
                int pair;
                memcpy(&pair, axis->coefficients + (long)output * taps + k, 4);
                for (int copy = 0; copy < 4; copy++) *to++ = pair;
            }
#else
    (void)axis; (void)side; (void)errors;
#endif
}

#ifdef __AVX2__
/* Outputs p's and q's RGBX sums (one per 128-bit lane, shifted down) over `taps` pixels from
 * each: four pixels a load, whose bytes r0 g0 b0 x0 .. r3 g3 b3 x3 become the 16-bit pairs
 * (r0 r1) (g0 g1) (b0 b1) (x0 x1), then (r2 r3) .., each weighed with its (c_k c_k+1) by one
 * multiply-add. Inlined with `taps` a constant, so that the loop over taps unrolls. */
static inline __attribute__((always_inline)) __m256i two_outputs(const unsigned char *p, const unsigned char *q,
                                                                  const __m256i *weights, int taps) {
    const __m256i pairs_low = _mm256_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1,
                                               0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1);
    const __m256i pairs_high = _mm256_setr_epi8(8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1,
                                                8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1);
    __m256i sum = _mm256_set1_epi32(1 << (COEFFICIENT_BITS - 1));
    int k = 0;
    for (; k + 4 <= taps; k += 4) {
        __m256i pixels = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 4 * k))),
                                                 _mm_loadu_si128((const __m128i *)(q + 4 * k)), 1);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, pairs_low), _mm256_loadu_si256(weights + k / 2)));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, pairs_high),
                                                      _mm256_loadu_si256(weights + k / 2 + 1)));
    }
    if (k < taps) {                                /* the last two taps */
        __m256i pixels = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(p + 4 * k))),
                                                 _mm_loadl_epi64((const __m128i *)(q + 4 * k)), 1);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, pairs_low), _mm256_loadu_si256(weights + k / 2)));
    }
    return _mm256_srai_epi32(sum, COEFFICIENT_BITS);
}

/* Outputs x .. x+3 of a row a step, while four remain; returns the first output not made. */
static inline __attribute__((always_inline)) int resize_row_simd(const unsigned char *in, unsigned char *out,
                                                                  const axis_weights *axis, int side, int taps) {
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i *weights = (const __m256i *)axis->lanes;
    const int *bounds = axis->bounds;
    int x = 0;
    for (; x + 4 <= side; x += 4, weights += taps) {
        __m256i first = two_outputs(in + (size_t)bounds[x] * 4, in + (size_t)bounds[x + 1] * 4, weights, taps);
        __m256i second = two_outputs(in + (size_t)bounds[x + 2] * 4, in + (size_t)bounds[x + 3] * 4, weights + taps / 2, taps);
        /* lanes: (x, x+2) then (x+1, x+3), each pixel's 4 bytes repeated; gathered into x .. x+3 */
        __m256i words = _mm256_packs_epi32(first, second);
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, words), in_order);
        _mm_storeu_si128((__m128i *)(out + 4 * x), _mm256_castsi256_si128(bytes));
    }
    return x;
}
#endif

/* One RGBX row resized across: out[x] from in[bounds[x] ...] (reads up to `taps` pixels from
 * each first one: the rows are padded so that this stays inside the buffer). The SIMD and the
 * plain code compute the same integers. */
static void resize_row(const unsigned char *in, unsigned char *out, const axis_weights *axis, int side) {
    int x = 0, taps = axis->taps;
#ifdef __AVX2__
    switch (taps) {                /* the common widths with the loop over taps unrolled, which cost as much as the sums */
    case 2: x = resize_row_simd(in, out, axis, side, 2); break;
    case 4: x = resize_row_simd(in, out, axis, side, 4); break;
    case 6: x = resize_row_simd(in, out, axis, side, 6); break;
    case 8: x = resize_row_simd(in, out, axis, side, 8); break;
    default: x = resize_row_simd(in, out, axis, side, taps);
    }
#endif
    for (; x < side; x++) {
        const unsigned char *p = in + (size_t)axis->bounds[x] * 4;
        const short *c = axis->coefficients + (long)x * taps;
        int sum[4] = {1 << (COEFFICIENT_BITS - 1), 1 << (COEFFICIENT_BITS - 1), 1 << (COEFFICIENT_BITS - 1),
                      1 << (COEFFICIENT_BITS - 1)};
        for (int k = 0; k < taps; k++, p += 4)
            for (int channel = 0; channel < 4; channel++) sum[channel] += p[channel] * c[k];
        for (int channel = 0; channel < 4; channel++) out[4 * x + channel] = clip8(sum[channel]);
    }
}

/* One output row from `taps` consecutive rows of `length` bytes, weighed by `c`: the bytes of
 * rows k and k+1 interleaved into 16-bit pairs, weighed with (c_k c_k+1) by one multiply-add. */
static void resize_column(const unsigned char *rows, size_t stride, const short *c, int taps, int length,
                          unsigned char *out) {
    int x = 0;
#ifdef __AVX2__
    /* 32 bytes a step; the unpacks and packs stay within 128-bit lanes, so the bytes come out in order */
    const __m256i zero = _mm256_setzero_si256();
    for (; x + 32 <= length; x += 32) {
        __m256i s0 = _mm256_set1_epi32(1 << (COEFFICIENT_BITS - 1)), s1 = s0, s2 = s0, s3 = s0;
        for (int k = 0; k < taps; k += 2) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(rows + k * stride + x));
            __m256i b = _mm256_loadu_si256((const __m256i *)(rows + (k + 1) * stride + x));
            int w;
            memcpy(&w, c + k, 4);
            __m256i weights = _mm256_set1_epi32(w);
            __m256i low = _mm256_unpacklo_epi8(a, b), high = _mm256_unpackhi_epi8(a, b);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(low, zero), weights));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(low, zero), weights));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(high, zero), weights));
            s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(high, zero), weights));
        }
        __m256i first = _mm256_packs_epi32(_mm256_srai_epi32(s0, COEFFICIENT_BITS), _mm256_srai_epi32(s1, COEFFICIENT_BITS));
        __m256i second = _mm256_packs_epi32(_mm256_srai_epi32(s2, COEFFICIENT_BITS), _mm256_srai_epi32(s3, COEFFICIENT_BITS));
        _mm256_storeu_si256((__m256i *)(out + x), _mm256_packus_epi16(first, second));
    }
#endif
#ifdef __SSE4_1__
    for (; x + 8 <= length; x += 8) {
        __m128i low = _mm_set1_epi32(1 << (COEFFICIENT_BITS - 1)), high = low;
        for (int k = 0; k < taps; k += 2) {
            __m128i a = _mm_loadl_epi64((const __m128i *)(rows + k * stride + x));
            __m128i b = _mm_loadl_epi64((const __m128i *)(rows + (k + 1) * stride + x));
            __m128i both = _mm_unpacklo_epi8(a, b);
            int w;
            memcpy(&w, c + k, 4);
            __m128i weights = _mm_set1_epi32(w);
            low = _mm_add_epi32(low, _mm_madd_epi16(_mm_cvtepu8_epi16(both), weights));
            high = _mm_add_epi32(high, _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(both, 8)), weights));
        }
        __m128i words = _mm_packs_epi32(_mm_srai_epi32(low, COEFFICIENT_BITS), _mm_srai_epi32(high, COEFFICIENT_BITS));
        _mm_storel_epi64((__m128i *)(out + x), _mm_packus_epi16(words, words));
    }
#endif
    for (; x < length; x++) {
        int sum = 1 << (COEFFICIENT_BITS - 1);
        for (int k = 0; k < taps; k++) sum += rows[k * stride + x] * c[k];
        out[x] = clip8(sum);
    }
}

/* `count` RGBX pixels as RGB, in reverse order when `flip`. */
static void rgbx_to_rgb(const unsigned char *in, unsigned char *out, int count, int flip) {
    int x = 0;
#ifdef __AVX2__
    /* 8 pixels a step: each lane's 4 pixels to 12 bytes, the lanes then joined into 24 */
    const __m256i drop_x = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                            0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7), reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    for (; x + 8 <= count; x += 8) {
        __m256i pixels = _mm256_loadu_si256((const __m256i *)(in + 4 * (flip ? count - 8 - x : x)));
        if (flip) pixels = _mm256_permutevar8x32_epi32(pixels, reverse);
        __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(pixels, drop_x), join);
        _mm_storeu_si128((__m128i *)(out + 3 * x), _mm256_castsi256_si128(packed));
        _mm_storel_epi64((__m128i *)(out + 3 * x + 16), _mm256_extracti128_si256(packed, 1));
    }
#endif
    for (; x < count; x++) {
        const unsigned char *p = in + 4 * (flip ? count - 1 - x : x);
        out[3 * x] = p[0]; out[3 * x + 1] = p[1]; out[3 * x + 2] = p[2];
    }
}

/* out[k] = in[k] * scale[k] + offset[k] for `count` values. Where out is 32-byte aligned,
 * written past the cache: a batch is far larger than the cache, and a store that first reads
 * the line it fills would double the memory traffic of the largest stage at high resolution. */
static void normalize_row(const unsigned char *in, float *out, const float *scale, const float *offset, int count) {
    int k = 0;
#ifdef __AVX2__
    if (((size_t)out & 31) == 0) {
        for (; k + 8 <= count; k += 8) {
            __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + k))));
            _mm256_stream_ps(out + k, _mm256_add_ps(_mm256_mul_ps(values, _mm256_loadu_ps(scale + k)),
                                                    _mm256_loadu_ps(offset + k)));
        }
    }
#endif
    for (; k < count; k++) out[k] = in[k] * scale[k] + offset[k];
}

/* The region's box [x0, x1) x [y0, y1) resized to side x side, flipped and ColOut'ed into the
 * sample's slot of the batch (uint8, or float32 normalized), each pass's CPU seconds added to
 * `seconds` (across, down, write). Across first, then down, through a uint8 intermediate, as
 * Pillow does. */
static void resize_into(worker *self, const batch_job *job, int index, const unsigned char *region,
                        int region_width, int region_rows, double x0, double y0, double x1, double y1, int flip,
                        double seconds[3]) {
    double started = now();
    int side = job->side;
    axis_weights *across = &self->across, *down = &self->down;
    resample_weights(down, &self->errors, y0, y1, region_rows, side);
    resample_weights(across, &self->errors, x0, x1, region_width, side);
    lane_weights(across, side, &self->errors);
    /* Only the region rows the vertical pass reads are resized across; the last output's taps
     * may reach past them (with zero weight), so a few rows more are kept. */
    int row_first = down->bounds[0], row_last = down->bounds[side - 1] + down->taps;
    size_t stride = (size_t)side * 4;
    self->rows = grow(self->rows, &self->rows_size, (size_t)(row_last - row_first) * stride, &self->errors);
    self->resized = grow(self->resized, &self->resized_size, (size_t)job->out_rows * stride, &self->errors);
    unsigned char *rows = self->rows;
    for (int y = row_first; y < row_last; y++) {
        if (y < region_rows) resize_row(region + (size_t)y * region_width * 4, rows + (size_t)(y - row_first) * stride,
                                        across, side);
        else memset(rows + (size_t)(y - row_first) * stride, 0, stride);
    }
    double across_done = now();
    seconds[0] = across_done - started;
    const int *keep_rows = job->keep_rows ? job->keep_rows + (long)index * job->out_rows : NULL;
    const int *keep_cols = job->keep_cols ? job->keep_cols + (long)index * job->out_cols : NULL;
    for (int r = 0; r < job->out_rows; r++) {
        int y = keep_rows ? keep_rows[r] : r;
        resize_column(rows + (size_t)(down->bounds[y] - row_first) * stride, stride,
                      down->coefficients + (long)y * down->taps, down->taps, side * 4, self->resized + r * stride);
    }
    double down_done = now();
    seconds[1] = down_done - across_done;
    for (int r = 0; r < job->out_rows; r++) {
        const unsigned char *line = self->resized + r * stride;
        size_t at = ((size_t)index * job->out_rows + r) * job->out_cols * 3;
        unsigned char *to = job->out_float ? self->rgb : job->out + at;
        if (!keep_cols) {
            rgbx_to_rgb(line, to, side, flip);
        } else {
            for (int col = 0; col < job->out_cols; col++) {
                int x = flip ? side - 1 - keep_cols[col] : keep_cols[col];
                for (int channel = 0; channel < 3; channel++) to[3 * col + channel] = line[4 * x + channel];
            }
        }
        if (job->out_float)                   /* normalized, against constants tiled along the row */
            normalize_row(to, job->out_float + at, self->row_scale, self->row_offset, 3 * job->out_cols);
    }
#ifdef __AVX2__
    _mm_sfence();                             /* the streamed stores are seen before the batch is handed on */
#endif
    seconds[2] = now() - down_done;
}

/* The bytes from the sample's first (image or label) to its last, read from its file, or where
   they already lie in memory; *image_offset is the image's place in them. */
static const unsigned char *read_sample(worker *self, const batch_job *job, int i, long long *image_offset) {
    long long first = job->image_at[i] < job->label_at[i] ? job->image_at[i] : job->label_at[i];
    long long end = job->image_at[i] + job->image_size[i];
    if (job->label_at[i] + 4 > end) end = job->label_at[i] + 4;
    size_t length = (size_t)(end - first);
    const unsigned char *bytes;
    if (job->bases && job->bases[i]) {
        bytes = job->bases[i] + first;
    } else {
        self->bytes = grow(self->bytes, &self->bytes_size, length, &self->errors);
        for (size_t done = 0; done < length;) {
            ssize_t got = pread(job->fds[i], self->bytes + done, length - done, (off_t)(first + done));
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) refuse(&self->errors, "cannot read %zu bytes at offset %lld (%s)", length, first,
                                 got < 0 ? strerror(errno) : "end of file");
            done += (size_t)got;
        }
        bytes = self->bytes;
    }
    const unsigned char *label = bytes + (job->label_at[i] - first);
    *image_offset = job->image_at[i] - first;
    if (job->checksums) {                 /* before anything is taken from the bytes */
        uint32_t crc = crc32_fold(crc32_fold(0, bytes + *image_offset, (size_t)job->image_size[i]), label, 4);
        if ((unsigned)crc != job->checksums[i]) {
            self->damaged = 1;
            refuse(&self->errors, "its bytes fail the checksum recorded at conversion (CRC-32 %08x, recorded %08x)",
                   (unsigned)crc, job->checksums[i]);
        }
    }
    job->labels[i] = (int)((unsigned)label[0] | (unsigned)label[1] << 8 | (unsigned)label[2] << 16 |
                           (unsigned)label[3] << 24);
    return bytes;
}

static void read_header(worker *self, const unsigned char *jpeg, size_t size) {
    jpeg_mem_src(&self->info, jpeg, (unsigned long)size);
    jpeg_read_header(&self->info, TRUE);
    if (self->info.jpeg_color_space == JCS_CMYK || self->info.jpeg_color_space == JCS_YCCK)
        refuse(&self->errors, "CMYK JPEG (not decoded here)");
}

/* The headers of restart_cut's JPEG of `jpeg`'s MCUs `mcus` read (with its segments or not). */
static void read_cut(worker *self, const unsigned char *jpeg, mcu_rect mcus, int segments) {
    size_t cut_size = restart_cut(&self->restarts, jpeg, mcus, segments, &self->cut, &self->cut_size);
    if (!cut_size) refuse(&self->errors, "out of memory (the crop's MCUs)");
    read_header(self, self->cut, cut_size);
}

/* The decode started at DCT scale m/8, into RGBX rows. */
static void start_output(struct jpeg_decompress_struct *info, int m) {
    info->out_color_space = JCS_EXT_RGBX;
    info->scale_num = (unsigned)m;
    info->scale_denom = 8;
    jpeg_start_decompress(info);
}

/* Every MCU of the scan into coefficients, and nothing more: the entropy decoding that a decode
 * of the same crop cannot avoid (benchmarks/loaders.py's decode_floor). */
static void decode_all_mcus(worker *self, struct jpeg_decompress_struct *info, int segmented) {
    JBLOCK blocks[C_MAX_BLOCKS_IN_MCU];
    JBLOCKROW pointers[C_MAX_BLOCKS_IN_MCU];
    for (int b = 0; b < C_MAX_BLOCKS_IN_MCU; b++) pointers[b] = &blocks[b];
    /* one component: an MCU is one block, so a row of MCUs is a row of blocks */
    int rows = info->comps_in_scan == 1 ? (int)info->cur_comp_info[0]->height_in_blocks : (int)info->total_iMCU_rows;
    for (int row = 0; row < rows; row++)
        for (int column = 0; column < (int)info->MCUs_per_row; column++) {
            memset(blocks, 0, sizeof(JBLOCK) * info->blocks_in_MCU);   /* as libjpeg's coefficient controller does */
            if (segmented)
                segments_decode(&self->segments, info->blocks_in_MCU, info->MCU_membership, row, column, pointers);
            else (*info->entropy->decode_mcu)(info, pointers);
        }
}

static void make_sample(worker *self, batch_job *job, int i) {
    struct jpeg_decompress_struct *info = &self->info;
    double *seconds = job->stage_seconds + (long)i * STAGES, started = now();
    long long image_offset;
    const unsigned char *sample = read_sample(self, job, i, &image_offset);
    double read_done = now();
    seconds[0] = read_done - started;
    const unsigned char *jpeg = sample + image_offset;
    size_t jpeg_size = (size_t)job->image_size[i];
    int indexed = job->restarts && restart_index_build(&self->restarts, jpeg, jpeg_size);
    int width, height;
    if (indexed) {
        width = self->restarts.width;
        height = self->restarts.height;
    } else {
        read_header(self, jpeg, jpeg_size);
        width = (int)info->image_width;
        height = (int)info->image_height;
    }
    int box[4], flip;
    crop_box(job, sample_uniforms(job, i, self->uniforms), height, width, box, &flip);
    int m = pick_scale(job, box[2], box[3]);
    job->scale_used[i] = m;
    /* libjpeg's output size at scale m/8 (jdiv_round_up in jpeg_core_output_dimensions) */
    int scaled_width = (width * m + 7) / 8, scaled_height = (height * m + 7) / 8;
    double x_scale = (double)scaled_width / width, y_scale = (double)scaled_height / height;
    double x0 = box[1] * x_scale, y0 = box[0] * y_scale;
    double x1 = (box[1] + box[3]) * x_scale, y1 = (box[0] + box[2]) * y_scale;
    /* The filter reads up to (shrink factor) pixels beyond the box; one more, since libjpeg
     * upsamples chroma at a region's edge columns as at the image's. */
    double span = (x1 - x0) > (y1 - y0) ? (x1 - x0) : (y1 - y0);
    int margin = (int)ceil(span / job->side) + 2;
    int row0 = (int)floor(y0) - margin, row1 = (int)ceil(y1) + margin;
    int col0 = (int)floor(x0) - margin, col1 = (int)ceil(x1) + margin;
    if (row0 < 0) row0 = 0;
    if (col0 < 0) col0 = 0;
    if (row1 > scaled_height) row1 = scaled_height;
    if (col1 > scaled_width) col1 = scaled_width;
    /* the index's MCUs decoded: all of them, or those cut out below */
    mcu_rect mcus = {0, indexed ? self->restarts.mcus_down : 0, 0, indexed ? self->restarts.mcus_across : 0};
    int cut = 0;
    if (indexed && (row1 - row0) * (col1 - col0) < scaled_height * scaled_width) {
        /* Only the MCUs under rows [row0, row1) and columns [col0, col1), cut out as a JPEG
         * of their own (coordinates move with its corner). Pixels at a cut edge differ from the
         * whole image's (chroma upsampling reads 1 pixel across an MCU edge), but the margin
         * above keeps what the filter reads 2 pixels inside the region, as for
         * jpeg_crop_scanline's edges. */
        const restart_index *index = &self->restarts;
        int mcu_rows = index->mcu_height * m / 8, mcu_cols = index->mcu_width * m / 8;
        mcus = restart_cover(index, mcu_rows, mcu_cols, row0, row1, col0, col1);
        cut = 1;
        read_cut(self, jpeg, mcus, 0);            /* headers alone: its MCUs are read from `jpeg` */
        int dy = mcus.top * mcu_rows, dx = mcus.left * mcu_cols;
        y0 -= dy; y1 -= dy; row0 -= dy; row1 -= dy;
        x0 -= dx; x1 -= dx; col0 -= dx; col1 -= dx;
    } else if (indexed) {
        read_header(self, jpeg, jpeg_size);    /* the crop needs (nearly) every MCU: decoded whole */
    }
    double entry_done = now();
    seconds[1] = entry_done - read_done;
    if (job->entropy_only && !indexed) {       /* every MCU of a JPEG without markers */
        jpeg_read_coefficients(info);
        jpeg_abort_decompress(info);
        seconds[2] = now() - entry_done;
        return;
    }
    start_output(info, m);
    int segmented = indexed && segments_take_over(&self->segments, info, &self->restarts, jpeg, jpeg + jpeg_size, mcus);
    if (cut && !segmented) {                   /* libjpeg decodes the cut itself: now with its MCUs */
        jpeg_abort_decompress(info);
        read_cut(self, jpeg, mcus, 1);
        start_output(info, m);
    }
    if (job->entropy_only) {                   /* the MCUs cut, Huffman-decoded as the decode below would */
        decode_all_mcus(self, info, segmented);
        jpeg_abort_decompress(info);
        seconds[2] = now() - entry_done;
        return;
    }
    JDIMENSION first_col = (JDIMENSION)col0, region_width = (JDIMENSION)(col1 - col0);
    if (region_width < info->output_width) jpeg_crop_scanline(info, &first_col, &region_width);
    int rows = row1 - row0;
    /* resize_row reads up to 2 x margin pixels from a tap's first one, with zero weight past the row */
    self->region = grow(self->region, &self->region_size, (size_t)region_width * 4 * rows + (size_t)16 * (margin + 8),
                        &self->errors);
    if (row0 > 0 && jpeg_skip_scanlines(info, (JDIMENSION)row0) != (JDIMENSION)row0)
        refuse(&self->errors, "cannot skip %d rows", row0);
    /* every row's pointer at once: libjpeg then colour-converts a row group per call, not a row */
    self->row_pointers = grow(self->row_pointers, &self->row_pointers_size, sizeof(JSAMPROW) * rows, &self->errors);
    for (int row = 0; row < rows; row++) self->row_pointers[row] = self->region + (size_t)row * region_width * 4;
    for (int row = 0; row < rows;)
        row += (int)jpeg_read_scanlines(info, self->row_pointers + row, (JDIMENSION)(rows - row));
    jpeg_abort_decompress(info);   /* the rows below the crop are never decoded */
    seconds[2] = now() - entry_done;
    resize_into(self, job, i, self->region, (int)region_width, rows, x0 - first_col, y0 - row0,
                x1 - first_col, y1 - row0, flip, seconds + 3);
}

/* For tests: crc32_fold.h's CRC-32, to hold against zlib's. */
unsigned engine_crc32(unsigned crc, const unsigned char *data, size_t size) { return crc32_fold(crc, data, size); }

/* At load (pipeline/native/library.py): the libjpeg loaded is the one compiled against. */
int engine_check(char *message, int message_size) { return jpeg_library_matches(message, message_size); }

/* A pool thread's worker, made at its first batch and kept: its decoder, tables and buffers. */
static worker *worker_made(void **state) {
    if (!*state && (*state = calloc(1, sizeof(worker)))) {
        worker *self = *state;
        jpeg_errors_start(&self->info, &self->errors, self->spare_message, sizeof self->spare_message);
        jpeg_create_decompress(&self->info);
        self->segments.errors = &self->errors;
    }
    return *state;
}

/* Room to note each sample of the job this thread makes; 0 when out of memory. */
static int made_ready(worker *self, const batch_job *job) {
    self->made_count = 0;
    if (job->count <= self->made_size) return 1;
    int *made = realloc(self->made, sizeof(int) * (size_t)job->count);
    if (!made) return 0;
    self->made = made;
    self->made_size = job->count;
    return 1;
}

/* The stage seconds of the samples this thread made, from the wall clock to its CPU time: scaled
 * by its CPU time over wall time since `wall_started`, so that time it waited preempted on a
 * busy machine is not counted. */
static void cpu_share(worker *self, batch_job *job, double cpu_started, double wall_started) {
    double wall = now() - wall_started, cpu = clock_seconds(CLOCK_THREAD_CPUTIME_ID) - cpu_started;
    double share = wall > 0.0 && cpu < wall ? cpu / wall : 1.0;
    for (int k = 0; k < self->made_count; k++)
        for (int stage = 0; stage < STAGES; stage++) job->stage_seconds[(long)self->made[k] * STAGES + stage] *= share;
}

/* The job's normalization constants tiled along an output row; 0 when out of memory. */
static int rows_ready(worker *self, const batch_job *job) {
    size_t row_values = 3 * (size_t)job->out_cols;
    if (row_values > self->row_values_size) {
        free(self->rgb); free(self->row_scale); free(self->row_offset);
        self->rgb = malloc(row_values);
        self->row_scale = malloc(sizeof(float) * row_values);
        self->row_offset = malloc(sizeof(float) * row_values);
        self->row_values_size = self->rgb && self->row_scale && self->row_offset ? row_values : 0;
        if (!self->row_values_size) return 0;
    }
    for (size_t k = 0; k < row_values; k++) {
        self->row_scale[k] = job->scale[k % 3];
        self->row_offset[k] = job->offset[k % 3];
    }
    return 1;
}

/* A pool thread's share of a batch (thread_pool.h's task): samples taken one at a time from the
 * job's counter until none is left. */
static void work(void *argument, void **state) {
    batch_job *job = argument;
    worker *self = worker_made(state);
    if (!self || !rows_ready(self, job) || !made_ready(self, job)) {
        for (int i; (i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->count;) {
            snprintf(job->messages + (long)i * job->message_size, job->message_size, "out of memory");
            job->status[i] = -1;
        }
        return;
    }
    double cpu_started = clock_seconds(CLOCK_THREAD_CPUTIME_ID), wall_started = now();
    for (;;) {
        int i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->count) break;
        self->made[self->made_count++] = i;
        char *message = job->messages + (long)i * job->message_size;
        message[0] = 0;
        self->errors.message = message;
        self->errors.message_size = job->message_size;
        if (setjmp(self->errors.escape)) {
            jpeg_abort_decompress(&self->info);      /* the decoder is reusable for the next sample */
            job->status[i] = self->damaged ? -2 : -1;
            self->damaged = 0;
            continue;
        }
        make_sample(self, job, i);
        job->status[i] = 0;
    }
    cpu_share(self, job, cpu_started, wall_started);
}

/* The pool's task of making every sample of `job`, its counter at the first. */
static pool_task batch_task(batch_job *job) {
    job->next = 0;
    return (pool_task){.work = work, .argument = job, .threads = job->threads};
}

/* Starts making every sample of `job` on `job->threads` of the pool's threads and returns at
 * once; engine_finish_batch waits for them. NULL when out of memory. Per-sample failures are
 * in job->status. */
void *engine_start_batch(batch_job *job) {
    pool_task *task = malloc(sizeof *task);
    if (!task) return NULL;
    *task = batch_task(job);
    pool_start(task);
    return task;
}

void engine_finish_batch(void *task) {
    pool_finish(task);
    free(task);
}

/* Makes every sample of `job` with `job->threads` threads; returns when they are made (0). */
int engine_decode_batch(batch_job *job) {
    pool_task task = batch_task(job);
    pool_start(&task);
    pool_finish(&task);
    return 0;
}

int engine_stages(void) { return STAGES; }

/* For tests: the crop box and flip the engine draws for sample `index` of `job` in a
 * height x width image. */
void engine_crop_box(const batch_job *job, int index, int height, int width, int *box, int *flip) {
    double buffer[MOST_UNIFORMS];
    crop_box(job, sample_uniforms(job, index, buffer), height, width, box, flip);
}

/* For tests: numpy's default_rng(sample_seed(seed, epoch, sample_id)).random(count). */
void engine_uniforms(long long seed, long long epoch, long long sample_id, double *out, int count) {
    numpy_uniforms(sample_seed(seed, epoch, sample_id), out, count);
}
