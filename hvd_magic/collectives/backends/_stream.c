/* Copy with non-temporal ("streaming") stores: the copy goes to memory and leaves the
 * writing core's caches alone.
 *
 * Why: in some launches of the 2-core VM the project is measured on, lines that one core
 * wrote are ~4x slower to read from the other core than from memory (benchmarks/README.md).
 * The shared-memory allreduce (shm.py) copies each rank's input into a segment that the
 * other ranks then read; written with streaming stores, they read it from memory. In the
 * other launches the ordinary copy is faster (the data stays in the shared cache), so the
 * data-path tuner (tune.py) measures both ways and keeps the faster one.
 *
 * Built by `pip install` (setup.py, an optional extension): without a C compiler the
 * package works as before and the tuner simply never offers the streaming way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HVD_STREAMING 1
#else
#define HVD_STREAMING 0
#endif

static void stream_copy(char *d, const char *s, size_t n)
{
#if HVD_STREAMING
    size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    for (; i + 16 <= n; i += 16)
        _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    memcpy(d + i, s + i, n - i);
    _mm_sfence(); /* the stores are visible before whatever tells the readers (a barrier) */
#else
    memcpy(d, s, n);
#endif
}

static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src) takes two buffers");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy(dst, src): dst has %zd bytes and src %zd; "
                     "pass buffers of one size", dst.len, src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src): copy the C-contiguous buffer src into dst (same size) with streaming "
     "stores where the CPU has them (x86-64), else an ordinary copy."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stream",
    "Copies that bypass the writing core's caches (see _stream.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__stream(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HVD_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
