/* pagekeeper.core._native: the two hot loops of page hashing in C.
 *
 * An optional accelerator of pagekeeper.core.hashing, byte-for-byte equal to its Python
 * functions (tests check both on random inputs):
 *
 *   encode_pages(tokens, page_size) -> (body, ends)
 *       = _encode_tokens_np: every token of the full pages as a CBOR unsigned integer,
 *         concatenated, and the end offset of each page's run in `body`. `tokens` is any
 *         C-contiguous buffer of unsigned integers of 1, 2, 4 or 8 bytes (native order).
 *
 *   chain_sha256(first_head, head, parent, array_head, body, ends, extras) -> [digest]
 *       = _chain for sha256_cbor: page i hashes
 *             head_i | parent_i | array_head | body[ends[i-1]:ends[i]] | extra_i
 *         where page 0 takes `first_head` and `parent`, later pages `head` and the digest
 *         of the page before. `extras` is one bytes object (the same for every page) or a
 *         list of them, one per page.
 *
 *   sha256_page(head, parent, array_head, tokens, start, page_size, extra) -> digest
 *       One page of a chain in one call: the SHA-256 of
 *             head | parent | array_head | CBOR(tokens[start : start + page_size]) | extra
 *         with `tokens` a buffer as for encode_pages, read in place (a decode's filled
 *         page, straight from the request's stored ids: no slice, body or list).
 *
 * SHA-256 is OpenSSL's (the library CPython's hashlib uses): one EVP context per call,
 * reused for its pages, so a page costs the digest itself and one bytes object, not four
 * Python objects and a call frame. The extension is built when a C compiler and OpenSSL's headers are there
 * (setup.py marks it optional); without it the Python code runs, with equal results.
 */
#define PY_SSIZE_T_CLEAN
/* SHA256_Init/Update/Final: deprecated in OpenSSL 3.0 (still there, and the same
 * SHA-NI block code as EVP) but without EVP's per-digest dispatch: ~100 ns against
 * 140-170 ns for a page's 90-byte message here, and no context allocation for a decode's
 * one page. A build without them (OpenSSL 4, or 3 built without deprecated APIs) uses EVP. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#if OPENSSL_VERSION_MAJOR >= 4 || defined(OPENSSL_NO_DEPRECATED_3_0)
#define PK_EVP_ONLY 1
#endif

#define DIGEST_SIZE 32

static EVP_MD *sha256_md = NULL; /* fetched once, read-only after */

/* CBOR head of a major type 0 (unsigned) item: the value itself below 24, else a size
 * byte and 1, 2, 4 or 8 big-endian bytes. Returns the bytes written (at most 9). */
static inline Py_ssize_t
put_uint(unsigned char *out, uint64_t v)
{
    if (v < 24) {
        out[0] = (unsigned char)v;
        return 1;
    }
    if (v < 0x100) {
        out[0] = 0x18;
        out[1] = (unsigned char)v;
        return 2;
    }
    if (v < 0x10000) {
        out[0] = 0x19;
        out[1] = (unsigned char)(v >> 8);
        out[2] = (unsigned char)v;
        return 3;
    }
    if (v < 0x100000000ULL) {
        out[0] = 0x1a;
        out[1] = (unsigned char)(v >> 24);
        out[2] = (unsigned char)(v >> 16);
        out[3] = (unsigned char)(v >> 8);
        out[4] = (unsigned char)v;
        return 5;
    }
    out[0] = 0x1b;
    for (int k = 0; k < 8; k++) {
        out[1 + k] = (unsigned char)(v >> (56 - 8 * k));
    }
    return 9;
}

static inline uint64_t
load_uint(const char *data, Py_ssize_t itemsize, Py_ssize_t i)
{
    switch (itemsize) {
    case 1:
        return ((const uint8_t *)data)[i];
    case 2:
        return ((const uint16_t *)data)[i];
    case 4:
        return ((const uint32_t *)data)[i];
    default:
        return ((const uint64_t *)data)[i];
    }
}

/* `view` of `obj`: a C-contiguous buffer of unsigned integers of 1, 2, 4 or 8 bytes in
 * native order; -1 with an exception set (and nothing held) otherwise. */
static int
get_tokens(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    Py_ssize_t itemsize = view->itemsize;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '@' || *fmt == '=' || (PY_LITTLE_ENDIAN && *fmt == '<')) {
        fmt++;  /* native byte order */
    }
    if (!(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8)
        || strchr("BHILQN", *fmt) == NULL || fmt[0] == '\0' || fmt[1] != '\0') {
        PyErr_Format(PyExc_TypeError,
                     "tokens must be a buffer of unsigned integers, got format '%s'",
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
encode_pages(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_pages(tokens, page_size)");
        return NULL;
    }
    Py_ssize_t page_size = PyLong_AsSsize_t(args[1]);
    if (page_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (page_size < 1) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1");
        return NULL;
    }
    Py_buffer view;
    if (get_tokens(args[0], &view) < 0) {
        return NULL;
    }
    PyObject *body = NULL, *ends = NULL, *result = NULL;
    Py_ssize_t itemsize = view.itemsize;
    Py_ssize_t num_pages = (view.len / itemsize) / page_size;
    if (num_pages > PY_SSIZE_T_MAX / 9 / page_size) {
        PyErr_NoMemory();
        goto done;
    }
    body = PyBytes_FromStringAndSize(NULL, num_pages * page_size * 9);
    ends = PyList_New(num_pages);
    if (body == NULL || ends == NULL) {
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(body);
    Py_ssize_t written = 0, i = 0;
    for (Py_ssize_t page = 0; page < num_pages; page++) {
        for (Py_ssize_t stop = i + page_size; i < stop; i++) {
            written += put_uint(out + written, load_uint(view.buf, itemsize, i));
        }
        PyObject *end = PyLong_FromSsize_t(written);
        if (end == NULL) {
            goto done;
        }
        PyList_SET_ITEM(ends, page, end);
    }
    if (_PyBytes_Resize(&body, written) < 0) {
        goto done;
    }
    result = PyTuple_Pack(2, body, ends);
done:
    Py_XDECREF(body);
    Py_XDECREF(ends);
    PyBuffer_Release(&view);
    return result;
}

/* A bytes object's bytes, or a TypeError naming the argument. */
static int
as_bytes(PyObject *obj, const char *name, const char **data, Py_ssize_t *size)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *data = PyBytes_AS_STRING(obj);
    *size = PyBytes_GET_SIZE(obj);
    return 0;
}

static PyObject *
chain_sha256(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_sha256(first_head, head, parent, array_head, body, ends, extras)");
        return NULL;
    }
    const char *first_head, *head, *parent, *array_head, *body;
    Py_ssize_t first_head_len, head_len, parent_len, array_head_len, body_len;
    if (as_bytes(args[0], "first_head", &first_head, &first_head_len) < 0
        || as_bytes(args[1], "head", &head, &head_len) < 0
        || as_bytes(args[2], "parent", &parent, &parent_len) < 0
        || as_bytes(args[3], "array_head", &array_head, &array_head_len) < 0
        || as_bytes(args[4], "body", &body, &body_len) < 0) {
        return NULL;
    }
    PyObject *ends = args[5], *extras = args[6];
    if (!PyList_Check(ends)) {
        PyErr_SetString(PyExc_TypeError, "ends must be a list of ints");
        return NULL;
    }
    Py_ssize_t num_pages = PyList_GET_SIZE(ends);
    int one_extra = PyBytes_Check(extras);
    if (!one_extra && !PyList_Check(extras)) {
        PyErr_SetString(PyExc_TypeError, "extras must be bytes or a list of bytes");
        return NULL;
    }
    if (!one_extra && PyList_GET_SIZE(extras) < num_pages) {
        num_pages = PyList_GET_SIZE(extras);  /* as zip(): the shorter one ends the chain */
    }
    PyObject *out = PyList_New(num_pages);
    if (out == NULL || num_pages == 0) {
        return out;
    }
    /* What the loop reads is copied first: the offsets into a C array and the extras into
     * a list of our own (allocations below may run a collection, and a finalizer could
     * change the caller's lists). One pass checks them and sizes the message buffer. */
    PyObject *own_extras = one_extra ? NULL : PyList_GetSlice(extras, 0, num_pages);
    Py_ssize_t *offsets = PyMem_New(Py_ssize_t, num_pages);
    unsigned char *message = NULL;
    EVP_MD_CTX *ctx = NULL;
    if ((!one_extra && own_extras == NULL) || offsets == NULL) {
        if (offsets == NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    Py_ssize_t max_run = 0, max_extra = one_extra ? PyBytes_GET_SIZE(extras) : 0, start = 0;
    for (Py_ssize_t i = 0; i < num_pages; i++) {
        Py_ssize_t end = PyLong_AsSsize_t(PyList_GET_ITEM(ends, i));
        if (end == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (end < start || end > body_len) {
            PyErr_Format(PyExc_ValueError, "ends[%zd] = %zd outside [%zd, %zd]", i, end, start,
                         body_len);
            goto fail;
        }
        offsets[i] = end;
        if (end - start > max_run) {
            max_run = end - start;
        }
        start = end;
        if (!one_extra) {
            PyObject *extra = PyList_GET_ITEM(own_extras, i);
            if (!PyBytes_Check(extra)) {
                PyErr_Format(PyExc_TypeError, "extras[%zd] must be bytes", i);
                goto fail;
            }
            if (PyBytes_GET_SIZE(extra) > max_extra) {
                max_extra = PyBytes_GET_SIZE(extra);
            }
        }
    }
    Py_ssize_t lead = first_head_len + parent_len;
    if (head_len + DIGEST_SIZE > lead) {
        lead = head_len + DIGEST_SIZE;
    }
    message = PyMem_Malloc(lead + array_head_len + max_run + max_extra);
    if (message == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
#ifdef PK_EVP_ONLY
    /* A context per call (one allocation, not one per page): nothing is shared between
     * calls, whichever threads make them. */
    ctx = EVP_MD_CTX_new();
    if (ctx == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
#endif
    /* Page 0's lead: the given parent (any length) after its own byte-string head. */
    memcpy(message, first_head, first_head_len);
    memcpy(message + first_head_len, parent, parent_len);
    Py_ssize_t parent_end = first_head_len + parent_len;
    unsigned char digest[DIGEST_SIZE];
    start = 0;
    for (Py_ssize_t i = 0; i < num_pages; i++) {
        PyObject *extra = one_extra ? extras : PyList_GET_ITEM(own_extras, i);
        Py_ssize_t end = offsets[i], n = parent_end;
        memcpy(message + n, array_head, array_head_len);
        n += array_head_len;
        memcpy(message + n, body + start, end - start);
        n += end - start;
        memcpy(message + n, PyBytes_AS_STRING(extra), PyBytes_GET_SIZE(extra));
        n += PyBytes_GET_SIZE(extra);
#ifdef PK_EVP_ONLY
        unsigned int digest_len = 0;
        if (!EVP_DigestInit_ex(ctx, sha256_md, NULL)
            || !EVP_DigestUpdate(ctx, message, (size_t)n)
            || !EVP_DigestFinal_ex(ctx, digest, &digest_len)
            || digest_len != DIGEST_SIZE) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
            goto fail;
        }
#else
        SHA256_CTX sha;
        if (!SHA256_Init(&sha) || !SHA256_Update(&sha, message, (size_t)n)
            || !SHA256_Final(digest, &sha)) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
            goto fail;
        }
#endif
        PyObject *item = PyBytes_FromStringAndSize((const char *)digest, DIGEST_SIZE);
        if (item == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, item);
        if (i == 0) {
            memcpy(message, head, head_len);  /* later pages: a digest as the parent */
            parent_end = head_len + DIGEST_SIZE;
        }
        memcpy(message + head_len, digest, DIGEST_SIZE);
        start = end;
    }
    EVP_MD_CTX_free(ctx);
    PyMem_Free(message);
    PyMem_Free(offsets);
    Py_XDECREF(own_extras);
    return out;
fail:
    EVP_MD_CTX_free(ctx);
    PyMem_Free(message);
    PyMem_Free(offsets);
    Py_XDECREF(own_extras);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
sha256_page(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "sha256_page(head, parent, array_head, tokens, start, page_size, extra)");
        return NULL;
    }
    const char *head, *parent, *array_head, *extra;
    Py_ssize_t head_len, parent_len, array_head_len, extra_len;
    if (as_bytes(args[0], "head", &head, &head_len) < 0
        || as_bytes(args[1], "parent", &parent, &parent_len) < 0
        || as_bytes(args[2], "array_head", &array_head, &array_head_len) < 0
        || as_bytes(args[6], "extra", &extra, &extra_len) < 0) {
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    Py_ssize_t page_size = start == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (start < 0 || page_size < 1 || page_size > PY_SSIZE_T_MAX / 9) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0 and page_size >= 1");
        return NULL;
    }
    Py_buffer view;
    if (get_tokens(args[3], &view) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    unsigned char small[9 * 64], *encoded = small;
    EVP_MD_CTX *ctx = NULL;
    Py_ssize_t itemsize = view.itemsize;
    if (start > view.len / itemsize - page_size) {
        PyErr_Format(PyExc_ValueError, "no full page of %zd tokens at %zd (%zd tokens)",
                     page_size, start, view.len / itemsize);
        goto done;
    }
    if (page_size > 64) {
        encoded = PyMem_Malloc(9 * page_size);
        if (encoded == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = start; i < start + page_size; i++) {
        n += put_uint(encoded + n, load_uint(view.buf, itemsize, i));
    }
    unsigned char digest[DIGEST_SIZE];
#ifdef PK_EVP_ONLY
    ctx = EVP_MD_CTX_new();
    if (ctx == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned int digest_len = 0;
    if (!EVP_DigestInit_ex(ctx, sha256_md, NULL)
        || !EVP_DigestUpdate(ctx, head, (size_t)head_len)
        || !EVP_DigestUpdate(ctx, parent, (size_t)parent_len)
        || !EVP_DigestUpdate(ctx, array_head, (size_t)array_head_len)
        || !EVP_DigestUpdate(ctx, encoded, (size_t)n)
        || !EVP_DigestUpdate(ctx, extra, (size_t)extra_len)
        || !EVP_DigestFinal_ex(ctx, digest, &digest_len) || digest_len != DIGEST_SIZE) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
        goto done;
    }
#else
    SHA256_CTX sha;
    if (!SHA256_Init(&sha) || !SHA256_Update(&sha, head, (size_t)head_len)
        || !SHA256_Update(&sha, parent, (size_t)parent_len)
        || !SHA256_Update(&sha, array_head, (size_t)array_head_len)
        || !SHA256_Update(&sha, encoded, (size_t)n)
        || !SHA256_Update(&sha, extra, (size_t)extra_len) || !SHA256_Final(digest, &sha)) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
        goto done;
    }
#endif
    result = PyBytes_FromStringAndSize((const char *)digest, DIGEST_SIZE);
done:
    EVP_MD_CTX_free(ctx);
    if (encoded != small) {
        PyMem_Free(encoded);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef native_methods[] = {
    {"encode_pages", (PyCFunction)(void (*)(void))encode_pages, METH_FASTCALL,
     "encode_pages(tokens, page_size) -> (body, ends): CBOR uints of the full pages."},
    {"chain_sha256", (PyCFunction)(void (*)(void))chain_sha256, METH_FASTCALL,
     "chain_sha256(first_head, head, parent, array_head, body, ends, extras) -> list of "
     "SHA-256 digests, each page's the next one's parent."},
    {"sha256_page", (PyCFunction)(void (*)(void))sha256_page, METH_FASTCALL,
     "sha256_page(head, parent, array_head, tokens, start, page_size, extra) -> the "
     "SHA-256 of one page read in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "pagekeeper.core._native",
    "The hot loops of page hashing in C (optional; see pagekeeper.core.hashing).", -1,
    native_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (sha256_md == NULL) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
        /* Fetched once: an implicit fetch at every init costs as much as the digest. */
        sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
        sha256_md = (EVP_MD *)EVP_sha256();
#endif
        if (sha256_md == NULL) {
            PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA-256");
            return NULL;
        }
    }
    return PyModule_Create(&native_module);
}
