/* pagekeeper.core._poolops: the per-page loops of PagePool's bulk paths in C.
 *
 * An optional accelerator of pagekeeper.core.pool. It works on the pool's own Python
 * objects (the state list, the cached-flag bytearray, the prefix-cache index dict and the
 * list of each page's hash), so nothing about the pool's layout, snapshots or introspection changes; each
 * function does what the Python loop it replaces does, and tests run the pool both ways.
 *
 *   take(state, pages) -> evicted
 *       Allocation: every page's state becomes 2 (held once, not cached); the pages whose
 *       state was not 0 (cached: evicted now) are returned, in order.
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
 * Page ids are checked against the state list's length before anything is written (an
 * IndexError, as the Python loops would raise, changes nothing here).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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
    if (index != NULL && !PyDict_CheckExact(index)) {
        PyErr_SetString(PyExc_TypeError, "index must be a dict");
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
pool_take(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(state, pages)");
        return NULL;
    }
    PyObject *state = args[0];
    if (check_types(state, NULL, NULL, NULL) < 0) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[1], "pages must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *evicted = NULL;
    Py_ssize_t *ids = page_ids(fast, PyList_GET_SIZE(state));
    if (ids == NULL) {
        goto done;
    }
    evicted = PyList_New(0);
    if (evicted == NULL) {
        goto done;
    }
    /* Free pages read 0 (no hash) or 1 (cached); any other state is reported as the
     * Python loop does (as evicted: check_invariants then finds the broken pool). */
    for (Py_ssize_t i = 0; i < k; i++) {
        long s = state_at(state, ids[i]);
        if (s < 0) {
            Py_CLEAR(evicted);
            goto done;
        }
        if (s != 0 && PyList_Append(evicted, items[i]) < 0) {
            Py_CLEAR(evicted);
            goto done;
        }
        if (set_state(state, ids[i], 2) < 0) {
            Py_CLEAR(evicted);
            goto done;
        }
    }
done:
    PyMem_Free(ids);
    Py_DECREF(fast);
    return evicted;
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
        if (PyDict_DelItem(index, h) < 0) {
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
    /* 2. The index, undone if a hash is already there (or repeats within the run). */
    for (Py_ssize_t i = 0; i < k; i++) {
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
            int rc = PyDict_DelItem(index, hashes[j]);
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

static PyMethodDef poolops_methods[] = {
    {"untrack", (PyCFunction)pool_untrack, METH_O,
     "untrack(obj) -> bool: stop the GC tracking obj when nothing it references is "
     "tracked (its type aside); whether it did."},
    {"atomic_tuple", (PyCFunction)pool_atomic_tuple, METH_O,
     "atomic_tuple(items) -> tuple, untracked by the GC when it holds only bytes, ints "
     "and None."},
    {"take", (PyCFunction)(void (*)(void))pool_take, METH_FASTCALL,
     "take(state, pages) -> evicted: allocation's state pass."},
    {"evict", (PyCFunction)(void (*)(void))pool_evict, METH_FASTCALL,
     "evict(index, hash_of, cached, pages, flag) -> hashes | None: one group's eviction."},
    {"cache", (PyCFunction)(void (*)(void))pool_cache, METH_FASTCALL,
     "cache(index, hash_of, state, cached, pages, hashes, flag) -> bool: a fresh run."},
    {"release", (PyCFunction)(void (*)(void))pool_release, METH_FASTCALL,
     "release(state, pages, same, now) -> bool: a free of pages in one state."},
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
    return PyModule_Create(&poolops_module);
}
