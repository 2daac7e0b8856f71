/* pipeline.shards.buffer_shuffle.buffer_shuffle in C, item for item, for every lane of an epoch at
 * once: an ImageNet epoch's plan is 1.28 million draws, which Python's loop takes most of a second
 * over, on every rank at every epoch's start.
 *
 * Each lane's draws come from CPython's own generator (Modules/_randommodule.c): the Mersenne
 * Twister, started from the state `random.Random(seed).getstate()` gives (Python seeds it), and
 * `randint(0, n - 1)` as CPython computes it: the top bit_length(n) bits of one 32-bit output,
 * drawn again while they are n or more.
 */
#include <stdint.h>

#define STATE_WORDS 624
#define SHIFT 397

typedef struct {
    uint32_t words[STATE_WORDS];
    int next;
} twister;

static uint32_t next_word(twister *t) {
    uint32_t *mt = t->words, y;
    if (t->next >= STATE_WORDS) {
        for (int k = 0; k < STATE_WORDS; k++) {
            y = (mt[k] & 0x80000000u) | (mt[(k + 1) % STATE_WORDS] & 0x7fffffffu);
            mt[k] = mt[(k + SHIFT) % STATE_WORDS] ^ (y >> 1) ^ (y & 1u ? 0x9908b0dfu : 0u);
        }
        t->next = 0;
    }
    y = mt[t->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* random.randint(0, n - 1) for 1 <= n < 2**32 */
static uint32_t below(twister *t, uint32_t n) {
    int bits = 32 - __builtin_clz(n);
    uint32_t r;
    do r = next_word(t) >> (32 - bits); while (r >= n);
    return r;
}

/* Lane l of `lanes` (each `length` items, in `items`) shuffled through a `window`-item buffer into
 * the same place of `out`; `states` holds each lane's 624 state words then its position, as
 * getstate() lists them; `buffer` room for `window` items. */
void buffer_shuffle_lanes(const int64_t *items, int64_t lanes, int64_t length, int64_t window,
                          const uint32_t *states, int64_t *buffer, int64_t *out) {
    for (int64_t lane = 0; lane < lanes; lane++) {
        twister t;
        for (int k = 0; k < STATE_WORDS; k++) t.words[k] = states[lane * (STATE_WORDS + 1) + k];
        t.next = (int)states[lane * (STATE_WORDS + 1) + STATE_WORDS];
        const int64_t *in = items + lane * length;
        int64_t *to = out + lane * length, held = 0;
        for (int64_t i = 0; i < length; i++) {
            buffer[held++] = in[i];
            if (held >= window) {
                uint32_t slot = below(&t, (uint32_t)held);
                *to++ = buffer[slot];
                buffer[slot] = buffer[--held];
            }
        }
        while (held) {
            uint32_t slot = below(&t, (uint32_t)held);
            *to++ = buffer[slot];
            buffer[slot] = buffer[--held];
        }
    }
}
