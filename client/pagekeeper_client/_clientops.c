/* The scheduler mirror's per-row decode loops in C (optional: the client runs the same
 * loops in Python without them, with the same results).
 *
 * check_decodes: the step's up-front check (see below).
 *
 * held_ends: a published batch's computed counts for rows holding back decodes (below).
 *
 * plan_decodes: hold_decodes, and the rows it stops at planned as growths too (below).
 *
 * hold_decodes(tracked, token_bytes, start, page_size, max_len, lookahead, alignment,
 *              held_back) -> stop
 *
 * For rows start, start + 1, ... of a decode step on a pool of one full-attention group, a
 * row whose decode needs no new page and completes no page to cache is held back in the
 * mirror: its token (4 bytes of token_bytes) is appended to the request's ``held`` bytes,
 * its ``num_tokens`` and ``num_computed_tokens`` grow by one, and the request is appended
 * to ``held_back``. The loop stops at the first row that needs anything else (a page, a
 * page to cache, or a field of a type it does not expect) and returns that row's index
 * (len(tracked) when every row was held): the caller plans that row itself and calls again
 * from the next. ``alignment`` is the caching alignment (0: prefix caching is off).
 *
 * Rows are applied strictly in order, each one whole: a row's new values are all built
 * before any is stored.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *str_num_tokens, *str_num_computed_tokens, *str_pages, *str_held;

/* An attribute that is an exact int in [0, 2**40): 1 with its value in *out; 0 when it is
 * missing, of another type or out of range (the row goes back to the caller); -1 with an
 * exception set on an error other than a missing attribute. */
static int
int_attr(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int ok = 0;
    if (PyLong_CheckExact(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(value);
            return -1;
        }
        if (!overflow && v >= 0 && v < (1LL << 40)) {
            *out = v;
            ok = 1;
        }
    }
    Py_DECREF(value);
    return ok;
}

static int
arg_ll(PyObject *arg, const char *what, long long low, long long *out)
{
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int", what);
        return -1;
    }
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < low || v > (1LL << 40)) {
        PyErr_Format(PyExc_ValueError, "%s out of range", what);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *str_pending, *empty_bytes;

/* What a decode step's rows share (hold_decodes' and plan_decodes' arguments). */
typedef struct {
    PyObject *tracked, *ids, *tokens, *held_back, *growths, *growth_type;
    long long start, page_size, max_len, lookahead, alignment;
    int hold;
} DecodeRows;

/* One row: 1 when held back or planned, 0 when it is left to the caller (nothing
 * changed), -1 with an exception set. Held back (with ``hold``): a decode that needs no
 * page and completes none to cache -- its token appended to ``held``, its counts one up,
 * the request appended to ``held_back``. Planned (with ``growths``, for any other row of a
 * request whose fields are as expected): ``growth_type(...)`` (see plan_decodes) appended,
 * the counts one up, ``pending`` set, ``held`` emptied. Every new value is built before
 * any is stored. */
static int
decode_row(const DecodeRows *d, PyObject *t, PyObject *rid, const char *token)
{
    long long num_tokens, computed;
    int ok = int_attr(t, str_num_tokens, &num_tokens);
    if (ok == 1)
        ok = int_attr(t, str_num_computed_tokens, &computed);
    if (ok <= 0)
        return ok;
    long long num_slots = computed + 1 + d->lookahead;
    if (num_slots > d->max_len)
        num_slots = d->max_len;
    if (num_slots <= 0)
        return 0;
    PyObject *pages = PyObject_GetAttr(t, str_pages);
    if (pages == NULL)
        return -1;
    Py_ssize_t held_pages = -1;
    if (PyList_CheckExact(pages) && PyList_GET_SIZE(pages) >= 1
        && PyList_CheckExact(PyList_GET_ITEM(pages, 0)))
        held_pages = PyList_GET_SIZE(PyList_GET_ITEM(pages, 0));
    Py_DECREF(pages);
    if (held_pages < 0)
        return 0; /* not a layout this loop knows */
    /* -(-num_slots // page_size) - held (num_slots > 0). */
    long long num_needed = (num_slots + d->page_size - 1) / d->page_size - held_pages;
    int needs = num_needed > 0;
    int completes = d->alignment && (computed + 1) % d->alignment == 0; /* a page to cache */
    int holds = d->hold && !needs && !completes;
    if (!holds && (d->growths == NULL || rid == NULL || !PyUnicode_CheckExact(rid)))
        return 0;
    PyObject *held = PyObject_GetAttr(t, str_held);
    if (held == NULL)
        return -1;
    if (!PyBytes_CheckExact(held)) {
        Py_DECREF(held);
        return 0;
    }
    Py_ssize_t k = PyBytes_GET_SIZE(held);
    int result = -1;
    PyObject *growth = NULL, *nulled = NULL, *computed_o = NULL, *lookahead_o = NULL;
    PyObject *needed_o = NULL, *tokens_o = NULL, *one = NULL;
    /* The held tokens then this one: the new ``held`` when held back, else the growth's. */
    PyObject *token_bytes = PyBytes_FromStringAndSize(NULL, k + 4);
    PyObject *new_tokens = PyLong_FromLongLong(num_tokens + 1);
    PyObject *new_computed = PyLong_FromLongLong(computed + 1);
    if (token_bytes == NULL || new_tokens == NULL || new_computed == NULL)
        goto done;
    memcpy(PyBytes_AS_STRING(token_bytes), PyBytes_AS_STRING(held), (size_t)k);
    memcpy(PyBytes_AS_STRING(token_bytes) + k, token, 4);
    if (holds) {
        int failed = PyObject_SetAttr(t, str_held, token_bytes) < 0
                     || PyObject_SetAttr(t, str_num_tokens, new_tokens) < 0
                     || PyObject_SetAttr(t, str_num_computed_tokens, new_computed) < 0
                     || PyList_Append(d->held_back, t) < 0;
        result = failed ? -1 : 1;
        goto done;
    }
    nulled = PyList_New(0);
    computed_o = PyLong_FromLongLong(computed);
    lookahead_o = PyLong_FromLongLong(d->lookahead);
    needed_o = PyLong_FromLongLong(needs ? num_needed : 0);
    tokens_o = PyLong_FromLongLong(num_tokens);
    one = PyLong_FromLong(1);
    if (nulled == NULL || computed_o == NULL || lookahead_o == NULL || needed_o == NULL
        || tokens_o == NULL || one == NULL)
        goto done;
    PyObject *args[20] = {
        rid, token_bytes, computed_o, one, lookahead_o, needs ? Py_True : Py_False,
        needed_o, Py_False, tokens_o, computed_o, nulled, t, needs ? Py_False : Py_True,
        Py_False, Py_False, Py_None, k ? Py_True : Py_False,
        (d->lookahead == 0 && k == 0) ? Py_True : Py_False, Py_False, held,
    };
    growth = PyObject_Vectorcall(d->growth_type, args, 20, NULL);
    if (growth != NULL
        && PyObject_SetAttr(t, str_num_tokens, new_tokens) == 0
        && PyObject_SetAttr(t, str_num_computed_tokens, new_computed) == 0
        && PyObject_SetAttr(t, str_pending, growth) == 0
        && PyObject_SetAttr(t, str_held, empty_bytes) == 0
        && PyList_Append(d->growths, growth) == 0)
        result = 1;
done:
    Py_XDECREF(growth);
    Py_XDECREF(nulled);
    Py_XDECREF(computed_o);
    Py_XDECREF(lookahead_o);
    Py_XDECREF(needed_o);
    Py_XDECREF(tokens_o);
    Py_XDECREF(one);
    Py_XDECREF(token_bytes);
    Py_XDECREF(new_tokens);
    Py_XDECREF(new_computed);
    Py_DECREF(held);
    return result;
}

/* The numeric arguments from ``nums`` (start, page_size, max_len, lookahead, alignment)
 * and the lengths checked, then the rows from ``start`` in order: the index of the first
 * row left to the caller, or NULL with an exception set. */
static PyObject *
decode_rows(DecodeRows *d, PyObject *const *nums)
{
    if (arg_ll(nums[0], "start", 0, &d->start) < 0
        || arg_ll(nums[1], "page_size", 1, &d->page_size) < 0
        || arg_ll(nums[2], "max_len", 1, &d->max_len) < 0
        || arg_ll(nums[3], "lookahead", 0, &d->lookahead) < 0
        || arg_ll(nums[4], "alignment", 0, &d->alignment) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(d->tracked);
    if (PyBytes_GET_SIZE(d->tokens) != 4 * n) {
        PyErr_Format(PyExc_ValueError, "%zd token bytes for %zd rows",
                     PyBytes_GET_SIZE(d->tokens), n);
        return NULL;
    }
    if (d->ids != NULL && PyList_GET_SIZE(d->ids) != n) {
        PyErr_Format(PyExc_ValueError, "%zd ids for %zd rows", PyList_GET_SIZE(d->ids), n);
        return NULL;
    }
    if (d->start > n) {
        PyErr_SetString(PyExc_ValueError, "start past the last row");
        return NULL;
    }
    const char *token = PyBytes_AS_STRING(d->tokens);
    Py_ssize_t i = (Py_ssize_t)d->start;
    /* A row (and its id) is held (a strong reference) while its attributes are read and
     * set: a descriptor could run code that changes the lists. */
    for (; i < n && i < PyList_GET_SIZE(d->tracked)
           && (d->ids == NULL || i < PyList_GET_SIZE(d->ids));
         i++) {
        PyObject *t = Py_NewRef(PyList_GET_ITEM(d->tracked, i));
        PyObject *rid = d->ids == NULL ? NULL : Py_NewRef(PyList_GET_ITEM(d->ids, i));
        int done = decode_row(d, t, rid, token + 4 * i);
        Py_DECREF(t);
        Py_XDECREF(rid);
        if (done < 0)
            return NULL;
        if (!done)
            break;
    }
    return PyLong_FromSsize_t(i);
}

static PyObject *
clientops_hold_decodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "hold_decodes takes 8 arguments");
        return NULL;
    }
    DecodeRows d = {.tracked = args[0], .tokens = args[1], .held_back = args[7], .hold = 1};
    if (!PyList_CheckExact(d.tracked) || !PyBytes_CheckExact(d.tokens)
        || !PyList_CheckExact(d.held_back)) {
        PyErr_SetString(PyExc_TypeError,
                        "hold_decodes needs a list of requests, token bytes and a list");
        return NULL;
    }
    return decode_rows(&d, args + 2);
}

/* plan_decodes(tracked, ids, token_bytes, start, page_size, max_len, lookahead, alignment,
 *              held_back, growths, growth_type, hold) -> stop
 *
 * hold_decodes (only with ``hold``), and the rows it would stop at planned too when they
 * are decodes of a request whose fields are as expected: a row that needs a page or
 * completes one to cache (or any row, without ``hold``) becomes ``growth_type(request_id,
 * token_bytes, computed, 1, lookahead, needs, num_needed, False, num_tokens, computed, [],
 * t, not needs, False, False, None, bool(held), lookahead == 0 and not held, False,
 * held)`` (the mirror's _PendingGrowth, positionally; token_bytes is the held tokens then
 * its own), appended to ``growths``, the request's counts one up, ``pending`` set and
 * ``held`` emptied: SchedulerState.plan_decodes' loop body. Returns the index of the
 * first row it leaves to the caller (len(tracked): none). */
static PyObject *
clientops_plan_decodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "plan_decodes takes 12 arguments");
        return NULL;
    }
    DecodeRows d = {.tracked = args[0], .ids = args[1], .tokens = args[2],
                    .held_back = args[8], .growths = args[9], .growth_type = args[10]};
    if ((d.hold = PyObject_IsTrue(args[11])) < 0)
        return NULL;
    if (!PyList_CheckExact(d.tracked) || !PyList_CheckExact(d.ids)
        || !PyBytes_CheckExact(d.tokens) || !PyList_CheckExact(d.held_back)
        || !PyList_CheckExact(d.growths) || !PyCallable_Check(d.growth_type)) {
        PyErr_SetString(PyExc_TypeError,
                        "plan_decodes needs lists of requests and ids, token bytes, two lists "
                        "and the growth type");
        return NULL;
    }
    return decode_rows(&d, args + 3);
}

/* check_decodes(request_ids, requests, max_len, lookahead) -> list | int
 *
 * The up-front check of a decode step: every id names a request of ``requests`` whose
 * counts leave room for one more token (num_tokens and num_computed_tokens below max_len,
 * num_computed_tokens at most num_tokens + lookahead). Returns the requests in order when
 * every row passes, else the index of the first row that fails or that it cannot judge (a
 * count that is not an exact int): the caller's own check then says why. */
static PyObject *
clientops_check_decodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "check_decodes takes 4 arguments");
        return NULL;
    }
    PyObject *ids = args[0], *requests = args[1];
    if (!PyList_CheckExact(ids) || !PyDict_CheckExact(requests)) {
        PyErr_SetString(PyExc_TypeError, "check_decodes needs a list of ids and a dict");
        return NULL;
    }
    long long max_len, lookahead;
    if (arg_ll(args[2], "max_len", 1, &max_len) < 0
        || arg_ll(args[3], "lookahead", 0, &lookahead) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (; i < n && i < PyList_GET_SIZE(ids); i++) {
        PyObject *key = PyList_GET_ITEM(ids, i);
        Py_INCREF(key);
        PyObject *t = PyDict_GetItemWithError(requests, key);
        Py_DECREF(key);
        long long num_tokens, computed;
        int ok = 0;
        if (t != NULL) {
            Py_INCREF(t); /* owned: reading its attributes could change the dict */
            ok = int_attr(t, str_num_tokens, &num_tokens);
            if (ok == 1)
                ok = int_attr(t, str_num_computed_tokens, &computed);
        }
        else if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                Py_DECREF(out);
                return NULL;
            }
            PyErr_Clear(); /* an unhashable id: the caller's check says so */
        }
        if (ok <= 0 || num_tokens >= max_len || computed >= max_len
            || computed > num_tokens + lookahead) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return ok < 0 ? NULL : PyLong_FromSsize_t(i);
        }
        PyList_SET_ITEM(out, i, t); /* the reference taken above */
    }
    if (i < n) { /* the id list shrank meanwhile: the caller's check judges it */
        Py_DECREF(out);
        return PyLong_FromSsize_t(i);
    }
    return out;
}

/* held_ends(requests, batch) -> bytes | None | NotImplemented
 *
 * Batch.num_computed_tokens as the mirror has it: for each id of ``batch`` (a list or
 * tuple), the request's num_computed_tokens when it holds back decodes (a non-empty
 * ``held`` bytes), else -1, as little-endian int32. None when no row holds any;
 * NotImplemented when a row is not as expected (an unhashable id, a count that is not an
 * exact int below 2**31, ``held`` not bytes): the caller's Python loop then decides. */
static PyObject *
clientops_held_ends(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "held_ends takes 2 arguments");
        return NULL;
    }
    PyObject *requests = args[0], *batch = args[1];
    if (!PyDict_CheckExact(requests) || !(PyList_CheckExact(batch) || PyTuple_CheckExact(batch)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *fast = PySequence_Fast(batch, "batch must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    int any = 0, unknown = 0;
    for (Py_ssize_t i = 0; i < n && !unknown; i++) {
        PyObject *t = PyDict_GetItemWithError(requests, PySequence_Fast_GET_ITEM(fast, i));
        long long end = -1;
        if (t == NULL) {
            if (PyErr_Occurred()) {
                PyErr_Clear(); /* an unhashable id: the caller's loop says so */
                unknown = 1;
                break;
            }
        }
        else {
            Py_INCREF(t);
            PyObject *held = PyObject_GetAttr(t, str_held);
            if (held == NULL || !PyBytes_CheckExact(held)) {
                unknown = 1;
            }
            else if (PyBytes_GET_SIZE(held) > 0) {
                int ok = int_attr(t, str_num_computed_tokens, &end);
                if (ok <= 0 || end >= (1LL << 31)) {
                    unknown = 1;
                }
                any = 1;
            }
            Py_XDECREF(held);
            Py_DECREF(t);
            if (unknown) {
                PyErr_Clear();
                break;
            }
        }
        uint32_t v = (uint32_t)(int32_t)end;
        dst[4 * i] = (unsigned char)(v & 0xff);
        dst[4 * i + 1] = (unsigned char)((v >> 8) & 0xff);
        dst[4 * i + 2] = (unsigned char)((v >> 16) & 0xff);
        dst[4 * i + 3] = (unsigned char)(v >> 24);
    }
    Py_DECREF(fast);
    if (unknown || !any) {
        Py_DECREF(out);
        if (unknown)
            Py_RETURN_NOTIMPLEMENTED;
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef clientops_methods[] = {
    {"check_decodes", (PyCFunction)(void (*)(void))clientops_check_decodes, METH_FASTCALL,
     "The requests of a decode step when every row passes the up-front check, else the "
     "index of the first row the caller must judge."},
    {"held_ends", (PyCFunction)(void (*)(void))clientops_held_ends, METH_FASTCALL,
     "Batch.num_computed_tokens (little-endian int32) for rows holding back decodes, -1 "
     "for the others; None when none holds any; NotImplemented: the caller's loop decides."},
    {"plan_decodes", (PyCFunction)(void (*)(void))clientops_plan_decodes, METH_FASTCALL,
     "hold_decodes, the other plain decode rows planned as growths too; returns the index "
     "of the first row the caller must plan (len(tracked): none)."},
    {"hold_decodes", (PyCFunction)(void (*)(void))clientops_hold_decodes, METH_FASTCALL,
     "Hold back decode rows that need nothing from the service, from `start` on, in order; "
     "returns the index of the first row that needs planning (len(tracked): none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef clientops_module = {
    PyModuleDef_HEAD_INIT, "_clientops",
    "The scheduler mirror's per-row decode loops in C (see the source's header).", -1,
    clientops_methods,
};

PyMODINIT_FUNC
PyInit__clientops(void)
{
    str_num_tokens = PyUnicode_InternFromString("num_tokens");
    str_num_computed_tokens = PyUnicode_InternFromString("num_computed_tokens");
    str_pages = PyUnicode_InternFromString("pages");
    str_held = PyUnicode_InternFromString("held");
    str_pending = PyUnicode_InternFromString("pending");
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    if (!str_num_tokens || !str_num_computed_tokens || !str_pages || !str_held || !str_pending
        || !empty_bytes)
        return NULL;
    return PyModule_Create(&clientops_module);
}
