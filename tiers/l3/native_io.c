/* The L3's page I/O loop: a page read or written in pieces, each hashed as it moves, in one call that holds no
   interpreter lock (tiers/l3/native.py loads it with ctypes). Built at install (setup.py). */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "copy_hash.h"

typedef void *(*create_fn)(void);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);
typedef int (*free_fn)(void *);

static create_fn h_create;
static reset_fn h_reset;
static update_fn h_update;
static digest_fn h_digest;
static free_fn h_free;

int hicache_native_init(void *create, void *reset, void *update, void *digest, void *release) {
    h_create = (create_fn)create;
    h_reset = (reset_fn)reset;
    h_update = (update_fn)update;
    h_digest = (digest_fn)digest;
    h_free = (free_fn)release;
    return h_create && h_reset && h_update && h_digest && h_free ? 0 : -EINVAL;
}

/* Move len bytes between buf and the file at offset, `piece` bytes at a time, hashing each piece while it is in
   the core's cache: right after it is read, or right before it is written. 0 and *digest set, or -errno: -ENODATA
   where a read finds the file ending first, -EIO where the device stops taking a write's bytes. */
static int move_hashed(int fd, char *buf, size_t len, int64_t offset, size_t piece, int write, uint64_t *digest) {
    void *state = h_create();
    if (!state) return -ENOMEM;
    h_reset(state);
    size_t done = 0;
    while (done < len) {
        size_t n = len - done < piece ? len - done : piece;
        if (write) h_update(state, buf + done, n);
        size_t moved = 0;
        while (moved < n) {
            char *at = buf + done + moved;
            off_t where = (off_t)(offset + done + moved);
            ssize_t r = write ? pwrite(fd, at, n - moved, where) : pread(fd, at, n - moved, where);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                int err = r < 0 ? errno : (write ? EIO : ENODATA);
                h_free(state);
                return -err;
            }
            moved += (size_t)r;
        }
        if (!write) h_update(state, buf + done, n);
        done += n;
    }
    *digest = h_digest(state);
    h_free(state);
    return 0;
}

int hicache_read_hashed(int fd, char *buf, size_t len, int64_t offset, size_t piece, uint64_t *digest) {
    return move_hashed(fd, buf, len, offset, piece, 0, digest);
}

int hicache_write_hashed(int fd, char *buf, size_t len, int64_t offset, size_t piece, uint64_t *digest) {
    return move_hashed(fd, buf, len, offset, piece, 1, digest);
}

/* 1 if the file lives in memory (tmpfs, ramfs, hugetlbfs: its pages are the page cache), 0 if not, -errno. */
int hicache_in_memory_fs(int fd) {
    struct statfs s;
    if (fstatfs(fd, &s)) return -errno;
    return s.f_type == 0x01021994 || s.f_type == 0x858458f6 || s.f_type == 0x958458f6;
}

int hicache_map(int fd, size_t len, int writable, void **out) {
    void *p = mmap(NULL, len, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return -errno;
    *out = p;
    return 0;
}

int hicache_unmap(void *p, size_t len) {
    return munmap(p, len) ? -errno : 0;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

/* Touch every 4 KiB page of a mapping once: a read, or for a writable one an atomic add of zero, which takes a write
   fault (page tables filled writable) without changing a byte, even where another thread is copying into the page. */
void hicache_touch(char *p, size_t len, int writable) {
    volatile char sink = 0;
    for (size_t at = 0; at < len; at += 4096) {
        if (writable) __atomic_fetch_add(p + at, 0, __ATOMIC_RELAXED);
        else sink += p[at];
    }
    (void)sink;
}

/* Fault len bytes of a mapping in ahead of use (page tables filled, for writing if `writable`), so the copies do not
   take a fault per 4 KiB page: 0 by MADV_POPULATE_*, 1 by touching each page (kernels before 5.14 and sandboxes
   that refuse the advice), or -errno. */
int hicache_populate(char *p, size_t len, int writable) {
    if (madvise(p, len, writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0) return 0;
    if (errno != EINVAL && errno != ENOSYS) return -errno;
    hicache_touch(p, len, writable);
    return 1;
}

/* Copy len bytes between buf and a shared mapping of the file (`mapped` bytes long) at offset, hashing them: in one
   pass where the one-pass copy is on (copy_hash.h), else `piece` bytes at a time, each piece hashed while it is in
   the core's cache (a read hashes the piece it copied into buf, a write the piece of buf it has just copied). The
   file's size is checked first: touching a mapping past the end of its file raises SIGBUS, so a slab cut short
   gives -ENODATA instead. */
static int copy_mapped(char *base, size_t mapped, int fd, char *buf, size_t len, int64_t offset, size_t piece,
                       int write, uint64_t *digest) {
    struct stat st;
    if (fstat(fd, &st)) return -errno;
    if (offset < 0 || (uint64_t)offset + len > mapped || (uint64_t)offset + len > (uint64_t)st.st_size)
        return -ENODATA;
    if (ch_enabled && len >= CH_MIN_LEN) {  /* one pass: the copy's registers are hashed as they are stored */
        *digest = write ? ch_copy_xxh3(base + offset, buf, len) : ch_copy_xxh3(buf, base + offset, len);
        return 0;
    }
    void *state = h_create();
    if (!state) return -ENOMEM;
    h_reset(state);
    for (size_t done = 0; done < len; done += piece) {
        size_t n = len - done < piece ? len - done : piece;
        if (write) {  /* copy first: the copy streams the piece from memory, the hash then finds it in cache */
            memcpy(base + offset + done, buf + done, n);
            h_update(state, buf + done, n);
        } else {
            memcpy(buf + done, base + offset + done, n);
            h_update(state, buf + done, n);
        }
    }
    *digest = h_digest(state);
    h_free(state);
    return 0;
}

int hicache_read_mapped(char *base, size_t mapped, int fd, char *buf, size_t len, int64_t offset, size_t piece,
                        uint64_t *digest) {
    return copy_mapped(base, mapped, fd, buf, len, offset, piece, 0, digest);
}

int hicache_write_mapped(char *base, size_t mapped, int fd, char *buf, size_t len, int64_t offset, size_t piece,
                         uint64_t *digest) {
    return copy_mapped(base, mapped, fd, buf, len, offset, piece, 1, digest);
}

/* n pages of len bytes between bufs[i] and the mapping at offsets[i], each hashed into digests[i] with its result
   (0 or -errno) in rcs[i]. Several threads may run one batch at once: each takes the next page from *next until
   none is left, so a slow page holds up one thread, and a call costs one entry from Python per thread. */
void hicache_copy_mapped_batch(char *base, size_t mapped, int fd, char **bufs, const int64_t *offsets, size_t n,
                               size_t len, size_t piece, int write, int64_t *next, uint64_t *digests, int *rcs) {
    for (;;) {
        int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i < 0 || (size_t)i >= n) return;
        rcs[i] = copy_mapped(base, mapped, fd, bufs[i], len, offsets[i], piece, write, &digests[i]);
    }
}
