/* A page copied and hashed in one pass: xxh3_64 (seed 0) of the bytes computed from the same registers that store
   them, so the hash costs no second read of the page and hides under the copy's memory traffic. Included by
   native_io.c.

   Hashing a piece after copying it reads it a second time from the core's cache, and memcpy of a piece that fits
   the cache stores through the cache: each destination line is read before it is written. Both cost: a 2 MiB page
   moved well below the rate of a streaming copy (bench/RESULTS.md, 'Engine tiers against the engines' own').
   Here the destination is written with non-temporal stores where it is 32-byte aligned, as host pools and slab
   slots are.

   The digest is xxh3_64's long-input algorithm (inputs over 240 bytes): eight 64-bit accumulators take 64-byte
   stripes, each keyed by the secret at 8 bytes further per stripe; after every 16 stripes (1,024 bytes) the
   accumulators are scrambled; the last stripe is the input's final 64 bytes; then the accumulators are merged and
   avalanched. The secret is libxxhash's default, handed in at start (`hicache_copy_hash_init`), and native.py
   checks this code's digests against libxxhash's before it uses them. x86-64 with AVX2 only; elsewhere
   `hicache_copy_hash_init` reports it off and pages are hashed by libxxhash as before. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#define CH_SECRET_BYTES 192
#define CH_STRIPE 64
#define CH_BLOCK 1024 /* stripes per block: (secret bytes - stripe) / 8 = 16 */
#define CH_MIN_LEN 241 /* shorter inputs take xxh3's other algorithms */

static unsigned char ch_secret[CH_SECRET_BYTES];
static int ch_enabled;

#if defined(__x86_64__)
#include <immintrin.h>

#define CH_P32_1 0x9E3779B1u
#define CH_P32_2 0x85EBCA77u
#define CH_P32_3 0xC2B2AE3Du
#define CH_P64_1 0x9E3779B185EBCA87ull
#define CH_P64_2 0xC2B2AE3D27D4EB4Full
#define CH_P64_3 0x165667B19E3779F9ull
#define CH_P64_4 0x85EBCA77C2B2AE63ull
#define CH_P64_5 0x27D4EB2F165667C5ull

/* One stripe: acc[i ^ 1] += word i; acc[i] += low32(word i ^ key i) * high32(word i ^ key i); the words stored to
   dst first where dst is given (`stream`: non-temporal). */
__attribute__((target("avx2"))) static inline void ch_stripe(__m256i acc[2], const char *src, char *dst,
                                                            const unsigned char *key, int stream) {
    for (int half = 0; half < 2; half++) {
        __m256i words = _mm256_loadu_si256((const __m256i *)(src + 32 * half));
        if (dst) {
            if (stream) _mm256_stream_si256((__m256i *)(dst + 32 * half), words);
            else _mm256_storeu_si256((__m256i *)(dst + 32 * half), words);
        }
        __m256i keyed = _mm256_xor_si256(words, _mm256_loadu_si256((const __m256i *)(key + 32 * half)));
        __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
        __m256i swapped = _mm256_shuffle_epi32(words, _MM_SHUFFLE(1, 0, 3, 2));
        acc[half] = _mm256_add_epi64(acc[half], _mm256_add_epi64(product, swapped));
    }
}

/* acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1, with the key at the secret's last 64 bytes. */
__attribute__((target("avx2"))) static inline void ch_scramble(__m256i acc[2]) {
    const __m256i prime = _mm256_set1_epi32((int)CH_P32_1);
    for (int half = 0; half < 2; half++) {
        __m256i a = _mm256_xor_si256(acc[half], _mm256_srli_epi64(acc[half], 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(ch_secret + CH_SECRET_BYTES - 64 + 32 * half)));
        __m256i low = _mm256_mul_epu32(a, prime);
        __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        acc[half] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
    }
}

static inline uint64_t ch_read64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t ch_fold(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

/* Copy len (> 240) bytes from src to dst (dst NULL: hash only) and return their xxh3_64. */
__attribute__((target("avx2"))) static uint64_t ch_copy_xxh3(char *dst, const char *src, size_t len) {
    int stream = dst && ((uintptr_t)dst & 31) == 0;
    const uint64_t init[8] = {CH_P32_3, CH_P64_1, CH_P64_2, CH_P64_3, CH_P64_4, CH_P32_2, CH_P64_5, CH_P32_1};
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)init), _mm256_loadu_si256((const __m256i *)(init + 4))};
    size_t blocks = (len - 1) / CH_BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        size_t at = b * CH_BLOCK;
        for (int s = 0; s < CH_BLOCK / CH_STRIPE; s++)
            ch_stripe(acc, src + at + CH_STRIPE * s, dst ? dst + at + CH_STRIPE * s : NULL, ch_secret + 8 * s, stream);
        ch_scramble(acc);
    }
    size_t at = blocks * CH_BLOCK, stripes = (len - 1 - at) / CH_STRIPE;
    for (size_t s = 0; s < stripes; s++)
        ch_stripe(acc, src + at + CH_STRIPE * s, dst ? dst + at + CH_STRIPE * s : NULL, ch_secret + 8 * s, stream);
    at += stripes * CH_STRIPE;
    if (dst) memcpy(dst + at, src + at, len - at); /* the tail no whole stripe stored (1 to 64 bytes) */
    ch_stripe(acc, src + len - CH_STRIPE, NULL, ch_secret + CH_SECRET_BYTES - CH_STRIPE - 7, 0);
    if (stream) _mm_sfence(); /* the streamed stores are visible before the caller reports the page done */
    uint64_t a[8];
    _mm256_storeu_si256((__m256i *)a, acc[0]);
    _mm256_storeu_si256((__m256i *)(a + 4), acc[1]);
    uint64_t h = (uint64_t)len * CH_P64_1;
    for (int i = 0; i < 4; i++)
        h += ch_fold(a[2 * i] ^ ch_read64(ch_secret + 11 + 16 * i), a[2 * i + 1] ^ ch_read64(ch_secret + 19 + 16 * i));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    return h;
}

static int ch_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#else
static uint64_t ch_copy_xxh3(char *dst, const char *src, size_t len) {
    (void)dst, (void)src, (void)len;
    return 0;
}

static int ch_supported(void) { return 0; }
#endif

/* Take xxh3's default secret (192 bytes; NULL turns the one-pass copy off) and say whether the one-pass copy is
   on: 1 where this CPU has AVX2, else 0. */
int hicache_copy_hash_init(const unsigned char *secret) {
    ch_enabled = 0;
    if (!secret || !ch_supported()) return 0;
    memcpy(ch_secret, secret, CH_SECRET_BYTES);
    ch_enabled = 1;
    return 1;
}

/* The one-pass copy and hash of len bytes as the page loops run it (dst NULL: hash only), for native.py's check
   against libxxhash and for tests: 0 and *digest set, or -EINVAL where the one-pass copy is off or len is too
   short for it. */
int hicache_copy_xxh3(char *dst, const char *src, size_t len, uint64_t *digest) {
    if (!ch_enabled || len < CH_MIN_LEN) return -EINVAL;
    *digest = ch_copy_xxh3(dst, src, len);
    return 0;
}
