/* Native kernels for the codec's hot loops.
 *
 * scan:  compare two equal-length arrays of fixed-width elements as raw bits and
 *        emit, in one pass, every differing index with its old and new bits.
 *        Blocks of 32 bytes are OR-reduced first, so unchanged regions cost a few
 *        instructions per block; at 1-5% change rates most blocks are skipped or
 *        hold one change.
 *
 * scatter: write (overwrite entries) or XOR (XOR entries) values at positions (plus a
 *        constant shift) in place, touching only those elements.
 *
 * positions: turn one item's coded locations (gaps or runs, escape-coded; FORMAT.md)
 *        into ascending element indices in one pass, instead of numpy's widen, escape
 *        join, add and cumulative sum, each a pass of its own.
 *
 * xxh3_fold: the sequential half of xxh3's long-input loop: add each 1 KiB block's lane
 *        sums (computed elsewhere, in parallel: on the device) into the accumulators and
 *        scramble them, block after block.
 *
 * span_sum: the additive fingerprint of one strided view of a canonical tensor: the sum,
 *        modulo 2**64, of a mixed hash of every element's bits and canonical index
 *        (dcr/codec/sums.py says why it adds); index_sum: the same over listed indices.
 *
 * All work on the buffer protocol (numpy arrays, mmaps), release the GIL, and use
 * memcpy for loads so unaligned tensors (safetensors does not align) are fine.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Emit every element of one 8-byte word whose bits differ: `x` holds the old word,
 * `y` the new one, `first` the element index of its first lane. Lanes are found from
 * the XOR with count-trailing-zeros, so unchanged lanes cost nothing. */
#define EMIT_WORD(T, BITS)                                                               \
    do {                                                                                 \
        uint64_t d = x ^ y;                                                              \
        while (d) {                                                                      \
            int lane = __builtin_ctzll(d) / (BITS);                                      \
            int shift = lane * (BITS);                                                   \
            pos[k] = offset + first + lane;                                              \
            ((T *)old)[k] = (T)(x >> shift);                                             \
            ((T *)new_)[k] = (T)(y >> shift);                                            \
            k++;                                                                         \
            d &= (BITS) == 64 ? 0 : ~(((uint64_t)(T)~(T)0) << shift);                    \
        }                                                                                \
    } while (0)

#define SCAN_BODY(T, BITS)                                                               \
    do {                                                                                 \
        const Py_ssize_t per_word = 64 / (BITS);                                         \
        Py_ssize_t i = 0; /* byte offset */                                              \
        for (; i + 32 <= nbytes; i += 32) {                                              \
            uint64_t a0 = load64(a + i), a1 = load64(a + i + 8);                         \
            uint64_t a2 = load64(a + i + 16), a3 = load64(a + i + 24);                   \
            uint64_t b0 = load64(b + i), b1 = load64(b + i + 8);                         \
            uint64_t b2 = load64(b + i + 16), b3 = load64(b + i + 24);                   \
            if (!((a0 ^ b0) | (a1 ^ b1) | (a2 ^ b2) | (a3 ^ b3)))                        \
                continue;                                                                \
            Py_ssize_t first = i / (BITS / 8);                                           \
            uint64_t x, y;                                                               \
            x = a0; y = b0; EMIT_WORD(T, BITS); first += per_word;                       \
            x = a1; y = b1; EMIT_WORD(T, BITS); first += per_word;                       \
            x = a2; y = b2; EMIT_WORD(T, BITS); first += per_word;                       \
            x = a3; y = b3; EMIT_WORD(T, BITS);                                          \
        }                                                                                \
        for (Py_ssize_t e = i / (BITS / 8); e < n; e++) { /* tail: under 32 bytes */     \
            T va, vb;                                                                    \
            memcpy(&va, a + e * (BITS / 8), sizeof va);                                  \
            memcpy(&vb, b + e * (BITS / 8), sizeof vb);                                  \
            if (va != vb) {                                                              \
                pos[k] = offset + e;                                                     \
                ((T *)old)[k] = va;                                                      \
                ((T *)new_)[k] = vb;                                                     \
                k++;                                                                     \
            }                                                                            \
        }                                                                                \
    } while (0)

/* Outputs are numpy arrays we allocate, so they are aligned for T. */
static Py_ssize_t scan_impl(const unsigned char *a, const unsigned char *b, Py_ssize_t n,
                            int itemsize, int64_t offset, int64_t *pos, unsigned char *old,
                            unsigned char *new_) {
    Py_ssize_t k = 0;
    Py_ssize_t nbytes = n * itemsize;
    switch (itemsize) {
    case 1: SCAN_BODY(uint8_t, 8); break;
    case 2: SCAN_BODY(uint16_t, 16); break;
    case 4: SCAN_BODY(uint32_t, 32); break;
    default: SCAN_BODY(uint64_t, 64); break;
    }
    return k;
}

/* scan(base, target, itemsize, positions, old, new, offset) -> count
 * base/target: n*itemsize bytes each; positions: int64 with room for n;
 * old/new: room for n elements. Positions are element indices plus offset. */
static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer a, b, p, o, w;
    int itemsize;
    long long offset;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*w*L", &a, &b, &itemsize, &p, &o, &w, &offset))
        return NULL;
    PyObject *result = NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8, got %d", itemsize);
        goto done;
    }
    if (a.len != b.len || a.len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "base (%zd bytes) and target (%zd bytes) differ or "
                     "are not whole elements of %d bytes", a.len, b.len, itemsize);
        goto done;
    }
    Py_ssize_t n = a.len / itemsize;
    if (p.len < n * 8 || o.len < n * itemsize || w.len < n * itemsize) {
        PyErr_Format(PyExc_ValueError, "output buffers are too small for %zd elements", n);
        goto done;
    }
    Py_ssize_t k;
    Py_BEGIN_ALLOW_THREADS
    k = scan_impl(a.buf, b.buf, n, itemsize, (int64_t)offset, p.buf, o.buf, w.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&p);
    PyBuffer_Release(&o);
    PyBuffer_Release(&w);
    return result;
}

#define SCATTER_BODY(T)                                                                  \
    do {                                                                                 \
        const T *v = (const T *)vals;                                                    \
        for (Py_ssize_t i = 0; i < count; i++) {                                         \
            unsigned char *dst = tgt + (pos[i] + shift) * (Py_ssize_t)sizeof(T);         \
            T cur;                                                                       \
            memcpy(&cur, v + i, sizeof cur);                                             \
            if (xor) {                                                                   \
                T old;                                                                   \
                memcpy(&old, dst, sizeof old);                                           \
                cur ^= old;                                                              \
            }                                                                            \
            memcpy(dst, &cur, sizeof cur);                                               \
        }                                                                                \
    } while (0)

/* scatter(target, itemsize, positions, values, xor, shift=0) -> None
 * target[positions[i] + shift] = values[i], or ^= when xor. Every position is
 * bounds-checked before the first write, so a bad index writes nothing. */
static PyObject *scatter(PyObject *self, PyObject *args) {
    Py_buffer t, p, v;
    int itemsize, xor;
    long long shift = 0;
    if (!PyArg_ParseTuple(args, "w*iy*y*p|L", &t, &itemsize, &p, &v, &xor, &shift))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = p.len / 8;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8, got %d", itemsize);
        goto done;
    }
    if (p.len % 8 != 0 || v.len != count * itemsize || t.len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%zd position bytes do not match %zd value bytes of "
                     "width %d", p.len, v.len, itemsize);
        goto done;
    }
    const int64_t *pos = p.buf;
    const unsigned char *vals = v.buf;
    unsigned char *tgt = t.buf;
    Py_ssize_t n = t.len / itemsize;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t q;
        if (__builtin_add_overflow(pos[i], (int64_t)shift, &q) || q < 0 || q >= n) {
            PyErr_Format(PyExc_IndexError, "position %lld of record %zd (shifted by %lld) is "
                         "outside a target of %zd elements", (long long)pos[i], i, shift, n);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1: SCATTER_BODY(uint8_t); break;
    case 2: SCATTER_BODY(uint16_t); break;
    case 4: SCATTER_BODY(uint32_t); break;
    default: SCATTER_BODY(uint64_t); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&t);
    PyBuffer_Release(&p);
    PyBuffer_Release(&v);
    return result;
}

/* An unsigned little-endian value of `width` bytes (1, 2, 4 or 8) at index i. */
static inline uint64_t load_uint(const unsigned char *base, int width, Py_ssize_t i) {
    switch (width) {
    case 1: return base[i];
    case 2: { uint16_t x; memcpy(&x, base + 2 * i, 2); return x; }
    case 4: { uint32_t x; memcpy(&x, base + 4 * i, 4); return x; }
    default: { uint64_t x; memcpy(&x, base + 8 * i, 8); return x; }
    }
}

/* Runs through one item's location values; 0 on success, else the error is set.
 * Every sum is checked against `span`, so a hostile item cannot overflow or write past
 * `out` even if the caller skipped its own validation. */
static int positions_impl(const unsigned char *small, Py_ssize_t nloc, const unsigned char *esc,
                          Py_ssize_t nesc, int esc_width, const unsigned char *lens,
                          int len_width, int64_t start, int64_t span, int64_t *out,
                          Py_ssize_t count) {
    Py_ssize_t e = 0, k = 0;
    uint64_t next = 0; /* the element after the previous record or run, relative to start */
    if (!lens) { /* gaps: one record per location value */
        if (nloc != count)
            return 1;
        for (Py_ssize_t i = 0; i < nloc; i++) {
            uint64_t gap = small[i];
            if (__builtin_expect(gap == 255, 0)) {
                if (e == nesc)
                    return 1;
                uint64_t x = load_uint(esc, esc_width, e++);
                if (x > (uint64_t)span)
                    return 2;
                gap = x + 255;
            }
            next += gap;
            if (next >= (uint64_t)span)
                return 2;
            out[i] = start + (int64_t)next;
            next++;
        }
        return e != nesc ? 1 : 0;
    }
    for (Py_ssize_t i = 0; i < nloc; i++) { /* runs */
        uint64_t gap = small[i];
        if (gap == 255) {
            if (e == nesc)
                return 1;
            uint64_t x = load_uint(esc, esc_width, e++);
            if (x > (uint64_t)span)
                return 2;
            gap = x + 255;
        }
        uint64_t length = load_uint(lens, len_width, i);
        if (length >= (uint64_t)span)
            return 2;
        length++;
        uint64_t first = next + gap;
        if (first > (uint64_t)span || length > (uint64_t)span - first ||
            length > (uint64_t)(count - k))
            return 2;
        for (uint64_t j = 0; j < length; j++)
            out[k++] = start + (int64_t)(first + j);
        next = first + length;
    }
    return (k != count || e != nesc) ? 1 : 0;
}

/* positions(small, escaped, esc_width, lengths, len_width, start, span, out) -> None
 * small: one byte per location value, 255 marking an escape; escaped: the escaped
 * values minus 255, esc_width bytes each; lengths: run lengths minus one, len_width bytes
 * each, one per location value (a `runs` item), or empty for a `gaps` item. Writes the
 * item's element indices (start + offset in the item) to out (int64, one per record). */
static PyObject *positions(PyObject *self, PyObject *args) {
    Py_buffer s, e, l, o;
    int esc_width, len_width;
    long long start, span;
    if (!PyArg_ParseTuple(args, "y*y*iy*iLLw*", &s, &e, &esc_width, &l, &len_width, &start,
                          &span, &o))
        return NULL;
    PyObject *result = NULL;
    int ok_width = (esc_width == 1 || esc_width == 2 || esc_width == 4 || esc_width == 8) &&
                   (len_width == 1 || len_width == 2 || len_width == 4 || len_width == 8);
    if (!ok_width || e.len % esc_width || l.len % len_width || o.len % 8 || start < 0 ||
        span < 0) {
        PyErr_Format(PyExc_ValueError, "bad widths (%d, %d), buffer sizes or range", esc_width,
                     len_width);
        goto done;
    }
    int runs = l.len > 0;
    if (runs && l.len / len_width != s.len) {
        PyErr_Format(PyExc_ValueError, "%zd run lengths for %zd location values",
                     l.len / len_width, s.len);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = positions_impl(s.buf, s.len, e.buf, e.len / esc_width, esc_width,
                        runs ? l.buf : NULL, len_width, start, span, o.buf, o.len / 8);
    Py_END_ALLOW_THREADS
    if (rc == 1) {
        PyErr_Format(PyExc_ValueError, "location values do not match %zd records and %zd "
                     "escapes", o.len / 8, e.len / esc_width);
        goto done;
    }
    if (rc == 2) {
        PyErr_Format(PyExc_ValueError, "locations reach past the item's %lld elements", span);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&s);
    PyBuffer_Release(&e);
    PyBuffer_Release(&l);
    PyBuffer_Release(&o);
    return result;
}

/* xxh3_fold(acc, blocks, keys) -> None
 * acc: 8 uint64 accumulators, updated in place; blocks: n rows of 8 uint64 lane sums;
 * keys: the 8 uint64 scramble keys. For each row: acc += row, then xxh3's scramble
 * (xorshift 47, XOR the key, multiply by PRIME32_1), all modulo 2**64. */
static PyObject *xxh3_fold(PyObject *self, PyObject *args) {
    Py_buffer a, b, k;
    if (!PyArg_ParseTuple(args, "w*y*y*", &a, &b, &k))
        return NULL;
    PyObject *result = NULL;
    if (a.len != 64 || k.len != 64 || b.len % 64 != 0) {
        PyErr_Format(PyExc_ValueError, "xxh3_fold wants 64-byte accumulators and keys and "
                     "rows of 64 bytes, got %zd, %zd and %zd bytes", a.len, k.len, b.len);
        goto done;
    }
    uint64_t acc[8], key[8];
    memcpy(acc, a.buf, 64);
    memcpy(key, k.buf, 64);
    const unsigned char *rows = b.buf;
    Py_ssize_t n = b.len / 64;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) {
        for (int i = 0; i < 8; i++) {
            uint64_t x = acc[i] + load64(rows + 64 * r + 8 * i);
            x ^= x >> 47;
            x ^= key[i];
            acc[i] = x * 0x9E3779B1ULL;
        }
    }
    Py_END_ALLOW_THREADS
    memcpy(a.buf, acc, 64);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&k);
    return result;
}


/* Murmur3's 64-bit finalizer: a bijection of 64-bit words that mixes every input bit
 * into every output bit. */
static inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

#define SUM_KEY 0x9E3779B97F4A7C15ULL /* odd: bits * KEY + index is one to one in bits */

/* The terms of one row of `inner` elements of type T starting at element k, whose
 * canonical indices start at `at` and step by `step`. */
#define SUM_ROW(T)                                                                       \
    do {                                                                                 \
        const unsigned char *row = p + k * (Py_ssize_t)sizeof(T);                        \
        for (int64_t j = 0; j < inner; j++) {                                            \
            T v;                                                                         \
            memcpy(&v, row + j * (Py_ssize_t)sizeof(T), sizeof v);                       \
            sum += fmix64((uint64_t)v * SUM_KEY + at + (uint64_t)(j * step));            \
        }                                                                                \
    } while (0)
#define MAX_DIMS 16

/* span_sum(bits, width, offset, sizes, strides) -> int
 * bits: the view's elements in row-major order, `width` bytes each (read unsigned);
 * sizes, strides: int64 arrays, one per dimension, in elements of the canonical tensor;
 * the element at multi-index k sits at canonical index offset + sum(k[d] * strides[d]).
 * Returns sum(fmix64(bits * KEY + index)) modulo 2**64. */
static PyObject *span_sum(PyObject *self, PyObject *args) {
    Py_buffer b, sz, st;
    int width;
    long long offset;
    if (!PyArg_ParseTuple(args, "y*iLy*y*", &b, &width, &offset, &sz, &st))
        return NULL;
    PyObject *result = NULL;
    int64_t sizes[MAX_DIMS], strides[MAX_DIMS], idx[MAX_DIMS] = {0};
    Py_ssize_t nd = sz.len / 8, n = 1;
    if (sz.len % 8 || st.len != sz.len || nd > MAX_DIMS ||
        (width != 1 && width != 2 && width != 4 && width != 8)) {
        PyErr_Format(PyExc_ValueError, "span_sum wants widths of 1, 2, 4 or 8 bytes and at "
                     "most %d sizes and as many strides, got width %d and %zd and %zd bytes",
                     MAX_DIMS, width, sz.len, st.len);
        goto done;
    }
    memcpy(sizes, sz.buf, sz.len);
    memcpy(strides, st.buf, st.len);
    for (Py_ssize_t d = 0; d < nd; d++) {
        if (sizes[d] < 0) {
            PyErr_Format(PyExc_ValueError, "span_sum: size %lld is negative", (long long)sizes[d]);
            goto done;
        }
        n *= sizes[d];
    }
    if (b.len != n * width) {
        PyErr_Format(PyExc_ValueError, "span_sum: %zd bytes of bits for %zd elements of %d "
                     "bytes", b.len, n, width);
        goto done;
    }
    uint64_t sum = 0;
    if (n) {
        const unsigned char *p = b.buf;
        int64_t inner = nd ? sizes[nd - 1] : 1, step = nd ? strides[nd - 1] : 1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n; k += inner) {
            uint64_t at = (uint64_t)offset;
            for (Py_ssize_t d = 0; d + 1 < nd; d++)
                at += (uint64_t)(idx[d] * strides[d]);
            switch (width) { /* one loop per width: no branch per element */
            case 1: SUM_ROW(uint8_t); break;
            case 2: SUM_ROW(uint16_t); break;
            case 4: SUM_ROW(uint32_t); break;
            default: SUM_ROW(uint64_t); break;
            }
            for (Py_ssize_t d = nd - 2; d >= 0; d--) { /* the odometer, last dim excluded */
                if (++idx[d] < sizes[d])
                    break;
                idx[d] = 0;
            }
        }
        Py_END_ALLOW_THREADS
    }
    result = PyLong_FromUnsignedLongLong(sum);
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&sz);
    PyBuffer_Release(&st);
    return result;
}

/* index_sum(bits, width, index) -> int
 * The same sum over elements listed one by one: bits[k] (`width` bytes, unsigned) sits at
 * canonical index index[k] (int64). For an owner's part of a region it holds in pieces. */
static PyObject *index_sum(PyObject *self, PyObject *args) {
    Py_buffer b, ix;
    int width;
    if (!PyArg_ParseTuple(args, "y*iy*", &b, &width, &ix))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ix.len / 8;
    if ((width != 1 && width != 2 && width != 4 && width != 8) || ix.len % 8 ||
        b.len != n * width) {
        PyErr_Format(PyExc_ValueError, "index_sum wants widths of 1, 2, 4 or 8 bytes and one "
                     "int64 index per element, got width %d, %zd bytes of bits and %zd of "
                     "indices", width, b.len, ix.len);
        goto done;
    }
    uint64_t sum = 0;
    const unsigned char *p = b.buf, *q = ix.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++)
        sum += fmix64(load_uint(p, width, k) * SUM_KEY + load64(q + 8 * k));
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(sum);
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&ix);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(base, target, itemsize, positions, old, new, offset) -> count of changed elements"},
    {"scatter", scatter, METH_VARARGS,
     "scatter(target, itemsize, positions, values, xor, shift=0) -> None: write or XOR "
     "values at positions + shift in place"},
    {"positions", positions, METH_VARARGS,
     "positions(small, escaped, esc_width, lengths, len_width, start, span, out) -> None: "
     "one item's coded locations as ascending element indices"},
    {"xxh3_fold", xxh3_fold, METH_VARARGS,
     "xxh3_fold(acc, blocks, keys) -> None: add each row of lane sums to the accumulators "
     "and scramble them, row after row"},
    {"span_sum", span_sum, METH_VARARGS,
     "span_sum(bits, width, offset, sizes, strides) -> int: the additive fingerprint of "
     "one strided view's elements"},
    {"index_sum", index_sum, METH_VARARGS,
     "index_sum(bits, width, index) -> int: the same sum over elements at listed indices"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dcr.codec._native", "Native kernels of the DCR codec.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
