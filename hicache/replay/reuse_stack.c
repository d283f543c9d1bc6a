/* The replay's LRU stack-depth pass (hicache/replay/reuse.py loads it with ctypes). Built at install (setup.py). */
#include <stdint.h>
#include <stdlib.h>

/* ids: every access as a dense item number in [0, items), requests back to back, request r being
   [starts[r], starts[r + 1]) at time ts[r]. Out: depths (0 = first access) and ages (-1 = first access), as the
   Python stack_depths computes them. 0, or -1 where memory ran out. */
int hicache_stack_depths(const int64_t *ids, int64_t n, const int64_t *starts, int64_t nreq, const double *ts,
                         int64_t items, int64_t *depths, double *ages) {
    int64_t size = n + 1;
    int64_t *fenwick = calloc((size_t)size + 1, sizeof(int64_t));
    int64_t *last = calloc((size_t)items + 1, sizeof(int64_t)); /* position of the last touch, 0 = none */
    double *last_ts = calloc((size_t)items + 1, sizeof(double));
    if (!fenwick || !last || !last_ts) {
        free(fenwick); free(last); free(last_ts);
        return -1;
    }
    int64_t live = 0, pos = 0;
    for (int64_t r = 0; r < nreq; r++) {
        int64_t a = starts[r], b = starts[r + 1];
        double t = ts[r];
        for (int64_t k = a; k < b; k++) {
            int64_t x = ids[k], p = last[x];
            if (!p) { depths[k] = 0; ages[k] = -1.0; continue; }
            int64_t before = 0;
            for (int64_t i = p; i; i &= i - 1) before += fenwick[i];
            depths[k] = live - before + 1;
            ages[k] = t - last_ts[x];
        }
        for (int64_t k = b - 1; k >= a; k--) {
            int64_t x = ids[k], p = last[x];
            if (!p) live++;
            else for (int64_t i = p; i <= size; i += i & -i) fenwick[i]--;
            pos++;
            for (int64_t i = pos; i <= size; i += i & -i) fenwick[i]++;
            last[x] = pos;
            last_ts[x] = t;
        }
    }
    free(fenwick); free(last); free(last_ts);
    return 0;
}
