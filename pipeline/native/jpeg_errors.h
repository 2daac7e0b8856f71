/* libjpeg errors as messages and a jump back to the caller, not an exit: shared by
 * jpeg_roi.c and decode_engine.c.
 *
 * `jpeg_errors_start` installs the handlers; the caller then sets `escape` with setjmp before
 * any libjpeg call, and points `message` at its own buffer of `message_size` bytes. Any libjpeg
 * warning (corrupt or truncated data) counts as an error, as Pillow fails on a truncated file
 * rather than return grey rows. libjpeg formats up to JMSG_LENGTH_MAX bytes: the text is cut
 * to the caller's buffer, which may be smaller.
 */
#ifndef JPEG_ERRORS_H
#define JPEG_ERRORS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr base;
    jmp_buf escape;
    char *message;
    int message_size;
} error_manager;

static void on_error(j_common_ptr info) {
    error_manager *errors = (error_manager *)info->err;
    char text[JMSG_LENGTH_MAX];
    (*info->err->format_message)(info, text);
    snprintf(errors->message, errors->message_size, "%s", text);
    longjmp(errors->escape, 1);
}

static void on_message(j_common_ptr info, int level) {
    if (level < 0) on_error(info);   /* a warning: corrupt or truncated data */
}

/* A refusal of our own (bad region, CMYK...): set the message and leave through the same
 * setjmp exit as libjpeg's errors. */
static void refuse(error_manager *errors, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(errors->message, errors->message_size, format, args);
    va_end(args);
    longjmp(errors->escape, 1);
}

static void jpeg_errors_start(struct jpeg_decompress_struct *info, error_manager *errors, char *message,
                              int message_size) {
    info->err = jpeg_std_error(&errors->base);
    errors->base.error_exit = on_error;
    errors->base.emit_message = on_message;
    errors->message = message;
    errors->message_size = message_size;
    message[0] = 0;
}

/* What the version check of jpeg_library_matches claims to be compiled against: the headers'
 * own, unless a test builds with another to see the check refuse. */
#ifndef CHECKED_JPEG_LIB_VERSION
#define CHECKED_JPEG_LIB_VERSION JPEG_LIB_VERSION
#endif

/* 0 if the libjpeg loaded is the one the headers describe; else -1 and libjpeg's message
 * ("Wrong JPEG library version: library is 80, caller expects 62"). libjpeg refuses a caller
 * of another version from jpeg_create_*, before the caller's structs exist: checked once at
 * load, that refusal is one clear line instead of a crash in whichever call comes first. */
static int jpeg_library_matches(char *message, int message_size) {
    struct jpeg_decompress_struct source;
    struct jpeg_compress_struct target;
    error_manager errors;
    memset(&target, 0, sizeof target);      /* no memory manager yet: destroying it is a no-op */
    jpeg_errors_start(&source, &errors, message, message_size);
    target.err = source.err;
    if (setjmp(errors.escape)) {
        jpeg_destroy_compress(&target);
        jpeg_destroy_decompress(&source);
        return -1;
    }
    jpeg_CreateDecompress(&source, CHECKED_JPEG_LIB_VERSION, sizeof source);
    jpeg_CreateCompress(&target, CHECKED_JPEG_LIB_VERSION, sizeof target);
    jpeg_destroy_compress(&target);
    jpeg_destroy_decompress(&source);
    return 0;
}

#endif
