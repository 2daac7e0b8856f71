/* Entering a JPEG's entropy-coded data at any MCU, so that a crop costs the Huffman decode of
 * its own MCUs only, not of every MCU above and beside it (libjpeg's jpeg_skip_scanlines and
 * jpeg_crop_scanline save the IDCT there, but must still entropy-decode the whole way).
 *
 * In a baseline JPEG with a restart marker after every MCU (what tools/convert_wds.py stores:
 * jpeg_roi_add_restarts adds them losslessly, the DCT coefficients untouched), each MCU is a
 * byte-aligned segment of its own: a restart resets the DC predictors and the bit buffer. So
 * any rectangle of MCUs is itself a valid JPEG: the same headers with the rectangle's size in
 * the SOF, then its segments joined by renumbered RST markers. Decoded, it gives the
 * original's pixels except at a cut edge (chroma upsampling reads 1 pixel across an MCU edge),
 * so a caller keeps the pixels it reads at least one pixel inside the cut.
 * A JPEG without a marker after every MCU (progressive, several scans, another interval, a
 * 4-component one) gets no index, and the caller decodes it whole as before.
 * Used by decode_engine.c and jpeg_roi.c; header-only, as jpeg_errors.h.
 */
#ifndef JPEG_RESTARTS_H
#define JPEG_RESTARTS_H

#include <stdlib.h>
#include <string.h>

typedef struct {
    int width, height, mcu_width, mcu_height, mcus_across, mcus_down;
    size_t sof_at, scan_at;                       /* the SOF's length field; the scan's first byte */
    unsigned *segment_at, *segment_end;           /* MCU k's bytes: [segment_at[k], segment_end[k]) */
    size_t capacity;
} restart_index;

static int read_u16(const unsigned char *p) { return p[0] << 8 | p[1]; }

static void restart_index_free(restart_index *index) {
    free(index->segment_at);
    free(index->segment_end);
    memset(index, 0, sizeof *index);
}

/* The headers up to the scan: 1 for one baseline scan of all 1 or 3 components with a restart
 * interval of one MCU, the geometry filled in; 0 for anything else. Reads only within `size`. */
static int restart_headers(restart_index *index, const unsigned char *data, size_t size) {
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return 0;
    int components = 0, interval = 0, most_h = 1, most_v = 1;
    index->sof_at = 0;
    for (size_t at = 2;;) {
        while (at + 1 < size && data[at] == 0xFF && data[at + 1] == 0xFF) at++;    /* fill bytes */
        if (at + 4 > size || data[at] != 0xFF) return 0;
        int marker = data[at + 1];
        size_t length = (size_t)read_u16(data + at + 2);
        if (length < 2 || at + 2 + length > size) return 0;
        const unsigned char *body = data + at + 4;
        if (marker == 0xC0 || marker == 0xC1) {                   /* baseline or extended Huffman */
            if (length < 8 || body[0] != 8) return 0;
            components = body[5];
            if ((components != 1 && components != 3) || length != 8 + 3 * (size_t)components) return 0;
            index->height = read_u16(body + 1);
            index->width = read_u16(body + 3);
            for (int c = 0; c < components; c++) {
                int h = body[7 + 3 * c] >> 4, v = body[7 + 3 * c] & 15;
                if (h < 1 || v < 1) return 0;
                if (h > most_h) most_h = h;
                if (v > most_v) most_v = v;
            }
            index->sof_at = at + 2;
        } else if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4) || (marker >= 0xD0 && marker <= 0xD9) ||
                   marker == 0x01) {
            return 0;                                             /* progressive, lossless, arithmetic; stray markers */
        } else if (marker == 0xDD) {
            if (length != 4) return 0;
            interval = read_u16(body);
        } else if (marker == 0xDA) {
            if (!index->sof_at || interval != 1 || body[0] != components || index->width < 1 || index->height < 1)
                return 0;
            index->scan_at = at + 2 + length;
            break;
        }
        at += 2 + length;
    }
    /* One component: a non-interleaved scan, whose MCU is one 8x8 block */
    index->mcu_width = components == 1 ? 8 : 8 * most_h;
    index->mcu_height = components == 1 ? 8 : 8 * most_v;
    index->mcus_across = (index->width + index->mcu_width - 1) / index->mcu_width;
    index->mcus_down = (index->height + index->mcu_height - 1) / index->mcu_height;
    return 1;
}

/* Indexes every MCU's segment of `data`; 1 on success, 0 when the JPEG is not one with a
 * restart marker after every MCU, ending at EOI (or memory ran out: then it is decoded whole). */
static int restart_index_build(restart_index *index, const unsigned char *data, size_t size) {
    if (!restart_headers(index, data, size)) return 0;
    size_t mcus = (size_t)index->mcus_across * index->mcus_down;
    if (mcus > index->capacity) {
        unsigned *at = realloc(index->segment_at, mcus * sizeof *at);
        if (at) index->segment_at = at;
        unsigned *end = realloc(index->segment_end, mcus * sizeof *end);
        if (end) index->segment_end = end;
        if (!at || !end) return 0;
        index->capacity = mcus;
    }
    size_t k = 0;
    index->segment_at[0] = (unsigned)index->scan_at;
    const unsigned char *p = data + index->scan_at, *end = data + size;
    for (;;) {
        p = memchr(p, 0xFF, (size_t)(end - p));
        if (!p || p + 1 >= end) return 0;
        int next = p[1];
        if (next == 0x00) { p += 2; continue; }                   /* a stuffed 0xFF data byte */
        if (next == 0xFF) { p += 1; continue; }                   /* fill before a marker */
        if (next >= 0xD0 && next <= 0xD7) {
            if ((size_t)(next & 7) != (k & 7) || k + 1 >= mcus) return 0;
            index->segment_end[k] = (unsigned)(p - data);
            index->segment_at[++k] = (unsigned)(p + 2 - data);
            p += 2;
            continue;
        }
        if (next != 0xD9 || k + 1 != mcus) return 0;
        index->segment_end[k] = (unsigned)(p - data);
        return 1;
    }
}

/* Bytes the JPEG of MCU rows [row0, row1) and columns [col0, col1) takes; with `segments` 0, its
 * headers and end alone. */
static size_t restart_region_size(const restart_index *index, int row0, int row1, int col0, int col1, int segments) {
    size_t size = index->scan_at + 2;
    if (!segments) return size;
    for (int r = row0; r < row1; r++)
        for (int c = col0; c < col1; c++) {
            size_t k = (size_t)r * index->mcus_across + c;
            size += index->segment_end[k] - index->segment_at[k] + 2;
        }
    return size;
}

/* Writes that JPEG into `out` (restart_region_size bytes). */
static void restart_region_write(const restart_index *index, const unsigned char *data, int row0, int row1,
                                 int col0, int col1, int segments, unsigned char *out) {
    int bottom = row1 * index->mcu_height, right = col1 * index->mcu_width;
    int height = (bottom < index->height ? bottom : index->height) - row0 * index->mcu_height;
    int width = (right < index->width ? right : index->width) - col0 * index->mcu_width;
    memcpy(out, data, index->scan_at);
    unsigned char *sof = out + index->sof_at;          /* length (2), precision, height (2), width (2) */
    sof[3] = (unsigned char)(height >> 8); sof[4] = (unsigned char)height;
    sof[5] = (unsigned char)(width >> 8); sof[6] = (unsigned char)width;
    unsigned char *to = out + index->scan_at;
    unsigned written = 0;
    for (int r = row0; segments && r < row1; r++)
        for (int c = col0; c < col1; c++, written++) {
            if (written) { *to++ = 0xFF; *to++ = (unsigned char)(0xD0 + ((written - 1) & 7)); }
            size_t k = (size_t)r * index->mcus_across + c;
            size_t length = index->segment_end[k] - index->segment_at[k];
            memcpy(to, data + index->segment_at[k], length);
            to += length;
        }
    *to++ = 0xFF; *to++ = 0xD9;
}

/* MCU rows [top, bottom) and columns [left, right) of an index */
typedef struct {
    int top, bottom, left, right;
} mcu_rect;

/* The MCUs that cover pixel rows [row0, row1) and columns [col0, col1) of the image decoded at a
 * scale where an MCU is mcu_rows x mcu_cols pixels. */
static mcu_rect restart_cover(const restart_index *index, int mcu_rows, int mcu_cols, int row0, int row1, int col0,
                              int col1) {
    mcu_rect rect = {row0 / mcu_rows, (row1 + mcu_rows - 1) / mcu_rows,
                     col0 / mcu_cols, (col1 + mcu_cols - 1) / mcu_cols};
    if (rect.bottom > index->mcus_down) rect.bottom = index->mcus_down;
    if (rect.right > index->mcus_across) rect.right = index->mcus_across;
    return rect;
}

/* The JPEG of `rect`'s MCUs written into *buffer, grown to fit (*capacity bytes): its size, or 0
 * where memory ran out. With `segments` 0, its headers alone, for a decoder that reads the MCUs
 * from `data`'s own segments (jpeg_huffman.h's): libjpeg reads no entropy-coded byte of its own
 * once its `decode_mcu` is replaced, so the copy would go unread. */
static size_t restart_cut(const restart_index *index, const unsigned char *data, mcu_rect rect, int segments,
                          unsigned char **buffer, size_t *capacity) {
    size_t size = restart_region_size(index, rect.top, rect.bottom, rect.left, rect.right, segments);
    if (size > *capacity) {
        unsigned char *bigger = realloc(*buffer, size);
        if (!bigger) return 0;
        *buffer = bigger;
        *capacity = size;
    }
    restart_region_write(index, data, rect.top, rect.bottom, rect.left, rect.right, segments, *buffer);
    return size;
}

#endif
