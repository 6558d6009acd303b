/* memsem._hot: the entry of the same-node hot path, as a CPython extension.
 *
 * memsem_plan_copy (memsem_native.c) does every check of a same-node get or put in one call;
 * reaching it through cffi costs more than the copy of a small payload: a GIL release and
 * re-acquire around every call, the conversion of eight arguments, and on the Python side the
 * lookup of the local buffer's address and its door checks (dtype, contiguity, writability,
 * size). This module takes the local buffer object itself and does those door checks through
 * the buffer protocol, then calls memsem_plan_copy, so a small get is one C call.
 *
 * It only accepts what needs no judgement: a C-contiguous buffer of exactly nbytes whose format
 * is a plain number or bool in native byte order (writable for a get), of the ref's dtype or
 * uint8 on either side. Anything else (torch tensors, DLPack producers, other dtypes,
 * a wrong size...) returns MEMSEM_RC_BUFFER with nothing done, and the Python door
 * (memsem._buffers) accepts it or raises the error that names the argument. No check is made
 * only here: the Python door makes the same ones, this is where they run for the common case.
 *
 * The GIL is kept for copies under MEMSEM_HOT_GIL_BYTES (releasing and re-acquiring it costs
 * more than such a copy) and released for larger ones.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "memsem_native.h"

/* Wire dtype code (memsem/_dtypes.py) of a buffer format, or 0 when it is not a plain number
 * or bool in native byte order. */
static int format_code(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL) return itemsize == 1 ? 3 : 0; /* no format: unsigned bytes */
    if (*fmt == '@' || *fmt == '=') fmt++;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (*fmt == '<') fmt++;
#endif
    if (fmt[0] == 'Z') {
        if (fmt[2] != 0) return 0;
        if (fmt[1] == 'f' && itemsize == 8) return 16;
        if (fmt[1] == 'd' && itemsize == 16) return 17;
        return 0;
    }
    if (fmt[0] == 0 || fmt[1] != 0) return 0;
    switch (fmt[0]) {
    case '?': return itemsize == 1 ? 1 : 0;
    case 'b': return itemsize == 1 ? 2 : 0;
    case 'B': return itemsize == 1 ? 3 : 0;
    case 'h': return itemsize == 2 ? 4 : 0;
    case 'H': return itemsize == 2 ? 5 : 0;
    case 'i': case 'l': case 'q': case 'n':
        return itemsize == 4 ? 6 : itemsize == 8 ? 8 : 0;
    case 'I': case 'L': case 'Q': case 'N':
        return itemsize == 4 ? 7 : itemsize == 8 ? 9 : 0;
    case 'e': return itemsize == 2 ? 10 : 0;
    case 'f': return itemsize == 4 ? 11 : 0;
    case 'd': return itemsize == 8 ? 12 : 0;
    default: return 0;
    }
}

#define UINT8_CODE 3

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

PyDoc_STRVAR(copy_doc,
"copy(plan, put, offset, buf, nbytes, code, version=0, lease_slot=0, lease_id=0) -> int\n\n"
"memsem_plan_copy of ``nbytes`` between the buffer object ``buf`` and the window of the plan at\n"
"address ``plan`` (window byte ``offset``); ``put`` 0 reads the window into ``buf``, 1 writes it.\n"
"``code``: the ref's dtype code the buffer must match (or uint8 on either side); -1: any\n"
"plain dtype. Returns memsem_plan_copy's result, or MEMSEM_RC_BUFFER (nothing done) when ``buf``\n"
"needs the Python door (memsem._buffers) first.");

static PyObject *hot_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 6 || nargs > 9) {
        PyErr_SetString(PyExc_TypeError, "copy() takes 6 to 9 arguments");
        return NULL;
    }
    uint64_t plan, offset, nbytes, version = 0, lease_slot = 0, lease_id = 0;
    if (as_u64(args[0], &plan) || as_u64(args[2], &offset) || as_u64(args[4], &nbytes)) return NULL;
    int put = PyObject_IsTrue(args[1]);
    if (put < 0) return NULL;
    long want = PyLong_AsLong(args[5]);
    if (want == -1 && PyErr_Occurred()) return NULL;
    if (nargs > 6 && as_u64(args[6], &version)) return NULL;
    if (nargs > 7 && as_u64(args[7], &lease_slot)) return NULL;
    if (nargs > 8 && as_u64(args[8], &lease_id)) return NULL;
    if (plan == 0) {
        PyErr_SetString(PyExc_ValueError, "copy(): plan address is 0");
        return NULL;
    }

    Py_buffer view;
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (put ? 0 : PyBUF_WRITABLE);
    if (PyObject_GetBuffer(args[3], &view, flags) != 0) {
        PyErr_Clear(); /* not a buffer, read-only, not contiguous, a format it cannot export */
        return PyLong_FromUnsignedLongLong(MEMSEM_RC_BUFFER);
    }
    int code = format_code(view.format, view.itemsize);
    int fits = code != 0 && (uint64_t)view.len == nbytes;
    /* the ref's dtype or uint8 on either side (raw bytes), for a get's destination as for a
     * put's source: the Python door raises the TypeError naming the argument */
    if (fits && want >= 0 && code != want && code != UINT8_CODE && want != UINT8_CODE) fits = 0;
    if (!fits) {
        PyBuffer_Release(&view);
        return PyLong_FromUnsignedLongLong(MEMSEM_RC_BUFFER);
    }
    uint64_t local = (uint64_t)(uintptr_t)view.buf;
    uint64_t rc;
    memsem_plan *p = (memsem_plan *)(uintptr_t)plan;
    if (nbytes < MEMSEM_HOT_GIL_BYTES) {
        rc = memsem_plan_copy(p, put, offset, local, nbytes, version, lease_slot, lease_id);
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = memsem_plan_copy(p, put, offset, local, nbytes, version, lease_slot, lease_id);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(rc);
}

static PyMethodDef hot_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))hot_copy, METH_FASTCALL, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "memsem._hot",
    "The same-node hot path entry (native/memsem_hot.c): memsem_plan_copy on a buffer object.",
    -1, hot_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hot(void) {
    PyObject *m = PyModule_Create(&hot_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "RC_BUFFER", MEMSEM_RC_BUFFER) < 0 ||
        PyModule_AddIntConstant(m, "GIL_BYTES", MEMSEM_HOT_GIL_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
