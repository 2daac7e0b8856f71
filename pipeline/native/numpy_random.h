/* numpy's `np.random.default_rng(seed).random(n)` for a seed below 2**32, bit for bit, in C:
 * SeedSequence's entropy pool and state generation, PCG64 (XSL-RR 128/64) seeded from it, and
 * Generator.random's 53-bit doubles. The decode engine draws each sample's crop uniforms with
 * it (pipeline.transforms.crops.sample_uniforms in Python took ~25 µs a sample, most of it SeedSequence),
 * so the engine's crops stay those of every other backend. tests/test_decode_engine.py holds
 * it against numpy. The constants are numpy's (numpy/random/bit_generator.pyx, pcg64.h).
 */
#ifndef NUMPY_RANDOM_H
#define NUMPY_RANDOM_H

#include <stdint.h>

enum { POOL_SIZE = 4 };
static const uint32_t INIT_A = 0x43b0d7e5u, MULT_A = 0x931e8875u, INIT_B = 0x8b51f9ddu, MULT_B = 0x58f38dedu;
static const uint32_t MIX_MULT_L = 0xca01f9ddu, MIX_MULT_R = 0x4973f715u;

static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= MULT_A;
    value *= *hash_const;
    return value ^ (value >> 16);
}

static uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t result = MIX_MULT_L * x - MIX_MULT_R * y;
    return result ^ (result >> 16);
}

/* SeedSequence(seed).generate_state(4, np.uint64), for 0 <= seed < 2**32 (one entropy word) */
static void seed_sequence_state(uint32_t seed, uint64_t state[4]) {
    uint32_t pool[POOL_SIZE], hash_const = INIT_A;
    for (int i = 0; i < POOL_SIZE; i++) pool[i] = hashmix(i == 0 ? seed : 0, &hash_const);
    for (int src = 0; src < POOL_SIZE; src++)
        for (int dst = 0; dst < POOL_SIZE; dst++)
            if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
    uint32_t words[8];
    hash_const = INIT_B;
    for (int i = 0; i < 8; i++) {
        uint32_t value = pool[i % POOL_SIZE] ^ hash_const;
        hash_const *= MULT_B;
        value *= hash_const;
        words[i] = value ^ (value >> 16);
    }
    for (int i = 0; i < 4; i++) state[i] = (uint64_t)words[2 * i] | (uint64_t)words[2 * i + 1] << 32;
}

typedef struct { unsigned __int128 state, increment; } pcg64;

static const unsigned __int128 PCG_MULTIPLIER =
    ((unsigned __int128)2549297995355413924ULL << 64) | 4865540595714422341ULL;

static uint64_t pcg64_next(pcg64 *rng) {
    rng->state = rng->state * PCG_MULTIPLIER + rng->increment;
    uint64_t high = (uint64_t)(rng->state >> 64), folded = high ^ (uint64_t)rng->state;
    unsigned rotation = (unsigned)(high >> 58);
    return (folded >> rotation) | (folded << ((64 - rotation) & 63));
}

/* default_rng(seed).random(count) into out */
static void numpy_uniforms(uint32_t seed, double *out, int count) {
    uint64_t words[4];
    seed_sequence_state(seed, words);
    unsigned __int128 initial = (unsigned __int128)words[0] << 64 | words[1];
    unsigned __int128 sequence = (unsigned __int128)words[2] << 64 | words[3];
    pcg64 rng = {0, sequence << 1 | 1};
    pcg64_next(&rng);
    rng.state += initial;
    pcg64_next(&rng);
    for (int i = 0; i < count; i++) out[i] = (double)(pcg64_next(&rng) >> 11) * (1.0 / 9007199254740992.0);
}

/* pipeline.transforms.crops.sample_seed, with Python's unbounded integers (seed, epoch, id >= 0) */
static uint32_t sample_seed(long long seed, long long epoch, long long sample_id) {
    unsigned __int128 mixed = ((unsigned __int128)seed * 1000003u + (unsigned __int128)epoch) * 2654435761u +
                              (unsigned __int128)sample_id * 40503u;
    return (uint32_t)(mixed % 4294967291u);
}

#endif
