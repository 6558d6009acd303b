/* memsem native layer: delta versions (tile digests, diffs, patches); see memsem_native.h.
 *
 * The digest is built like XXH3's long-input path (eight lanes of 32x32-bit products and adds,
 * scrambled every kilobyte, merged with xxh64's rounds, then its avalanche): not cryptographic,
 * 64 bits, about as fast as memory can be read. It tells a
 * reader whether its buffers hold the writer's bytes (an accident: a buffer changed between
 * versions, a lost patch); relays, which must catch a faulty peer, keep sha256.
 */
#include "memsem_native.h"

#include <stdint.h>
#include <string.h>

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull
#define P4 0x85EBCA77C2B2AE63ull
#define P5 0x27D4EB2F165667C5ull

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t pad8(uint64_t x) { return (x + 7) & ~(uint64_t)7; }

static inline uint64_t round64(uint64_t acc, uint64_t in) {
    acc += in * P2;
    acc = rotl(acc, 31);
    return acc * P1;
}

/* The bulk: 8 accumulators, each 64-byte stripe adds to lane i the product of the two 32-bit
 * halves of (word i ^ key i) and to lane i ^ 1 word i itself (so every input bit reaches an
 * accumulator through a plain add); every 16 stripes the lanes are scrambled (xorshift, key,
 * a 32-bit prime). The same arithmetic with SSE2 (two lanes per register) or in plain C (the
 * base), and with AVX2 (four lanes) where the CPU has it. */
static const uint64_t KEY[8] = {0xbe4ba423396cfeb8ull, 0x1cad21f72c81017cull, 0xdb979083e96dd4deull,
                                0x1f67b3b7a4a44072ull, 0x78e5c0cc4ee679cbull, 0x2172ffcc7dd05a82ull,
                                0x8e2443f7744608b8ull, 0x4c263a81e69035e0ull};
#define STRIPE 64
#define STRIPES_PER_BLOCK 16
#define PRIME32 0x9E3779B1ull

#if defined(__SSE2__)
#include <emmintrin.h>

static void bulk_base(uint64_t acc_out[8], const uint8_t *p, uint64_t stripes) {
    __m128i acc[4], key[4];
    const __m128i prime = _mm_set1_epi32((int)PRIME32);
    for (int j = 0; j < 4; j++) {
        acc[j] = _mm_loadu_si128((const __m128i *)(acc_out + 2 * j));
        key[j] = _mm_loadu_si128((const __m128i *)(KEY + 2 * j));
    }
    for (uint64_t s = 0; s < stripes; s++, p += STRIPE) {
        for (int j = 0; j < 4; j++) {
            __m128i d = _mm_loadu_si128((const __m128i *)(p + 16 * j));
            __m128i k = _mm_xor_si128(d, key[j]);
            __m128i prod = _mm_mul_epu32(k, _mm_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)));
            __m128i swap = _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
            acc[j] = _mm_add_epi64(acc[j], _mm_add_epi64(prod, swap));
        }
        if ((s + 1) % STRIPES_PER_BLOCK == 0) {
            for (int j = 0; j < 4; j++) {
                __m128i a = _mm_xor_si128(_mm_xor_si128(acc[j], _mm_srli_epi64(acc[j], 47)), key[j]);
                __m128i lo = _mm_mul_epu32(a, prime);
                __m128i hi = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
                acc[j] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
            }
        }
    }
    for (int j = 0; j < 4; j++)
        _mm_storeu_si128((__m128i *)(acc_out + 2 * j), acc[j]);
}
#else
static void bulk_base(uint64_t acc[8], const uint8_t *p, uint64_t stripes) {
    for (uint64_t s = 0; s < stripes; s++, p += STRIPE) {
        for (int i = 0; i < 8; i++) {
            uint64_t v = rd64(p + 8 * i), k = v ^ KEY[i];
            acc[i ^ 1] += v;
            acc[i] += (k & 0xffffffffull) * (k >> 32);
        }
        if ((s + 1) % STRIPES_PER_BLOCK == 0) {
            for (int i = 0; i < 8; i++) {
                uint64_t a = acc[i];
                a ^= a >> 47;
                a ^= KEY[i];
                acc[i] = a * PRIME32;
            }
        }
    }
}
#endif


#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_BULK 1

/* The same arithmetic four lanes at a time: _mm256_shuffle_epi32 and _mm256_mul_epu32 act on each
 * 128-bit half as their SSE2 forms do on one register, so every lane computes what it computes
 * above, and the digest is the same function on every machine (a writer with AVX2 and a reader
 * without agree). Chosen at run time (memsem_digest_impl). */
__attribute__((target("avx2"))) static void bulk_avx2(uint64_t acc_out[8], const uint8_t *p, uint64_t stripes) {
    __m256i acc[2], key[2];
    const __m256i prime = _mm256_set1_epi32((int)PRIME32);
    for (int j = 0; j < 2; j++) {
        acc[j] = _mm256_loadu_si256((const __m256i *)(acc_out + 4 * j));
        key[j] = _mm256_loadu_si256((const __m256i *)(KEY + 4 * j));
    }
    for (uint64_t s = 0; s < stripes; s++, p += STRIPE) {
        for (int j = 0; j < 2; j++) {
            __m256i d = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
            __m256i k = _mm256_xor_si256(d, key[j]);
            __m256i prod = _mm256_mul_epu32(k, _mm256_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)));
            __m256i swap = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
            acc[j] = _mm256_add_epi64(acc[j], _mm256_add_epi64(prod, swap));
        }
        if ((s + 1) % STRIPES_PER_BLOCK == 0) {
            for (int j = 0; j < 2; j++) {
                __m256i a = _mm256_xor_si256(_mm256_xor_si256(acc[j], _mm256_srli_epi64(acc[j], 47)), key[j]);
                __m256i lo = _mm256_mul_epu32(a, prime);
                __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
                acc[j] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
            }
        }
    }
    for (int j = 0; j < 2; j++)
        _mm256_storeu_si256((__m256i *)(acc_out + 4 * j), acc[j]);
}
#endif

typedef void (*bulk_fn)(uint64_t acc[8], const uint8_t *p, uint64_t stripes);
/* the bulk in use (NULL: not chosen yet); a relaxed atomic word: every thread that chooses
 * chooses the same */
static bulk_fn bulk_impl;

static bulk_fn choose_bulk(void) {
#ifdef HAVE_AVX2_BULK
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        return bulk_avx2;
#endif
    return bulk_base;
}

int memsem_digest_impl(int which) {
    bulk_fn f;
    if (which == 0)
        f = choose_bulk();
    else if (which == 1)
        f = bulk_base;
    else if (which == 2) {
#ifdef HAVE_AVX2_BULK
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("avx2"))
            return -1;
        f = bulk_avx2;
#else
        return -1;
#endif
    } else if (which == -1) {
        f = __atomic_load_n(&bulk_impl, __ATOMIC_RELAXED);
        if (f == NULL)
            f = choose_bulk();
    } else
        return -1;
    if (which != -1)
        __atomic_store_n(&bulk_impl, f, __ATOMIC_RELAXED);
#ifdef HAVE_AVX2_BULK
    if (f == bulk_avx2)
        return 2;
#endif
    return 1;
}

static inline void bulk(uint64_t acc[8], const uint8_t *p, uint64_t stripes) {
    bulk_fn f = __atomic_load_n(&bulk_impl, __ATOMIC_RELAXED);
    if (__builtin_expect(f == NULL, 0)) {
        f = choose_bulk();
        __atomic_store_n(&bulk_impl, f, __ATOMIC_RELAXED);
    }
    f(acc, p, stripes);
}

static inline void digest_init(uint64_t acc[8], uint64_t seed) {
    const uint64_t init[8] = {P3, P1, P2, P4, P5, P3 ^ seed, P2 ^ seed, P1 ^ seed};
    memcpy(acc, init, sizeof init);
}

/* The digest of nbytes at addr whose whole stripes were already folded into acc by bulk(). */
static uint64_t digest_finish(const uint64_t acc[8], uint64_t addr, uint64_t nbytes, uint64_t seed) {
    const uint8_t *p = (const uint8_t *)(uintptr_t)addr + (nbytes / STRIPE) * STRIPE;
    uint64_t h = seed + P5 + nbytes;
    for (int i = 0; i < 8; i++) {
        h ^= round64(0, acc[i]);
        h = rotl(h, 27) * P1 + P4;
    }
    const uint8_t *end = (const uint8_t *)(uintptr_t)addr + nbytes;
    while (p + 8 <= end) {
        h ^= round64(0, rd64(p));
        h = rotl(h, 27) * P1 + P4;
        p += 8;
    }
    while (p < end) {
        h ^= (*p) * P5;
        h = rotl(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

uint64_t memsem_digest(uint64_t addr, uint64_t nbytes, uint64_t seed) {
    uint64_t acc[8];
    digest_init(acc, seed);
    bulk(acc, (const uint8_t *)(uintptr_t)addr, nbytes / STRIPE);
    return digest_finish(acc, addr, nbytes, seed);
}

void memsem_digest_tiles(const uint64_t *addr, const uint64_t *nbytes, uint64_t n, uint64_t *out) {
    for (uint64_t i = 0; i < n; i++)
        out[i] = memsem_digest(addr[i], nbytes[i], 0);
}

/* One bit per byte of 32 bytes at p and q: set where they differ. */
#if defined(__SSE2__)
static inline uint32_t diff_bits(const uint8_t *p, const uint8_t *q) {
    __m128i e0 = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)q));
    __m128i e1 = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(p + 16)), _mm_loadu_si128((const __m128i *)(q + 16)));
    uint32_t eq = (uint32_t)_mm_movemask_epi8(e0) | ((uint32_t)_mm_movemask_epi8(e1) << 16);
    return ~eq;
}
#else
static inline uint32_t diff_bits(const uint8_t *p, const uint8_t *q) {
    uint32_t d = 0;
    for (int w = 0; w < 4; w++) {
        uint64_t x = rd64(p + 8 * w) ^ rd64(q + 8 * w);
        if (!x)
            continue;
        for (int k = 0; k < 8; k++)
            d |= (uint32_t)(((x >> (8 * k)) & 0xFF) != 0) << (8 * w + k);
    }
    return d;
}
#endif

/* The elements (of `size` bytes: 1, 2, 4 or 8) at which a and b differ, over nbytes (a multiple
 * of size), in order: each is counted, and written (its index to idx, its value in a to vals)
 * while fewer than `want` were written (idx NULL: counted only). Returns the count, or stop + 1
 * as soon as it passes stop. Each block of 32 bytes is compared at once (a bit per byte), and only
 * its differing elements are visited: at RL-like changes (about 1% of elements) most blocks
 * have none. */
/* Set bits of x (SWAR: no popcnt instruction is assumed, and libgcc's is a call). */
static inline uint32_t popcount32(uint32_t x) {
    x = x - ((x >> 1) & 0x55555555u);
    x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
    x = (x + (x >> 4)) & 0x0F0F0F0Fu;
    return (x * 0x01010101u) >> 24;
}

/* From one bit per byte, one bit per element of `size` bytes (at its first byte): set where any
 * of its bytes is. */
static inline uint32_t element_bits(uint32_t d, uint32_t size) {
    switch (size) {
    case 1: return d;
    case 2: return (d | (d >> 1)) & 0x55555555u;
    case 4: d |= d >> 1; d |= d >> 2; return d & 0x11111111u;
    default: d |= d >> 1; d |= d >> 2; d |= d >> 4; return d & 0x01010101u;
    }
}

#define SCAN_FN(NAME, SIZE)                                                                        \
    static uint64_t NAME(const uint8_t *a, const uint8_t *b, uint64_t nbytes, uint64_t stop, uint16_t *idx,      \
                         uint8_t *vals, uint64_t want) {                                                  \
        uint64_t c = 0, i = 0;                                                                            \
        const uint32_t emask = SIZE == 8 ? 0xFFu : (1u << SIZE) - 1;                                      \
        if (!idx) { /* counting only: one popcount per block of 32 bytes */                               \
            for (; i + 32 <= nbytes && c <= stop; i += 32)                                                \
                c += popcount32(element_bits(diff_bits(a + i, b + i), SIZE));                               \
            if (c > stop)                                                                                 \
                return stop + 1;                                                                          \
        }                                                                                                 \
        for (; i + 32 <= nbytes; i += 32) {                                                               \
            uint32_t d = diff_bits(a + i, b + i); /* bit k: byte i + k differs */                         \
            while (d) {                                                                                   \
                uint32_t k = (uint32_t)__builtin_ctz(d) & ~(uint32_t)(SIZE - 1); /* its first byte */      \
                d &= ~(emask << k);                                                                       \
                if (idx && c < want) {                                                                    \
                    idx[c] = (uint16_t)((i + k) / SIZE);                                                  \
                    memcpy(vals + c * SIZE, a + i + k, SIZE);                                             \
                }                                                                                         \
                if (++c > stop)                                                                           \
                    return stop + 1;                                                                      \
            }                                                                                             \
        }                                                                                                 \
        for (; i < nbytes; i += SIZE) {                                                                   \
            if (memcmp(a + i, b + i, SIZE) == 0)                                                          \
                continue;                                                                                 \
            if (idx && c < want) {                                                                        \
                idx[c] = (uint16_t)(i / SIZE);                                                            \
                memcpy(vals + c * SIZE, a + i, SIZE);                                                     \
            }                                                                                             \
            if (++c > stop)                                                                               \
                return stop + 1;                                                                          \
        }                                                                                                 \
        return c;                                                                                         \
    }

SCAN_FN(scan1, 1)
SCAN_FN(scan2, 2)
SCAN_FN(scan4, 4)
SCAN_FN(scan8, 8)

static uint64_t scan(const uint8_t *a, const uint8_t *b, uint64_t nbytes, uint32_t size, uint64_t stop,
                     uint16_t *idx, uint8_t *vals, uint64_t want) {
    switch (size) {
    case 1: return scan1(a, b, nbytes, stop, idx, vals, want);
    case 2: return scan2(a, b, nbytes, stop, idx, vals, want);
    case 4: return scan4(a, b, nbytes, stop, idx, vals, want);
    default: return scan8(a, b, nbytes, stop, idx, vals, want);
    }
}

uint64_t memsem_record_tiles(const uint64_t *new_addr, const uint64_t *old_addr, const uint64_t *nbytes,
                             const uint32_t *itemsize, const uint32_t *limit, const uint64_t *prev_digest, uint64_t n,
                             uint64_t *digest, uint32_t *count, uint64_t out, uint64_t out_cap) {
    uint64_t used = 0;
    for (uint64_t t = 0; t < n; t++) {
        const uint8_t *nw = (const uint8_t *)(uintptr_t)new_addr[t];
        const uint8_t *od = (const uint8_t *)(uintptr_t)old_addr[t];
        uint32_t size = itemsize[t];
        digest[t] = memsem_digest(new_addr[t], nbytes[t], 0);
        if (prev_digest && prev_digest[t] == digest[t]) {
            count[t] = 0;
            continue;
        }
        if (!od || (size != 1 && size != 2 && size != 4 && size != 8) || nbytes[t] % size) {
            count[t] = MEMSEM_DELTA_DENSE;
            continue;
        }
        /* the tile is in cache after its digest: count, then (few enough) encode */
        uint64_t c = scan(nw, od, nbytes[t], size, limit[t], NULL, NULL, 0);
        uint64_t ib = 2 * c, vb = c * size, need = pad8(ib) + pad8(vb);
        if (c > limit[t] || used + need > out_cap) {
            count[t] = c ? MEMSEM_DELTA_DENSE : 0;
            continue;
        }
        count[t] = (uint32_t)c;
        if (!c)
            continue;
        uint8_t *o = (uint8_t *)(uintptr_t)(out + used);
        if (scan(nw, od, nbytes[t], size, c, (uint16_t *)o, o + pad8(ib), c) != c) {
            count[t] = MEMSEM_DELTA_DENSE;  /* the bytes moved between the two scans */
            continue;
        }
        memset(o + ib, 0, pad8(ib) - ib);  /* the padding is zeros, never stale bytes */
        memset(o + pad8(ib) + vb, 0, pad8(vb) - vb);
        used += need;
    }
    return used;
}

#define PATCH_LOOP(T)                                                                   \
    do {                                                                                \
        T *d = (T *)dst;                                                                \
        const T *vals = (const T *)(p + pad8(2 * (uint64_t)c));                         \
        uint64_t elems = nbytes / sizeof(T);                                            \
        for (uint32_t k = 0; k < c; k++) {                                              \
            if (idx[k] < elems)                                                         \
                d[idx[k]] = vals[k];                                                    \
            else                                                                        \
                bad++;                                                                  \
        }                                                                               \
    } while (0)

/* Apply one tile's patch; returns the indices past the tile (not written). */
static uint64_t patch_one(uint8_t *dst, uint64_t nbytes, uint32_t size, uint32_t c, const uint8_t *p) {
    uint64_t bad = 0;
    const uint16_t *idx = (const uint16_t *)p;
    switch (size) {
    case 1: PATCH_LOOP(uint8_t); break;
    case 2: PATCH_LOOP(uint16_t); break;
    case 4: PATCH_LOOP(uint32_t); break;
    case 8: PATCH_LOOP(uint64_t); break;
    default: bad = c; break;
    }
    return bad;
}

uint64_t memsem_patch_tiles(const uint64_t *dst, const uint64_t *nbytes, const uint32_t *itemsize,
                            const uint32_t *count, const uint64_t *patch, uint64_t n) {
    uint64_t bad = 0;
    for (uint64_t t = 0; t < n; t++) {
        uint32_t c = count[t];
        if (c == 0 || c == MEMSEM_DELTA_DENSE)
            continue;
        bad += patch_one((uint8_t *)(uintptr_t)dst[t], nbytes[t], itemsize[t], c, (const uint8_t *)(uintptr_t)patch[t]);
    }
    return bad;
}

/* Patch and digest one tile in one pass, in blocks of FUSED_BLOCK bytes (whole digest blocks, a
 * multiple of every element size): a block's patches are applied right before the digest reads
 * the block, so each line of the tile is fetched once, in address order (patching the whole tile
 * first fetched its lines in the patches' scattered order: 3 times the digest's time for 1% of
 * elements). Needs ascending indices (record_tiles writes them so); when one falls in a block
 * already digested, the rest of the patch is applied and the tile digested again whole. Returns the digest; *bad
 * gets the indices past the tile (not written). */
#define FUSED_BLOCK (STRIPE * STRIPES_PER_BLOCK)
#define FUSED_LOOP(T)                                                                            \
    do {                                                                                         \
        T *d = (T *)dst;                                                                         \
        const T *vals = (const T *)(p + pad8(2 * (uint64_t)c));                                  \
        uint64_t elems = nbytes / sizeof(T), prev = 0;                                           \
        for (; off < whole; off += FUSED_BLOCK) {                                                \
            uint64_t end = (off + FUSED_BLOCK) / sizeof(T);                                      \
            for (; k < c && idx[k] < end; k++) {                                                 \
                if (idx[k] < prev) {                                                             \
                    sorted = 0;                                                                  \
                    goto T##_rest;                                                               \
                }                                                                                \
                prev = idx[k];                                                                   \
                d[idx[k]] = vals[k];                                                             \
            }                                                                                    \
            bulk(acc, dst + off, STRIPES_PER_BLOCK);                                             \
        }                                                                                        \
    T##_rest:                                                                                    \
        for (; k < c; k++) {                                                                     \
            if ((uint64_t)idx[k] * sizeof(T) < off)                                              \
                sorted = 0; /* a block already digested */                                       \
            if (idx[k] < elems)                                                                  \
                d[idx[k]] = vals[k];                                                             \
            else                                                                                 \
                (*bad)++;                                                                        \
        }                                                                                        \
    } while (0)

static uint64_t digest_patched(uint8_t *dst, uint64_t nbytes, uint32_t size, uint32_t c, const uint8_t *p,
                               uint64_t *bad) {
    const uint16_t *idx = (const uint16_t *)p;
    uint64_t acc[8];
    uint64_t whole = (nbytes / FUSED_BLOCK) * FUSED_BLOCK, off = 0;
    uint32_t k = 0;
    int sorted = 1;
    digest_init(acc, 0);
    switch (size) {
    case 1: FUSED_LOOP(uint8_t); break;
    case 2: FUSED_LOOP(uint16_t); break;
    case 4: FUSED_LOOP(uint32_t); break;
    case 8: FUSED_LOOP(uint64_t); break;
    default: *bad = c; return 0;
    }
    if (!sorted)
        return memsem_digest((uint64_t)(uintptr_t)dst, nbytes, 0);
    bulk(acc, dst + whole, (nbytes - whole) / STRIPE);
    return digest_finish(acc, (uint64_t)(uintptr_t)dst, nbytes, 0);
}

uint64_t memsem_check_tiles(const uint64_t *dst, const uint64_t *nbytes, const uint32_t *itemsize,
                            const uint32_t *count, const uint64_t *patch, const uint64_t *expected, uint64_t n) {
    uint64_t wrong = 0;
    for (uint64_t t = 0; t < n; t++) {
        uint32_t c = count ? count[t] : 0;
        uint64_t got, bad = 0;
        if (c && c != MEMSEM_DELTA_DENSE)
            got = digest_patched((uint8_t *)(uintptr_t)dst[t], nbytes[t], itemsize[t], c,
                                 (const uint8_t *)(uintptr_t)patch[t], &bad);
        else
            got = memsem_digest(dst[t], nbytes[t], 0);
        if (bad || got != expected[t])
            wrong++;
    }
    return wrong;
}
