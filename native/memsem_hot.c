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
 *
 * wire() is the same for a kept wire route (memsem.core.KeptWire: a small get or put of another
 * node's window through tcp): door, bracket open, the request on the connection's socket, the
 * receives of its reply for one slice, and for a plain reply the copy and the bracket's close.
 * Only the plain case is finished here; every other reply, and anything that takes longer
 * than a slice, is handed back with its bytes in the connection's buffer to the one reader of
 * the connection (memsem/engines/tcp/_client.py, Connection.small_reply), which knows the
 * whole protocol (memsem/engines/tcp/_wire.py; the reply header layout is read here as defined
 * there, checked by tests/test_wire_native.py against its structs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <endian.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>

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

/* The door of a buffer object: a C-contiguous buffer of exactly nbytes (writable for a get)
 * whose format is a plain number or bool in native byte order, of the ref's dtype ``want`` or
 * uint8 on either side (-1: any plain dtype). 1 with ``view`` held (release it), else 0 with
 * nothing held and no Python error set: the Python door (memsem._buffers) accepts it or raises
 * the error that names the argument. */
static int door(PyObject *buf, int put, uint64_t nbytes, long want, Py_buffer *view) {
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (put ? 0 : PyBUF_WRITABLE);
    if (PyObject_GetBuffer(buf, view, flags) != 0) {
        PyErr_Clear(); /* not a buffer, read-only, not contiguous, a format it cannot export */
        return 0;
    }
    int code = format_code(view->format, view->itemsize);
    int fits = code != 0 && (uint64_t)view->len == nbytes;
    /* the ref's dtype or uint8 on either side (raw bytes), for a get's destination as for a
     * put's source */
    if (fits && want >= 0 && code != want && code != UINT8_CODE && want != UINT8_CODE) fits = 0;
    if (!fits) PyBuffer_Release(view);
    return fits;
}

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
    if (!door(args[3], put, nbytes, want, &view)) return PyLong_FromUnsignedLongLong(MEMSEM_RC_BUFFER);
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

PyDoc_STRVAR(copy_buf_doc,
"copy_buf(plan, put, offset, nbytes, code, buf) -> int\n\n"
"copy() with the buffer last and no version or lease: what a ref's same-node route binds its\n"
"plan, range and dtype into (functools.partial), so its plain get or put is one call of it.");

static PyObject *hot_copy_buf(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_buf() takes 6 arguments");
        return NULL;
    }
    PyObject *a[6] = {args[0], args[1], args[2], args[5], args[3], args[4]};
    return hot_copy(self, a, 6);
}

/* ---- the kept wire route's request (memsem.core.KeptWire, memsem.engines.tcp) --------------- */

/* Reply header of the tcp wire (memsem/engines/tcp/_wire.py, REP "<BBHIQQ"): status u8 | flags
 * u8 | handle u16 | req_id u32 | value u64 | nbytes u64, little endian. */
#define REP_SIZE 24
#define REP_OK 0
#define REP_DATA 1

static uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

static uint32_t rd32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}

static uint16_t rd16(const unsigned char *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return le16toh(v);
}

/* One reply header at p: the one place the reply layout is read (the Python reader of the
 * connection calls it through reply_header()). */
typedef struct {
    unsigned status, flags, handle;
    uint32_t rid;
    uint64_t value, nbytes;
} rep_header;

static rep_header rep_read(const unsigned char *p) {
    rep_header h = {p[0], p[1], rd16(p + 2), rd32(p + 4), rd64(p + 8), rd64(p + 16)};
    return h;
}

/* The reply of request ``rid`` on ``handle`` is whole in rb[0:got] and plain: a get's DATA of
 * n bytes and its OK trailer, a put's OK, each of that request and handle, carrying nothing
 * else, naming a version a window can have. The version it names, else -1: anything else is
 * read by the caller's Python (Connection.check, which refuses what breaks the protocol);
 * what is accepted here is a reply that check accepts too. */
static int64_t plain_reply(const unsigned char *rb, size_t got, int put, uint32_t rid, unsigned handle,
                           uint64_t n) {
    if (got != (put ? REP_SIZE : 2 * REP_SIZE + n)) return -1;
    rep_header t = rep_read(rb);
    if (!put) {
        if (t.status != REP_DATA || t.rid != rid || t.handle != handle || t.nbytes != n) return -1;
        t = rep_read(rb + REP_SIZE + n);
    }
    if (t.status != REP_OK || t.rid != rid || t.handle != handle || t.nbytes != 0 || t.value > MEMSEM_VERSION_MAX)
        return -1;
    return (int64_t)t.value;
}

PyDoc_STRVAR(reply_header_doc,
"reply_header(buf, offset) -> (status, flags, handle, rid, value, nbytes)\n\n"
"The tcp reply header (memsem/engines/tcp/_wire.py: 24 bytes, little endian) at ``offset`` of\n"
"the buffer ``buf``: the one reader of the reply layout (the kept route's native call reads it\n"
"through the same function).");

static PyObject *hot_reply_header(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "reply_header() takes 2 arguments");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    if (off == -1 && PyErr_Occurred()) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_SIMPLE) != 0) return NULL;
    if (off < 0 || off > v.len - REP_SIZE) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "reply_header(): the buffer holds no header at that offset");
        return NULL;
    }
    rep_header h = rep_read((const unsigned char *)v.buf + off);
    PyBuffer_Release(&v);
    return Py_BuildValue("(IIIkKK)", h.status, h.flags, h.handle, (unsigned long)h.rid,
                         (unsigned long long)h.value, (unsigned long long)h.nbytes);
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* One wait for ``events`` on fd until ``end`` (CLOCK_MONOTONIC ms; the one slice of the whole
 * call, however many waits it takes): 1 ready, 0 the slice passed, -errno. */
static int wait_fd(int fd, short events, uint64_t end) {
    struct pollfd pfd = {fd, events, 0};
    for (;;) {
        uint64_t t = now_ms();
        if (t >= end) return 0;
        int r = poll(&pfd, 1, (int)(end - t));
        if (r > 0) return 1;
        if (r == 0) return 0;
        if (errno != EINTR) return -errno;
    }
}

PyDoc_STRVAR(wire_doc,
"wire(bracket, plan, fd, put, offset, buf, nbytes, code, head, rid, rbuf, slice_ms) -> int\n\n"
"One small request of a kept wire route: the door of ``buf`` (as copy), the copy bracket at\n"
"address ``bracket`` opened on the plan at address ``plan`` (window byte ``offset``), the\n"
"request ``head`` (and for a put the ``nbytes`` of ``buf``) sent on the connected socket ``fd``,\n"
"and the receives of its reply into ``rbuf`` for at most ``slice_ms`` ms in all. A plain reply of\n"
"request ``rid`` (a get's DATA and OK trailer, whose bytes are copied into ``buf``; a put's OK)\n"
"closes the bracket: the close's result with the owner's version in the value bits. Else:\n"
"MEMSEM_RC_BUFFER (the door: nothing done), the bracket's refusal (nothing done),\n"
"MEMSEM_RC_WIRE_PENDING with the bytes received in the value bits (the bracket is open, the\n"
"request sent: the caller reads the rest of its reply from rbuf[:got] on), MEMSEM_RC_WIRE_SENDING\n"
"with the bytes of the request sent in the value bits (the bracket is open; the socket took no\n"
"more within the slice: the caller sends the rest, then reads the reply), MEMSEM_RC_WIRE_LOST\n"
"with the errno (0: closed by the peer) in the value bits (the bracket is open: the caller\n"
"undoes it and drops the connection). The GIL is released around the socket calls.");

static PyObject *hot_wire(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "wire() takes 12 arguments");
        return NULL;
    }
    uint64_t baddr, plan, offset, nbytes, rid;
    if (as_u64(args[0], &baddr) || as_u64(args[1], &plan) || as_u64(args[4], &offset) ||
        as_u64(args[6], &nbytes) || as_u64(args[9], &rid))
        return NULL;
    long fd = PyLong_AsLong(args[2]);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    int put = PyObject_IsTrue(args[3]);
    if (put < 0) return NULL;
    long want = PyLong_AsLong(args[7]);
    if (want == -1 && PyErr_Occurred()) return NULL;
    long slice_ms = PyLong_AsLong(args[11]);
    if (slice_ms == -1 && PyErr_Occurred()) return NULL;
    if (baddr == 0 || plan == 0 || fd < 0 || fd > INT_MAX || slice_ms < 0 || slice_ms > 3600000) {
        PyErr_SetString(PyExc_ValueError, "wire(): bracket, plan, fd or slice_ms is not valid");
        return NULL;
    }
    char *head;
    Py_ssize_t head_len;
    if (PyBytes_AsStringAndSize(args[8], &head, &head_len) < 0) return NULL;
    Py_buffer rv;
    if (PyObject_GetBuffer(args[10], &rv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    if ((uint64_t)rv.len < 2 * REP_SIZE + nbytes) {
        PyBuffer_Release(&rv);
        PyErr_SetString(PyExc_ValueError, "wire(): rbuf cannot hold the reply");
        return NULL;
    }
    Py_buffer view;
    if (!door(args[5], put, nbytes, want, &view)) {
        PyBuffer_Release(&rv);
        return PyLong_FromUnsignedLongLong(MEMSEM_RC_BUFFER);
    }
    memsem_bracket *b = (memsem_bracket *)(uintptr_t)baddr;
    uint64_t rc = memsem_bracket_open(b, (memsem_plan *)(uintptr_t)plan, put, offset, nbytes, 0, 0, 0);
    if (rc != MEMSEM_OK) goto done;

    unsigned char *rb = (unsigned char *)rv.buf;
    size_t cap = (size_t)rv.len, got = 0;
    size_t need = put ? REP_SIZE : 2 * REP_SIZE + (size_t)nbytes;
    int lost = -1; /* >= 0: the connection failed (the errno; 0 closed by the peer) */
    size_t left = (size_t)head_len + (put ? (size_t)nbytes : 0); /* bytes of the request not sent */
    Py_BEGIN_ALLOW_THREADS
    uint64_t end = now_ms() + (uint64_t)slice_ms; /* one slice for the whole call */
    struct iovec iov[2] = {{head, (size_t)head_len}, {view.buf, put ? (size_t)nbytes : 0}};
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = put && nbytes ? 2 : 1;
    while (left) {
        ssize_t k = sendmsg((int)fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
            left -= (size_t)k;
            while (k > 0 && msg.msg_iovlen) { /* drop what was sent from the front */
                size_t take = (size_t)k < msg.msg_iov[0].iov_len ? (size_t)k : msg.msg_iov[0].iov_len;
                msg.msg_iov[0].iov_base = (char *)msg.msg_iov[0].iov_base + take;
                msg.msg_iov[0].iov_len -= take;
                k -= (ssize_t)take;
                if (!msg.msg_iov[0].iov_len) {
                    msg.msg_iov++;
                    msg.msg_iovlen--;
                }
            }
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd((int)fd, POLLOUT, end);
            if (r > 0) continue;
            if (r < 0) lost = -r;
            break; /* the slice passed: the caller sends the rest within its deadline */
        }
        lost = k < 0 ? errno : EPIPE;
        break;
    }
    while (lost < 0 && !left && got < need) {
        ssize_t k = recv((int)fd, rb + got, cap - got, MSG_DONTWAIT);
        if (k > 0) {
            got += (size_t)k;
            if (got >= REP_SIZE && rb[0] != (put ? REP_OK : REP_DATA)) break; /* not plain: Python */
            continue;
        }
        if (k == 0) {
            lost = 0;
            break;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = wait_fd((int)fd, POLLIN, end);
            if (r > 0) continue;
            if (r < 0) lost = -r;
            break; /* the slice passed: the caller waits on, with its deadline */
        }
        lost = errno;
    }
    Py_END_ALLOW_THREADS
    if (lost >= 0) {
        rc = MEMSEM_RC_WIRE_LOST | ((uint64_t)lost << MEMSEM_RC_VERSION_SHIFT);
        goto done;
    }
    if (left) { /* not all of the request went within the slice: the caller sends the rest */
        rc = MEMSEM_RC_WIRE_SENDING |
             ((uint64_t)((size_t)head_len + (put ? (size_t)nbytes : 0) - left) << MEMSEM_RC_VERSION_SHIFT);
        goto done;
    }
    int64_t v = plain_reply(rb, got, put, (uint32_t)rid, head_len >= 4 ? rd16((const unsigned char *)head + 2) : 0,
                            nbytes);
    if (v < 0) {
        rc = MEMSEM_RC_WIRE_PENDING | ((uint64_t)got << MEMSEM_RC_VERSION_SHIFT);
        goto done;
    }
    if (!put && nbytes) memcpy(view.buf, rb + REP_SIZE, (size_t)nbytes);
    rc = memsem_bracket_close(b, 0);
    if (!(rc & MEMSEM_RC_STATUS_MASK))
        rc = (rc & ((1ull << MEMSEM_RC_VERSION_SHIFT) - 1)) | ((uint64_t)v << MEMSEM_RC_VERSION_SHIFT);
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&rv);
    return PyLong_FromUnsignedLongLong(rc);
}

static PyMethodDef hot_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))hot_copy, METH_FASTCALL, copy_doc},
    {"copy_buf", (PyCFunction)(void (*)(void))hot_copy_buf, METH_FASTCALL, copy_buf_doc},
    {"wire", (PyCFunction)(void (*)(void))hot_wire, METH_FASTCALL, wire_doc},
    {"reply_header", (PyCFunction)(void (*)(void))hot_reply_header, METH_FASTCALL, reply_header_doc},
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
        PyModule_AddIntConstant(m, "GIL_BYTES", MEMSEM_HOT_GIL_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "RC_WIRE_PENDING", MEMSEM_RC_WIRE_PENDING) < 0 ||
        PyModule_AddIntConstant(m, "RC_WIRE_LOST", MEMSEM_RC_WIRE_LOST) < 0 ||
        PyModule_AddIntConstant(m, "RC_WIRE_SENDING", MEMSEM_RC_WIRE_SENDING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
