/* Region-of-interest JPEG decode with libjpeg-turbo: decode only the rows and columns a crop
 * needs, at a DCT scale of 1/1, 1/2, 1/4 or 1/8.
 *
 * Rows above the crop are skipped with jpeg_skip_scanlines (entropy decoding only, no IDCT,
 * upsampling or colour conversion), rows below it are never decoded (the decompressor is
 * aborted), and columns outside it are left out with jpeg_crop_scanline, which widens the
 * region to whole iMCUs and upsamples the chroma of its edge columns as at an image edge (so the
 * caller asks for a margin around the crop). A JPEG with a restart marker after every MCU (what
 * jpeg_roi_transcode writes for the converter) is first cut down to the MCUs around the region
 * (jpeg_restarts.h), two scaled pixels wider on each side so that its pixels are those of the
 * whole image's decode, and those MCUs are Huffman-decoded by jpeg_huffman.h, as the decode
 * engine does. Built and loaded by pipeline/decode/jpeg_roi.py (ctypes); libjpeg's errors and
 * warnings make the call fail with a message (jpeg_errors.h).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "jpeg_errors.h"
#include "jpeg_huffman.h"
#include "jpeg_restarts.h"

/* What a thread keeps between calls: the restart index, the cut and the Huffman decoder, whose
 * tables are reused while images share them. Freed when the thread ends. */
typedef struct {
    restart_index restarts;
    segment_decoder segments;
    unsigned char *cut;
    size_t cut_size;
} region_state;

static pthread_key_t state_key;
static pthread_once_t state_once = PTHREAD_ONCE_INIT;

static void free_state(void *pointer) {
    region_state *state = pointer;
    restart_index_free(&state->restarts);
    free(state->cut);
    free(state);
}

static void make_state_key(void) { pthread_key_create(&state_key, free_state); }

/* This thread's state, or NULL if there is no memory for it (the JPEG is then decoded whole). */
static region_state *thread_state(void) {
    pthread_once(&state_once, make_state_key);
    region_state *state = pthread_getspecific(state_key);
    if (!state && (state = calloc(1, sizeof *state)) && pthread_setspecific(state_key, state)) {
        free(state);
        state = NULL;
    }
    return state;
}

/* Called after the caller's setjmp: libjpeg's errors jump back into the caller's frame. */
static void read_header(struct jpeg_decompress_struct *info, const unsigned char *data, unsigned long size) {
    jpeg_create_decompress(info);
    jpeg_mem_src(info, data, size);
    jpeg_read_header(info, TRUE);
}

/* The image's width and height; 0 on success, -1 with `message` set on failure. */
int jpeg_roi_size(const unsigned char *data, unsigned long size, int *width, int *height,
                  char *message, int message_size) {
    struct jpeg_decompress_struct info;
    error_manager errors;
    jpeg_errors_start(&info, &errors, message, message_size);
    if (setjmp(errors.escape)) {
        jpeg_destroy_decompress(&info);
        return -1;
    }
    read_header(&info, data, size);
    *width = (int)info.image_width;
    *height = (int)info.image_height;
    jpeg_destroy_decompress(&info);
    return 0;
}

/* Decodes, at scale 1/`denominator`, the scaled rows [top, top + rows) and at least the scaled
 * columns [left, left + cols) into `out` (RGBX, rows of `*out_width` pixels, at most `capacity`
 * bytes). On return `*out_left` is the first decoded column (at most `left`: iMCU-aligned),
 * `*out_width` the number of columns decoded, `*scaled_width` / `*scaled_height` the size of the
 * whole scaled image. 0 on success, -1 with `message` set on failure. */
int jpeg_roi_decode(const unsigned char *data, unsigned long size, int denominator,
                    int top, int rows, int left, int cols, unsigned char *out, long capacity,
                    int *out_left, int *out_width, int *scaled_width, int *scaled_height,
                    char *message, int message_size) {
    struct jpeg_decompress_struct info;
    error_manager errors;
    jpeg_errors_start(&info, &errors, message, message_size);
    if (setjmp(errors.escape)) {
        jpeg_destroy_decompress(&info);
        return -1;
    }
    read_header(&info, data, size);
    if (info.jpeg_color_space == JCS_CMYK || info.jpeg_color_space == JCS_YCCK)
        refuse(&errors, "CMYK JPEG (not decoded here)");
    info.scale_num = 1;
    info.scale_denom = (unsigned int)denominator;
    jpeg_calc_output_dimensions(&info);
    *scaled_width = (int)info.output_width;
    *scaled_height = (int)info.output_height;
    if (top < 0 || rows < 1 || left < 0 || cols < 1 || top + rows > (int)info.output_height ||
        left + cols > (int)info.output_width)
        refuse(&errors, "region outside the %dx%d scaled image", *scaled_width, *scaled_height);
    region_state *state = thread_state();
    const restart_index *index = state ? &state->restarts : NULL;
    int indexed = state && 8 % denominator == 0 && restart_index_build(&state->restarts, data, size);
    mcu_rect mcus = {0, indexed ? index->mcus_down : 0, 0, indexed ? index->mcus_across : 0};   /* decoded */
    int dy = 0, dx = 0;                                              /* their corner, in scaled pixels */
    if (indexed) {
        int mcu_rows = index->mcu_height / denominator, mcu_cols = index->mcu_width / denominator;
        mcu_rect around = restart_cover(index, mcu_rows, mcu_cols, top > 2 ? top - 2 : 0, top + rows + 2,
                                        left > 2 ? left - 2 : 0, left + cols + 2);
        if ((around.bottom - around.top) * (around.right - around.left) < index->mcus_down * index->mcus_across) {
            mcus = around;
            size_t cut_size = restart_cut(index, data, mcus, 1, &state->cut, &state->cut_size);
            if (!cut_size) refuse(&errors, "out of memory (the region's MCUs)");
            jpeg_abort_decompress(&info);
            jpeg_mem_src(&info, state->cut, cut_size);
            jpeg_read_header(&info, TRUE);
            info.scale_num = 1;
            info.scale_denom = (unsigned int)denominator;
            dy = mcus.top * mcu_rows;
            dx = mcus.left * mcu_cols;
        }
    }
    info.out_color_space = JCS_EXT_RGBX;   /* Pillow's own layout: it can wrap the buffer, not copy it */
    jpeg_start_decompress(&info);
    if (indexed) {
        state->segments.errors = &errors;
        segments_take_over(&state->segments, &info, index, data, data + size, mcus);
    }
    top -= dy;
    JDIMENSION x = (JDIMENSION)(left - dx), width = (JDIMENSION)cols;
    if (width < info.output_width) jpeg_crop_scanline(&info, &x, &width);
    if ((long)width * 4 * rows > capacity)
        refuse(&errors, "output buffer too small");
    if (top > 0 && jpeg_skip_scanlines(&info, (JDIMENSION)top) != (JDIMENSION)top)
        refuse(&errors, "cannot skip %d rows", top);
    for (int row = 0; row < rows;) {
        JSAMPROW pointer = out + (long)row * width * 4;
        row += (int)jpeg_read_scanlines(&info, &pointer, 1);
    }
    *out_left = (int)x + dx;
    *out_width = (int)width;
    jpeg_abort_decompress(&info);   /* the rows below the crop are never decoded */
    jpeg_destroy_decompress(&info);
    return 0;
}

/* `data` rewritten losslessly (the same DCT coefficients, so the same pixels) as one baseline
 * scan with optimized Huffman tables and a restart marker every `restart_interval` MCUs (0:
 * none). Every MCU is the layout jpeg_restarts.h can cut anywhere. `*out` (malloc'ed, free
 * with jpeg_roi_free) holds `*out_size` bytes. 0 on success, -1 with `message` set on failure. */
int jpeg_roi_transcode(const unsigned char *data, unsigned long size, int restart_interval, unsigned char **out,
                       unsigned long *out_size, char *message, int message_size) {
    struct jpeg_decompress_struct source;
    struct jpeg_compress_struct target;
    error_manager errors;
    volatile int written = 0;               /* *out is libjpeg's final buffer, ours to free */
    memset(&target, 0, sizeof target);      /* destroyable before it is created */
    *out = NULL;
    *out_size = 0;
    jpeg_errors_start(&source, &errors, message, message_size);
    target.err = source.err;
    if (setjmp(errors.escape)) {
        /* Before jpeg_finish_compress, *out may be stale: once the output buffer has grown,
         * libjpeg has freed the first one and holds the new one privately. Reading the source
         * fails before any output exists; a failure while writing (out of memory) leaks it. */
        jpeg_destroy_compress(&target);
        jpeg_destroy_decompress(&source);
        if (written) free(*out);
        *out = NULL;
        return -1;
    }
    jpeg_create_decompress(&source);
    jpeg_create_compress(&target);
    jpeg_mem_src(&source, data, size);
    jpeg_read_header(&source, TRUE);
    jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&source);
    jpeg_copy_critical_parameters(&source, &target);
    target.restart_interval = (unsigned)restart_interval;
    target.optimize_coding = TRUE;
    jpeg_mem_dest(&target, out, out_size);
    jpeg_write_coefficients(&target, coefficients);
    jpeg_finish_compress(&target);
    written = 1;
    jpeg_finish_decompress(&source);
    jpeg_destroy_compress(&target);
    jpeg_destroy_decompress(&source);
    return 0;
}

void jpeg_roi_free(void *pointer) { free(pointer); }

int jpeg_roi_check(char *message, int message_size) { return jpeg_library_matches(message, message_size); }
