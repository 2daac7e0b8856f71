/* Huffman decoding of a JPEG whose every MCU is a restart segment of its own (jpeg_restarts.h),
 * in place of libjpeg's: the same coefficients, without libjpeg's slow path.
 *
 * libjpeg-turbo decodes any stream with restart markers on its slow path (a bounds and marker
 * check at every refill of the bit buffer), since a marker may come at any byte. Here each
 * MCU's bytes are known from the restart index, so the reader refills 8 bytes at a time where
 * no 0xFF is among them, and one table lookup decodes a short code with its value bits: a DC
 * difference, or an AC coefficient's run and value (stb_image's "fast AC" table), a block's end
 * or a run of 16 zeros. The DC predictors start at 0 in each segment, so an MCU needs nothing
 * from the one before it.
 *
 * Plugged in through libjpeg's own module hook: after jpeg_start_decompress, the decoder's
 * `decode_mcu` is replaced (`segments_take_over`), and libjpeg's coefficient controller, IDCT,
 * upsampling and colour conversion run as before on the coefficients it gets. Bad data (a code
 * no table has, an MCU that reads past its segment or leaves a byte of it unread) leaves through
 * the caller's error exit, as libjpeg's warnings do (jpeg_errors.h). Header-only, as
 * jpeg_restarts.h.
 */
#ifndef JPEG_HUFFMAN_H
#define JPEG_HUFFMAN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <jpeglib.h>
#include <jpegint.h>
#include "jpeg_errors.h"
#include "jpeg_restarts.h"

#define FAST_BITS 10                      /* codes (and small AC values) this long take one lookup */

typedef struct {
    unsigned short fast[1 << FAST_BITS];  /* next FAST_BITS bits -> length << 8 | symbol; 0: a longer code */
    int fast_value[1 << FAST_BITS];       /* a code and its value bits in one: 0 where they are longer, else
                                             DC: value << 8 | length;
                                             AC: value << 16 | step << 8 | length, the step to the next
                                             coefficient being run + 1, 16 for 16 zeros, 64 for the block's end */
    uint32_t limit[18];                   /* a code of length l is below limit[l] (16-bit, left-aligned) */
    int offset[18];                       /* its symbol: values[code + offset[l]] */
    unsigned char values[256];
    UINT8 bits[17], huffval[256];         /* the table this was built from, to reuse it for the next image */
    int built;
} huffman_table;

typedef struct {
    uint64_t bits;                        /* the next `count` bits at the top */
    int count;
    const unsigned char *p, *end, *readable;  /* the segment's next byte and end; 8-byte loads stop at readable */
} bit_reader;

typedef struct {
    huffman_table dc[NUM_HUFF_TBLS], ac[NUM_HUFF_TBLS];
    const huffman_table *dc_of[C_MAX_BLOCKS_IN_MCU], *ac_of[C_MAX_BLOCKS_IN_MCU];
    const restart_index *index;
    const unsigned char *jpeg, *readable;
    int top, left, mcus_across, mcus_down;     /* the rectangle of the index's MCUs being decoded */
    JDIMENSION seen_row;                       /* the MCU decode_mcu is called for next: its row ... */
    int column;                                /* ... and column */
    error_manager *errors;
} segment_decoder;

/* Natural order of the zigzag index, with spare entries (63, as libjpeg's) for a corrupt run past
 * 63 and for the zero an end of block writes at k + 63 (never yet written: k < 64) */
static const unsigned char natural_order[128] = {
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14,
    21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60,
    61, 54, 47, 55, 62, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63,
    63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63,
    63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63};

static inline int extend(int value, int size) { return value < (1 << (size - 1)) ? value - (1 << size) + 1 : value; }

/* The lookups of a code of `length` <= FAST_BITS bits, `code`, for `symbol`: every FAST_BITS-bit
 * peek that starts with it, and in fast_value, with the value bits after it where they fit. */
static void huffman_fast_entries(huffman_table *table, int code, int length, int symbol, int is_ac) {
    int first = code << (FAST_BITS - length), count = 1 << (FAST_BITS - length);
    for (int peek = first; peek < first + count; peek++) table->fast[peek] = (unsigned short)(length << 8 | symbol);
    int run = is_ac ? symbol >> 4 : 0, size = is_ac ? symbol & 15 : symbol;
    if (size > 15 || length + size > FAST_BITS) {               /* the value's bits run past the peek */
        memset(table->fast_value + first, 0, sizeof(int) * (size_t)count);
        return;
    }
    int step = size ? run + 1 : run == 15 ? 16 : 64, rest = FAST_BITS - length - size;
    for (int bits = 0; bits < 1 << size; bits++) {
        int value = size ? extend(bits, size) : 0;
        int entry = is_ac ? value * 65536 + step * 256 + length + size : value * 256 + length + size;
        int *to = table->fast_value + first + (bits << rest);
        for (int fill = 0; fill < 1 << rest; fill++) to[fill] = entry;
    }
}

/* `table` from libjpeg's, unless it was built from the same one already; canonical codes as in
 * the standard's Annex C. A table whose codes overflow their lengths is refused. Each image a
 * converter optimized has tables of its own, so this is built per image: the lookups are filled
 * code by code, not peek by peek. */
static void huffman_build(huffman_table *table, const JHUFF_TBL *from, int is_ac, error_manager *errors) {
    if (table->built && !memcmp(table->bits, from->bits, sizeof table->bits) &&
        !memcmp(table->huffval, from->huffval, sizeof table->huffval))
        return;
    table->built = 0;
    int code = 0, k = 0;
    for (int length = 1; length <= 16; length++) {
        table->offset[length] = k - code;
        for (int n = 0; n < from->bits[length]; n++, k++, code++) {
            if (k >= 256 || code >= (1 << length)) refuse(errors, "Bogus Huffman table definition");
            table->values[k] = from->huffval[k];
            if (length <= FAST_BITS) huffman_fast_entries(table, code, length, from->huffval[k], is_ac);
        }
        if (length == FAST_BITS) {                 /* the peeks past the short codes: a longer code */
            memset(table->fast + code, 0, sizeof(unsigned short) * (size_t)((1 << FAST_BITS) - code));
            memset(table->fast_value + code, 0, sizeof(int) * (size_t)((1 << FAST_BITS) - code));
        }
        table->limit[length] = (uint32_t)code << (16 - length);
        code <<= 1;
    }
    table->limit[17] = 0xFFFFFFFFu;            /* no code is this long: the search stops here */
    memcpy(table->bits, from->bits, sizeof table->bits);
    memcpy(table->huffval, from->huffval, sizeof table->huffval);
    table->built = 1;
}

/* At least 56 bits in the buffer: 8 bytes at a time where none is 0xFF (a stuffed byte), else
 * one by one, skipping the 0x00 after each 0xFF; zeros past the segment's end. */
static inline void refill(bit_reader *r) {
    if (r->p + 8 <= r->readable) {
        uint64_t word;
        memcpy(&word, r->p, 8);
        word = __builtin_bswap64(word);
        ptrdiff_t left = r->end - r->p;
        if (left < 8) word = left > 0 ? word & ~0ULL << (64 - 8 * left) : 0;   /* not the marker after it */
        uint64_t inverted = ~word;
        if (!((inverted - 0x0101010101010101ULL) & ~inverted & 0x8080808080808080ULL)) {
            r->bits |= word >> r->count;
            r->p += (63 - r->count) >> 3;
            r->count |= 56;
            return;
        }
    }
    while (r->count <= 56) {
        uint64_t byte = 0;
        if (r->p < r->end) {
            byte = *r->p;
            if (byte == 0xFF) r->p++;
        }
        r->p++;                                  /* past the end too: counts the zeros read there */
        r->bits |= byte << (56 - r->count);
        r->count += 8;
    }
}

static inline int take_bits(bit_reader *r, int n) {
    int value = (int)(r->bits >> (64 - n));
    r->bits <<= n;
    r->count -= n;
    return value;
}

/* The next symbol of `table`; -1 for a code it does not have. */
static inline int decode_symbol(bit_reader *r, const huffman_table *table) {
    int entry = table->fast[r->bits >> (64 - FAST_BITS)];
    if (entry) {
        r->bits <<= entry >> 8;
        r->count -= entry >> 8;
        return entry & 255;
    }
    uint32_t top = (uint32_t)(r->bits >> 48);
    int length = FAST_BITS + 1;
    while (top >= table->limit[length]) length++;
    if (length > 16) return -1;
    return table->values[take_bits(r, length) + table->offset[length]];
}

/* One block's coefficients (zigzag to natural order) into `block`, zeroed by the caller; the
 * component's DC predictor `dc` moves on. 0 for a code the tables do not have. */
static inline int decode_block(bit_reader *r, const huffman_table *dc_table, const huffman_table *ac_table,
                               int *dc, JCOEF *block) {
    if (r->count < 32) refill(r);
    int fast = dc_table->fast_value[r->bits >> (64 - FAST_BITS)];
    if (fast) {
        *dc += fast >> 8;
        r->bits <<= fast & 31;
        r->count -= fast & 31;
    } else {
        int size = decode_symbol(r, dc_table);
        if (size < 0) return 0;
        if (size) *dc += extend(take_bits(r, size), size);
    }
    block[0] = (JCOEF)*dc;
    for (int k = 1; k < 64;) {
        if (r->count < 32) refill(r);
        fast = ac_table->fast_value[r->bits >> (64 - FAST_BITS)];
        if (fast) {
            int step = (fast >> 8) & 127;
            block[natural_order[k + step - 1]] = (JCOEF)(fast >> 16);
            k += step;
            r->bits <<= fast & 31;
            r->count -= fast & 31;
            continue;
        }
        int symbol = decode_symbol(r, ac_table);
        if (symbol < 0) return 0;
        int run = symbol >> 4, size = symbol & 15;
        if (size) {
            k += run;
            block[natural_order[k]] = (JCOEF)extend(take_bits(r, size), size);
            k++;
        } else if (run == 15) {
            k += 16;
        } else {
            break;
        }
    }
    return 1;
}

/* MCU (row, column) of the index into `blocks` (NULL: skipped, which a segment allows). */
static void segments_decode(segment_decoder *d, int blocks_in_mcu, const int *membership, int row, int column,
                            JBLOCKROW *blocks) {
    if (row >= d->mcus_down || column >= d->mcus_across)
        refuse(d->errors, "Corrupt JPEG data: more MCUs asked for than the scan has");
    if (!blocks) return;
    size_t k = (size_t)(d->top + row) * d->index->mcus_across + d->left + column;
    bit_reader r = {0, 0, d->jpeg + d->index->segment_at[k], d->jpeg + d->index->segment_end[k], d->readable};
    int dc[MAX_COMPS_IN_SCAN] = {0};
    for (int b = 0; b < blocks_in_mcu; b++)
        if (!decode_block(&r, d->dc_of[b], d->ac_of[b], &dc[membership[b]], blocks[b][0]))
            refuse(d->errors, "Corrupt JPEG data: bad Huffman code");
    /* The segment's bits not read: fewer than 8 (its padding) in a sound one. The zeros read past
     * its end count negative, and a byte left unread makes 8 or more, as it does for libjpeg. */
    long left = 8L * (r.end - r.p) + r.count;
    if (left < 0) refuse(d->errors, "Corrupt JPEG data: premature end of data segment");
    if (left >= 8) refuse(d->errors, "Corrupt JPEG data: %ld extraneous bytes before marker", left / 8);
}

static boolean segments_decode_mcu(j_decompress_ptr info, JBLOCKROW *blocks) {
    segment_decoder *d = info->client_data;
    if (info->input_iMCU_row != d->seen_row) {      /* one MCU row an iMCU row: the counter follows libjpeg's */
        d->seen_row = info->input_iMCU_row;
        d->column = 0;
    }
    segments_decode(d, info->blocks_in_MCU, info->MCU_membership, (int)d->seen_row, d->column++, blocks);
    return TRUE;
}

/* After jpeg_start_decompress of the JPEG of the index's MCUs `rect` (restart_cut's, or the
 * whole image's): its MCUs are decoded from
 * `jpeg`'s segments by `d` from here on. 0 where libjpeg's layout is not one MCU row per iMCU row,
 * in one scan (it then decodes on its own). `readable`: how far 8-byte loads may reach. */
static int segments_take_over(segment_decoder *d, j_decompress_ptr info, const restart_index *index,
                              const unsigned char *jpeg, const unsigned char *readable, mcu_rect rect) {
    int down = rect.bottom - rect.top, across = rect.right - rect.left;
    if (info->progressive_mode || info->arith_code || info->restart_interval != 1 || info->comps_in_scan < 1 ||
        info->MCUs_per_row != (JDIMENSION)across || info->total_iMCU_rows != (JDIMENSION)down ||
        (info->comps_in_scan == 1 && info->cur_comp_info[0]->v_samp_factor != 1))
        return 0;
    for (int b = 0; b < info->blocks_in_MCU; b++) {
        const jpeg_component_info *component = info->cur_comp_info[info->MCU_membership[b]];
        int dc = component->dc_tbl_no, ac = component->ac_tbl_no;
        if (!info->dc_huff_tbl_ptrs[dc] || !info->ac_huff_tbl_ptrs[ac]) return 0;
        huffman_build(&d->dc[dc], info->dc_huff_tbl_ptrs[dc], 0, d->errors);
        huffman_build(&d->ac[ac], info->ac_huff_tbl_ptrs[ac], 1, d->errors);
        d->dc_of[b] = &d->dc[dc];
        d->ac_of[b] = &d->ac[ac];
    }
    d->index = index;
    d->jpeg = jpeg;
    d->readable = readable;
    d->top = rect.top; d->left = rect.left; d->mcus_down = down; d->mcus_across = across;
    d->seen_row = info->input_iMCU_row;
    d->column = 0;
    info->client_data = d;
    info->entropy->decode_mcu = segments_decode_mcu;
    return 1;
}

#endif
