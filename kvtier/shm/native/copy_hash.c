/* kvtier.shm._copy_hash: copy a block and take its xxh3-64 in one pass, with the GIL released.

   Why compiled (docs/performance.md, "Eleventh stop"): from Python a block can only be copied by
   glibc's memcpy, which below its non-temporal threshold (a sixth of the shared cache: 190 MiB on
   the 2-core host) writes through the cache at about half the speed of a one-call copy of the
   same bytes, and python-xxhash holds the GIL below about 100 KB, so two copy threads serialise
   on small blocks. Here each piece of CHUNK bytes is loaded once; the loaded bytes go to a bounce
   buffer in L1 and, with non-temporal stores, to the destination; xxh3 then reads the bounce
   buffer. The digest is of exactly the bytes written to dst, which are exactly the bytes read
   from src: what onepass.py's Python path certifies for a read (its own copy) and for a write
   (its source, never the shared slot) alike.

   Non-temporal stores are weakly ordered: the copy ends with an sfence, so a seqlock header
   written after it (kvtier/shm/slots.py) is never seen before the payload.

   xxhash.h (BSD 2-Clause, LICENSE-xxhash) is xxHash 0.8.2 as python-xxhash 3.5.0 vendors it;
   XXH3_64bits streamed gives the same digest as python-xxhash's xxh3_64_intdigest.

   GCC or Clang (the fences and the compiler barrier are theirs); kvtier runs on Linux. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* xxh3's AVX2 kernels are built beside its SSE2 ones and picked at import where the CPU has
   AVX2 (`hash_update`), as xxHash's own xxh_x86dispatch.c does: the package is built once, for
   the baseline, and runs on any x86-64. Same digest either way. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
/* The AVX2 kernel works on the accumulators as 32-byte vectors: they must be aligned for it, as
   xxh_x86dispatch.c has them (an SSE2 build aligns them to 16 alone: a crash where the compiler
   does not realign the stack, as at -O0). */
#define XXH_ACC_ALIGN 64
#define HAVE_AVX2_KERNEL 1
#else
#define HAVE_AVX2_KERNEL 0
#endif

#define XXH_INLINE_ALL
#include "xxhash.h"

typedef XXH_errorcode (*update_fn)(XXH3_state_t *, const void *, size_t);

#if HAVE_AVX2_KERNEL
XXH_TARGET_AVX2 static XXH_errorcode update_avx2(XXH3_state_t *state, const void *input, size_t len) {
    return XXH3_update(state, (const xxh_u8 *)input, len, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#endif

/* Set once, at module init, before any thread can call it. */
static update_fn hash_update = XXH3_64bits_update;

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

/* A piece: small enough that its bounce copy stays in a 32 KiB L1 beside its source lines while
   xxh3 reads it. From 4 to 32 KiB the curve is flat on the 2-core host (docs/performance.md). */
#define CHUNK 8192
/* Below this a block is copied with ordinary stores: a small copy's destination is likely read
   soon, and streaming it out of the cache would cost its reader a trip to memory. */
#define STREAM_MIN (32 * 1024)

#if HAVE_STREAM
/* n bytes (a multiple of 64) from src to bounce (ordinary stores) and to dst (non-temporal; dst
   16-byte aligned), each 16-byte lane loaded once. */
static void tee_stream(char *dst, char *bounce, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_store_si128((__m128i *)(bounce + i), a);
        _mm_store_si128((__m128i *)(bounce + i + 16), b);
        _mm_store_si128((__m128i *)(bounce + i + 32), c);
        _mm_store_si128((__m128i *)(bounce + i + 48), d);
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}
#endif

/* Copy n bytes from src to dst, feeding them to `state` in order. */
static void copy_update(XXH3_state_t *state, char *dst, const char *src, size_t n) {
    XXH_ALIGN(64) char bounce[CHUNK];
    int stream = HAVE_STREAM && n >= STREAM_MIN;
    (void)stream;
    /* Non-temporal stores may pass earlier ordinary ones (a seqlock's odd gen): fence first. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    size_t off = 0;
    while (off < n) {
        size_t len = n - off < CHUNK ? n - off : CHUNK;
        size_t done = 0;
#if HAVE_STREAM
        if (stream) {
            if (((uintptr_t)(dst + off) & 15) != 0) {
                /* a head up to dst's next 16-byte boundary, then the rest streams */
                len = 16 - ((uintptr_t)(dst + off) & 15);
                if (len > n - off) len = n - off;
            } else {
                done = len & ~(size_t)63;
                tee_stream(dst + off, bounce, src + off, done);
            }
        }
#endif
        memcpy(bounce + done, src + off + done, len - done);
        /* The compiler may not fold the two copies into src -> dst (a second read of src). */
        __asm__ volatile("" ::: "memory");
        memcpy(dst + off + done, bounce + done, len - done);
        hash_update(state, bounce, len);
        off += len;
    }
    /* The payload before anything written after it (the header's even gen): an sfence for the
       non-temporal stores, and a full fence where stores are not ordered (not x86). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#if HAVE_STREAM
    if (stream) _mm_sfence();
#endif
}

static uint64_t copy_hash(char *dst, const char *src, size_t n) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    copy_update(&state, dst, src, n);
    return XXH3_64bits_digest(&state);
}

/* copy_hashed's two arguments: a writable contiguous dst and a contiguous src of its length
   (0), or an exception set and nothing held (-1). */
static int get_pair(PyObject *const *args, Py_ssize_t nargs, Py_buffer *d, Py_buffer *s) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy_hashed(dst, src) takes two buffers");
        return -1;
    }
    if (PyObject_GetBuffer(args[0], d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(args[1], s, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(d);
        return -1;
    }
    if (d->len != s->len) {
        PyErr_Format(PyExc_ValueError, "copy_hashed: dst holds %zd bytes, src %zd", d->len, s->len);
        PyBuffer_Release(s);
        PyBuffer_Release(d);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_hashed_doc,
"copy_hashed(dst, src) -> int\n\n"
"Copy the contiguous buffer src into the writable contiguous buffer dst of the same length and\n"
"return the xxh3-64 of the bytes copied (python-xxhash's xxh3_64_intdigest of them). dst and src\n"
"must not overlap.");

static PyObject *copy_hashed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer d, s;
    if (get_pair(args, nargs, &d, &s) < 0) return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = copy_hash((char *)d.buf, (const char *)s.buf, (size_t)d.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

/* A 2-D uint8 buffer whose rows are contiguous (a numpy array [rows, bytes] or a view of one). */
static int get_rows(PyObject *o, Py_buffer *b, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (b->ndim != 2 || b->itemsize != 1 || b->strides[1] != 1 || b->strides[0] < b->shape[1]) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %s must be 2-D uint8 with contiguous rows", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* A 1-D contiguous buffer of n 8-byte integers (signed, or unsigned when `unsigned_`). */
static int get_vector(PyObject *o, Py_buffer *b, Py_ssize_t n, int writable, int unsigned_, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int integer = unsigned_ ? (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0) : (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
    if (!integer || b->itemsize != 8 || b->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd 8-byte integers", what, n);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_rows_doc,
"copy_rows(dst, dst_rows, src, src_rows, nbytes, sums) -> None\n\n"
"For each j, copy the first nbytes of src[src_rows[j]] into dst[dst_rows[j]] and store their\n"
"xxh3-64 in sums[j]. dst and src are 2-D uint8 arrays with contiguous rows; dst_rows and src_rows\n"
"int64, sums uint64, all of one length. Every row is checked in range before any is copied.");

static PyObject *copy_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_rows(dst, dst_rows, src, src_rows, nbytes, sums) takes six arguments");
        return NULL;
    }
    Py_ssize_t nbytes = PyNumber_AsSsize_t(args[4], PyExc_OverflowError);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Py_buffer d, s, dr, sr, out;
    if (get_rows(args[0], &d, 1, "dst") < 0) return NULL;
    if (get_rows(args[2], &s, 0, "src") < 0) goto fail_d;
    if (PyObject_GetBuffer(args[5], &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail_s;
    Py_ssize_t n = out.itemsize ? out.len / out.itemsize : 0;
    PyBuffer_Release(&out);
    if (get_vector(args[1], &dr, n, 0, 0, "copy_rows: dst_rows") < 0) goto fail_s;
    if (get_vector(args[3], &sr, n, 0, 0, "copy_rows: src_rows") < 0) goto fail_dr;
    if (get_vector(args[5], &out, n, 1, 1, "copy_rows: sums") < 0) goto fail_sr;
    if (nbytes < 0 || nbytes > d.shape[1] || nbytes > s.shape[1]) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %zd bytes do not fit a row", nbytes);
        goto fail_out;
    }
    /* The offsets are taken and checked here, under the GIL, and only they are used below: the
       caller's index arrays could change once it is released. */
    Py_ssize_t *at = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (at == NULL) {
        PyErr_NoMemory();
        goto fail_out;
    }
    const int64_t *di = (const int64_t *)dr.buf, *si = (const int64_t *)sr.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t a = di[j], b = si[j];
        if (a < 0 || a >= d.shape[0] || b < 0 || b >= s.shape[0]) {
            PyErr_Format(PyExc_IndexError, "copy_rows: row %zd names dst row %lld, src row %lld", j,
                         (long long)a, (long long)b);
            PyMem_Free(at);
            goto fail_out;
        }
        at[2 * j] = (Py_ssize_t)a * d.strides[0];
        at[2 * j + 1] = (Py_ssize_t)b * s.strides[0];
    }
    uint64_t *sums = (uint64_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++)
        sums[j] = copy_hash((char *)d.buf + at[2 * j], (const char *)s.buf + at[2 * j + 1], (size_t)nbytes);
    Py_END_ALLOW_THREADS
    PyMem_Free(at);
    PyBuffer_Release(&out);
    PyBuffer_Release(&sr);
    PyBuffer_Release(&dr);
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
fail_out:
    PyBuffer_Release(&out);
fail_sr:
    PyBuffer_Release(&sr);
fail_dr:
    PyBuffer_Release(&dr);
fail_s:
    PyBuffer_Release(&s);
fail_d:
    PyBuffer_Release(&d);
    return NULL;
}

/* A slot header's tag (kvtier/shm/slots.py key_tag): xxh3-64 of the 32-byte key followed by the
   checksum as 8 little-endian bytes, on any host. */
static uint64_t key_tag(const unsigned char *key, uint64_t csum) {
    unsigned char rec[40];
    memcpy(rec, key, 32);
    for (int i = 0; i < 8; i++) rec[32 + i] = (unsigned char)(csum >> (8 * i));
    return XXH3_64bits(rec, sizeof rec);
}

PyDoc_STRVAR(key_tags_doc,
"key_tags(keys, csums, tags) -> None\n\n"
"For each j, store in tags[j] the xxh3-64 of the 32-byte key keys[32j:32j+32] followed by csums[j]\n"
"as 8 little-endian bytes: a slot header's tag (kvtier/shm/slots.py key_tag). keys is a contiguous\n"
"buffer of whole keys; csums and tags uint64 vectors of one per key. Under the GIL: it is short.");

static PyObject *key_tags(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "key_tags(keys, csums, tags) takes three arguments");
        return NULL;
    }
    Py_buffer k, c, t;
    if (PyObject_GetBuffer(args[0], &k, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (k.len % 32) {
        PyErr_Format(PyExc_ValueError, "key_tags: keys must be whole 32-byte keys, got %zd bytes", k.len);
        PyBuffer_Release(&k);
        return NULL;
    }
    Py_ssize_t n = k.len / 32;
    if (get_vector(args[1], &c, n, 0, 1, "key_tags: csums") < 0) {
        PyBuffer_Release(&k);
        return NULL;
    }
    if (get_vector(args[2], &t, n, 1, 1, "key_tags: tags") < 0) {
        PyBuffer_Release(&c);
        PyBuffer_Release(&k);
        return NULL;
    }
    const unsigned char *kp = (const unsigned char *)k.buf;
    const uint64_t *cp = (const uint64_t *)c.buf;
    uint64_t *tp = (uint64_t *)t.buf;
    for (Py_ssize_t j = 0; j < n; j++) tp[j] = key_tag(kp + 32 * j, cp[j]);
    PyBuffer_Release(&t);
    PyBuffer_Release(&c);
    PyBuffer_Release(&k);
    Py_RETURN_NONE;
}

/* A slot header (kvtier/shm/slots.py HEADER_DTYPE): the offsets check_ready reads. */
#define HDR 128
#define H_MAGIC 0
#define H_FLAGS 4
#define H_GEN 8
#define H_KEY 16
#define H_LENGTH 48
#define H_CHECKSUM 56
#define H_TAG 96

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

PyDoc_STRVAR(check_ready_doc,
"check_ready(headers, slots, gens, keys, block_bytes, magic, ready, snaps) -> list[bool]\n\n"
"A put's granted blocks against their slots' headers, as the daemon adopts them (kvtier/shm/flips.py\n"
"check_ready). headers: a table's 128-byte slot headers; slots int64 and gens uint64 vectors and keys\n"
"(joined 32-byte keys) of one per block; snaps: a writable buffer of 128 bytes a block. For each j,\n"
"snaps[j] gets a copy of slot slots[j]'s header (zeros for a slot outside the table), and the answer's\n"
"j-th item says whether that copy is whole and this block's: magic, flags == ready, gen == gens[j]\n"
"and even, key == keys[j], length == block_bytes, tag == key_tag(key, checksum). Every check reads\n"
"the copy, never the header again. Under the GIL: it is short.");

static PyObject *check_ready(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "check_ready(headers, slots, gens, keys, block_bytes, magic, ready, snaps) takes eight arguments");
        return NULL;
    }
    unsigned long long bb = PyLong_AsUnsignedLongLong(args[4]);
    if (bb == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long magic = PyLong_AsUnsignedLong(args[5]);
    if (magic == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    unsigned long ready = PyLong_AsUnsignedLong(args[6]);
    if (ready == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    PyObject *res = NULL;
    Py_buffer h, sl, g, k, sn;
    if (PyObject_GetBuffer(args[0], &h, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[3], &k, PyBUF_C_CONTIGUOUS) < 0) goto fail_h;
    if (h.len % HDR || k.len % 32) {
        PyErr_Format(PyExc_ValueError, "check_ready: %zd bytes of headers, %zd of keys", h.len, k.len);
        goto fail_k;
    }
    Py_ssize_t n = k.len / 32, table = h.len / HDR;
    if (get_vector(args[1], &sl, n, 0, 0, "check_ready: slots") < 0) goto fail_k;
    if (get_vector(args[2], &g, n, 0, 1, "check_ready: gens") < 0) goto fail_sl;
    if (PyObject_GetBuffer(args[7], &sn, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail_g;
    if (sn.len != n * HDR) {
        PyErr_Format(PyExc_ValueError, "check_ready: snaps must be %zd bytes, got %zd", n * HDR, sn.len);
        goto fail_sn;
    }
    res = PyList_New(n);
    if (res == NULL) goto fail_sn;
    const int64_t *slots = (const int64_t *)sl.buf;
    const uint64_t *gens = (const uint64_t *)g.buf;
    const unsigned char *keys = (const unsigned char *)k.buf;
    unsigned char *snaps = (unsigned char *)sn.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        unsigned char *c = snaps + j * HDR;
        int ok = 0;
        if (slots[j] >= 0 && slots[j] < table) {
            /* One copy of the header as the client left it (it may still write to it: every
               check below reads the copy, which is also what the caller writes back VALID). */
            memcpy(c, (const unsigned char *)h.buf + slots[j] * HDR, HDR);
            uint64_t gen = le64(c + H_GEN);
            if (le32(c + H_MAGIC) == magic && le32(c + H_FLAGS) == ready && gen == gens[j] && gen % 2 == 0
                && memcmp(c + H_KEY, keys + 32 * j, 32) == 0 && le64(c + H_LENGTH) == bb)
                ok = key_tag(c + H_KEY, le64(c + H_CHECKSUM)) == le64(c + H_TAG);
        } else {
            memset(c, 0, HDR);
        }
        PyObject *b = ok ? Py_True : Py_False;
        Py_INCREF(b);
        PyList_SET_ITEM(res, j, b);
    }
fail_sn:
    PyBuffer_Release(&sn);
fail_g:
    PyBuffer_Release(&g);
fail_sl:
    PyBuffer_Release(&sl);
fail_k:
    PyBuffer_Release(&k);
fail_h:
    PyBuffer_Release(&h);
    return res;
}

/* A directory entry (kvtier/shm/directory.py _ENTRY): used, gpu, cpu, flags, key, disk, pad. */
#define ENTRY 64
#define E_KEY 16
#define E_DISK 48

static void put_le32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

PyDoc_STRVAR(dir_insert_doc,
"dir_insert(entries, keys, homes, slots, column, buckets) -> None\n\n"
"New keys into the shared-memory directory's open-addressing table (kvtier/shm/directory.py\n"
"DirectoryWriter.set_slots): entries, its writable table of 64-byte entries (a power of two of them);\n"
"keys, whole 32-byte keys, none in the table yet and no two alike; homes and slots int64 vectors of\n"
"one per key. For each key in order, probe linearly from its home for a free entry and write it whole:\n"
"used, its slot in `column` (0 gpu, 1 cpu, 2 disk) and no slot in the others, no flags. buckets[j]\n"
"gets key j's entry. ValueError, and the table as it was, for a slot that does not fit 32 bits or a\n"
"table that fills (the caller leaves room): the entries this call wrote are emptied again, which\n"
"restores the table, as they filled buckets no earlier key's probe crossed.");

static PyObject *dir_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "dir_insert(entries, keys, homes, slots, column, buckets) takes six arguments");
        return NULL;
    }
    long column = PyLong_AsLong(args[4]);
    if (column == -1 && PyErr_Occurred()) return NULL;
    if (column < 0 || column > 2) {
        PyErr_Format(PyExc_ValueError, "dir_insert: column %ld is not 0, 1 or 2", column);
        return NULL;
    }
    PyObject *res = NULL;
    Py_buffer t, k, h, sl, b;
    if (PyObject_GetBuffer(args[0], &t, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &k, PyBUF_C_CONTIGUOUS) < 0) goto fail_t;
    Py_ssize_t cap = t.len / ENTRY, n = k.len / 32;
    if (t.len % ENTRY || cap == 0 || (cap & (cap - 1)) || k.len % 32) {
        PyErr_Format(PyExc_ValueError, "dir_insert: %zd bytes of entries, %zd of keys", t.len, k.len);
        goto fail_k;
    }
    if (get_vector(args[2], &h, n, 0, 0, "dir_insert: homes") < 0) goto fail_k;
    if (get_vector(args[3], &sl, n, 0, 0, "dir_insert: slots") < 0) goto fail_h;
    if (get_vector(args[5], &b, n, 1, 0, "dir_insert: buckets") < 0) goto fail_sl;
    unsigned char *table = (unsigned char *)t.buf;
    const unsigned char *keys = (const unsigned char *)k.buf;
    const int64_t *homes = (const int64_t *)h.buf, *slots = (const int64_t *)sl.buf;
    int64_t *buckets = (int64_t *)b.buf;
    Py_ssize_t mask = cap - 1, j;
    for (j = 0; j < n; j++) {  /* every slot checked before any entry is written */
        if (slots[j] < INT32_MIN || slots[j] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "dir_insert: slot %lld does not fit an entry", (long long)slots[j]);
            goto done;
        }
    }
    for (j = 0; j < n; j++) {
        Py_ssize_t i = (Py_ssize_t)(homes[j] & mask), steps = 0;
        while (le32(table + i * ENTRY) != 0) {  /* linear probing from the key's home */
            i = (i + 1) & mask;
            if (++steps == cap) {  /* the caller leaves room: this call's entries are taken back */
                for (Py_ssize_t u = 0; u < j; u++) memset(table + buckets[u] * ENTRY, 0, ENTRY);
                PyErr_SetString(PyExc_ValueError, "dir_insert: the directory is full");
                goto done;
            }
        }
        unsigned char rec[ENTRY] = {0};
        int32_t col[3] = {-1, -1, -1};  /* gpu, cpu, disk */
        col[column] = (int32_t)slots[j];
        put_le32(rec, 1);
        put_le32(rec + 4, (uint32_t)col[0]);
        put_le32(rec + 8, (uint32_t)col[1]);
        memcpy(rec + E_KEY, keys + 32 * j, 32);
        put_le32(rec + E_DISK, (uint32_t)col[2]);
        memcpy(table + i * ENTRY, rec, ENTRY);
        buckets[j] = i;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&b);
fail_sl:
    PyBuffer_Release(&sl);
fail_h:
    PyBuffer_Release(&h);
fail_k:
    PyBuffer_Release(&k);
fail_t:
    PyBuffer_Release(&t);
    return res;
}

/* A checksum taken over several copies (a block that lands in runs: vLLM's per-layer pages,
   SGLang's strided pages), as python-xxhash's xxh3_64 object is over several updates. One
   thread at a time: its state is used with the GIL released, so a second thread's call while
   one runs is refused (RuntimeError), never let race on it. */
typedef struct {
    PyObject_HEAD
    XXH3_state_t *state;
    int busy;  /* set and cleared with the GIL held */
} Stream;

static int stream_enter(Stream *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "a Stream is used by one thread at a time");
        return -1;
    }
    self->busy = 1;
    return 0;
}

static PyObject *stream_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Stream() takes no arguments");
        return NULL;
    }
    Stream *self = (Stream *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->state = XXH3_createState();
    if (self->state == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    XXH3_64bits_reset(self->state);
    return (PyObject *)self;
}

static void stream_dealloc(Stream *self) {
    XXH3_freeState(self->state);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *stream_copy(Stream *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer d, s;
    if (get_pair(args, nargs, &d, &s) < 0) return NULL;
    if (stream_enter(self) < 0) {
        PyBuffer_Release(&s);
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_update(self->state, (char *)d.buf, (const char *)s.buf, (size_t)d.len);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
}

static PyObject *stream_update(Stream *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (stream_enter(self) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    hash_update(self->state, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *stream_intdigest(Stream *self, PyObject *unused) {
    (void)unused;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "a Stream is used by one thread at a time");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)XXH3_64bits_digest(self->state));
}

static PyMethodDef stream_methods[] = {
    {"copy_hashed", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "copy_hashed(dst, src): copy the contiguous buffer src into dst (same length), the bytes copied fed to "
     "the checksum"},
    {"update", (PyCFunction)stream_update, METH_O, "update(buf): feed the contiguous buffer buf to the checksum"},
    {"intdigest", (PyCFunction)stream_intdigest, METH_NOARGS, "the xxh3-64 of every byte fed so far, in order"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.shm._copy_hash.Stream",
    .tp_basicsize = sizeof(Stream),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An xxh3-64 taken over copies and updates in order (python-xxhash's xxh3_64 digest).",
    .tp_new = stream_new,
    .tp_dealloc = (destructor)stream_dealloc,
    .tp_methods = stream_methods,
};

static PyMethodDef methods[] = {
    {"copy_hashed", (PyCFunction)(void (*)(void))copy_hashed, METH_FASTCALL, copy_hashed_doc},
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL, copy_rows_doc},
    {"key_tags", (PyCFunction)(void (*)(void))key_tags, METH_FASTCALL, key_tags_doc},
    {"check_ready", (PyCFunction)(void (*)(void))check_ready, METH_FASTCALL, check_ready_doc},
    {"dir_insert", (PyCFunction)(void (*)(void))dir_insert, METH_FASTCALL, dir_insert_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_hash",
    "Copy and xxh3-64 in one pass with the GIL released (kvtier/shm/onepass.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy_hash(void) {
    int avx2 = 0;
#if HAVE_AVX2_KERNEL
    __builtin_cpu_init();
    /* KVTIER_HASH_KERNEL=baseline keeps SSE2: to compare the two, and to test it on an AVX2 host. */
    const char *want = getenv("KVTIER_HASH_KERNEL");
    avx2 = __builtin_cpu_supports("avx2") != 0 && !(want != NULL && strcmp(want, "baseline") == 0);
    if (avx2) hash_update = update_avx2;
#endif
    if (PyType_Ready(&StreamType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&StreamType);
    if (PyModule_AddObject(m, "Stream", (PyObject *)&StreamType) < 0) {
        Py_DECREF(&StreamType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "STREAMS", HAVE_STREAM) < 0 || PyModule_AddIntConstant(m, "CHUNK", CHUNK) < 0
        || PyModule_AddIntConstant(m, "STREAM_MIN", STREAM_MIN) < 0
        || PyModule_AddStringConstant(m, "HASH_KERNEL", avx2 ? "avx2" : "baseline") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
