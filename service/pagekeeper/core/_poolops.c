/* pagekeeper.core._poolops: the per-page loops of PagePool's bulk paths in C.
 *
 * An optional accelerator of pagekeeper.core.pool. It works on the pool's own Python
 * objects (the state list, the cached-flag bytearray, the prefix-cache index and the
 * list of each page's hash), so nothing about the pool's layout, snapshots or introspection changes; each
 * function does what the Python loop it replaces does, and tests run the pool both ways.
 *
 *   take_run(buf, head, num, state) -> (pages, evicted, head)
 *       Allocation from the free queue: the next `num` page ids of the int32 buffer `buf`
 *       from cell `head` (holes, -1, skipped); every one's state becomes 2 (held once, not
 *       cached). The pages, those whose state was not 0 (cached: evicted now), in order,
 *       and the cell after the last one taken.
 *
 *   append_each(table, lengths, rows, at, pages) -> bool
 *       PageRows.append_page_each: row rows[i] of an int32 matrix, of length at[i] (the
 *       int32 vector `lengths`), gets pages[i] and grows by one; False, with nothing
 *       changed, when a check fails (the caller then names it).
 *
 *   pack_i32(ints) -> bytes
 *       A sequence of ints as little-endian int32 bytes (the wire's arrays of page ids).
 *
 *   check_digests(buf, width) -> int
 *       Client page hashes packed end to end (the wire's packed_page_hashes), `width`
 *       bytes each, checked distinct without creating an object each: -1, else the
 *       index of the first one that repeats an earlier one; ValueError when the length is
 *       not a multiple (see "Page hashes as raw bytes" below).
 *
 *   split_digests(buf, width) -> tuple
 *       The same hashes as bytes objects, their Python hashes computed (cached in each:
 *       the sets and the index they enter next do not compute them again).
 *
 *   DigestSet()
 *       A set of byte strings held as raw bytes: add(buf, width) enters each width-byte
 *       string packed in buf, `x in s` for bytes x, clear(), len(s).
 *
 *   widen_tokens(src, dst) -> bool
 *       Token ids from a native integer buffer, checked non-negative, widened into the
 *       uint64 buffer `dst` (or only checked: dst None); False for another layout.
 *
 *   evict(index, hash_of, cached, pages, flag) -> hashes | None
 *       Lazy eviction of pages that all belong to one group (cached[page] == flag) and
 *       each hold their hash's only index entry: take each page's hash from `hash_of`
 *       (leaving None), delete it from `index`, clear the flag; the hashes in page order. None (nothing
 *       changed) when a page is not of that group.
 *
 *   cache(index, hash_of, state, cached, pages, hashes, flag) -> bool
 *       Enter a run of held, uncached pages under new, distinct hashes: index[hash] = page,
 *       hash_of[page] = hash, cached[page] = flag, state + 1. All or nothing: False, with
 *       nothing changed, when a page is the null page, cached, free or listed twice, a
 *       hash is not bytes, is already indexed or repeats in the run (the caller's general
 *       path handles, or refuses, those).
 *
 *   PageIndex(expected=0)
 *       The prefix-cache index (hash -> page) the pool keeps per group when this module
 *       is built: a dict's methods, no tombstones (see below). evict and cache take it
 *       or a dict.
 *
 *   release(state, pages, same, now) -> bool
 *       A free whose pages all have state `same`: each becomes `now`. When one does not
 *       (a page listed twice reads `now` the second time), the pages set so far go back
 *       to `same` and False is returned.
 *
 *   untrack(obj) -> bool
 *       Stop the cyclic garbage collector tracking `obj` when no object it references
 *       (its tp_traverse's visits, its own type aside) is tracked and it has no instance
 *       __dict__: then `obj` can be in no reference cycle as long as its references do
 *       not change (CPython's own rule for tuples). For objects that never change once built: the KV events and their
 *       token runs, which otherwise survive, thousands at a time, into the older
 *       generations, whose collections scanned them (10-25 ms pauses). Whether it did.
 *
 *   atomic_tuple(items) -> tuple
 *       tuple(items), not tracked by the cyclic garbage collector when every item is an
 *       exact bytes, int or None (such a tuple can be in no reference cycle). CPython
 *       untracks these itself, but only when a collection first looks at them: an event's
 *       tuples of ~125 hashes and page ids each were traversed by the next young
 *       collection, and thousands of events waiting for it made a 20 ms pause.
 *
 *   decode_rows(reqs, tokens, start, num_free, page_counts, num_cached_pages, page_size,
 *               hash_page_size, max_len, lookahead, caching, crossing, crossing_held,
 *               crossing_rows[, fill[, extras[, named[, take_crossings[, pretaken]]]]])
 *       -> (stop, num_free)
 *       The manager's decode step for one full-attention group, row after row from `start`,
 *       for the rows that need no Python: request reqs[i] (a manager _Request) appends
 *       tokens[i] and counts one more computed token when that fills no page to cache and
 *       completes no hash page, and takes at most one new page while `num_free` allows.
 *       A row that takes a page is listed (its id, the pages it held, its row) in the three
 *       crossing lists, whose pages the caller takes later in one pool call; num_free goes
 *       down by one. Stops at the first other row (and at any row whose fields are not what
 *       the manager keeps), leaving it unchanged: `stop` is its index (len(reqs) at the end).
 *       With `fill` (a FillContext tuple, see below), a row whose token fills its page is
 *       one of them too, when it takes no page and the crossings waiting will take pages
 *       that are not cached (so evict nothing): the page is hashed, entered into the index
 *       and announced by a `stored` event, as the manager's _extend_hashes +
 *       GroupManager.cache_next + PagePool.cache_one do. `extras` (a dict or None): a
 *       request's held-back decode tokens (a list of checked ints), appended and counted
 *       as computed before its own token, as the manager's loop does. `named` (a dict or
 *       None): the client's hash (bytes) of the page a request's token fills, used for that
 *       page instead of hashing it (the manager checked it); the parent hash may then be of
 *       any size. `take_crossings` (a callable or None): called (no arguments) when a row
 *       fills its page while crossings wait for pages that are cached: it takes their pages
 *       (evicting, announcing `removed` first, as the manager's loop does before such a
 *       fill) and empties the crossing lists, and the fill stays in C; without it, the C
 *       pass stops at that row. `pretaken` (a list or None; with `fill`, only where the
 *       group holds no hash twice and no eviction is deferred): the crossings take those
 *       pages here instead, in order, as PagePool.allocate(1) would (held, counted, a
 *       cached one evicted with its own `removed` event), their ids appended to it: the
 *       first len(pretaken) crossings listed hold theirs, and the caller puts them in the
 *       rows and page counts after the pass (take_crossings too, when called).
 *
 *   decode_columns(request_ids, num_new_tokens, num_new_token_ids, num_computed_tokens,
 *                  num_lookahead_tokens, new_token_ids, lengths, tracked, max_len)
 *       -> (tokens, held, lookahead) | None
 *       A step's growth columns (int32; `lengths` and `tracked`, the rows' token and
 *       computed counts as gathered, int64) when every growth is a decode: one new token,
 *       its own last in new_token_ids after any held-back ones, a computed count that is
 *       the tracked one (-1 with one token) or the tracked one plus the held tokens, one
 *       lookahead for all. Checked in one pass as the service's column validation checks
 *       them (counts adding up, tokens >= 0, within max_len and the request's tokens);
 *       returns each row's own token, {request id: its held tokens} for the rows that
 *       carry some (lists of ints) and the lookahead. None when any row is not such a
 *       decode or fails a check (the caller's general path then says which).
 *
 *   gather_rows(requests, request_ids, owner, lengths, computed)
 *       -> (reqs, max_tokens, max_computed, max_ahead) | None
 *       PageManager.running_rows in one pass: each id's request, None when one is unknown
 *       or not `owner`'s (unless owner is None); each row's token and computed counts into
 *       the int64 buffers `lengths` and `computed` when given.
 *
 * Page ids are checked against the state list's length before anything is written (an
 * IndexError, as the Python loops would raise, changes nothing here).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Page ids of a sequence as C integers, each in [0, n); NULL with an exception set.
 * Only exact ints (the pool's own lists hold nothing else): no Python code runs while
 * the pool's objects are read and written. */
static Py_ssize_t *
page_ids(PyObject *fast, Py_ssize_t n)
{
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t *ids = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(Py_ssize_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!PyLong_CheckExact(items[i])) {
            PyErr_Format(PyExc_TypeError, "page ids must be ints, got %.100s",
                         Py_TYPE(items[i])->tp_name);
            PyMem_Free(ids);
            return NULL;
        }
        Py_ssize_t page = PyLong_AsSsize_t(items[i]);
        if (page == -1 && PyErr_Occurred()) {
            PyErr_Clear();  /* beyond a C integer: out of range */
            PyErr_Format(PyExc_IndexError, "page %R out of range (pool of %zd pages)",
                         items[i], n);
            PyMem_Free(ids);
            return NULL;
        }
        if (page < 0 || page >= n) {
            PyErr_Format(PyExc_IndexError, "page %zd out of range (pool of %zd pages)", page, n);
            PyMem_Free(ids);
            return NULL;
        }
        ids[i] = page;
    }
    return ids;
}

/* The value of a state cell (a small non-negative int); -1 with an exception set. */
static inline long
state_at(PyObject *state, Py_ssize_t page)
{
    PyObject *item = PyList_GET_ITEM(state, page);
    long v = PyLong_AsLong(item);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "page %zd has state %ld", page, v);
        return -1;
    }
    return v;
}

/* state[page] = v (v small: CPython hands out its shared int objects). */
static inline int
set_state(PyObject *state, Py_ssize_t page, long v)
{
    PyObject *value = PyLong_FromLong(v);
    if (value == NULL) {
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(state, page);
    PyList_SET_ITEM(state, page, value);
    Py_DECREF(old);
    return 0;
}

/* -- PageIndex: the prefix-cache index --------------------------------------------------
 *
 * A hash -> page map with the methods of a dict the pool uses. Open addressing with linear
 * probing over a table kept at most half full, and deletion by backward shift: a removed
 * entry's slot is refilled by the entries after it that probed past it, so no tombstone is
 * ever left. A dict instead leaves a dummy per deletion and, when its free slots run out
 * (every ~218,000 insertions for 131,072 entries), rebuilds itself inside the insertion
 * that ran out: ~8 ms in one step. Here the table is rebuilt only when it doubles (filled
 * past half), which a group's index, holding each page at most once, stops doing once the
 * cache has filled; after that every insertion and deletion costs the same.
 *
 * Keys are exact bytes (hashed with Python's own salted bytes hash, which each bytes
 * object caches), values exact ints; so the map holds no reference cycle and is not
 * tracked by the garbage collector. Lookups with any other key find nothing.
 * keys(), values() and items() are lists in table order, which follows the hash seed of
 * the process: a snapshot lists the index in page order instead. */

/* How many keys ahead of the one being entered or removed a bulk pass asks for slots. */
#define PREFETCH_AHEAD 8

typedef struct {
    PyObject *key;   /* exact bytes (owned); NULL: the slot is empty */
    Py_hash_t hash;
    PyObject *value; /* exact int (owned) */
} IndexSlot;

typedef struct {
    PyObject_HEAD
    IndexSlot *slots;
    size_t mask;     /* slots - 1; a power of two minus one */
    Py_ssize_t used;
} PageIndexObject;

static PyTypeObject PageIndex_Type;
#define PageIndex_Check(op) Py_IS_TYPE((op), &PageIndex_Type)

static size_t
index_slots_for(Py_ssize_t entries)
{
    size_t n = 8;
    while (n / 2 < (size_t)entries) {
        n <<= 1;
    }
    return n;
}

static inline int
index_keys_equal(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b)
           && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0;
}

/* The slot holding `key` (exact bytes), or the empty slot where it would go. */
static inline size_t
index_find(PageIndexObject *self, PyObject *key, Py_hash_t hash)
{
    size_t i = (size_t)hash & self->mask;
    for (;;) {
        IndexSlot *s = &self->slots[i];
        if (s->key == NULL || (s->hash == hash && index_keys_equal(s->key, key))) {
            return i;
        }
        i = (i + 1) & self->mask;
    }
}

static int
index_resize(PageIndexObject *self, size_t n)
{
    IndexSlot *slots = PyMem_Calloc(n, sizeof(IndexSlot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = n - 1;
    if (self->slots != NULL) {
        for (size_t j = 0; j <= self->mask; j++) {
            if (self->slots[j].key != NULL) {
                size_t i = (size_t)self->slots[j].hash & mask;
                while (slots[i].key != NULL) {
                    i = (i + 1) & mask;
                }
                slots[i] = self->slots[j];
            }
        }
        PyMem_Free(self->slots);
    }
    self->slots = slots;
    self->mask = mask;
    return 0;
}

/* Ask for the cache line holding `p` (a hint, never a fault). */
static inline void
prefetch_read(const void *p)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 1);
#else
    (void)p;
#endif
}

/* Ask for the cache line of the slot `hash` probes first (a hint: the table may still
 * be resized before the key goes in). */
static inline void
index_prefetch(PageIndexObject *self, Py_hash_t hash)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&self->slots[(size_t)hash & self->mask], 1, 1);
#else
    (void)self;
    (void)hash;
#endif
}

static int index_insert_hashed(PageIndexObject *self, PyObject *key, Py_hash_t hash,
                               PyObject *value);

/* Enter key -> value unless key is there: 1 entered, 0 there already (nothing changed),
 * -1 with an exception set. `key` exact bytes, `value` exact int (the caller checks). */
static int
index_insert(PageIndexObject *self, PyObject *key, PyObject *value)
{
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) {
        return -1;
    }
    return index_insert_hashed(self, key, hash, value);
}

/* index_insert with the key's hash already computed. */
static int
index_insert_hashed(PageIndexObject *self, PyObject *key, Py_hash_t hash, PyObject *value)
{
    size_t i = index_find(self, key, hash);
    if (self->slots[i].key != NULL) {
        return 0;
    }
    if ((size_t)(self->used + 1) > (self->mask + 1) / 2) {
        if (index_resize(self, (self->mask + 1) * 2) < 0) {
            return -1;
        }
        i = index_find(self, key, hash);
    }
    self->slots[i].key = Py_NewRef(key);
    self->slots[i].hash = hash;
    self->slots[i].value = Py_NewRef(value);
    self->used++;
    return 1;
}

/* Empty slot i, moving back each later entry of its run whose probe passed it. The
 * caller holds (and releases) the references the slot had. */
static void
index_remove_at(PageIndexObject *self, size_t i)
{
    size_t mask = self->mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        IndexSlot *s = &self->slots[j];
        if (s->key == NULL) {
            break;
        }
        /* s probed from its home slot to j; the hole at i lies on that path when i is in
         * [home, j) cyclically, and then s moves into it. */
        size_t home = (size_t)s->hash & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            self->slots[i] = *s;
            i = j;
        }
    }
    self->slots[i].key = NULL;
    self->slots[i].value = NULL;
    self->used--;
}

/* The slot holding `key`, or -1 (no exception) when it is not there or not bytes; -2
 * with an exception set. */
static Py_ssize_t
index_locate(PageIndexObject *self, PyObject *key)
{
    if (!PyBytes_CheckExact(key)) {
        return -1;
    }
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) {
        return -2;
    }
    size_t i = index_find(self, key, hash);
    return self->slots[i].key == NULL ? -1 : (Py_ssize_t)i;
}

/* Empty slot i and return its value (the slot's reference). */
static PyObject *
index_pop_at(PageIndexObject *self, size_t i)
{
    PyObject *old_key = self->slots[i].key, *value = self->slots[i].value;
    index_remove_at(self, i);
    Py_DECREF(old_key);
    return value;
}

/* Remove `key`: 0, or -1 with KeyError (or another exception) set. */
static int
index_delete(PageIndexObject *self, PyObject *key)
{
    Py_ssize_t i = index_locate(self, key);
    if (i < 0) {
        if (i == -1) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return -1;
    }
    Py_DECREF(index_pop_at(self, (size_t)i));
    return 0;
}

static int
index_check_item(PyObject *key, PyObject *value)
{
    if (!PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "PageIndex keys are bytes, not %.100s",
                     Py_TYPE(key)->tp_name);
        return -1;
    }
    if (value != NULL && !PyLong_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "PageIndex values are ints, not %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    return 0;
}

static PyObject *
PageIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"expected", NULL};
    Py_ssize_t expected = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:PageIndex", kwlist, &expected)) {
        return NULL;
    }
    if (expected < 0 || expected > PY_SSIZE_T_MAX / 4 / (Py_ssize_t)sizeof(IndexSlot)) {
        PyErr_SetString(PyExc_ValueError, "expected must be a non-negative size");
        return NULL;
    }
    PageIndexObject *self = (PageIndexObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->slots = NULL;
    self->used = 0;
    if (index_resize(self, index_slots_for(expected)) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* Release every entry's references (the table is left empty). */
static void
index_drop_all(PageIndexObject *self)
{
    if (self->slots == NULL) {
        return;
    }
    for (size_t j = 0; j <= self->mask; j++) {
        IndexSlot *s = &self->slots[j];
        if (s->key != NULL) {
            PyObject *key = s->key, *value = s->value;
            s->key = NULL;
            s->value = NULL;
            Py_DECREF(key);
            Py_DECREF(value);
        }
    }
    self->used = 0;
}

static void
PageIndex_dealloc(PageIndexObject *self)
{
    index_drop_all(self);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
PageIndex_length(PageIndexObject *self)
{
    return self->used;
}

static PyObject *
PageIndex_subscript(PageIndexObject *self, PyObject *key)
{
    Py_ssize_t i = index_locate(self, key);
    if (i < 0) {
        if (i == -1) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return NULL;
    }
    return Py_NewRef(self->slots[i].value);
}

static int
PageIndex_ass_subscript(PageIndexObject *self, PyObject *key, PyObject *value)
{
    if (value == NULL) {
        return index_delete(self, key);
    }
    if (index_check_item(key, value) < 0) {
        return -1;
    }
    Py_ssize_t i = index_locate(self, key);
    if (i == -2) {
        return -1;
    }
    if (i >= 0) {
        PyObject *old = self->slots[i].value;
        self->slots[i].value = Py_NewRef(value);
        Py_DECREF(old);
        return 0;
    }
    return index_insert(self, key, value) < 0 ? -1 : 0;
}

static int
PageIndex_contains(PageIndexObject *self, PyObject *key)
{
    Py_ssize_t i = index_locate(self, key);
    return i == -2 ? -1 : i >= 0;
}

static PyObject *
PageIndex_get(PageIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    Py_ssize_t i = index_locate(self, args[0]);
    if (i == -2) {
        return NULL;
    }
    if (i >= 0) {
        return Py_NewRef(self->slots[i].value);
    }
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

/* prefix(hashes, limit): the pages of the longest run hashes[0], hashes[1], ... (at most
 * `limit` of them) all in the index; the same as a `get` per hash up to the first miss,
 * with each key's slot asked for a few keys ahead so the misses overlap. */
static PyObject *
PageIndex_prefix(PageIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prefix(hashes, limit)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[0], "hashes must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (limit < n) {
        n = limit < 0 ? 0 : limit;
    }
    PyObject **keys = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyList_New(0);
    Py_hash_t *hashes = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_hash_t));
    if (out == NULL || hashes == NULL) {
        if (hashes == NULL) {
            PyErr_NoMemory();
        }
        Py_XDECREF(out);
        PyMem_Free(hashes);
        Py_DECREF(fast);
        return NULL;
    }
    /* hashes[i]: the key's hash, or -1 for a key that cannot be in the index (not exact
     * bytes): the run ends there. Computed PREFETCH_AHEAD keys before the lookup. */
    Py_ssize_t ready = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (; ready < n && ready <= i + PREFETCH_AHEAD; ready++) {
            PyObject *key = keys[ready];
            hashes[ready] = PyBytes_CheckExact(key) ? PyObject_Hash(key) : -1;
            if (hashes[ready] != -1) {
                index_prefetch(self, hashes[ready]);
            }
        }
        if (hashes[i] == -1) {
            break;
        }
        size_t slot = index_find(self, keys[i], hashes[i]);
        if (self->slots[slot].key == NULL) {
            break;
        }
        if (PyList_Append(out, self->slots[slot].value) < 0) {
            Py_CLEAR(out);
            break;
        }
    }
    PyMem_Free(hashes);
    Py_DECREF(fast);
    return out;
}

static PyObject *
PageIndex_pop(PageIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    Py_ssize_t i = index_locate(self, args[0]);
    if (i == -2) {
        return NULL;
    }
    if (i == -1) {
        if (nargs == 2) {
            return Py_NewRef(args[1]);
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    return index_pop_at(self, (size_t)i);
}

static PyObject *
PageIndex_clear(PageIndexObject *self, PyObject *Py_UNUSED(ignored))
{
    index_drop_all(self);
    Py_RETURN_NONE;
}

/* 0: keys, 1: values, 2: (key, value) tuples; in table order. */
static PyObject *
index_listing(PageIndexObject *self, int what)
{
    PyObject *list = PyList_New(self->used);
    if (list == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t j = 0; j <= self->mask; j++) {
        IndexSlot *s = &self->slots[j];
        if (s->key == NULL) {
            continue;
        }
        PyObject *item;
        if (what == 0) {
            item = Py_NewRef(s->key);
        }
        else if (what == 1) {
            item = Py_NewRef(s->value);
        }
        else {
            item = PyTuple_Pack(2, s->key, s->value);
            if (item == NULL) {
                Py_DECREF(list);
                return NULL;
            }
        }
        PyList_SET_ITEM(list, k++, item);
    }
    return list;
}

static PyObject *
PageIndex_keys(PageIndexObject *self, PyObject *Py_UNUSED(ignored))
{
    return index_listing(self, 0);
}

static PyObject *
PageIndex_values(PageIndexObject *self, PyObject *Py_UNUSED(ignored))
{
    return index_listing(self, 1);
}

static PyObject *
PageIndex_items(PageIndexObject *self, PyObject *Py_UNUSED(ignored))
{
    return index_listing(self, 2);
}

static PyObject *
PageIndex_iter(PageIndexObject *self)
{
    PyObject *keys = index_listing(self, 0);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* update(pairs): enter each (key, value) of an iterable, as dict.update does with pairs.
 * All checked first, so a bad pair changes nothing. */
static PyObject *
PageIndex_update(PageIndexObject *self, PyObject *pairs)
{
    PyObject *fast = PySequence_Fast(pairs, "update() takes an iterable of (key, value)");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!PyTuple_CheckExact(items[i]) || PyTuple_GET_SIZE(items[i]) != 2) {
            PyErr_SetString(PyExc_TypeError, "update() takes (key, value) tuples");
            goto fail;
        }
        if (index_check_item(PyTuple_GET_ITEM(items[i], 0), PyTuple_GET_ITEM(items[i], 1)) < 0) {
            goto fail;
        }
    }
    if ((size_t)(self->used + k) > (self->mask + 1) / 2
        && index_resize(self, index_slots_for(self->used + k)) < 0) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (PageIndex_ass_subscript(self, PyTuple_GET_ITEM(items[i], 0),
                                    PyTuple_GET_ITEM(items[i], 1)) < 0) {
            goto fail; /* a MemoryError growing the table */
        }
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    return NULL;
}

static PyObject *
PageIndex_sizeof(PageIndexObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(PageIndexObject) + (self->mask + 1) * sizeof(IndexSlot));
}

static PyObject *
PageIndex_repr(PageIndexObject *self)
{
    return PyUnicode_FromFormat("PageIndex(%zd entries, %zu slots)", self->used,
                                self->mask + 1);
}

static PyObject *
PageIndex_get_slots(PageIndexObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->mask + 1);
}

static PyMethodDef PageIndex_methods[] = {
    {"get", (PyCFunction)(void (*)(void))PageIndex_get, METH_FASTCALL,
     "get(key, default=None): the page under key, or default."},
    {"pop", (PyCFunction)(void (*)(void))PageIndex_pop, METH_FASTCALL,
     "pop(key[, default]): remove key and return its page."},
    {"prefix", (PyCFunction)(void (*)(void))PageIndex_prefix, METH_FASTCALL,
     "prefix(hashes, limit): the pages of the longest run of hashes[:limit] found, in "
     "order (a get per hash up to the first miss)."},
    {"clear", (PyCFunction)PageIndex_clear, METH_NOARGS, "Remove every entry."},
    {"keys", (PyCFunction)PageIndex_keys, METH_NOARGS, "The hashes, as a list."},
    {"values", (PyCFunction)PageIndex_values, METH_NOARGS, "The pages, as a list."},
    {"items", (PyCFunction)PageIndex_items, METH_NOARGS,
     "(hash, page) tuples, as a list."},
    {"update", (PyCFunction)PageIndex_update, METH_O,
     "update(pairs): enter each (hash, page)."},
    {"__sizeof__", (PyCFunction)PageIndex_sizeof, METH_NOARGS, "Bytes of the table."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef PageIndex_getset[] = {
    {"slots", (getter)PageIndex_get_slots, NULL, "Slots in the table (a power of two).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods PageIndex_as_mapping = {
    (lenfunc)PageIndex_length,
    (binaryfunc)PageIndex_subscript,
    (objobjargproc)PageIndex_ass_subscript,
};

static PySequenceMethods PageIndex_as_sequence = {
    .sq_contains = (objobjproc)PageIndex_contains,
};

static PyTypeObject PageIndex_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pagekeeper.core._poolops.PageIndex",
    .tp_basicsize = sizeof(PageIndexObject),
    .tp_dealloc = (destructor)PageIndex_dealloc,
    .tp_repr = (reprfunc)PageIndex_repr,
    .tp_as_sequence = &PageIndex_as_sequence,
    .tp_as_mapping = &PageIndex_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_iter = (getiterfunc)PageIndex_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PageIndex(expected=0): the prefix-cache index, hash (bytes) -> page (int), "
              "sized for `expected` entries, doubling past half full; no tombstones, so never "
              "rebuilt at a steady size.",
    .tp_methods = PageIndex_methods,
    .tp_getset = PageIndex_getset,
    .tp_new = PageIndex_new,
};

/* The pool's objects, of the right types; `cached` and `hash_of` as long as `state`
 * (when given, else as long as each other). */
static int
check_types(PyObject *state, PyObject *cached, PyObject *index, PyObject *hash_of)
{
    if (state != NULL && !PyList_CheckExact(state)) {
        PyErr_SetString(PyExc_TypeError, "state must be a list");
        return -1;
    }
    if (cached != NULL && !PyByteArray_CheckExact(cached)) {
        PyErr_SetString(PyExc_TypeError, "cached must be a bytearray");
        return -1;
    }
    if (index != NULL && !PyDict_CheckExact(index) && !PageIndex_Check(index)) {
        PyErr_SetString(PyExc_TypeError, "index must be a PageIndex or a dict");
        return -1;
    }
    if (hash_of != NULL && !PyList_CheckExact(hash_of)) {
        PyErr_SetString(PyExc_TypeError, "hash_of must be a list");
        return -1;
    }
    Py_ssize_t n = state != NULL ? PyList_GET_SIZE(state) : PyByteArray_GET_SIZE(cached);
    if ((cached != NULL && PyByteArray_GET_SIZE(cached) != n)
        || (hash_of != NULL && PyList_GET_SIZE(hash_of) != n)) {
        PyErr_SetString(PyExc_ValueError, "the pool's per-page objects differ in length");
        return -1;
    }
    return 0;
}

static PyObject *
pool_evict(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "evict(index, hash_of, cached, pages, flag)");
        return NULL;
    }
    PyObject *index = args[0], *hash_of = args[1], *cached = args[2];
    if (check_types(NULL, cached, index, hash_of) < 0) {
        return NULL;
    }
    long flag = PyLong_AsLong(args[4]);
    if (flag == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[3], "pages must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject *hashes = NULL;
    Py_ssize_t *ids = page_ids(fast, PyByteArray_GET_SIZE(cached));
    if (ids == NULL) {
        goto done;
    }
    unsigned char *flags = (unsigned char *)PyByteArray_AS_STRING(cached);
    for (Py_ssize_t i = 0; i < k; i++) {
        if (flags[ids[i]] != flag) {
            hashes = Py_NewRef(Py_None);  /* another group, or not cached: the general path */
            goto done;
        }
    }
    hashes = PyList_New(k);
    if (hashes == NULL) {
        goto done;
    }
    int native = PageIndex_Check(index);
    if (native && k > 1) {
        /* Each page costs three dependent misses (its cell of `hash_of`, the hash object,
         * the index slot): taken in passes over the run, so they overlap. The hashes are
         * cached in their objects (they were entered), so the removal below reads them
         * again for nothing. */
        PyObject **cells = ((PyListObject *)hash_of)->ob_item;
        for (Py_ssize_t i = 0; i < k; i++) {
            prefetch_read(&cells[ids[i]]);
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            prefetch_read(cells[ids[i]]);
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *h = cells[ids[i]];
            if (PyBytes_CheckExact(h)) {
                index_prefetch((PageIndexObject *)index, PyObject_Hash(h));
            }
        }
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *h = PyList_GET_ITEM(hash_of, ids[i]);
        if (h == Py_None) {
            PyErr_Format(PyExc_KeyError, "page %zd has no hash", ids[i]);
            goto fail;
        }
        /* The list's reference moves to `hashes`; the cell takes None. */
        PyList_SET_ITEM(hashes, i, h);
        PyList_SET_ITEM(hash_of, ids[i], Py_NewRef(Py_None));
        flags[ids[i]] = 0;
        if ((native ? index_delete((PageIndexObject *)index, h) : PyDict_DelItem(index, h))
            < 0) {
            goto fail;
        }
    }
    goto done;
fail:
    /* Only an invariant already broken (a cached page without its hash or index entry)
     * gets here, after the pages before it were evicted: the caller reports it. */
    Py_CLEAR(hashes);
done:
    PyMem_Free(ids);
    Py_DECREF(fast);
    return hashes;
}

static PyObject *
pool_cache(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "cache(index, hash_of, state, cached, pages, hashes, flag)");
        return NULL;
    }
    PyObject *index = args[0], *hash_of = args[1], *state = args[2], *cached = args[3];
    if (check_types(state, cached, index, hash_of) < 0) {
        return NULL;
    }
    long flag = PyLong_AsLong(args[6]);
    if (flag == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (flag < 1 || flag > 255) {
        PyErr_SetString(PyExc_ValueError, "flag must be in 1..255");
        return NULL;
    }
    PyObject *pages_fast = PySequence_Fast(args[4], "pages must be a sequence");
    if (pages_fast == NULL) {
        return NULL;
    }
    PyObject *hashes_fast = PySequence_Fast(args[5], "hashes must be a sequence");
    if (hashes_fast == NULL) {
        Py_DECREF(pages_fast);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t *ids = NULL;
    long *states = NULL;
    Py_hash_t *key_hashes = NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(pages_fast);
    PyObject **pages = PySequence_Fast_ITEMS(pages_fast);
    PyObject **hashes = PySequence_Fast_ITEMS(hashes_fast);
    if (PySequence_Fast_GET_SIZE(hashes_fast) != k) {
        PyErr_Format(PyExc_ValueError, "%zd pages but %zd hashes", k,
                     PySequence_Fast_GET_SIZE(hashes_fast));
        goto done;
    }
    ids = page_ids(pages_fast, PyList_GET_SIZE(state));
    states = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(long));
    if (ids == NULL || states == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    unsigned char *flags = (unsigned char *)PyByteArray_AS_STRING(cached);
    /* The pages' cells in `state`, `cached` and `hash_of` are scattered: asked for all
     * at once, so the passes below find them arriving rather than wait for each (page_ids
     * checked every id against the pool, check_types the three lengths). */
    PyObject **state_cells = ((PyListObject *)state)->ob_item;
    PyObject **hash_cells = ((PyListObject *)hash_of)->ob_item;
    for (Py_ssize_t i = 0; i < k; i++) {
        prefetch_read(&state_cells[ids[i]]);
        prefetch_read(&flags[ids[i]]);
        prefetch_read(&hash_cells[ids[i]]);
    }
    /* 1. Checks: held, uncached, real pages, each once; bytes hashes. A page's flag is
     * set as it passes, so a page listed twice finds it set; undone on any refusal. */
    Py_ssize_t flagged = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        long s = state_at(state, ids[i]);
        if (s < 0) {
            goto unflag;
        }
        if (ids[i] == 0 || flags[ids[i]] || s < 2 || !PyBytes_CheckExact(hashes[i])) {
            result = Py_NewRef(Py_False);
            goto unflag;
        }
        states[i] = s;
        flags[ids[i]] = (unsigned char)flag;
        flagged = i + 1;
    }
    /* 2. The index, undone if a hash is already there (or repeats within the run). The
     * native index's slots are scattered over a table of megabytes: every key's hash is
     * computed and its slot's line asked for a few keys ahead of its insertion, so the
     * misses overlap instead of following one another. */
    int native = PageIndex_Check(index);
    if (native) {
        key_hashes = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(Py_hash_t));
        if (key_hashes == NULL) {
            PyErr_NoMemory();
            goto unflag;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            key_hashes[i] = PyObject_Hash(hashes[i]);  /* exact bytes: cannot fail */
        }
        for (Py_ssize_t i = 0; i < k && i < PREFETCH_AHEAD; i++) {
            index_prefetch((PageIndexObject *)index, key_hashes[i]);
        }
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (native) {
            PageIndexObject *pi = (PageIndexObject *)index;
            if (i + PREFETCH_AHEAD < k) {
                index_prefetch(pi, key_hashes[i + PREFETCH_AHEAD]);
            }
            int rc = index_insert_hashed(pi, hashes[i], key_hashes[i], pages[i]);
            if (rc < 0) {
                goto undo;  /* a MemoryError */
            }
            if (rc == 0) {
                result = Py_NewRef(Py_False);
                goto undo;
            }
            continue;
        }
        Py_ssize_t before = PyDict_GET_SIZE(index);
        if (PyDict_SetDefault(index, hashes[i], pages[i]) == NULL) {
            goto undo;  /* a MemoryError */
        }
        if (PyDict_GET_SIZE(index) == before) {
            result = Py_NewRef(Py_False);
            goto undo;
        }
        continue;
    undo:
        for (Py_ssize_t j = 0; j < i; j++) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            int rc = native ? index_delete((PageIndexObject *)index, hashes[j])
                            : PyDict_DelItem(index, hashes[j]);
            PyErr_Restore(type, value, tb);
            if (rc < 0) {
                break;
            }
        }
        goto unflag;
    }
    /* 3. The pages: their hash and cached bit (their flags are set). */
    for (Py_ssize_t i = 0; i < k; i++) {
        if (set_state(state, ids[i], states[i] + 1) < 0) {
            goto done;  /* a MemoryError */
        }
        PyObject *old = PyList_GET_ITEM(hash_of, ids[i]);
        PyList_SET_ITEM(hash_of, ids[i], Py_NewRef(hashes[i]));
        Py_DECREF(old);
    }
    result = Py_NewRef(Py_True);
    goto done;
unflag:
    for (Py_ssize_t i = 0; i < flagged; i++) {
        flags[ids[i]] = 0;
    }
done:
    PyMem_Free(key_hashes);
    PyMem_Free(ids);
    PyMem_Free(states);
    Py_DECREF(pages_fast);
    Py_DECREF(hashes_fast);
    return result;
}

static PyObject *
pool_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "release(state, pages, same, now)");
        return NULL;
    }
    PyObject *state = args[0];
    if (check_types(state, NULL, NULL, NULL) < 0) {
        return NULL;
    }
    long same = PyLong_AsLong(args[2]);
    long now = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[1], "pages must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    Py_ssize_t *ids = page_ids(fast, PyList_GET_SIZE(state));
    if (ids == NULL) {
        goto done;
    }
    /* A freed request's pages' state cells lie far apart: asked for at once (see
     * take_run). */
    PyObject **cells = ((PyListObject *)state)->ob_item;
    for (Py_ssize_t i = 0; i < k; i++) {
        prefetch_read(&cells[ids[i]]);
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        long s = state_at(state, ids[i]);
        if (s < 0) {
            goto undo;
        }
        if (s != same) {
            result = Py_NewRef(Py_False);
            goto undo;
        }
        if (set_state(state, ids[i], now) < 0) {
            goto undo;
        }
        continue;
    undo:
        for (Py_ssize_t j = 0; j < i; j++) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            int rc = set_state(state, ids[j], same);
            PyErr_Restore(type, value, tb);
            if (rc < 0) {
                break;
            }
        }
        goto done;
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(ids);
    Py_DECREF(fast);
    return result;
}

static PyObject *
pool_atomic_tuple(PyObject *module, PyObject *items)
{
    PyObject *result = PySequence_Tuple(items);
    if (result == NULL) {
        return NULL;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(result);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *item = PyTuple_GET_ITEM(result, i);
        if (!(PyBytes_CheckExact(item) || PyLong_CheckExact(item) || item == Py_None)) {
            return result;  /* tracked, as any tuple */
        }
    }
    if (PyObject_GC_IsTracked(result)) {
        PyObject_GC_UnTrack(result);
    }
    return result;
}

/* untrack: the visit of every object `obj` references; stops at the first one the
 * collector tracks (the instance's own type, which a heap type's instance visits, aside). */
typedef struct {
    PyObject *own_type;
    int refers_to_tracked;
} untrack_scan;

static int
visit_for_tracked(PyObject *referent, void *arg)
{
    untrack_scan *scan = (untrack_scan *)arg;
    if (referent == scan->own_type) {
        return 0;
    }
    if (PyObject_IS_GC(referent) && PyObject_GC_IsTracked(referent)) {
        scan->refers_to_tracked = 1;
        return 1;
    }
    return 0;
}

static PyObject *
pool_untrack(PyObject *module, PyObject *obj)
{
    if (!PyObject_IS_GC(obj) || !PyObject_GC_IsTracked(obj)) {
        Py_RETURN_FALSE;
    }
    PyTypeObject *type = Py_TYPE(obj);
    traverseproc traverse = type->tp_traverse;
    if (traverse == NULL || type->tp_dictoffset != 0
        || PyType_HasFeature(type, Py_TPFLAGS_MANAGED_DICT)) {
        /* An instance __dict__ can take any attribute later: never untracked. */
        Py_RETURN_FALSE;
    }
    untrack_scan scan = {(PyObject *)Py_TYPE(obj), 0};
    traverse(obj, visit_for_tracked, &scan);
    if (scan.refers_to_tracked) {
        Py_RETURN_FALSE;
    }
    PyObject_GC_UnTrack(obj);
    Py_RETURN_TRUE;
}

/* -- decode_rows: the manager's plain decode rows --------------------------------------- */

static PyObject *str_request_id, *str_num_computed_tokens, *str_token_ids, *str_hashes,
    *str_scheduled_start, *str_num_scheduled, *str_append, *int_one;

/* An int attribute or dict value as a C integer; -1 (no exception) when absent or not an
 * exact non-negative int that fits: the row is then the Python loop's. */
static Py_ssize_t
small_count(PyObject *obj)
{
    if (obj == NULL || !PyLong_CheckExact(obj)) {
        return -1;
    }
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    return v < 0 || v > PY_SSIZE_T_MAX / 4 ? -1 : v;
}

/* Whether a buffer holds native-order signed integers of `size` bytes: format i, l or q
 * (the item size tells which width), after at most a native byte-order prefix. */
static int
is_native_int(const Py_buffer *view, Py_ssize_t size)
{
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '@' || *fmt == '=' || (PY_LITTLE_ENDIAN && *fmt == '<')) {
        fmt++;
    }
    return view->itemsize == size && fmt[0] != '\0' && fmt[1] == '\0'
           && strchr("ilq", fmt[0]) != NULL;
}

/* What a filled page's caching reads and writes (decode_rows' `fill` tuple, in this
 * order; built by PageManager._fill_context):
 *   pool, index, hash_of, state, cached, events   the pool and its group's index
 *   table, request_rows                           the group's PageRows table (2-D int32)
 *                                                 and its request -> row dict
 *   no_extra_keys                                 requests with these keys (identity) only
 *   sha256_page, head, array_head, extra, none_hash
 *                                                 _native.sha256_page and its constant
 *                                                 parts (parents of 32 bytes only)
 *   new_stored, adopt, group_id                   events.new_stored, TokenRun.adopt, group
 *   new_removed                                   events.new_removed (a crossing's eviction) */
enum {
    F_POOL, F_INDEX, F_HASH_OF, F_STATE, F_CACHED, F_EVENTS, F_TABLE, F_REQUEST_ROWS,
    F_NO_EXTRA_KEYS, F_SHA256_PAGE, F_HEAD, F_ARRAY_HEAD, F_EXTRA, F_NONE_HASH, F_NEW_STORED,
    F_ADOPT, F_GROUP_ID, F_NEW_REMOVED, F_SIZE
};

#define DIGEST_SIZE 32

typedef struct {
    PyObject *page_counts, *num_cached, *crossing, *crossing_held, *crossing_rows;
    PyObject *extras;          /* request id -> its held-back tokens (a list), or NULL */
    PyObject *named;           /* request id -> the client's hash of its filled page, or NULL */
    PyObject *take_crossings;  /* takes the waiting crossings' pages (a callable), or NULL */
    PyObject *pretaken;        /* pages taken here for the first crossings (a list), or NULL */
    Py_ssize_t ps, hps, max_len, lookahead, num_free;
    int caching;
    PyObject **fill;           /* the fill tuple's items (borrowed), or NULL */
    Py_buffer table;           /* fill's table, when fill is set */
    Py_ssize_t table_rows, table_cols;
    long flag;                 /* group_id + 1: the cached-flag value of the group */
} DecodeStep;

static PyObject *str_extra_keys, *str_event_seq, *str_pop, *str_head, *str_buf, *str_extend,
    *str_num_free, *str_num_free_cached, *str_num_allocated_total, *str_num_evictions, *int_two;

/* The page row i fills, cached as the Python loop would; `k` is the page's index in the
 * request (= its hashes so far = its cached pages), `held` its pages. 1: done (the token
 * appended, the hash listed, the page indexed and announced, num_cached_pages[rid] set);
 * 0: left for the Python loop, nothing changed (the row's keys, a parent hash that is
 * not a digest, a page whose state or hash is not the plain case, e.g. a duplicate hash);
 * -1: an error. A MemoryError after the index took the page may leave the row partly
 * applied, as it would leave the Python loop. */
static int
fill_page(DecodeStep *d, PyObject *req, PyObject *rid, PyObject *token, PyObject *ids,
          PyObject *hashes, Py_ssize_t k, Py_ssize_t held, PyObject *given)
{
    PyObject **f = d->fill;
    PyObject *keys = PyObject_GetAttr(req, str_extra_keys);
    if (keys == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(keys);  /* only compared by identity; the request keeps it */
    if (keys != f[F_NO_EXTRA_KEYS] || k >= held) {
        return 0;
    }
    PyObject *parent = k ? PyList_GET_ITEM(hashes, k - 1) : f[F_NONE_HASH];
    if (!PyBytes_CheckExact(parent) || (given == NULL && PyBytes_GET_SIZE(parent) != DIGEST_SIZE)) {
        return 0;
    }
    PyObject *row_o = PyDict_GetItemWithError(f[F_REQUEST_ROWS], rid); /* borrowed */
    Py_ssize_t row = small_count(row_o);
    if (row < 0 || row >= d->table_rows || k >= d->table_cols) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
        }
        return 0;
    }
    Py_ssize_t page = ((const int32_t *)d->table.buf)[row * d->table_cols + k];
    PyObject *state = f[F_STATE], *hash_of = f[F_HASH_OF], *cached = f[F_CACHED];
    if (page <= 0 || page >= PyList_GET_SIZE(state) || page >= PyList_GET_SIZE(hash_of)
        || page >= PyByteArray_GET_SIZE(cached)) {
        return 0;
    }
    unsigned char *flags = (unsigned char *)PyByteArray_AS_STRING(cached);
    PyObject *state_o = PyList_GET_ITEM(state, page);
    Py_ssize_t page_state = small_count(state_o);
    if (flags[page] || page_state < 2) {
        return 0;  /* cached, free or odd: the Python loop says what is wrong */
    }
    /* Everything the row creates, before anything changes but the token. */
    int result = -1, appended = 0, listed = 0;
    PyObject *digest = NULL, *page_o = NULL, *run_ids = NULL, *run = NULL, *hash_tuple = NULL;
    PyObject *page_tuple = NULL, *seq_o = NULL, *next_seq = NULL, *event = NULL;
    PyObject *done_o = NULL, *state_next = NULL, *r;
    r = PyObject_CallMethodOneArg(ids, str_append, token);
    if (r == NULL) {
        goto fail;
    }
    Py_DECREF(r);
    appended = 1;
    PyObject *start_o = PyLong_FromSsize_t(k * d->ps), *ps_o = PyLong_FromSsize_t(d->ps);
    if (start_o != NULL && ps_o != NULL) {
        if (given != NULL) {
            digest = Py_NewRef(given);  /* the client's hash of the page */
        }
        else {
            PyObject *args[7] = {f[F_HEAD], parent, f[F_ARRAY_HEAD], ids, start_o, ps_o,
                                 f[F_EXTRA]};
            digest = PyObject_Vectorcall(f[F_SHA256_PAGE], args, 7, NULL);
        }
    }
    Py_XDECREF(start_o);
    if (digest == NULL || !PyBytes_CheckExact(digest)) {
        Py_XDECREF(ps_o);
        if (digest != NULL) {
            PyErr_SetString(PyExc_TypeError, "sha256_page must return bytes");
        }
        goto fail;
    }
    page_o = PyLong_FromSsize_t(page);
    run_ids = PySequence_GetSlice(ids, k * d->ps, (k + 1) * d->ps);
    if (page_o == NULL || run_ids == NULL) {
        Py_DECREF(ps_o);
        goto fail;
    }
    Py_XDECREF(pool_untrack(NULL, run_ids));
    run = PyObject_CallOneArg(f[F_ADOPT], run_ids);
    if (run == NULL) {
        Py_DECREF(ps_o);
        goto fail;
    }
    Py_XDECREF(pool_untrack(NULL, run));
    hash_tuple = PyTuple_Pack(1, digest);
    page_tuple = PyTuple_Pack(1, page_o);
    seq_o = PyObject_GetAttr(f[F_POOL], str_event_seq);
    if (hash_tuple == NULL || page_tuple == NULL || seq_o == NULL) {
        Py_DECREF(ps_o);
        goto fail;
    }
    PyObject_GC_UnTrack(hash_tuple);  /* bytes and ints only: in no cycle */
    PyObject_GC_UnTrack(page_tuple);
    next_seq = PyNumber_Add(seq_o, int_one);
    if (next_seq == NULL) {
        Py_DECREF(ps_o);
        goto fail;
    }
    {
        /* lora_name and extra_keys None (a request without keys), first_page k. */
        PyObject *first_o = PyLong_FromSsize_t(k);
        if (first_o != NULL) {
            PyObject *args[10] = {next_seq, f[F_GROUP_ID], hash_tuple, k ? parent : Py_None,
                                  run, ps_o, page_tuple, Py_None, Py_None, first_o};
            event = PyObject_Vectorcall(f[F_NEW_STORED], args, 10, NULL);
            Py_DECREF(first_o);
        }
    }
    Py_DECREF(ps_o);
    if (event == NULL) {
        goto fail;
    }
    Py_XDECREF(pool_untrack(NULL, event));
    done_o = PyLong_FromSsize_t(k + 1);
    state_next = PyLong_FromSsize_t(page_state + 1);
    if (done_o == NULL || state_next == NULL) {
        goto fail;
    }
    if (PyList_Append(hashes, digest) < 0) {
        goto fail;
    }
    listed = 1;
    /* The index: a hash already there (a duplicate page) is the Python loop's. */
    PyObject *index = f[F_INDEX];
    if (PageIndex_Check(index)) {
        int rc = index_insert((PageIndexObject *)index, digest, page_o);
        if (rc <= 0) {
            result = rc;
            goto fail;
        }
    }
    else {
        Py_ssize_t before = PyDict_GET_SIZE(index);
        if (PyDict_SetDefault(index, digest, page_o) == NULL) {
            goto fail;
        }
        if (PyDict_GET_SIZE(index) == before) {
            result = 0;
            goto fail;
        }
    }
    /* Past this point the page is the index's: the rest is the pool's and the group's
     * bookkeeping, then the event. */
    listed = 0;
    appended = 0;
    flags[page] = (unsigned char)d->flag;
    PyList_SET_ITEM(state, page, state_next);
    state_next = NULL;
    Py_DECREF(state_o);
    PyObject *old_hash = PyList_GET_ITEM(hash_of, page);
    PyList_SET_ITEM(hash_of, page, Py_NewRef(digest));
    Py_DECREF(old_hash);
    if (PyDict_SetItem(d->num_cached, rid, done_o) < 0
        || PyList_Append(f[F_EVENTS], event) < 0
        || PyObject_SetAttr(f[F_POOL], str_event_seq, next_seq) < 0) {
        goto fail;
    }
    result = 1;
fail:
    if (result <= 0 && (listed || appended)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (listed) {
            Py_ssize_t n = PyList_GET_SIZE(hashes);
            (void)PyList_SetSlice(hashes, n - 1, n, NULL);
        }
        if (appended) {
            Py_XDECREF(PyObject_CallMethodNoArgs(ids, str_pop));
        }
        if (result == 0) {
            PyErr_Clear();  /* a refusal, not an error: nothing is left changed */
        }
        else {
            PyErr_Restore(type, value, tb);
            type = value = tb = NULL;
        }
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    Py_XDECREF(digest);
    Py_XDECREF(page_o);
    Py_XDECREF(run_ids);
    Py_XDECREF(run);
    Py_XDECREF(hash_tuple);
    Py_XDECREF(page_tuple);
    Py_XDECREF(seq_o);
    Py_XDECREF(next_seq);
    Py_XDECREF(event);
    Py_XDECREF(done_o);
    Py_XDECREF(state_next);
    return result;
}

/* Whether the crossings waiting for their pages will take pages that are not cached: the
 * next len(crossing) pages of the free queue (from pool._head in pool._buf, holes skipped)
 * all have state 0. A fill may then be cached before they take them: taking them evicts
 * nothing and announces nothing, so every page, hash and event comes out as in the Python
 * loop, which takes them first. 1: yes; 0: no, or the pool is not as expected. */
static int
crossings_take_clean_pages(DecodeStep *d)
{
    Py_ssize_t k = PyList_GET_SIZE(d->crossing);
    if (d->pretaken != NULL) {
        k -= PyList_GET_SIZE(d->pretaken); /* those hold their pages already */
    }
    if (k <= 0) {
        return 1;
    }
    PyObject *pool = d->fill[F_POOL], *state = d->fill[F_STATE];
    PyObject *head_o = PyObject_GetAttr(pool, str_head);
    Py_ssize_t head = small_count(head_o);
    Py_XDECREF(head_o);
    PyObject *buf = head < 0 ? NULL : PyObject_GetAttr(pool, str_buf);
    Py_buffer view;
    if (buf == NULL || PyObject_GetBuffer(buf, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_XDECREF(buf);
        PyErr_Clear();
        return 0;
    }
    int clean = 0;
    if (is_native_int(&view, 4)) {
        const int32_t *queue = (const int32_t *)view.buf;
        Py_ssize_t len = view.len / 4, seen = 0;
        clean = 1;
        for (Py_ssize_t j = head; j < len && seen < k && clean; j++) {
            int32_t page = queue[j];
            if (page < 0) {
                continue; /* a hole: a page taken out of the middle */
            }
            seen++;
            clean = page < PyList_GET_SIZE(state)
                    && small_count(PyList_GET_ITEM(state, page)) == 0;
        }
        clean = clean && seen == k;
    }
    PyBuffer_Release(&view);
    Py_DECREF(buf);
    PyErr_Clear(); /* small_count leaves none; nothing here is the caller's error */
    return clean;
}

/* A pool counter (an exact int attribute >= 0) as a C integer; -1 when it is not one. */
static long long
pool_counter(PyObject *pool, PyObject *name)
{
    PyObject *o = PyObject_GetAttr(pool, name);
    long long v = -1;
    if (o != NULL && PyLong_CheckExact(o)) {
        v = PyLong_AsLongLong(o);
    }
    Py_XDECREF(o);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        v = -1;
    }
    return v < 0 ? -1 : v;
}

static int
set_counter(PyObject *pool, PyObject *name, long long value)
{
    PyObject *o = PyLong_FromLongLong(value);
    int rc = o == NULL ? -1 : PyObject_SetAttr(pool, name, o);
    Py_XDECREF(o);
    return rc;
}

/* The crossings waiting without a page (those after the first len(pretaken)) take theirs
 * now, from the head of the free queue, as PagePool.allocate(1) does for each in order:
 * the page held once, the pool's counters moved, a cached page evicted (its index entry,
 * hash and flag dropped) with its own `removed` event. The pages go to `pretaken`; the
 * rows and page counts are the caller's, after the pass (nothing in it reads them for
 * these requests). Only the plain case: every page free (state 0 or 1) and, when cached,
 * of this group with its hash (the group holds no hash twice: the caller's condition).
 * 1: taken; 0: not the plain case, nothing changed; -1: an error (after the pages before
 * it were taken and counted: an invariant already broken, or no memory). */
static int
take_waiting(DecodeStep *d)
{
    PyObject **f = d->fill;
    Py_ssize_t done = PyList_GET_SIZE(d->pretaken);
    Py_ssize_t k = PyList_GET_SIZE(d->crossing) - done;
    if (k <= 0) {
        return 1;
    }
    PyObject *pool = f[F_POOL], *state = f[F_STATE], *hash_of = f[F_HASH_OF];
    PyObject *cached = f[F_CACHED], *index = f[F_INDEX];
    long long head = pool_counter(pool, str_head);
    long long num_free = pool_counter(pool, str_num_free);
    long long num_free_cached = pool_counter(pool, str_num_free_cached);
    long long total = pool_counter(pool, str_num_allocated_total);
    long long evictions = pool_counter(pool, str_num_evictions);
    long long seq = pool_counter(pool, str_event_seq);
    if (head < 0 || num_free < k || num_free_cached < 0 || total < 0 || evictions < 0
        || seq < 0 || seq > LLONG_MAX - k) {
        return 0;
    }
    PyObject *buf = PyObject_GetAttr(pool, str_buf);
    Py_buffer view;
    if (buf == NULL || PyObject_GetBuffer(buf, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_XDECREF(buf);
        PyErr_Clear();
        return 0;
    }
    int result = 0;
    Py_ssize_t *pages = NULL;
    if (!is_native_int(&view, 4)) {
        goto release;
    }
    pages = PyMem_New(Py_ssize_t, k);
    if (pages == NULL) {
        PyErr_NoMemory();
        result = -1;
        goto release;
    }
    /* First the pages and whether each is the plain case; nothing changes yet. */
    const int32_t *queue = (const int32_t *)view.buf;
    Py_ssize_t len = view.len / 4, cell = (Py_ssize_t)head, got = 0;
    Py_ssize_t n = PyList_GET_SIZE(state);
    unsigned char *flags = (unsigned char *)PyByteArray_AS_STRING(cached);
    while (got < k && cell < len) {
        int32_t page = queue[cell++];
        if (page < 0) {
            continue; /* a hole: a page taken out of the middle */
        }
        if (page >= n || page >= PyList_GET_SIZE(hash_of) || page >= PyByteArray_GET_SIZE(cached)) {
            goto release;
        }
        Py_ssize_t st = small_count(PyList_GET_ITEM(state, page));
        if (st == 1) {
            if (flags[page] != d->flag || !PyBytes_CheckExact(PyList_GET_ITEM(hash_of, page))) {
                goto release;
            }
        }
        else if (st != 0 || flags[page]) {
            goto release;
        }
        pages[got++] = page;
    }
    if (got < k) {
        goto release;
    }
    /* Then each in order: held, listed, and evicted with its event. */
    Py_ssize_t taken = 0, evicted = 0;
    result = -1;
    for (; taken < k; taken++) {
        Py_ssize_t page = pages[taken];
        PyObject *page_o = PyLong_FromSsize_t(page);
        if (page_o == NULL || PyList_Append(d->pretaken, page_o) < 0) {
            Py_XDECREF(page_o);
            goto count;
        }
        PyObject *old_state = PyList_GET_ITEM(state, page);
        int was_cached = small_count(old_state) == 1;
        PyList_SET_ITEM(state, page, Py_NewRef(int_two));
        Py_DECREF(old_state);
        if (!was_cached) {
            Py_DECREF(page_o);
            continue;
        }
        /* The eviction: the hash's reference moves from hash_of to the event's tuple. */
        PyObject *h = PyList_GET_ITEM(hash_of, page);
        PyList_SET_ITEM(hash_of, page, Py_NewRef(Py_None));
        flags[page] = 0;
        evicted++;
        int rc = PageIndex_Check(index) ? index_delete((PageIndexObject *)index, h)
                                        : PyDict_DelItem(index, h);
        PyObject *hash_tuple = rc < 0 ? NULL : PyTuple_Pack(1, h);
        PyObject *page_tuple = hash_tuple == NULL ? NULL : PyTuple_Pack(1, page_o);
        Py_DECREF(h);
        Py_DECREF(page_o);
        PyObject *seq_o = page_tuple == NULL ? NULL : PyLong_FromLongLong(seq + 1);
        PyObject *event = NULL;
        if (seq_o != NULL) {
            PyObject_GC_UnTrack(hash_tuple); /* bytes and ints only: in no cycle */
            PyObject_GC_UnTrack(page_tuple);
            PyObject *args[4] = {seq_o, f[F_GROUP_ID], hash_tuple, page_tuple};
            event = PyObject_Vectorcall(f[F_NEW_REMOVED], args, 4, NULL);
        }
        Py_XDECREF(hash_tuple);
        Py_XDECREF(page_tuple);
        Py_XDECREF(seq_o);
        if (event == NULL) {
            taken++; /* held and evicted: counted below */
            goto count;
        }
        Py_XDECREF(pool_untrack(NULL, event));
        seq++;
        rc = PyList_Append(f[F_EVENTS], event);
        Py_DECREF(event);
        if (rc < 0) {
            taken++;
            goto count;
        }
    }
    result = 1;
count:
    /* The counters as the pages taken so far left them (all of them, unless an error). */
    {
        Py_ssize_t seen = 0, last = (Py_ssize_t)head;
        while (seen < taken) { /* the cell after the last page taken */
            if (queue[last++] >= 0) {
                seen++;
            }
        }
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (set_counter(pool, str_head, last) < 0
            || set_counter(pool, str_num_free, num_free - taken) < 0
            || set_counter(pool, str_num_free_cached, num_free_cached - evicted) < 0
            || set_counter(pool, str_num_allocated_total, total + taken) < 0
            || set_counter(pool, str_num_evictions, evictions + evicted) < 0
            || set_counter(pool, str_event_seq, seq) < 0) {
            result = -1;
        }
        if (type != NULL) {
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
        }
    }
release:
    PyMem_Free(pages);
    PyBuffer_Release(&view);
    Py_DECREF(buf);
    if (result == 0) {
        PyErr_Clear();
    }
    return result;
}

/* Drop the last item of each of the first `k` crossing lists (undoing a row's entries). */
static void
unlist_crossing(DecodeStep *d, int k)
{
    PyObject *lists[3] = {d->crossing, d->crossing_held, d->crossing_rows};
    for (int j = 0; j < k; j++) {
        Py_ssize_t n = PyList_GET_SIZE(lists[j]);
        (void)PyList_SetSlice(lists[j], n - 1, n, NULL);
    }
}

/* Append a row's held-back tokens to its token ids; *extended counts them for an undo
 * (-1: an error, ids as they were). */
static int
extend_ids(PyObject *ids, PyObject *extra, Py_ssize_t *extended)
{
    Py_ssize_t before = PyObject_Size(ids);
    if (before < 0) {
        return -1;
    }
    PyObject *r = PyObject_CallMethodOneArg(ids, str_extend, extra);
    if (r == NULL) {
        /* A list extends item by item: take back any that went in. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_ssize_t after = PyObject_Size(ids);
        if (after > before && PySequence_DelSlice(ids, before, after) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
        return -1;
    }
    Py_DECREF(r);
    *extended = PyObject_Size(ids) - before;
    return 0;
}

/* 1: row i applied; 0: left alone (the Python loop's); -1: an error, the row unchanged. */
static int
decode_row(DecodeStep *d, PyObject *req, PyObject *token, Py_ssize_t i)
{
    int result = 0, listed = 0;
    PyObject *rid = NULL, *computed_o = NULL, *ids = NULL, *hashes = NULL, *end_o = NULL;
    PyObject *held_o = NULL, *row_o = NULL, *start_o = NULL;
    PyObject *extra = NULL; /* borrowed: the row's held-back tokens, appended before its own */
    Py_ssize_t num_extra = 0, extended = 0;
    rid = PyObject_GetAttr(req, str_request_id);
    computed_o = rid ? PyObject_GetAttr(req, str_num_computed_tokens) : NULL;
    ids = computed_o ? PyObject_GetAttr(req, str_token_ids) : NULL;
    if (ids == NULL || !PyUnicode_CheckExact(rid) || !PyLong_CheckExact(token)) {
        goto leave;  /* not a manager request (or a missing field): the general loop */
    }
    Py_ssize_t computed = small_count(computed_o);
    held_o = PyDict_GetItemWithError(d->page_counts, rid); /* borrowed */
    Py_ssize_t held = small_count(held_o);
    if (computed < 0 || held < 0 || PyErr_Occurred()) {
        goto leave;
    }
    if (d->extras != NULL && (extra = PyDict_GetItemWithError(d->extras, rid)) != NULL) {
        /* Counted as computed before the row's own token (the manager checked them). */
        if (!PyList_CheckExact(extra)) {
            goto leave;
        }
        num_extra = PyList_GET_SIZE(extra);
        if (num_extra > PY_SSIZE_T_MAX / 4 - computed) {
            goto leave;
        }
        computed += num_extra;
        if ((start_o = PyLong_FromSsize_t(computed)) == NULL) {
            result = -1;
            goto done;
        }
    }
    if (PyErr_Occurred()) {
        goto leave;
    }
    Py_ssize_t end = computed + 1;
    Py_ssize_t num_slots = end + d->lookahead > d->max_len ? d->max_len : end + d->lookahead;
    Py_ssize_t num_new = (num_slots + d->ps - 1) / d->ps - held;
    if (num_new > 1 || (num_new == 1 && d->num_free < 1)) {
        goto leave;  /* several pages, or none left: the general loop decides */
    }
    Py_ssize_t num_tokens = PyObject_Size(ids);
    if (num_tokens < 0) {
        goto leave;
    }
    num_tokens += num_extra + 1;
    int fills = 0;
    if (d->caching) {
        hashes = PyObject_GetAttr(req, str_hashes);
        if (hashes == NULL || !PyList_CheckExact(hashes)) {
            goto leave;
        }
        Py_ssize_t done = small_count(PyDict_GetItemWithError(d->num_cached, rid));
        if (done < 0 || PyErr_Occurred()) {
            goto leave;
        }
        Py_ssize_t num_hashed = PyList_GET_SIZE(hashes);
        Py_ssize_t num_full = (end < num_tokens ? end : num_tokens) / d->ps;
        if (num_tokens / d->hps > num_hashed || num_full > done) {
            /* Completes a hash page or fills a page to cache: here only the plain case
             * (exactly the next page, hashed and cached so far, no page taken, and any
             * crossing waiting to take its page first taking one that evicts nothing),
             * with a fill context. */
            if (d->fill == NULL || num_new != 0 || d->hps != d->ps || num_hashed != done
                || num_full != done + 1 || num_tokens / d->ps != done + 1) {
                goto leave;
            }
            int clean = crossings_take_clean_pages(d);
            if (!clean && d->pretaken != NULL) {
                /* The crossings take their pages here (evicting): the fill follows them. */
                clean = take_waiting(d);
                if (clean < 0) {
                    result = -1;
                    goto done;
                }
            }
            if (!clean) {
                if (d->take_crossings == NULL) {
                    goto leave;
                }
                /* The crossings take their pages now (evicting): the fill follows them. */
                PyObject *taken = PyObject_CallNoArgs(d->take_crossings);
                if (taken == NULL) {
                    result = -1;
                    goto done;
                }
                Py_DECREF(taken);
                if (PyList_GET_SIZE(d->crossing) != 0) {
                    PyErr_SetString(PyExc_RuntimeError,
                                    "take_crossings left crossings waiting");
                    result = -1;
                    goto done;
                }
            }
            fills = 1;
            end_o = PyLong_FromSsize_t(end);
            if (end_o == NULL || (num_extra && extend_ids(ids, extra, &extended) < 0)) {
                result = -1;
                goto done;
            }
            PyObject *given = NULL;
            if (d->named != NULL) {
                given = PyDict_GetItemWithError(d->named, rid); /* borrowed */
                if (given == NULL && PyErr_Occurred()) {
                    result = -1;
                    goto done;
                }
                if (given != NULL && !PyBytes_CheckExact(given)) {
                    goto leave;
                }
            }
            int r = fill_page(d, req, rid, token, ids, hashes, done, held, given);
            if (r < 0) {
                result = -1;
                goto done;
            }
            if (r == 0) {
                goto leave;
            }
        }
    }
    if (end_o == NULL && (end_o = PyLong_FromSsize_t(end)) == NULL) {
        result = -1;
        goto done;
    }
    if (num_new == 1) {
        /* Listed first, so a failure below can take the entries back. */
        row_o = PyLong_FromSsize_t(i);
        if (row_o == NULL) {
            result = -1;
            goto done;
        }
        if (PyList_Append(d->crossing, rid) < 0) {
            result = -1;
            goto done;
        }
        listed = 1;
        if (PyList_Append(d->crossing_held, held_o) < 0) {
            result = -1;
            goto done;
        }
        listed = 2;
        if (PyList_Append(d->crossing_rows, row_o) < 0) {
            result = -1;
            goto done;
        }
        listed = 3;
    }
    if (num_extra && !fills && extend_ids(ids, extra, &extended) < 0) {
        result = -1;
        goto done;
    }
    if (!fills) {  /* fill_page appended it */
        PyObject *appended = PyObject_CallMethodOneArg(ids, str_append, token);
        if (appended == NULL) {
            result = -1;
            goto done;
        }
        Py_DECREF(appended);
    }
    listed = 0; /* the row is applied: its entries stay */
    extended = 0;
    /* Slot writes of ints: they cannot fail once the token is in. */
    if (PyObject_SetAttr(req, str_num_computed_tokens, end_o) < 0
        || PyObject_SetAttr(req, str_scheduled_start, start_o ? start_o : computed_o) < 0
        || PyObject_SetAttr(req, str_num_scheduled, int_one) < 0) {
        result = -1;
        goto done;
    }
    if (num_new == 1) {
        d->num_free -= 1;
    }
    result = 1;
    goto done;
leave:
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
done:
    if (result <= 0 && (listed || extended)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (listed) {
            unlist_crossing(d, listed);
        }
        if (extended) { /* the held tokens come off again: the row is left unchanged */
            Py_ssize_t n = PyObject_Size(ids);
            if (n < extended || PySequence_DelSlice(ids, n - extended, n) < 0) {
                PyErr_Clear();
            }
        }
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(start_o);
    Py_XDECREF(rid);
    Py_XDECREF(computed_o);
    Py_XDECREF(ids);
    Py_XDECREF(hashes);
    Py_XDECREF(end_o);
    Py_XDECREF(row_o);
    return result;
}

/* Check decode_rows' `fill` tuple and take its table's buffer (released by the caller). */
static int
set_fill(DecodeStep *d, PyObject *fill)
{
    if (!PyTuple_CheckExact(fill) || PyTuple_GET_SIZE(fill) != F_SIZE) {
        PyErr_Format(PyExc_TypeError, "fill must be a tuple of %d items", (int)F_SIZE);
        return -1;
    }
    PyObject **f = &PyTuple_GET_ITEM(fill, 0);
    if (!PyList_CheckExact(f[F_HASH_OF]) || !PyList_CheckExact(f[F_STATE])
        || !PyByteArray_CheckExact(f[F_CACHED]) || !PyList_CheckExact(f[F_EVENTS])
        || !PyDict_CheckExact(f[F_REQUEST_ROWS])
        || !(PageIndex_Check(f[F_INDEX]) || PyDict_CheckExact(f[F_INDEX]))
        || !PyBytes_CheckExact(f[F_HEAD]) || !PyBytes_CheckExact(f[F_ARRAY_HEAD])
        || !PyBytes_CheckExact(f[F_EXTRA]) || !PyBytes_CheckExact(f[F_NONE_HASH])
        || !PyCallable_Check(f[F_SHA256_PAGE]) || !PyCallable_Check(f[F_NEW_STORED])
        || !PyCallable_Check(f[F_ADOPT]) || !PyLong_CheckExact(f[F_GROUP_ID])
        || !PyCallable_Check(f[F_NEW_REMOVED])) {
        PyErr_SetString(PyExc_TypeError, "fill holds an item of the wrong type");
        return -1;
    }
    long group_id = PyLong_AsLong(f[F_GROUP_ID]);
    if (group_id < 0 || group_id > 254) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "fill's group_id must be in 0..254");
        }
        return -1;
    }
    if (PyObject_GetBuffer(f[F_TABLE], &d->table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (d->table.ndim != 2 || !is_native_int(&d->table, 4)) {
        PyBuffer_Release(&d->table);
        PyErr_SetString(PyExc_TypeError, "fill's table must be a 2-D C-contiguous int32 array");
        return -1;
    }
    d->table_rows = d->table.shape[0];
    d->table_cols = d->table.shape[1];
    d->flag = group_id + 1;
    d->fill = f;
    return 0;
}

static PyObject *
pool_decode_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 14 || nargs > 19) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_rows(reqs, tokens, start, num_free, page_counts, "
                        "num_cached_pages, page_size, hash_page_size, max_len, lookahead, "
                        "caching, crossing, crossing_held, crossing_rows[, fill[, extras"
                        "[, named[, take_crossings[, pretaken]]]]])");
        return NULL;
    }
    PyObject *reqs = args[0], *tokens = args[1];
    DecodeStep d = {
        .page_counts = args[4], .num_cached = args[5], .crossing = args[11],
        .crossing_held = args[12], .crossing_rows = args[13],
    };
    if (!PyList_CheckExact(reqs) || !PyList_CheckExact(tokens)
        || PyList_GET_SIZE(reqs) != PyList_GET_SIZE(tokens)) {
        PyErr_SetString(PyExc_TypeError, "reqs and tokens must be lists of one length");
        return NULL;
    }
    if (!PyDict_CheckExact(d.page_counts) || !PyDict_CheckExact(d.num_cached)) {
        PyErr_SetString(PyExc_TypeError, "page_counts and num_cached_pages must be dicts");
        return NULL;
    }
    if (!PyList_CheckExact(d.crossing) || !PyList_CheckExact(d.crossing_held)
        || !PyList_CheckExact(d.crossing_rows)) {
        PyErr_SetString(PyExc_TypeError, "the crossing lists must be lists");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    d.num_free = PyLong_AsSsize_t(args[3]);
    d.ps = PyLong_AsSsize_t(args[6]);
    d.hps = PyLong_AsSsize_t(args[7]);
    d.max_len = PyLong_AsSsize_t(args[8]);
    d.lookahead = PyLong_AsSsize_t(args[9]);
    d.caching = PyObject_IsTrue(args[10]);
    if (PyErr_Occurred() || d.caching < 0) {
        return NULL;
    }
    if (start < 0 || d.num_free < 0 || d.ps < 1 || d.hps < 1 || d.max_len < 0
        || d.lookahead < 0 || d.lookahead > PY_SSIZE_T_MAX / 4
        || d.max_len > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError,
                        "bad start, num_free, page sizes, max_len or lookahead");
        return NULL;
    }
    PyObject *fill = nargs >= 15 ? args[14] : Py_None;
    if (nargs >= 16 && args[15] != Py_None) {
        if (!PyDict_CheckExact(args[15])) {
            PyErr_SetString(PyExc_TypeError, "extras must be a dict or None");
            return NULL;
        }
        d.extras = args[15];
    }
    if (nargs == 19 && args[18] != Py_None) {
        if (!PyList_CheckExact(args[18])) {
            PyErr_SetString(PyExc_TypeError, "pretaken must be a list or None");
            return NULL;
        }
        d.pretaken = args[18];
    }
    if (nargs >= 18 && args[17] != Py_None) {
        if (!PyCallable_Check(args[17])) {
            PyErr_SetString(PyExc_TypeError, "take_crossings must be callable or None");
            return NULL;
        }
        d.take_crossings = args[17];
    }
    if (nargs >= 17 && args[16] != Py_None) {
        if (!PyDict_CheckExact(args[16])) {
            PyErr_SetString(PyExc_TypeError, "named must be a dict or None");
            return NULL;
        }
        d.named = args[16];
    }
    if (fill != Py_None && set_fill(&d, fill) < 0) {
        return NULL;
    }
    if (d.fill == NULL) {
        d.pretaken = NULL; /* taking pages here needs the fill's pool */
    }
    else if (d.pretaken != NULL
             && PyList_GET_SIZE(d.pretaken) > PyList_GET_SIZE(d.crossing)) {
        PyBuffer_Release(&d.table);
        PyErr_SetString(PyExc_ValueError, "pretaken lists more pages than crossings wait");
        return NULL;
    }
    /* A filled page's hash and event come from Python functions (sha256_page,
     * TokenRun.adopt, new_stored): each row's request and token are owned while it is
     * applied, and the lists' sizes are read again for every row. */
    PyObject *result = NULL;
    Py_ssize_t i = start;
    for (; i < PyList_GET_SIZE(reqs) && i < PyList_GET_SIZE(tokens); i++) {
        PyObject *req = Py_NewRef(PyList_GET_ITEM(reqs, i));
        PyObject *token = Py_NewRef(PyList_GET_ITEM(tokens, i));
        int r = decode_row(&d, req, token, i);
        Py_DECREF(req);
        Py_DECREF(token);
        if (r < 0) {
            goto done;
        }
        if (r == 0) {
            break;
        }
    }
    result = Py_BuildValue("(nn)", i, d.num_free);
done:
    if (d.fill != NULL) {
        PyBuffer_Release(&d.table);
    }
    return result;
}

/* -- gather_rows: a batch of running requests, looked up and measured in one pass ------- */

static PyObject *str_owner;

/* A writable C-contiguous int64 buffer of at least n items, or None (no buffer). */
static int
out_column(PyObject *obj, Py_buffer *view, Py_ssize_t n, const char *name)
{
    if (obj == Py_None) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (!is_native_int(view, 8) || view->len < n * 8) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be a writable int64 buffer of >= %zd items",
                     name, n);
        return -1;
    }
    return 1;
}

static PyObject *
pool_gather_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "gather_rows(requests, request_ids, owner, lengths, computed)");
        return NULL;
    }
    PyObject *requests = args[0], *owner = args[2];
    PyObject *ids = PySequence_Fast(args[1], "request_ids must be a sequence");
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    Py_buffer lengths_view, computed_view;
    int has_lengths = out_column(args[3], &lengths_view, n, "lengths");
    int has_computed = has_lengths < 0 ? -1 : out_column(args[4], &computed_view, n, "computed");
    PyObject *reqs = NULL, *result = NULL;
    if (has_computed < 0) {
        goto done;
    }
    reqs = PyList_New(n);
    if (reqs == NULL) {
        goto done;
    }
    int64_t *lengths = has_lengths ? (int64_t *)lengths_view.buf : NULL;
    int64_t *computed = has_computed ? (int64_t *)computed_view.buf : NULL;
    Py_ssize_t max_tokens = 0, max_computed = 0, max_ahead = 0;
    int is_dict = PyDict_CheckExact(requests);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* An owner's __eq__ (a str subclass) could change a list of ids under us. */
        if (i >= PySequence_Fast_GET_SIZE(ids)) {
            goto refuse;
        }
        PyObject *rid = PySequence_Fast_GET_ITEM(ids, i);
        PyObject *req;
        if (!PyUnicode_CheckExact(rid)) {
            goto refuse;
        }
        if (is_dict) {
            req = Py_XNewRef(PyDict_GetItemWithError(requests, rid));
        } else {
            req = PyObject_GetItem(requests, rid);
        }
        if (req == NULL) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_KeyError)) {
                goto done;
            }
            PyErr_Clear();
            goto refuse;
        }
        PyList_SET_ITEM(reqs, i, req); /* owns it */
        if (owner != Py_None) {
            PyObject *whose = PyObject_GetAttr(req, str_owner);
            int same = whose == NULL ? -1 : PyObject_RichCompareBool(whose, owner, Py_EQ);
            Py_XDECREF(whose);
            if (same < 0) {
                goto done;
            }
            if (!same) {
                goto refuse;
            }
        }
        PyObject *tokens = PyObject_GetAttr(req, str_token_ids);
        Py_ssize_t length = tokens == NULL ? -1 : PyObject_Size(tokens);
        Py_XDECREF(tokens);
        PyObject *count_o = length < 0 ? NULL : PyObject_GetAttr(req, str_num_computed_tokens);
        Py_ssize_t count = small_count(count_o);
        Py_XDECREF(count_o);
        if (PyErr_Occurred()) {
            goto done;
        }
        if (count < 0) {
            goto refuse; /* not an exact non-negative int: the Python path's to judge */
        }
        if (lengths != NULL) {
            lengths[i] = length;
        }
        if (computed != NULL) {
            computed[i] = count;
        }
        if (length > max_tokens) {
            max_tokens = length;
        }
        if (count > max_computed) {
            max_computed = count;
        }
        if (i == 0 || count - length > max_ahead) {
            max_ahead = count - length;
        }
    }
    if (PySequence_Fast_GET_SIZE(ids) != n) {
        goto refuse;
    }
    result = Py_BuildValue("(Onnn)", reqs, max_tokens, max_computed, max_ahead);
    goto done;
refuse:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(reqs);
    if (has_lengths > 0) {
        PyBuffer_Release(&lengths_view);
    }
    if (has_computed > 0) {
        PyBuffer_Release(&computed_view);
    }
    Py_DECREF(ids);
    return result;
}

/* take_run(buf, head, num, state) -> (pages, evicted, head): the next `num` pages of the
 * free queue (an int32 buffer whose cells from `head` on hold page ids or -1 for holes),
 * in order, holes skipped, each taken (state 2); the cell after the last one taken.
 * Nothing changes when it fails (the queue runs out, a page id or state is not a page's). */
static PyObject *
pool_take_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "take_run(buf, head, num, state)");
        return NULL;
    }
    PyObject *state = args[3];
    if (check_types(state, NULL, NULL, NULL) < 0) {
        return NULL;
    }
    Py_ssize_t head = PyLong_AsSsize_t(args[1]);
    Py_ssize_t num = PyLong_AsSsize_t(args[2]);
    if ((head == -1 || num == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (head < 0 || num < 0) {
        PyErr_SetString(PyExc_ValueError, "head and num must be >= 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    PyObject *pages = NULL, *evicted = NULL, *result = NULL;
    Py_ssize_t *ids = NULL;
    if (view.itemsize != 4 || view.format == NULL || strcmp(view.format, "i") != 0) {
        PyErr_SetString(PyExc_TypeError, "buf must be an int32 buffer (array('i'))");
        goto done;
    }
    const int *cells = (const int *)view.buf;
    Py_ssize_t num_cells = view.len / 4, n = PyList_GET_SIZE(state);
    ids = PyMem_Malloc((size_t)(num ? num : 1) * sizeof(Py_ssize_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t got = 0, cell = head;
    while (got < num) {
        if (cell >= num_cells) {
            PyErr_Format(PyExc_ValueError, "the free queue holds fewer than %zd pages", num);
            goto done;
        }
        int page = cells[cell++];
        if (page < 0) {
            continue; /* a hole left by a page taken out of the middle */
        }
        if (page >= n) {
            PyErr_Format(PyExc_IndexError, "page %d out of range (pool of %zd pages)", page, n);
            goto done;
        }
        /* The state slots of a queue's pages lie far apart (one cache line each, a miss
         * apiece once other work has run): asked for here, they arrive while the ids are
         * gathered and the lists made (125 pages: ~5.5 -> ~3 us in a polluted cache). */
        prefetch_read(&((PyListObject *)state)->ob_item[page]);
        ids[got++] = page;
    }
    pages = PyList_New(num);
    evicted = PyList_New(0);
    if (pages == NULL || evicted == NULL) {
        goto done;
    }
    /* Read every state and make every id first: the writes below cannot fail. */
    for (Py_ssize_t i = 0; i < num; i++) {
        long s = state_at(state, ids[i]);
        if (s < 0) {
            goto done;
        }
        PyObject *id = PyLong_FromSsize_t(ids[i]);
        if (id == NULL) {
            goto done;
        }
        PyList_SET_ITEM(pages, i, id);
        if (s != 0 && PyList_Append(evicted, id) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < num; i++) {
        (void)set_state(state, ids[i], 2); /* a shared small int: cannot fail */
    }
    result = Py_BuildValue("(OOn)", pages, evicted, cell);
done:
    Py_XDECREF(pages);
    Py_XDECREF(evicted);
    PyMem_Free(ids);
    PyBuffer_Release(&view);
    return result;
}

/* pack_i32(ints) -> bytes: a sequence of ints as little-endian int32 (OverflowError for
 * one outside int32, TypeError for one not an int). */
static PyObject *
pool_pack_i32(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *fast = PySequence_Fast(arg, "pack_i32 takes a sequence of ints");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * k);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "pack_i32: %.100s is not an int",
                         Py_TYPE(items[i])->tp_name);
            goto fail;
        }
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "%lld does not fit in int32", v);
            goto fail;
        }
        uint32_t u = (uint32_t)(int32_t)v;
        p[4 * i] = (unsigned char)u;
        p[4 * i + 1] = (unsigned char)(u >> 8);
        p[4 * i + 2] = (unsigned char)(u >> 16);
        p[4 * i + 3] = (unsigned char)(u >> 24);
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

/* widen_tokens(src, dst) -> bool: token ids from a C-contiguous native integer buffer
 * (numpy int32/int64/uint32/uint64, array 'i'/'l'/'q'/'I'/'L'/'Q') checked non-negative
 * and, with `dst` (a writable uint64 buffer of as many items), written there. False,
 * with nothing written, for a buffer of another layout (the caller converts it its own
 * way); ValueError, with nothing written, when an id is negative. */
static PyObject *
pool_widen_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "widen_tokens(src, dst)");
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    const char *f = src.format ? src.format : "B";
    if (f[0] == '=' || f[0] == '@' || (f[0] == '<' && !PY_BIG_ENDIAN)) {
        f++;
    }
    int is_signed;
    if (f[0] == '\0' || f[1] != '\0') {
        PyBuffer_Release(&src);
        Py_RETURN_FALSE;
    }
    switch (f[0]) {
    case 'i': case 'l': case 'q': is_signed = 1; break;
    case 'I': case 'L': case 'Q': is_signed = 0; break;
    default:
        PyBuffer_Release(&src);
        Py_RETURN_FALSE;
    }
    if (src.itemsize != 4 && src.itemsize != 8) {
        PyBuffer_Release(&src);
        Py_RETURN_FALSE;
    }
    Py_ssize_t k = src.len / src.itemsize;
    if (is_signed) {
        /* The sign bits OR-ed together: a loop the compiler vectorizes. */
        if (src.itemsize == 4) {
            const uint32_t *v = (const uint32_t *)src.buf;
            uint32_t bits = 0;
            for (Py_ssize_t i = 0; i < k; i++) {
                bits |= v[i];
            }
            if (bits >> 31) {
                goto negative;
            }
        }
        else {
            const uint64_t *v = (const uint64_t *)src.buf;
            uint64_t bits = 0;
            for (Py_ssize_t i = 0; i < k; i++) {
                bits |= v[i];
            }
            if (bits >> 63) {
                goto negative;
            }
        }
    }
    if (args[1] != Py_None) {
        Py_buffer dst;
        if (PyObject_GetBuffer(args[1], &dst, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
            < 0) {
            PyBuffer_Release(&src);
            return NULL;
        }
        if (dst.itemsize != 8 || dst.format == NULL || strcmp(dst.format, "Q") != 0
            || dst.len != 8 * k) {
            PyBuffer_Release(&dst);
            PyBuffer_Release(&src);
            PyErr_SetString(PyExc_ValueError, "dst must be a uint64 buffer of as many items");
            return NULL;
        }
        uint64_t *out = (uint64_t *)dst.buf;
        if (src.itemsize == 4) {
            const uint32_t *v = (const uint32_t *)src.buf;
            for (Py_ssize_t i = 0; i < k; i++) {
                out[i] = v[i];
            }
        }
        else {
            memcpy(out, src.buf, (size_t)(8 * k));
        }
        PyBuffer_Release(&dst);
    }
    PyBuffer_Release(&src);
    Py_RETURN_TRUE;
negative:
    PyBuffer_Release(&src);
    PyErr_SetString(PyExc_ValueError, "token ids must be non-negative");
    return NULL;
}

/* append_each(table, lengths, rows, at, pages) -> bool: PageRows.append_page_each in one
 * pass: row rows[i] of the C-contiguous int32 matrix `table`, whose length (the int32
 * vector `lengths`) is at[i], gets pages[i] there and grows by one. True when done; False,
 * with nothing changed, when the lists differ in length, a row or page is out of range,
 * a length is not at[i], a row is full or listed twice (the caller's checks name it). */
static PyObject *
pool_append_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "append_each(table, lengths, rows, at, pages)");
        return NULL;
    }
    Py_buffer table, lengths;
    int flags = PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(args[0], &table, flags) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &lengths, flags) < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    PyObject *result = NULL, *rows = NULL, *at = NULL, *pages = NULL;
    if (table.ndim != 2 || table.itemsize != 4 || strcmp(table.format, "i") != 0
        || lengths.ndim != 1 || lengths.itemsize != 4 || strcmp(lengths.format, "i") != 0
        || lengths.shape[0] < table.shape[0]) {
        PyErr_SetString(PyExc_TypeError, "table and lengths must be int32 (2-D, 1-D)");
        goto done;
    }
    rows = PySequence_Fast(args[2], "rows must be a sequence");
    at = rows ? PySequence_Fast(args[3], "at must be a sequence") : NULL;
    pages = at ? PySequence_Fast(args[4], "pages must be a sequence") : NULL;
    if (pages == NULL) {
        goto done;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(rows);
    int32_t *cells = (int32_t *)table.buf, *len = (int32_t *)lengths.buf;
    Py_ssize_t num_rows = table.shape[0], width = table.shape[1];
    if (PySequence_Fast_GET_SIZE(at) != k || PySequence_Fast_GET_SIZE(pages) != k) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    PyObject **r = PySequence_Fast_ITEMS(rows), **a = PySequence_Fast_ITEMS(at);
    PyObject **p = PySequence_Fast_ITEMS(pages);
    for (Py_ssize_t i = 0; i < k; i++) {
        long row = PyLong_AsLong(r[i]), col = PyLong_AsLong(a[i]), page = PyLong_AsLong(p[i]);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            result = Py_NewRef(Py_False);
            goto done;
        }
        if (row < 0 || row >= num_rows || col < 0 || col >= width || len[row] != col
            || page < 0 || page > INT32_MAX) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    }
    /* Checked: write, growing each row; a row listed twice finds its length moved on, and
     * the rows written so far are put back. */
    for (Py_ssize_t i = 0; i < k; i++) {
        long row = PyLong_AsLong(r[i]), col = PyLong_AsLong(a[i]), page = PyLong_AsLong(p[i]);
        if (len[row] != col) {
            for (Py_ssize_t j = i - 1; j >= 0; j--) {
                long back_row = PyLong_AsLong(r[j]), back_col = PyLong_AsLong(a[j]);
                cells[back_row * width + back_col] = 0;
                len[back_row] = (int32_t)back_col;
            }
            result = Py_NewRef(Py_False);
            goto done;
        }
        cells[row * width + col] = (int32_t)page;
        len[row] = (int32_t)(col + 1);
    }
    result = Py_NewRef(Py_True);
done:
    Py_XDECREF(rows);
    Py_XDECREF(at);
    Py_XDECREF(pages);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&table);
    return result;
}

/* ---- Page hashes as raw bytes: checked and remembered without a Python object each ----
 *
 * A client's packed page hashes (Admission.packed_page_hashes) are checked distinct, and an
 * admission whose prefix caching waits for settle() has its hashes remembered for the
 * lookups of later admissions, without creating 125 bytes objects for a 2,000-token prompt:
 * settle() creates them after the answer is out. The tables hash the raw bytes with a
 * multiply-shift hash keyed by 16 random bytes drawn for each process, so a client cannot
 * pick hashes that pile into one probe chain without knowing them. */

static uint64_t digest_key0, digest_key1;

static inline uint64_t
digest_hash(const unsigned char *p, Py_ssize_t n)
{
    uint64_t a = 0, b;
    if (n >= 8) {
        memcpy(&a, p, 8);
        memcpy(&b, p + n - 8, 8);
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++) {
            a = (a << 8) | p[i];
        }
        b = a;
    }
    return (a ^ digest_key0) * UINT64_C(0x9E3779B97F4A7C15)
           + (b ^ digest_key1 ^ (uint64_t)n) * UINT64_C(0xC2B2AE3D27D4EB4F);
}

/* The table's bits: the top ones of the hash (multiply-shift). */
static inline size_t
digest_slot(uint64_t h, int bits)
{
    return (size_t)(h >> (64 - bits));
}

/* The (buf, width) arguments of the digest functions: buf's buffer, which the caller
 * releases, holding a whole number of width-byte strings; -1 with an exception set. */
static int
digest_args(PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_buffer *view,
            Py_ssize_t *width)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *width = PyLong_AsSsize_t(args[1]);
    if (*width == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*width <= 0) {
        PyErr_SetString(PyExc_ValueError, "width must be positive");
        return -1;
    }
    if (PyObject_GetBuffer(args[0], view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (view->len % *width != 0) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not a whole number of %zd-byte strings",
                     view->len, *width);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* split_digests(buf, width) -> tuple: the width-byte strings packed in buf as bytes
 * objects, each with its hash computed (cached in the object: the sets and the index they
 * enter next do not compute it again). */
static PyObject *
pool_split_digests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    Py_buffer view;
    Py_ssize_t width;
    if (digest_args(args, nargs, "split_digests(buf, width)", &view, &width) < 0) {
        return NULL;
    }
    const char *base = (const char *)view.buf;
    Py_ssize_t n = view.len / width;
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = PyBytes_FromStringAndSize(base + i * width, width);
        if (item == NULL || PyObject_Hash(item) == -1) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    PyBuffer_Release(&view);
    return out;
}

/* DigestSet(): a set of byte strings kept as raw bytes in one arena (an open-addressing
 * table of entry numbers over it). add(buf, width) enters every width-byte string packed
 * in buf; `x in s` for a bytes x; clear(); len(s). */
typedef struct {
    PyObject_HEAD
    unsigned char *arena;
    Py_ssize_t arena_len, arena_cap;
    Py_ssize_t *offsets; /* entry i: its bytes at arena + offsets[i], lengths[i] long */
    Py_ssize_t *lengths;
    Py_ssize_t count, entries_cap;
    int32_t *table; /* entry number + 1; 0: empty */
    int bits;
} DigestSet;

static PyTypeObject DigestSet_Type;

#define DIGESTSET_MIN_BITS 8

static int
digestset_alloc_table(DigestSet *self, int bits)
{
    int32_t *table = PyMem_Calloc((size_t)1 << bits, sizeof(int32_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->table);
    self->table = table;
    self->bits = bits;
    return 0;
}

static PyObject *
DigestSet_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":DigestSet", kwlist)) {
        return NULL;
    }
    /* Zeroed: no table until the first add (an empty set finds nothing). */
    return type->tp_alloc(type, 0);
}

/* Give back a set's memory (its table too). */
static void
digestset_release(DigestSet *self)
{
    PyMem_Free(self->arena);
    PyMem_Free(self->offsets);
    PyMem_Free(self->lengths);
    PyMem_Free(self->table);
    self->arena = NULL;
    self->offsets = self->lengths = NULL;
    self->table = NULL;
    self->bits = 0;
    self->arena_len = self->arena_cap = self->count = self->entries_cap = 0;
}

static void
DigestSet_dealloc(DigestSet *self)
{
    digestset_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The slot holding these bytes, or the empty slot where they would go. */
static inline size_t
digestset_find(const DigestSet *self, const unsigned char *p, Py_ssize_t n, int *found)
{
    size_t mask = ((size_t)1 << self->bits) - 1;
    size_t j = digest_slot(digest_hash(p, n), self->bits);
    int32_t e;
    while ((e = self->table[j]) != 0) {
        Py_ssize_t k = e - 1;
        if (self->lengths[k] == n && memcmp(self->arena + self->offsets[k], p, (size_t)n) == 0) {
            *found = 1;
            return j;
        }
        j = (j + 1) & mask;
    }
    *found = 0;
    return j;
}

static int
digestset_grow(DigestSet *self, Py_ssize_t more_entries, Py_ssize_t more_bytes)
{
    Py_ssize_t need = self->count + more_entries;
    if (need > INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "DigestSet is full");
        return -1;
    }
    if (need > self->entries_cap) {
        Py_ssize_t cap = self->entries_cap ? self->entries_cap : 256;
        while (cap < need) {
            cap *= 2;
        }
        Py_ssize_t *offsets = PyMem_Realloc(self->offsets, (size_t)cap * sizeof(Py_ssize_t));
        if (offsets == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->offsets = offsets;
        Py_ssize_t *lengths = PyMem_Realloc(self->lengths, (size_t)cap * sizeof(Py_ssize_t));
        if (lengths == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->lengths = lengths;
        self->entries_cap = cap;
    }
    if (self->arena_len + more_bytes > self->arena_cap) {
        Py_ssize_t cap = self->arena_cap ? self->arena_cap : 8192;
        while (cap < self->arena_len + more_bytes) {
            cap *= 2;
        }
        unsigned char *arena = PyMem_Realloc(self->arena, (size_t)cap);
        if (arena == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->arena = arena;
        self->arena_cap = cap;
    }
    /* At most half full once they are in. */
    int bits = self->bits > DIGESTSET_MIN_BITS ? self->bits : DIGESTSET_MIN_BITS;
    while (((size_t)1 << bits) < 2 * (size_t)need) {
        bits++;
    }
    if (self->table == NULL || bits != self->bits) {
        if (digestset_alloc_table(self, bits) < 0) {
            return -1;
        }
        for (Py_ssize_t k = 0; k < self->count; k++) {
            int found;
            size_t j = digestset_find(self, self->arena + self->offsets[k], self->lengths[k], &found);
            self->table[j] = (int32_t)(k + 1);
        }
    }
    return 0;
}

/* Enter the n width-byte strings at base (each not yet in the set). With `repeat`, a
 * string already there stops it: *repeat is its index (-1: none was). */
static int
digestset_add_run(DigestSet *self, const unsigned char *base, Py_ssize_t n, Py_ssize_t width,
                  Py_ssize_t *repeat)
{
    if (digestset_grow(self, n, n * width) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = base + i * width;
        int found;
        size_t j = digestset_find(self, p, width, &found);
        if (found) {
            if (repeat != NULL) {
                *repeat = i;
                return 0;
            }
            continue;
        }
        Py_ssize_t k = self->count++;
        memcpy(self->arena + self->arena_len, p, (size_t)width);
        self->offsets[k] = self->arena_len;
        self->lengths[k] = width;
        self->arena_len += width;
        self->table[j] = (int32_t)(k + 1);
    }
    if (repeat != NULL) {
        *repeat = -1;
    }
    return 0;
}

static PyObject *
DigestSet_add(DigestSet *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t width;
    if (digest_args(args, nargs, "add(buf, width)", &view, &width) < 0) {
        return NULL;
    }
    int rc = digestset_add_run(self, view.buf, view.len / width, width, NULL);
    PyBuffer_Release(&view);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* check_digests(buf, width) -> int: -1 when the width-byte hashes packed in buf are
 * distinct, else the index of the first one that repeats an earlier one (entered into a
 * set of their own, as DigestSet.add enters them); ValueError when the length is not a
 * whole number of them. */
static PyObject *
pool_check_digests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    Py_buffer view;
    Py_ssize_t width;
    if (digest_args(args, nargs, "check_digests(buf, width)", &view, &width) < 0) {
        return NULL;
    }
    DigestSet seen;
    memset(&seen, 0, sizeof(seen));
    Py_ssize_t repeat = -1;
    int rc = digestset_add_run(&seen, view.buf, view.len / width, width, &repeat);
    digestset_release(&seen);
    PyBuffer_Release(&view);
    return rc < 0 ? NULL : PyLong_FromSsize_t(repeat);
}

static int
DigestSet_contains(DigestSet *self, PyObject *key)
{
    if (!PyBytes_Check(key) || self->count == 0) {
        return 0;
    }
    int found;
    digestset_find(self, (const unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                   &found);
    return found;
}

static Py_ssize_t
DigestSet_len(DigestSet *self)
{
    return self->count;
}

static PyObject *
DigestSet_clear(DigestSet *self, PyObject *Py_UNUSED(ignored))
{
    if (self->bits > 14 || self->arena_cap > (1 << 20)) {
        /* A large step's table and bytes: given back rather than kept (and cleared) for
         * good; the next add starts small again. */
        digestset_release(self);
    }
    else if (self->count) {
        memset(self->table, 0, ((size_t)1 << self->bits) * sizeof(int32_t));
        self->count = 0;
        self->arena_len = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef DigestSet_methods[] = {
    {"add", (PyCFunction)(void (*)(void))DigestSet_add, METH_FASTCALL,
     "add(buf, width): enter every width-byte string packed in buf."},
    {"clear", (PyCFunction)DigestSet_clear, METH_NOARGS, "Remove every entry."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods DigestSet_as_sequence = {
    .sq_length = (lenfunc)DigestSet_len,
    .sq_contains = (objobjproc)DigestSet_contains,
};

static PyTypeObject DigestSet_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pagekeeper.core._poolops.DigestSet",
    .tp_basicsize = sizeof(DigestSet),
    .tp_dealloc = (destructor)DigestSet_dealloc,
    .tp_as_sequence = &DigestSet_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A set of byte strings held as raw bytes (see the module comment).",
    .tp_methods = DigestSet_methods,
    .tp_new = DigestSet_new,
};

/* The digest tables' keys: 16 bytes from os.urandom, drawn for each process (not from
 * the interpreter's hash secret, which PYTHONHASHSEED may fix for every process alike). */
static int
digest_keys_init(void)
{
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) {
        return -1;
    }
    PyObject *drawn = PyObject_CallMethod(os, "urandom", "i", 16);
    Py_DECREF(os);
    if (drawn == NULL) {
        return -1;
    }
    if (!PyBytes_Check(drawn) || PyBytes_GET_SIZE(drawn) != 16) {
        Py_DECREF(drawn);
        PyErr_SetString(PyExc_RuntimeError, "os.urandom(16) gave something else");
        return -1;
    }
    memcpy(&digest_key0, PyBytes_AS_STRING(drawn), 8);
    memcpy(&digest_key1, PyBytes_AS_STRING(drawn) + 8, 8);
    Py_DECREF(drawn);
    return 0;
}

/* -- decode_columns: a step's growth columns that are all decodes, checked in one pass -- */

/* A 1-D C-contiguous buffer of native ints of `size` bytes and `n` items (n < 0: any). */
static int
int_column(PyObject *obj, Py_buffer *view, Py_ssize_t size, Py_ssize_t n)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (!is_native_int(view, size) || view->ndim != 1 || (n >= 0 && view->len != n * size)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static PyObject *
pool_decode_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_columns(request_ids, num_new_tokens, num_new_token_ids, "
                        "num_computed_tokens, num_lookahead_tokens, new_token_ids, lengths, "
                        "tracked, max_len)");
        return NULL;
    }
    PyObject *ids = args[0];
    Py_ssize_t max_len = PyLong_AsSsize_t(args[8]);
    if (max_len == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyTuple_CheckExact(ids) || max_len < 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    Py_buffer views[7];
    const Py_ssize_t sizes[7] = {4, 4, 4, 4, 4, 8, 8};
    int got = 0, ok = 1;
    for (; got < 7 && ok; got++) {
        /* The token column's length is the counts' sum (checked below). */
        int r = int_column(args[1 + got], &views[got], sizes[got], got == 4 ? -1 : n);
        if (r < 0) {
            for (int k = 0; k < got; k++) {
                PyBuffer_Release(&views[k]);
            }
            return NULL;
        }
        ok = r;
    }
    if (!ok) {
        got--; /* the last one was not taken */
    }
    PyObject *result = NULL, *tokens = NULL, *held = NULL;
    if (!ok) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const int32_t *num_new = views[0].buf, *num_ids = views[1].buf, *explicit_ = views[2].buf;
    const int32_t *ahead = views[3].buf, *toks = views[4].buf;
    const int64_t *lengths = views[5].buf, *tracked = views[6].buf;
    Py_ssize_t num_tokens_total = views[4].len / 4, at = 0;
    int32_t lookahead = n ? ahead[0] : 0;
    /* Every check of the state's column validation, and the plain-decode test, first. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t count = num_ids[i], comp = explicit_[i];
        int64_t num_tokens = lengths[i] + count;
        if (num_new[i] != 1 || ahead[i] != lookahead || lookahead < 0 || count < 1
            || count > num_tokens_total - at || num_tokens > max_len || comp < -1
            || comp > num_tokens
            || !(comp == -1 ? count == 1 : comp == tracked[i] + count - 1)
            || tracked[i] < 0 || tracked[i] > lengths[i]) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        int64_t computed = comp < 0 ? tracked[i] : comp;
        if (computed + 1 > max_len) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        for (int64_t k = 0; k < count; k++) {
            if (toks[at + k] < 0) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
        at += count;
    }
    if (at != num_tokens_total) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* Each row's own token (its last), and the held-back tokens before it by request. */
    tokens = PyList_New(n);
    held = PyDict_New();
    if (tokens == NULL || held == NULL) {
        goto done;
    }
    at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t count = num_ids[i];
        PyObject *last = PyLong_FromLong(toks[at + count - 1]);
        if (last == NULL) {
            goto done;
        }
        PyList_SET_ITEM(tokens, i, last);
        if (count > 1) {
            PyObject *before = PyList_New(count - 1);
            if (before == NULL) {
                goto done;
            }
            for (Py_ssize_t k = 0; k < count - 1; k++) {
                PyObject *t = PyLong_FromLong(toks[at + k]);
                if (t == NULL) {
                    Py_DECREF(before);
                    goto done;
                }
                PyList_SET_ITEM(before, k, t);
            }
            int rc = PyDict_SetItem(held, PyTuple_GET_ITEM(ids, i), before);
            Py_DECREF(before);
            if (rc < 0) {
                goto done;
            }
        }
        at += count;
    }
    result = Py_BuildValue("(OOi)", tokens, held, (int)lookahead);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(held);
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&views[k]);
    }
    return result;
}

static PyMethodDef poolops_methods[] = {
    {"untrack", (PyCFunction)pool_untrack, METH_O,
     "untrack(obj) -> bool: stop the GC tracking obj when nothing it references is "
     "tracked (its type aside); whether it did."},
    {"atomic_tuple", (PyCFunction)pool_atomic_tuple, METH_O,
     "atomic_tuple(items) -> tuple, untracked by the GC when it holds only bytes, ints "
     "and None."},
    {"take_run", (PyCFunction)(void (*)(void))pool_take_run, METH_FASTCALL,
     "take_run(buf, head, num, state) -> (pages, evicted, head): the next num pages of "
     "the free queue, taken."},
    {"append_each", (PyCFunction)(void (*)(void))pool_append_each, METH_FASTCALL,
     "append_each(table, lengths, rows, at, pages) -> bool: one new page at the end of "
     "each of these distinct rows (False: nothing changed, a check failed)."},
    {"pack_i32", (PyCFunction)pool_pack_i32, METH_O,
     "pack_i32(ints) -> bytes: little-endian int32."},
    {"check_digests", (PyCFunction)(void (*)(void))pool_check_digests, METH_FASTCALL,
     "check_digests(buf, width) -> int: -1 when the packed hashes are distinct, else the "
     "index of the first repeat."},
    {"split_digests", (PyCFunction)(void (*)(void))pool_split_digests, METH_FASTCALL,
     "split_digests(buf, width) -> tuple: packed page hashes as bytes objects."},
    {"widen_tokens", (PyCFunction)(void (*)(void))pool_widen_tokens, METH_FASTCALL,
     "widen_tokens(src, dst) -> bool: token ids checked non-negative (ValueError) and "
     "written into the uint64 buffer dst (None: only checked); False for a layout it does "
     "not read."},
    {"evict", (PyCFunction)(void (*)(void))pool_evict, METH_FASTCALL,
     "evict(index, hash_of, cached, pages, flag) -> hashes | None: one group's eviction."},
    {"cache", (PyCFunction)(void (*)(void))pool_cache, METH_FASTCALL,
     "cache(index, hash_of, state, cached, pages, hashes, flag) -> bool: a fresh run."},
    {"release", (PyCFunction)(void (*)(void))pool_release, METH_FASTCALL,
     "release(state, pages, same, now) -> bool: a free of pages in one state."},
    {"decode_columns", (PyCFunction)(void (*)(void))pool_decode_columns, METH_FASTCALL,
     "decode_columns(request_ids, num_new_tokens, num_new_token_ids, num_computed_tokens, "
     "num_lookahead_tokens, new_token_ids, lengths, tracked, max_len) -> (tokens, held, "
     "lookahead) | None: growth columns that are all decodes, checked."},
    {"decode_rows", (PyCFunction)(void (*)(void))pool_decode_rows, METH_FASTCALL,
     "decode_rows(reqs, tokens, start, num_free, page_counts, num_cached_pages, page_size, "
     "hash_page_size, max_len, lookahead, caching, crossing, crossing_held, crossing_rows"
     "[, fill[, extras[, named[, take_crossings]]]]) -> (stop, num_free): the manager's "
     "plain decode rows, "
     "in order "
     "from start."},
    {"gather_rows", (PyCFunction)(void (*)(void))pool_gather_rows, METH_FASTCALL,
     "gather_rows(requests, request_ids, owner, lengths, computed) -> (reqs, max_tokens, "
     "max_computed, max_ahead) | None: each id's request (None: an id unknown, not a str, "
     "not owner's unless owner is None, or a count not a plain int), the most tokens, the "
     "most computed tokens and the most computed past the tokens (0s when empty); "
     "lengths and computed (int64 buffers or None) get each row's."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef poolops_module = {
    PyModuleDef_HEAD_INIT, "pagekeeper.core._poolops",
    "The per-page loops of PagePool's bulk paths in C (optional; see "
    "pagekeeper.core.pool).", -1,
    poolops_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__poolops(void)
{
    if (PyType_Ready(&PageIndex_Type) < 0 || PyType_Ready(&DigestSet_Type) < 0
        || digest_keys_init() < 0) {
        return NULL;
    }
    struct {
        PyObject **slot;
        const char *name;
    } names[] = {
        {&str_request_id, "request_id"},
        {&str_num_computed_tokens, "num_computed_tokens"},
        {&str_token_ids, "token_ids"},
        {&str_hashes, "hashes"},
        {&str_scheduled_start, "scheduled_start"},
        {&str_num_scheduled, "num_scheduled"},
        {&str_append, "append"},
        {&str_extra_keys, "extra_keys"},
        {&str_event_seq, "_event_seq"},
        {&str_pop, "pop"},
        {&str_owner, "owner"},
        {&str_head, "_head"},
        {&str_buf, "_buf"},
        {&str_extend, "extend"},
        {&str_num_free, "_num_free"},
        {&str_num_free_cached, "_num_free_cached"},
        {&str_num_allocated_total, "num_allocated_total"},
        {&str_num_evictions, "num_evictions"},
    };
    if ((int_one == NULL && (int_one = PyLong_FromLong(1)) == NULL)
        || (int_two == NULL && (int_two = PyLong_FromLong(2)) == NULL)) {
        return NULL;
    }
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        if (*names[k].slot == NULL
            && (*names[k].slot = PyUnicode_InternFromString(names[k].name)) == NULL) {
            return NULL;
        }
    }
    PyObject *module = PyModule_Create(&poolops_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "PageIndex", (PyObject *)&PageIndex_Type) < 0
        || PyModule_AddObjectRef(module, "DigestSet", (PyObject *)&DigestSet_Type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
