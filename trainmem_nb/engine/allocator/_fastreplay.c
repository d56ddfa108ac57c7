/* The caching allocator's replay in C: the same decisions as `caching.CachingAllocator` (torch 2.13
 * c10/cuda/CUDACachingAllocator.cpp) with no memory fraction and no roundup_power2_divisions, on one
 * stream or several, with or without expandable segments, about twenty times faster. Optional: where
 * this module is not built, `trainmem_nb.engine.allocator.fast` replays in Python, and the tests check
 * that both give the same bytes on random traces and on the steps of every family.
 *
 * Rules (CCA = CUDACachingAllocator.cpp, line numbers as cited in caching.py):
 *   round_size: < 512 B -> 512, else up to a multiple of 512                 CCA:2586-2594
 *   pool: rounded size <= 1 MiB -> small pool, else large                    CCA:3080-3084
 *   best fit: the smallest cached block >= the request, lowest address first CCA:3134 (BlockComparatorSize)
 *   new segment: 2 MiB (small), large_segment_size under 10 MiB, else the
 *     request rounded up to 2 MiB                                            CCA:3115-3123
 *   max_split_size: no cached block of max_split_size or more for a smaller
 *     request; for a larger one, none max_non_split_rounding_size above it   CCA:3171-3179
 *   split: small pool if >= 512 B remain, large pool if > 1 MiB remain and
 *     the request is under max_split_size                                    CCA:3095-3113
 *   free: merge with free neighbours, back into the pool                     CCA:2949-3058
 * Streams (a malloc's CUDA stream, `trace_streams`): each stream has its own small and large pools; a
 * request is served from its stream's pools only, and a block goes back to the pools of the stream it was
 * allocated on: BlockComparatorSize orders blocks by stream first        CCA:867-875, and get_free_block's
 *   lower_bound searches from (stream, size)                                  CCA:3134
 * With expandable_segments:True (expandable.py) every segment is one virtual range per pool, mapped a page
 * at a time (2 MiB small, large_segment_size large):
 *   best fit by the size a block could grow to (its unmapped successor too)    CCA:3139-3154
 *   a new block: the lowest-address unmapped range (with the free block before
 *     it) that holds the request, else a new range; pages mapped as needed    CCA:2799-2946
 *   map: whole pages, merged with mapped free neighbours                       CCA:2846-2913
 *   split: whenever 512 B or more remain, in either pool                       CCA:3107-3108
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define K_SMALL_SIZE 1048576LL      /* AC.h:21 kSmallSize */
#define K_SMALL_BUFFER 2097152LL    /* AC.h:17 kSmallBuffer */
#define K_MIN_LARGE_ALLOC 10485760LL /* AC.h:23 kMinLargeAlloc */
#define K_ROUND_LARGE 2097152LL     /* AC.h:25 kRoundLarge */
#define ADDR_ALIGN 2097152LL        /* spec/alloc_conf.py _ADDR_ALIGN */
#define ADDR_BASE 0x7F0000000000LL  /* spec/alloc_conf.py _ADDR_BASE */
#define ADDR_LIMIT (1LL << 56)      /* spec/alloc_conf.py _KEY_SHIFT: addresses stay below 2**56 */

#define MAX_STREAMS 8 /* streams a trace may use: 0 (the default) to MAX_STREAMS - 1 */
#define ST_FREE 0     /* cached (mapped) */
#define ST_ALLOC 1
#define ST_UNMAPPED 2 /* an expandable segment's range with no pages behind it */

typedef struct {
    int64_t size, addr;
    int32_t prev, next;
    int32_t seg;   /* its expandable segment (State.es), -1 for a plain cudaMalloc segment */
    int8_t state;  /* ST_FREE, ST_ALLOC, ST_UNMAPPED; -1 slot unused */
    int8_t pool;   /* its pool: 2 * stream + (1 small, 0 large) */
} Block;

/* ExpandableSegment (CCA:368-780): its virtual range starts at base; pages of `page` bytes */
typedef struct {
    int64_t base, page;
} ExpSeg;

typedef struct {
    int64_t size, addr;
    int32_t blk;
} Key;

/* The unmapped ranges of a pool (expandable segments), keyed (address, 0): the keys sorted, in chunks of at
 * most CHUNK keys (a sorted list of sorted lists, as Python's sortedcontainers keeps them), so an insert
 * moves at most a chunk however many ranges there are. */
#define CHUNK 32
typedef struct {
    Key k[CHUNK];
    int n;
} Chunk;

typedef struct {
    Chunk **c;
    Key *last; /* each chunk's last key, side by side for the search */
    Py_ssize_t nc, cap;
} Pool;

typedef struct {
    Py_ssize_t c, i;
} Pos;

/* The free blocks of a pool in std::set order (size, then address: BlockComparatorSize, CCA:867-875), one
 * bucket per distinct size: the buckets sorted by size (`sizes` side by side for the search), each bucket's
 * addresses sorted high to low so that best fit's block, the lowest address of a size, is its last entry.
 * A step's cache holds hundreds of blocks but few distinct sizes (llama-3-8b: 365 blocks and 9 sizes on
 * average, 1020 and 14 at most), so finding a size is a few compares and taking its block costs nothing:
 * about three times faster than one sorted list of every block. */
typedef struct {
    int64_t addr;
    int32_t blk;
} Entry;

typedef struct {
    Entry *e;
    int32_t n, cap;
} Bucket;

typedef struct {
    int64_t *sizes;
    Bucket *b;
    Py_ssize_t n, cap;
    Bucket *spare; /* emptied buckets, their arrays kept for the next size */
    Py_ssize_t nspare, capspare;
} SPool;

/* index of the first bucket whose size is >= size, n when none */
static Py_ssize_t sp_bucket(const SPool *p, int64_t size) {
    Py_ssize_t n = p->n;
    if (n == 0) return 0;
    const int64_t *base = p->sizes;
    while (n > 1) {
        Py_ssize_t half = n >> 1;
        base = base[half - 1] < size ? base + half : base;
        n -= half;
    }
    return (base - p->sizes) + (*base < size);
}

/* best fit: the lowest address of the smallest size >= size (std::set::lower_bound((size, 0)));
 * .c == n when there is none */
static Pos sp_lower_bound(const SPool *p, int64_t size) {
    Pos pos = {sp_bucket(p, size), 0};
    if (pos.c < p->n) pos.i = p->b[pos.c].n - 1;
    return pos;
}

static inline const Entry *sp_at(const SPool *p, Pos pos) { return &p->b[pos.c].e[pos.i]; }

/* the next key in (size, address) order; .c == n past the last */
static inline Pos sp_next(const SPool *p, Pos pos) {
    if (pos.i > 0) {
        pos.i--;
    } else if (++pos.c < p->n) {
        pos.i = p->b[pos.c].n - 1;
    }
    return pos;
}

/* index in a bucket (addresses high to low) of the first entry below addr: where addr goes, or is just
 * before. From the low end: most blocks freed or split are near it (llama-3-8b: a dozen entries on average
 * in buckets of a hundred), and a short scan there beats a binary search's mispredicted branches. */
static Py_ssize_t sp_addr_index(const Bucket *bk, int64_t addr) {
    Py_ssize_t i = bk->n, stop = i > 16 ? i - 16 : 0;
    while (i > stop && bk->e[i - 1].addr < addr) i--;
    if (i > stop || i == 0) return i;
    Py_ssize_t n = i; /* further up: a binary search of the rest */
    const Entry *base = bk->e;
    while (n > 1) {
        Py_ssize_t half = n >> 1;
        base = base[half - 1].addr >= addr ? base + half : base;
        n -= half;
    }
    return (base - bk->e) + (base->addr >= addr);
}

static void sp_remove_at(SPool *p, Pos pos) {
    Bucket *bk = &p->b[pos.c];
    memmove(bk->e + pos.i, bk->e + pos.i + 1, (size_t)(bk->n - 1 - pos.i) * sizeof(Entry));
    if (--bk->n > 0) return;
    p->spare[p->nspare++] = *bk; /* room kept by sp_insert */
    memmove(p->b + pos.c, p->b + pos.c + 1, (size_t)(p->n - pos.c - 1) * sizeof(Bucket));
    memmove(p->sizes + pos.c, p->sizes + pos.c + 1, (size_t)(p->n - pos.c - 1) * sizeof(int64_t));
    p->n--;
}

static void sp_remove(SPool *p, int64_t size, int64_t addr) {
    Pos pos = {sp_bucket(p, size), 0};
    pos.i = sp_addr_index(&p->b[pos.c], addr) - 1; /* the entry at addr: the last one at or above it */
    sp_remove_at(p, pos);
}

static int sp_insert(SPool *p, int64_t size, int64_t addr, int32_t blk) {
    Py_ssize_t c = sp_bucket(p, size);
    if (c == p->n || p->sizes[c] != size) { /* a new size */
        if (p->n == p->cap) {
            Py_ssize_t cap = p->cap ? p->cap * 2 : 16;
            int64_t *sizes = realloc(p->sizes, (size_t)cap * sizeof(int64_t));
            if (!sizes) return -1;
            p->sizes = sizes;
            Bucket *b = realloc(p->b, (size_t)cap * sizeof(Bucket));
            if (!b) return -1;
            p->b = b;
            Bucket *spare = realloc(p->spare, (size_t)cap * sizeof(Bucket)); /* every bucket may empty */
            if (!spare) return -1;
            p->spare = spare;
            p->cap = p->capspare = cap;
        }
        Bucket nb = {NULL, 0, 0};
        if (p->nspare) nb = p->spare[--p->nspare];
        memmove(p->b + c + 1, p->b + c, (size_t)(p->n - c) * sizeof(Bucket));
        memmove(p->sizes + c + 1, p->sizes + c, (size_t)(p->n - c) * sizeof(int64_t));
        p->b[c] = nb;
        p->sizes[c] = size;
        p->n++;
    }
    Bucket *bk = &p->b[c];
    if (bk->n == bk->cap) {
        int32_t cap = bk->cap ? bk->cap * 2 : 8;
        Entry *e = realloc(bk->e, (size_t)cap * sizeof(Entry));
        if (!e) return -1;
        bk->e = e;
        bk->cap = cap;
    }
    Py_ssize_t i = sp_addr_index(bk, addr);
    memmove(bk->e + i + 1, bk->e + i, (size_t)(bk->n - i) * sizeof(Entry));
    bk->e[i].addr = addr;
    bk->e[i].blk = blk;
    bk->n++;
    return 0;
}

static void sp_free(SPool *p) {
    for (Py_ssize_t i = 0; i < p->n; i++) free(p->b[i].e);
    for (Py_ssize_t i = 0; i < p->nspare; i++) free(p->spare[i].e);
    free(p->sizes);
    free(p->b);
    free(p->spare);
}

typedef struct {
    Block *b;
    Py_ssize_t n, cap;
    int32_t *spare; /* slots of blocks merged away */
    Py_ssize_t nspare, capspare;
    SPool pool[2 * MAX_STREAMS];  /* [2 * stream] large, [2 * stream + 1] small */
    Pool upool[2 * MAX_STREAMS];  /* unmapped blocks by address (BlockComparatorAddress, CCA:876-881): key (addr, 0) */
    ExpSeg *es;
    Py_ssize_t nes, capes;
    int64_t next_addr, reserved, allocated, peak_reserved, peak_allocated;
} State;

static inline int key_less(int64_t s1, int64_t a1, int64_t s2, int64_t a2) {
    return (s1 < s2) | ((s1 == s2) & (a1 < a2));
}

/* index of the first of keys[0..n) >= (size, addr), n when none; without branches on the data (a
 * mispredicted branch per level cost more than the rest of the replay) */
static Py_ssize_t search(const Key *keys, Py_ssize_t n, int64_t size, int64_t addr) {
    if (n == 0) return 0;
    const Key *base = keys;
    while (n > 1) {
        Py_ssize_t half = n >> 1;
        const Key *m = base + half - 1;
        base = key_less(m->size, m->addr, size, addr) ? base + half : base;
        n -= half;
    }
    return (base - keys) + key_less(base->size, base->addr, size, addr);
}

/* the first key >= (size, addr): std::set::lower_bound; .c == nc when there is none */
static Pos lower_bound(const Pool *p, int64_t size, int64_t addr) {
    Pos pos = {search(p->last, p->nc, size, addr), 0};
    if (pos.c < p->nc) pos.i = search(p->c[pos.c]->k, p->c[pos.c]->n, size, addr);
    return pos;
}

static int add_chunk(Pool *p, Py_ssize_t at) {
    if (p->nc == p->cap) {
        Py_ssize_t cap = p->cap ? p->cap * 2 : 16;
        Chunk **c = realloc(p->c, (size_t)cap * sizeof(Chunk *));
        if (!c) return -1;
        p->c = c;
        Key *last = realloc(p->last, (size_t)cap * sizeof(Key));
        if (!last) return -1;
        p->last = last;
        p->cap = cap;
    }
    Chunk *ch = malloc(sizeof(Chunk));
    if (!ch) return -1;
    ch->n = 0;
    memmove(p->c + at + 1, p->c + at, (size_t)(p->nc - at) * sizeof(Chunk *));
    memmove(p->last + at + 1, p->last + at, (size_t)(p->nc - at) * sizeof(Key));
    p->c[at] = ch;
    p->nc++;
    return 0;
}

static int pool_insert(Pool *p, int64_t size, int64_t addr, int32_t blk) {
    Pos pos = lower_bound(p, size, addr);
    if (pos.c == p->nc) { /* after every key: the end of the last chunk */
        if (p->nc == 0 || p->c[p->nc - 1]->n == CHUNK) {
            if (add_chunk(p, p->nc) < 0) return -1;
            pos.c = p->nc - 1;
            pos.i = 0;
        } else {
            pos.c = p->nc - 1;
            pos.i = p->c[pos.c]->n;
        }
    } else if (p->c[pos.c]->n == CHUNK) { /* full: its upper half to a new chunk after it */
        if (add_chunk(p, pos.c + 1) < 0) return -1;
        Chunk *a = p->c[pos.c], *b = p->c[pos.c + 1];
        memcpy(b->k, a->k + CHUNK / 2, (CHUNK / 2) * sizeof(Key));
        a->n = b->n = CHUNK / 2;
        p->last[pos.c] = a->k[CHUNK / 2 - 1];
        p->last[pos.c + 1] = b->k[CHUNK / 2 - 1];
        if (pos.i > CHUNK / 2) {
            pos.c++;
            pos.i -= CHUNK / 2;
        }
    }
    Chunk *ch = p->c[pos.c];
    memmove(ch->k + pos.i + 1, ch->k + pos.i, (size_t)(ch->n - pos.i) * sizeof(Key));
    ch->k[pos.i].size = size;
    ch->k[pos.i].addr = addr;
    ch->k[pos.i].blk = blk;
    if (pos.i == ch->n) p->last[pos.c] = ch->k[pos.i];
    ch->n++;
    return 0;
}

static void pool_remove_at(Pool *p, Pos pos) {
    Chunk *ch = p->c[pos.c];
    memmove(ch->k + pos.i, ch->k + pos.i + 1, (size_t)(ch->n - pos.i - 1) * sizeof(Key));
    if (--ch->n == 0) {
        free(ch);
        memmove(p->c + pos.c, p->c + pos.c + 1, (size_t)(p->nc - pos.c - 1) * sizeof(Chunk *));
        memmove(p->last + pos.c, p->last + pos.c + 1, (size_t)(p->nc - pos.c - 1) * sizeof(Key));
        p->nc--;
    } else if (pos.i == ch->n) {
        p->last[pos.c] = ch->k[ch->n - 1];
    }
}

static void pool_free(Pool *p) {
    for (Py_ssize_t i = 0; i < p->nc; i++) free(p->c[i]);
    free(p->c);
    free(p->last);
}

/* room for one more of the `n` items of `size` bytes at *items (capacity *cap, doubled when full) */
static int reserve_one(void **items, Py_ssize_t *cap, Py_ssize_t n, size_t size) {
    if (n < *cap) return 0;
    Py_ssize_t c = *cap ? *cap * 2 : 256;
    void *grown = realloc(*items, (size_t)c * size);
    if (!grown) return -1;
    *items = grown;
    *cap = c;
    return 0;
}

static int32_t new_block(State *st) {
    if (st->nspare) return st->spare[--st->nspare];
    if (reserve_one((void **)&st->b, &st->cap, st->n, sizeof(Block)) < 0) return -1;
    return (int32_t)st->n++;
}

static int drop_block(State *st, int32_t i) {
    if (reserve_one((void **)&st->spare, &st->capspare, st->nspare, sizeof(int32_t)) < 0) return -1;
    st->b[i].state = -1;
    st->spare[st->nspare++] = i;
    return 0;
}

static int64_t largest_free(const State *st) {
    int64_t m = 0;
    for (int p = 0; p < 2 * MAX_STREAMS; p++) {
        const SPool *sp = &st->pool[p];
        if (sp->n && sp->sizes[sp->n - 1] > m) m = sp->sizes[sp->n - 1];
    }
    return m;
}

static void state_free(State *st) {
    free(st->b);
    free(st->spare);
    free(st->es);
    for (int p = 0; p < 2 * MAX_STREAMS; p++) {
        sp_free(&st->pool[p]);
        pool_free(&st->upool[p]);
    }
}

/* ---------------------------------------------------------------- expandable segments (expandable.py) */
#define FALLBACK (-2) /* a rule this path does not have: the caller replays in Python */

static int upool_insert(State *st, int32_t bi) {
    Block *b = &st->b[bi];
    b->state = ST_UNMAPPED;
    return pool_insert(&st->upool[b->pool], b->addr, 0, bi);
}

static void upool_remove(State *st, const Block *b) {
    pool_remove_at(&st->upool[b->pool], lower_bound(&st->upool[b->pool], b->addr, 0));
}

/* CCA:3027-3058 try_merge_blocks on the map path: src into dst when both are mapped and free, or both unmapped */
static int try_merge(State *st, int32_t di, int32_t si) {
    if (si < 0) return 0;
    Block *src = &st->b[si], *dst = &st->b[di];
    if (src->state == ST_ALLOC) return 0;
    if ((src->state == ST_UNMAPPED) != (dst->state == ST_UNMAPPED)) return 0;
    if (src->state == ST_UNMAPPED) upool_remove(st, src);
    else sp_remove(&st->pool[src->pool], src->size, src->addr);
    if (dst->prev == si) {
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev >= 0) st->b[dst->prev].next = di;
    } else {
        dst->next = src->next;
        if (dst->next >= 0) st->b[dst->next].prev = di;
    }
    dst->size += src->size;
    return drop_block(st, si);
}

/* CCA:2846-2913 map_block: the pages under [b, b + size) mapped; 1 done, FALLBACK past `capacity`, -1 error */
static int map_block(State *st, int32_t bi, int64_t size, int64_t capacity) {
    Block *b = &st->b[bi];
    const ExpSeg *es = &st->es[b->seg];
    int64_t begin = (b->addr - es->base) / es->page;                  /* CCA:400 segmentLeft */
    int64_t end = (b->addr + size - es->base + es->page - 1) / es->page; /* CCA:401 segmentRight */
    if (begin == end) return FALLBACK;
    int64_t nbytes = (end - begin) * es->page;
    if (capacity >= 0 && st->reserved + nbytes > capacity) return FALLBACK; /* CCA:466-475 */
    upool_remove(st, b);                                              /* CCA:2863-2864 */
    b->state = ST_FREE;
    if (nbytes < b->size) {                                           /* CCA:2867-2879 unmapped remainder */
        int32_t ri = new_block(st);
        if (ri < 0) return -1;
        b = &st->b[bi];
        Block *r = &st->b[ri];
        r->size = b->size - nbytes; r->addr = b->addr + nbytes; r->prev = bi; r->next = b->next;
        r->seg = b->seg; r->pool = b->pool;
        if (b->next >= 0) st->b[b->next].prev = ri;
        b->next = ri;
        b->size = nbytes;
        if (upool_insert(st, ri) < 0) return -1;
    }
    if (try_merge(st, bi, st->b[bi].prev) < 0) return -1;            /* CCA:2882-2883 */
    if (try_merge(st, bi, st->b[bi].next) < 0) return -1;
    b = &st->b[bi];
    if (sp_insert(&st->pool[b->pool], b->size, b->addr, bi) < 0) return -1; /* CCA:2885 */
    st->reserved += nbytes;                                           /* CCA:2888-2892 */
    if (st->reserved > st->peak_reserved) st->peak_reserved = st->reserved;
    return 1;
}

static int allocatable(const State *st, int32_t i) {
    return i >= 0 && (st->b[i].state == ST_FREE || st->b[i].state == ST_UNMAPPED);
}

/* CCA:2799-2844 find_expandable_block: the lowest-address unmapped range (with a free block right before it)
 * with room for `size`, else a new segment's whole range; a block index, FALLBACK or -1 */
static int32_t find_expandable_block(State *st, int pi, int64_t size, int64_t large_seg, int64_t total) {
    const Pool *u = &st->upool[pi];
    for (Py_ssize_t c = 0; c < u->nc; c++) {                          /* CCA:2819-2831 */
        for (int i = 0; i < u->c[c]->n; i++) {
            int32_t ci = u->c[c]->k[i].blk;
            if (allocatable(st, st->b[ci].prev)) ci = st->b[ci].prev;  /* CCA:2825-2827 */
            int64_t got = 0;
            for (int32_t x = ci; got < size && allocatable(st, x); x = st->b[x].next) got += st->b[x].size;
            if (got >= size) return ci;
        }
    }
    int64_t page = (pi & 1) ? K_SMALL_BUFFER : large_seg;             /* CCA:2832-2834 */
    int64_t handles = (total + total / 8 + page - 1) / page;         /* CCA:385 max_handles_ */
    int64_t va = handles * page;
    int64_t base = st->next_addr;
    st->next_addr = base + ((va + ADDR_ALIGN - 1) / ADDR_ALIGN) * ADDR_ALIGN;
    if (st->next_addr >= ADDR_LIMIT) return FALLBACK;
    if (reserve_one((void **)&st->es, &st->capes, st->nes, sizeof(ExpSeg)) < 0) return -1;
    st->es[st->nes].base = base;
    st->es[st->nes].page = page;
    int32_t bi = new_block(st);
    if (bi < 0) return -1;
    Block *b = &st->b[bi];
    b->size = va; b->addr = base; b->prev = b->next = -1; b->seg = (int32_t)st->nes++; b->pool = (int8_t)pi;
    if (upool_insert(st, bi) < 0) return -1;                          /* CCA:2838-2843 */
    return bi;
}

/* CCA:2915-2946 try_allocate_expandable_block: a free block of at least `size`, out of its pool */
static int32_t try_allocate_expandable(State *st, int pi, int64_t size, int64_t large_seg, int64_t capacity) {
    int64_t total = capacity >= 0 ? capacity : (1LL << 40);           /* spec/alloc_conf.py _DEFAULT_TOTAL */
    int32_t c = find_expandable_block(st, pi, size, large_seg, total);
    if (c < 0) return c;
    if (st->b[c].state == ST_UNMAPPED) {                              /* CCA:2927-2930 */
        int64_t want = st->b[c].size < size ? st->b[c].size : size;
        int r = map_block(st, c, want, capacity);
        if (r != 1) return r;
    }
    while (st->b[c].size < size) {                                    /* CCA:2933-2943 */
        int64_t remaining = size - st->b[c].size;
        int32_t nc = st->b[c].next;
        int64_t want = remaining < st->b[nc].size ? remaining : st->b[nc].size;
        int r = map_block(st, nc, want, capacity);
        if (r != 1) return r;
        c = nc;
    }
    sp_remove(&st->pool[pi], st->b[c].size, st->b[c].addr);           /* CCA:2944 */
    return c;
}

/* the size a cached block could reach: itself and the unmapped range after it (CCA:3141-3146) */
static int64_t expandable_size(const State *st, int32_t bi) {
    const Block *b = &st->b[bi];
    return b->size + (b->next >= 0 && st->b[b->next].state == ST_UNMAPPED ? st->b[b->next].size : 0);
}

/* reads an int64 sequence given as a buffer of 'q' (array('q')) */
static int get_buffer(PyObject *o, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(o, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != 8 || !view->format || (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an array('q') of int64", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* replay(load, ops, sizes, watch_from, large_segment_size, max_split_size, max_non_split_rounding_size, capacity,
 *        expandable=False, streams=None)
 *
 * The trace is `load` followed by `ops` expanded at `sizes`: an op o >= 0 mallocs sizes[o], o < 0 frees
 * allocation ~o + shift (allocations are numbered in order over load and ops; `shift` is the number of
 * mallocs in `load`, size 0 included). capacity < 0: unlimited. `streams`: None, or each op's stream (an
 * array('q') as long as `ops`, 0 to MAX_STREAMS - 1; loading's mallocs are on stream 0).
 * Returns None when the replay needs a rule this path does not have (a new segment beyond `capacity`:
 * the out-of-memory retry; the synthetic address space exhausted), else
 * (reserved, allocated, largest_free_block, peak_reserved, peak_allocated, watched) with watched None or
 * (reserved, allocated, largest free block at the highest (reserved, allocated) point from watch_from on,
 *  highest allocated from watch_from on), as `replay.replay(..., watch_from=...)` keeps it. */
static PyObject *replay(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *lo, *oo, *so, *stro = Py_None;
    long long watch_from, large_seg, max_split, max_nsr, capacity;
    int expandable = 0;
    if (!PyArg_ParseTuple(args, "OOOLLLLL|pO", &lo, &oo, &so, &watch_from, &large_seg, &max_split, &max_nsr, &capacity,
                          &expandable, &stro))
        return NULL;
    Py_buffer lv, ov, sv, tv;
    if (get_buffer(lo, &lv, "load") < 0) return NULL;
    if (get_buffer(oo, &ov, "ops") < 0) { PyBuffer_Release(&lv); return NULL; }
    if (get_buffer(so, &sv, "sizes") < 0) { PyBuffer_Release(&lv); PyBuffer_Release(&ov); return NULL; }
    const int64_t *streams = NULL;
    if (stro != Py_None) {
        if (get_buffer(stro, &tv, "streams") < 0) {
            PyBuffer_Release(&lv); PyBuffer_Release(&ov); PyBuffer_Release(&sv);
            return NULL;
        }
        if (tv.len != ov.len) {
            PyBuffer_Release(&lv); PyBuffer_Release(&ov); PyBuffer_Release(&sv); PyBuffer_Release(&tv);
            PyErr_SetString(PyExc_ValueError, "streams: one per op expected");
            return NULL;
        }
        streams = tv.buf;
    }
    const int64_t *load = lv.buf, *ops = ov.buf, *sizes = sv.buf;
    Py_ssize_t nload = lv.len / 8, nops = ov.len / 8, nsizes = sv.len / 8, nev = nload + nops;
    if (watch_from < 0) watch_from = nev; /* nothing watched */
    int64_t shift = 0;                    /* the ops' allocations are numbered after loading's */
    for (Py_ssize_t k = 0; k < nload; k++) shift += load[k] >= 0;

    State st;
    memset(&st, 0, sizeof st);
    st.next_addr = ADDR_BASE;
    /* handles: block index per allocation (-1: a size-0 malloc); at most one per event */
    int32_t *handles = malloc((size_t)(nev ? nev : 1) * sizeof(int32_t));
    int64_t nh = 0;
    int64_t w_res = -1, w_all = -1, w_big = 0, w_most = 0;
    int fallback = 0;
    const char *err = NULL;
    /* the loop touches no Python object: other threads run meanwhile (a sweep replays its rows side by side) */
    PyThreadState *released = NULL;
    if (!handles) { err = "out of memory"; goto done; }
    released = PyEval_SaveThread();

    for (Py_ssize_t k = 0; k < nev; k++) {
        int64_t e;
        int stream = 0;
        if (k < nload) {
            e = load[k];
        } else {
            int64_t o = ops[k - nload];
            if (streams) {
                int64_t sk = streams[k - nload];
                if (sk < 0 || sk >= MAX_STREAMS) { err = "stream out of range (0 to 7)"; goto done; }
                stream = (int)sk;
            }
            if (o >= 0) {
                if (o >= nsizes) { err = "size index out of range"; goto done; }
                e = sizes[o];
                if (e < 0) { err = "negative size"; goto done; }
            } else {
                e = ~((~o) + shift);
            }
        }
        if (e > 0) {
            int64_t rs = e < 512 ? 512 : ((e + 511) & ~511LL);          /* CCA:2586-2594 */
            int small = rs <= K_SMALL_SIZE;                              /* CCA:3080 */
            int pi = 2 * stream + small;                                 /* CCA:867-875 the stream's blocks */
            SPool *pool = &st.pool[pi];
            Pos i = sp_lower_bound(pool, rs);                            /* CCA:3134 */
            int32_t bi;
            int found = i.c < pool->n;
            if (found && expandable) {              /* CCA:3139-3154: every segment is expandable here */
                int64_t esz = expandable_size(&st, sp_at(pool, i)->blk);
                for (Pos j = sp_next(pool, i); j.c < pool->n; j = sp_next(pool, j)) {
                    int64_t csz = expandable_size(&st, sp_at(pool, j)->blk);
                    if (!(csz < esz)) break;
                    i = j;
                    esz = csz;
                }
            }
            if (found) {
                int64_t bs = pool->sizes[i.c];
                if (rs < max_split && bs >= max_split) found = 0;       /* CCA:3171-3174 no oversize block */
                if (rs >= max_split && bs >= rs + max_nsr) found = 0;   /* CCA:3175-3179 oversize rounding */
            }
            if (found) {
                bi = sp_at(pool, i)->blk;
                sp_remove_at(pool, i);
            } else if (expandable) {                                     /* CCA:3284-3298 */
                bi = try_allocate_expandable(&st, pi, rs, large_seg, capacity);
                if (bi == FALLBACK) { fallback = 1; goto done; }
                if (bi < 0) { err = "out of memory"; goto done; }
            } else {                                                     /* CCA:3115-3123, 3258-3344 */
                int64_t as = small ? K_SMALL_BUFFER
                             : rs < K_MIN_LARGE_ALLOC ? large_seg
                             : K_ROUND_LARGE * ((rs + K_ROUND_LARGE - 1) / K_ROUND_LARGE);
                if (capacity >= 0 && st.reserved + as > capacity) { fallback = 1; goto done; }
                int64_t addr = st.next_addr;
                st.next_addr = addr + ((as + ADDR_ALIGN - 1) / ADDR_ALIGN) * ADDR_ALIGN;
                if (st.next_addr >= ADDR_LIMIT) { fallback = 1; goto done; }
                bi = new_block(&st);
                if (bi < 0) { err = "out of memory"; goto done; }
                Block *nb = &st.b[bi];
                nb->size = as; nb->addr = addr; nb->prev = nb->next = -1; nb->seg = -1; nb->state = ST_ALLOC;
                nb->pool = (int8_t)pi;
                st.reserved += as;
                if (st.reserved > st.peak_reserved) st.peak_reserved = st.reserved;
            }
            int64_t remaining = st.b[bi].size - rs;
            if (small || expandable ? remaining >= 512 : rs < max_split && remaining > K_SMALL_SIZE) { /* CCA:3107-3111 */
                int32_t ni = new_block(&st);
                if (ni < 0) { err = "out of memory"; goto done; }
                Block *b = &st.b[bi], *nb = &st.b[ni];
                nb->size = rs; nb->addr = b->addr; nb->prev = b->prev; nb->next = bi; nb->seg = b->seg;
                nb->state = ST_ALLOC; nb->pool = (int8_t)pi;
                if (b->prev >= 0) st.b[b->prev].next = ni;
                b->prev = ni;
                b->addr += rs;
                b->size = remaining;
                b->state = ST_FREE;
                if (sp_insert(pool, b->size, b->addr, bi) < 0) { err = "out of memory"; goto done; }
                bi = ni;
            } else {
                st.b[bi].state = ST_ALLOC;
            }
            st.allocated += st.b[bi].size;                               /* CCA:1727-1733 */
            if (st.allocated > st.peak_allocated) st.peak_allocated = st.allocated;
            handles[nh++] = bi;
            if (k >= watch_from) {
                if (st.reserved > w_res || (st.reserved == w_res && st.allocated > w_all)) {
                    w_res = st.reserved;
                    w_all = st.allocated;
                    w_big = largest_free(&st);
                }
                if (st.allocated > w_most) w_most = st.allocated;
            }
        } else if (e == 0) {
            handles[nh++] = -1;
        } else {
            int64_t id = ~e;
            if (id >= nh) { err = "free of an allocation not made yet"; goto done; }
            int32_t bi = handles[id];
            if (bi == -1) continue;                                      /* a size-0 malloc */
            if (bi < 0) { err = "free of a handle that is not allocated (double free?)"; goto done; }
            Block *b = &st.b[bi];
            if (b->state != ST_ALLOC) { err = "free of a handle that is not allocated (double free?)"; goto done; }
            handles[id] = -2;
            st.allocated -= b->size;                                     /* CCA:1993-1996 */
            SPool *pool = &st.pool[b->pool];
            int32_t pi = b->prev;
            if (pi >= 0 && st.b[pi].state == ST_FREE) {                  /* CCA:3028-3042 */
                Block *p = &st.b[pi];
                sp_remove(pool, p->size, p->addr);
                b->addr = p->addr;
                b->prev = p->prev;
                if (p->prev >= 0) st.b[p->prev].next = bi;
                b->size += p->size;
                if (drop_block(&st, pi) < 0) { err = "out of memory"; goto done; }
                b = &st.b[bi];
            }
            int32_t xi = b->next;
            if (xi >= 0 && st.b[xi].state == ST_FREE) {                  /* CCA:3043-3048 */
                Block *x = &st.b[xi];
                sp_remove(pool, x->size, x->addr);
                b->next = x->next;
                if (x->next >= 0) st.b[x->next].prev = bi;
                b->size += x->size;
                if (drop_block(&st, xi) < 0) { err = "out of memory"; goto done; }
                b = &st.b[bi];
            }
            b->state = ST_FREE;                                          /* CCA:2986 */
            if (sp_insert(pool, b->size, b->addr, bi) < 0) { err = "out of memory"; goto done; }
        }
    }

done:
    if (released) PyEval_RestoreThread(released);
    free(handles);
    PyBuffer_Release(&lv);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&sv);
    if (streams) PyBuffer_Release(&tv);
    if (err) {
        state_free(&st);
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    if (fallback) {
        state_free(&st);
        Py_RETURN_NONE;
    }
    int64_t big = largest_free(&st);
    state_free(&st);
    if (w_res < 0)
        return Py_BuildValue("(LLLLLO)", (long long)st.reserved, (long long)st.allocated, (long long)big,
                             (long long)st.peak_reserved, (long long)st.peak_allocated, Py_None);
    return Py_BuildValue("(LLLLL(LLLL))", (long long)st.reserved, (long long)st.allocated, (long long)big,
                         (long long)st.peak_reserved, (long long)st.peak_allocated, (long long)w_res,
                         (long long)w_all, (long long)w_big, (long long)w_most);
}

static PyMethodDef methods[] = {
    {"replay", replay, METH_VARARGS,
     "replay(load, ops, sizes, watch_from, large_segment_size, max_split_size, max_non_split_rounding_size, "
     "capacity, expandable=False, streams=None): the allocator without rounding divisions or a memory fraction."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastreplay",
                                    "The caching allocator's default path in C (see fast.py).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastreplay(void) { return PyModule_Create(&module); }
