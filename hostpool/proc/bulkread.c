/*
 * hostpool.proc.bulkread: the exporter's per-line and per-fd loops over /proc, in C.
 *
 * A scrape reads every maps line and stats every fd of every process it looks at
 * (hundreds of thousands per scrape on a loaded host). In Python each line or fd costs
 * more interpreter time than the kernel spends producing it, so these loops run here and
 * hand Python one entry per object instead of one per line or fd. What a line or an fd
 * means (names, pools, kinds) stays in Python (hostpool/proc/scan.py).
 *
 * This is the one parser of maps and smaps: the exporter, the host view and `hostpool
 * inspect` (a detailed read: each object's VMAs, smaps usage and fds) all read here, so
 * they see the same objects; lines end at `\n` only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>

/* the fields statx is asked for; AT_STATX_DONT_SYNC takes what the kernel has cached, so
 * another user's FUSE daemon or a slow network filesystem cannot stall the read */
#define WANTED (STATX_TYPE | STATX_INO | STATX_BLOCKS)
/* the host view (`devices` given) also wants each object's length and times */
#define WANTED_HOST (WANTED | STATX_SIZE | STATX_MTIME | STATX_CTIME)
#define BATCH 256 /* fds statx-ed with the GIL released, between two looks at the deadline */

/* ---- maps ------------------------------------------------------------------------- */

/* A lowercase hex number of 1-16 digits at *p (before end); advances *p past it. */
static int
parse_hex(const char **p, const char *end, unsigned long long *out)
{
    const char *s = *p;
    unsigned long long v = 0;
    int digits = 0;
    for (; s < end; s++) {
        int d;
        if (*s >= '0' && *s <= '9')
            d = *s - '0';
        else if (*s >= 'a' && *s <= 'f')
            d = *s - 'a' + 10;
        else
            break;
        if (++digits > 16)
            return 0;
        v = (v << 4) | (unsigned long long)d;
    }
    if (digits == 0)
        return 0;
    *p = s;
    *out = v;
    return 1;
}

/* A decimal number of 1-20 digits that fits 64 bits at *p; advances *p past it. */
static int
parse_dec(const char **p, const char *end, unsigned long long *out)
{
    const char *s = *p;
    unsigned long long v = 0;
    int digits = 0;
    for (; s < end && *s >= '0' && *s <= '9'; s++) {
        unsigned d = (unsigned)(*s - '0');
        if (++digits > 20 || v > (~0ULL - d) / 10)
            return 0;
        v = v * 10 + d;
    }
    if (digits == 0)
        return 0;
    *p = s;
    *out = v;
    return 1;
}

static int
expect(const char **p, const char *end, char c)
{
    if (*p >= end || **p != c)
        return 0;
    (*p)++;
    return 1;
}

struct maps_line {
    unsigned long long start, end, offset, major, minor, inode;
    int shared; /* `s` in the perms: MAP_SHARED */
    const char *perms;
    Py_ssize_t perms_len;
    const char *path;
    Py_ssize_t path_len;
};

/* `start-end perms offset major:minor inode  path` (proc(5)); 0 for a line without a
 * path or not of that shape. The path is the rest of the line after the spaces that pad
 * it to its column. */
static int
parse_maps_line(const char *s, const char *eol, struct maps_line *out)
{
    const char *perms;
    if (!parse_hex(&s, eol, &out->start) || !expect(&s, eol, '-'))
        return 0;
    if (!parse_hex(&s, eol, &out->end) || !expect(&s, eol, ' '))
        return 0;
    for (perms = s; s < eol && *s != ' '; s++)
        ;
    if (s == perms || !expect(&s, eol, ' '))
        return 0;
    out->shared = s - perms >= 5 && perms[3] == 's';
    out->perms = perms;
    out->perms_len = s - 1 - perms;
    if (!parse_hex(&s, eol, &out->offset) || !expect(&s, eol, ' '))
        return 0;
    if (!parse_hex(&s, eol, &out->major) || !expect(&s, eol, ':'))
        return 0;
    if (!parse_hex(&s, eol, &out->minor) || !expect(&s, eol, ' '))
        return 0;
    if (!parse_dec(&s, eol, &out->inode) || !expect(&s, eol, ' '))
        return 0;
    while (s < eol && *s == ' ')
        s++;
    if (s >= eol || out->end < out->start)
        return 0;
    out->path = s;
    out->path_len = eol - s;
    return 1;
}

static int
mentions(const char *path, Py_ssize_t len, PyObject *needles)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(needles);
    for (i = 0; i < n; i++) {
        PyObject *needle = PyTuple_GET_ITEM(needles, i);
        if (memmem(path, (size_t)len, PyBytes_AS_STRING(needle),
                   (size_t)PyBytes_GET_SIZE(needle)))
            return 1;
    }
    return 0;
}

/* A row per object, the fields of scan.py's ROW_* (each object's truth while a scan
 * reads it): [path, match, mappings, mapped_bytes, fds, allocated_bytes (st_blocks * 512
 * through its first fd) or None, smaps_resident or None]. `match` is what the caller's
 * names say of the path: (kind, name, pool key) */
enum {
    ROW_PATH, ROW_MATCH, ROW_MAPPINGS, ROW_MAPPED, ROW_FDS, ROW_ALLOCATED, ROW_SMAPS, ROW_FIELDS
};
/* The host view's rows (`devices` given) carry more: the name of the object's first VMA
 * in /proc/PID/map_files or the fd it was met by ([vma or fd, is_fd]: a stat through
 * either gives its pages), whether any mapping is MAP_SHARED, and from its first fd its
 * length and times (host/scan.py's HROW_*) */
enum { ROW_VIA = ROW_FIELDS, ROW_SHARED, ROW_SIZE, ROW_MTIME, ROW_CTIME, HOST_ROW_FIELDS };
/* A detailed read (`detail` & DETAIL_VMAS, inspect and the leak check) adds one last item
 * to a row: its logical mappings, each a list of its VMAs (start, end, offset, perms,
 * usage), usage None from maps, (rss, shared_hugetlb, private_hugetlb, kernel_page_size)
 * bytes from smaps. DETAIL_SMAPS: `data` is /proc/PID/smaps; each row's ROW_SMAPS is the
 * sum of its VMAs' Rss and hugetlb pages. */
enum { DETAIL_VMAS = 1, DETAIL_SMAPS = 2 };

/* (inode, dev major, dev minor): the key of an object with an inode, as maps and statx
 * give it */
static PyObject *
identity(unsigned long long inode, unsigned long long major, unsigned long long minor)
{
    PyObject *key = PyTuple_New(3);
    if (key == NULL)
        return NULL;
    PyTuple_SET_ITEM(key, 0, PyLong_FromUnsignedLongLong(inode));
    PyTuple_SET_ITEM(key, 1, PyLong_FromUnsignedLongLong(major));
    PyTuple_SET_ITEM(key, 2, PyLong_FromUnsignedLongLong(minor));
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    return key;
}

/* whether a row is a host row (with or without its VMA list) */
static int
is_host_row(PyObject *row)
{
    return PyList_GET_SIZE(row) >= HOST_ROW_FIELDS;
}

static int
row_check(PyObject *row)
{
    Py_ssize_t n = PyList_CheckExact(row) ? PyList_GET_SIZE(row) : 0;
    if (n == ROW_FIELDS || n == ROW_FIELDS + 1 || n == HOST_ROW_FIELDS ||
        n == HOST_ROW_FIELDS + 1)
        return 0;
    PyErr_SetString(PyExc_TypeError, "rows must map keys to maps_objects rows");
    return -1;
}

static int
add_to_item(PyObject *row, Py_ssize_t at, unsigned long long more)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(row, at));
    PyObject *sum;
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    sum = PyLong_FromUnsignedLongLong(value + more);
    return sum == NULL ? -1 : PyList_SetItem(row, at, sum);
}

/* A row; `via` non-NULL makes a host row (its VMA's map_files name or its fd's entry),
 * `vmas` one with a last item, an empty list of logical mappings */
static PyObject *
new_row(PyObject *path, PyObject *match, unsigned long long mappings, unsigned long long size,
        long fds, PyObject *via, int is_fd, int shared, int vmas)
{
    Py_ssize_t n = (via ? HOST_ROW_FIELDS : ROW_FIELDS) + (vmas ? 1 : 0);
    PyObject *row = PyList_New(n);
    if (row == NULL)
        return NULL;
    if (vmas)
        PyList_SET_ITEM(row, n - 1, PyList_New(0));
    PyList_SET_ITEM(row, ROW_PATH, Py_NewRef(path));
    PyList_SET_ITEM(row, ROW_MATCH, Py_NewRef(match));
    PyList_SET_ITEM(row, ROW_MAPPINGS, PyLong_FromUnsignedLongLong(mappings));
    PyList_SET_ITEM(row, ROW_MAPPED, PyLong_FromUnsignedLongLong(size));
    PyList_SET_ITEM(row, ROW_FDS, PyLong_FromLong(fds));
    PyList_SET_ITEM(row, ROW_ALLOCATED, Py_NewRef(Py_None));
    PyList_SET_ITEM(row, ROW_SMAPS, Py_NewRef(Py_None));
    if (via) {
        PyList_SET_ITEM(row, ROW_VIA, Py_BuildValue("(Oi)", via, is_fd));
        PyList_SET_ITEM(row, ROW_SHARED, PyBool_FromLong(shared));
        PyList_SET_ITEM(row, ROW_SIZE, Py_NewRef(Py_None));
        PyList_SET_ITEM(row, ROW_MTIME, Py_NewRef(Py_None));
        PyList_SET_ITEM(row, ROW_CTIME, Py_NewRef(Py_None));
    }
    if (PyErr_Occurred())
        Py_CLEAR(row);
    return row;
}

/* The logical mapping a VMA of `row` joins (borrowed): the row's last one, or a new one
 * when `fresh` (it does not continue the row's last VMA). */
static PyObject *
mapping_of(PyObject *row, int fresh)
{
    PyObject *mappings = PyList_GET_ITEM(row, PyList_GET_SIZE(row) - 1);
    Py_ssize_t n = PyList_GET_SIZE(mappings);
    if (fresh || n == 0) {
        PyObject *mapping = PyList_New(0);
        int rc = mapping == NULL ? -1 : PyList_Append(mappings, mapping);
        Py_XDECREF(mapping);
        return rc < 0 ? NULL : mapping; /* held by `mappings` */
    }
    return PyList_GET_ITEM(mappings, n - 1);
}

/* The line's VMA counted in the row of its object (`joined`: it continues the previous
 * line's VMA). Sets *row to that row (borrowed from `rows`), or to NULL when `names` says
 * the path is no match; with `vmas`, *mapping to the logical mapping the VMA joins
 * (borrowed from the row). -1 on error. */
static int
add_vma(PyObject *rows, PyObject *names, PyObject *unnamed, const struct maps_line *line,
        PyObject *previous, int joined, int host, int vmas, PyObject **row,
        PyObject **mapping)
{
    PyObject *path, *key = NULL, *match, *fresh = NULL, *via = NULL;
    unsigned long long size = line->end - line->start;

    *row = NULL;
    path = PyBytes_FromStringAndSize(line->path, line->path_len);
    if (path == NULL)
        return -1;
    match = PyDict_GetItemWithError(names, path);
    if (match == Py_None) /* a path met before that names no match */
        goto done;
    if (match == NULL && PyErr_Occurred())
        goto fail;
    /* an object with an inode is that inode (the identity statx gives its fds); one
     * without (an anonymous VMA named by prctl) is its path */
    key = line->inode ? identity(line->inode, line->major, line->minor) : Py_NewRef(path);
    if (key == NULL)
        goto fail;
    if (host) {
        char name[40]; /* the /proc/PID/map_files name: "%lx-%lx" (two 16-digit numbers) */
        int len = snprintf(name, sizeof(name), "%llx-%llx", line->start, line->end);
        via = PyBytes_FromStringAndSize(name, len);
        if (via == NULL)
            goto fail;
    }
    fresh = new_row(path, match == NULL ? Py_None : match, 1, size, 0, via, 0, line->shared,
                    vmas);
    if (fresh == NULL)
        goto fail;
    /* most objects are met once: one probe inserts the row or finds the object's */
    *row = PyDict_SetDefault(rows, key, fresh);
    if (*row == NULL)
        goto fail;
    if (*row == fresh) {
        if (match == NULL && PyList_Append(unnamed, key) < 0)
            goto fail;
    } else {
        if ((*row != previous || !joined) && add_to_item(*row, ROW_MAPPINGS, 1) < 0)
            goto fail;
        if (add_to_item(*row, ROW_MAPPED, size) < 0)
            goto fail;
        if (host && line->shared && is_host_row(*row) &&
            PyList_SetItem(*row, ROW_SHARED, Py_NewRef(Py_True)) < 0)
            goto fail;
    }
    if (vmas && (*mapping = mapping_of(*row, *row == fresh || *row != previous || !joined)) == NULL)
        goto fail;
done:
    Py_XDECREF(via);
    Py_XDECREF(fresh);
    Py_XDECREF(key);
    Py_DECREF(path);
    return 0;
fail:
    *row = NULL;
    Py_XDECREF(via);
    Py_XDECREF(fresh);
    Py_XDECREF(key);
    Py_DECREF(path);
    return -1;
}

/* Whether st_dev (major, minor) is in the set `devices` (ints as os.makedev makes them).
 * Lines and fds repeat few devices: the last answer is kept in *cache. -1 on error. */
struct device_cache {
    unsigned long long major, minor;
    int valid, member;
};

static int
on_device(PyObject *devices, unsigned long long major, unsigned long long minor,
          struct device_cache *cache)
{
    PyObject *dev;
    int member;
    if (cache->valid && cache->major == major && cache->minor == minor)
        return cache->member;
    dev = PyLong_FromUnsignedLongLong((unsigned long long)makedev(major, minor));
    if (dev == NULL)
        return -1;
    member = PySet_Contains(devices, dev);
    Py_DECREF(dev);
    if (member < 0)
        return -1;
    cache->major = major;
    cache->minor = minor;
    cache->valid = 1;
    cache->member = member;
    return member;
}

/* A detailed read's VMA, kept until its smaps fields are read (the next header line, or
 * the end): then its tuple joins its logical mapping and its pages its row's ROW_SMAPS. */
struct vma {
    PyObject *row, *mapping; /* strong; NULL: no VMA pending */
    unsigned long long start, end, offset;
    PyObject *perms;
    unsigned long long usage[4]; /* Rss, Shared_Hugetlb, Private_Hugetlb, KernelPageSize */
};

static const char *const USAGE_FIELDS[4] = {
    "Rss:", "Shared_Hugetlb:", "Private_Hugetlb:", "KernelPageSize:",
};

static void
vma_clear(struct vma *vma)
{
    Py_CLEAR(vma->row);
    Py_CLEAR(vma->mapping);
    Py_CLEAR(vma->perms);
}

static int
vma_start(struct vma *vma, PyObject *row, PyObject *mapping, const struct maps_line *line)
{
    vma->perms = PyUnicode_DecodeLatin1(line->perms, line->perms_len, NULL);
    if (vma->perms == NULL)
        return -1;
    vma->row = Py_NewRef(row);
    vma->mapping = Py_XNewRef(mapping);
    vma->start = line->start;
    vma->end = line->end;
    vma->offset = line->offset;
    memset(vma->usage, 0, sizeof(vma->usage));
    return 0;
}

/* One smaps `Name:   value kB` line, counted in the pending VMA if it is one we keep. */
static void
vma_field(struct vma *vma, const char *s, const char *eol)
{
    int i;
    unsigned long long kb;
    for (i = 0; i < 4; i++) {
        size_t n = strlen(USAGE_FIELDS[i]);
        if ((size_t)(eol - s) > n && memcmp(s, USAGE_FIELDS[i], n) == 0) {
            for (s += n; s < eol && *s == ' '; s++)
                ;
            if (parse_dec(&s, eol, &kb) && kb <= (~0ULL >> 10))
                vma->usage[i] = kb << 10;
            return;
        }
    }
}

/* The pending VMA, if any, added to its logical mapping and, from smaps, its pages to
 * its row's ROW_SMAPS. */
static int
vma_flush(struct vma *vma, int smaps)
{
    PyObject *item, *usage = Py_None;
    int rc = 0;
    unsigned long long resident = vma->usage[0] + vma->usage[1] + vma->usage[2];

    if (vma->row == NULL)
        return 0;
    if (smaps) {
        if (PyList_GET_ITEM(vma->row, ROW_SMAPS) != Py_None) {
            rc = add_to_item(vma->row, ROW_SMAPS, resident);
        } else {
            item = PyLong_FromUnsignedLongLong(resident);
            rc = item == NULL ? -1 : PyList_SetItem(vma->row, ROW_SMAPS, item);
        }
    }
    if (rc == 0 && vma->mapping != NULL) {
        if (smaps)
            usage = Py_BuildValue("(KKKK)", vma->usage[0], vma->usage[1], vma->usage[2],
                                  vma->usage[3]);
        item = usage == NULL ? NULL : Py_BuildValue("(KKKOO)", vma->start, vma->end,
                                                    vma->offset, vma->perms, usage);
        rc = item == NULL ? -1 : PyList_Append(vma->mapping, item);
        Py_XDECREF(item);
        if (smaps)
            Py_XDECREF(usage);
    }
    vma_clear(vma);
    return rc;
}

/* smaps: a VMA's header line starts with its address, its fields with a capital */
static int
is_header(const char *s, const char *eol)
{
    return s < eol && ((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f'));
}

PyDoc_STRVAR(maps_objects_doc,
"maps_objects(data, needles, names, devices=None, detail=0, /)\n--\n\n"
"The objects that the maps lines in `data` (a /proc/PID/maps file) map, among the lines\n"
"whose path contains one of `needles` (a tuple of non-empty bytes): (rows, unnamed).\n"
"`rows` maps each object's key, (inode, dev major, dev minor) or the path of an\n"
"inode-less VMA, to its row [path, match, mappings, mapped_bytes, 0, None, None]; the\n"
"last three are its fds, allocated bytes and smaps residency, which stat_fds and the\n"
"caller fill in. `match` is names[path]; a path that `names` maps to None is no match\n"
"and makes no row; a path `names` lacks gets match None and its key listed in\n"
"`unnamed`, for the caller to name. `mappings` counts logical mappings: the VMAs one\n"
"mmap was split into count once. Lines of another shape are skipped.\n\n"
"With `devices` (a set of st_dev ints, os.makedev's), the host view: a line is also taken\n"
"when its object lies on one of them, and each row has five more items: (its first\n"
"VMA's /proc/PID/map_files name, 0), whether any of its VMAs is MAP_SHARED, and None\n"
"for the length, mtime and ctime that stat_fds fills in.\n\n"
"`detail` (inspect, the leak check) is a sum of flags: 1 adds to each row one last item,\n"
"its logical mappings, each a list of its VMAs (start, end, offset, perms, usage); 2 reads\n"
"`data` as /proc/PID/smaps: each row's smaps residency is its VMAs' Rss and hugetlb pages,\n"
"and each VMA's usage is (rss, shared_hugetlb, private_hugetlb, kernel_page_size) in\n"
"bytes (None when `data` is maps).");

static PyObject *
maps_objects(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer data;
    PyObject *needles, *names, *devices = Py_None, *rows = NULL, *unnamed = NULL;
    PyObject *previous = NULL;
    unsigned long long previous_end = 0, previous_offset_end = 0;
    Py_ssize_t i;
    struct maps_line line;
    struct device_cache cache = {0, 0, 0, 0};
    struct vma vma = {NULL, NULL, 0, 0, 0, NULL, {0, 0, 0, 0}};
    int host, detail = 0, smaps;

    if (!PyArg_ParseTuple(args, "y*O!O!|Oi:maps_objects", &data, &PyTuple_Type, &needles,
                          &PyDict_Type, &names, &devices, &detail))
        return NULL;
    host = devices != Py_None;
    smaps = detail & DETAIL_SMAPS;
    if (detail & ~(DETAIL_VMAS | DETAIL_SMAPS)) {
        PyErr_SetString(PyExc_ValueError, "detail must be 0-3");
        goto fail;
    }
    if (host && !PyAnySet_Check(devices)) {
        PyErr_SetString(PyExc_TypeError, "devices must be a set of ints or None");
        goto fail;
    }
    for (i = 0; i < PyTuple_GET_SIZE(needles); i++) {
        PyObject *needle = PyTuple_GET_ITEM(needles, i);
        if (!PyBytes_Check(needle) || PyBytes_GET_SIZE(needle) == 0) {
            PyErr_SetString(PyExc_TypeError, "needles must be non-empty bytes");
            goto fail;
        }
    }
    rows = PyDict_New();
    unnamed = PyList_New(0);
    if (rows == NULL || unnamed == NULL)
        goto fail;
    {
        const char *p = data.buf, *end = p + data.len;
        while (p < end) {
            const char *eol = memchr(p, '\n', (size_t)(end - p));
            PyObject *row = NULL, *mapping = NULL;
            if (eol == NULL)
                eol = end;
            if (smaps && !is_header(p, eol)) { /* a field of the VMA above */
                if (vma.row != NULL)
                    vma_field(&vma, p, eol);
                p = eol + 1;
                continue;
            }
            if (vma_flush(&vma, smaps) < 0)
                goto fail;
            int wanted = parse_maps_line(p, eol, &line);
            if (wanted && !mentions(line.path, line.path_len, needles)) {
                wanted = host ? on_device(devices, line.major, line.minor, &cache) : 0;
                if (wanted < 0)
                    goto fail;
            }
            if (wanted) {
                /* maps is sorted by address: a VMA that starts where the previous line's
                 * ended, of the same object, at the next offset of the file, is the
                 * rest of one mmap split by madvise or mprotect (an anonymous VMA shows
                 * offset 0 whatever its part: its address decides) */
                int joined = previous != NULL && previous_end == line.start &&
                             (line.inode == 0 || previous_offset_end == line.offset);
                if (add_vma(rows, names, unnamed, &line, previous, joined, host,
                            detail & DETAIL_VMAS, &row, &mapping) < 0)
                    goto fail;
                if (row != NULL && detail && vma_start(&vma, row, mapping, &line) < 0)
                    goto fail;
                previous_end = line.end;
                previous_offset_end = line.offset + (line.end - line.start);
            }
            previous = row; /* NULL: another VMA lies between */
            p = eol + 1;
        }
    }
    if (vma_flush(&vma, smaps) < 0)
        goto fail;
    PyBuffer_Release(&data);
    return Py_BuildValue("(NN)", rows, unnamed);
fail:
    vma_clear(&vma);
    Py_XDECREF(rows);
    Py_XDECREF(unnamed);
    PyBuffer_Release(&data);
    return NULL;
}

/* add[] added to totals[pool] (a new [fds, mappings, mapped, resident] if none yet) */
static int
add_sums(PyObject *totals, PyObject *pool, const unsigned long long add[4])
{
    PyObject *sums;
    int i, rc = -1;

    Py_INCREF(pool); /* held: its __eq__ may drop the row it came from */
    sums = PyDict_GetItemWithError(totals, pool);
    if (sums == NULL) {
        if (!PyErr_Occurred()) {
            sums = Py_BuildValue("[KKKK]", add[0], add[1], add[2], add[3]);
            rc = sums == NULL ? -1 : PyDict_SetItem(totals, pool, sums);
            Py_XDECREF(sums);
        }
    } else {
        for (i = 0, rc = 0; i < 4 && rc == 0; i++)
            rc = add_to_item(sums, i, add[i]);
    }
    Py_DECREF(pool);
    return rc;
}

/* visit(key, row, out) for each row of the dict argument; `out` returned, or NULL */
static PyObject *
each_row(PyObject *args, const char *format, PyObject *out,
         int (*visit)(PyObject *key, PyObject *row, PyObject *out))
{
    PyObject *rows, *key, *row;
    Py_ssize_t pos = 0;

    if (out == NULL || !PyArg_ParseTuple(args, format, &PyDict_Type, &rows)) {
        Py_XDECREF(out);
        return NULL;
    }
    while (PyDict_Next(rows, &pos, &key, &row)) {
        if (row_check(row) < 0 || visit(key, row, out) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* One row added to the sums of its pool. */
static int
add_row(PyObject *Py_UNUSED(key), PyObject *row, PyObject *totals)
{
    PyObject *match = PyList_GET_ITEM(row, ROW_MATCH), *allocated, *smaps;
    unsigned long long add[4], mapped;

    if (match == Py_None)
        return 0;
    if (!PyTuple_Check(match) || PyTuple_GET_SIZE(match) < 3) {
        PyErr_SetString(PyExc_TypeError, "a match is (kind, name, pool key)");
        return -1;
    }
    add[0] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(row, ROW_FDS));
    add[1] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(row, ROW_MAPPINGS));
    add[2] = mapped = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(row, ROW_MAPPED));
    allocated = PyList_GET_ITEM(row, ROW_ALLOCATED);
    smaps = PyList_GET_ITEM(row, ROW_SMAPS);
    if (allocated != Py_None) {
        add[3] = PyLong_AsUnsignedLongLong(allocated);
        add[3] = add[3] < mapped ? add[3] : mapped;
    } else {
        add[3] = smaps == Py_None ? 0 : PyLong_AsUnsignedLongLong(smaps);
    }
    if (PyErr_Occurred())
        return -1;
    return add_sums(totals, PyTuple_GET_ITEM(match, 2), add);
}

PyDoc_STRVAR(pool_totals_doc,
"pool_totals(rows, /)\n--\n\n"
"The rows of one process summed per pool key (the third item of each row's match; rows\n"
"without a match are left out): {pool: [fds, mappings, mapped_bytes, resident_bytes]}.\n"
"An object's resident bytes are its allocated bytes, at most the bytes mapped, else its\n"
"smaps residency, else 0.");

static PyObject *
pool_totals(PyObject *Py_UNUSED(module), PyObject *args)
{
    return each_row(args, "O!:pool_totals", PyDict_New(), add_row);
}

static int
add_if_unmeasured(PyObject *key, PyObject *row, PyObject *keys)
{
    return PyList_GET_ITEM(row, ROW_ALLOCATED) == Py_None ? PyList_Append(keys, key) : 0;
}

PyDoc_STRVAR(unmeasured_doc,
"unmeasured(rows, /)\n--\n\n"
"The keys of the rows whose allocated bytes no fd gave (the objects a process maps\n"
"without holding an fd for them).");

static PyObject *
unmeasured(PyObject *Py_UNUSED(module), PyObject *args)
{
    return each_row(args, "O!:unmeasured", PyList_New(0), add_if_unmeasured);
}

/* ---- fds -------------------------------------------------------------------------- */

PyDoc_STRVAR(stat_fd_doc,
"stat_fd(dir_fd, name, /)\n--\n\n"
"((inode, dev major, dev minor), st_mode, st_blocks) of the object that the fd `name`\n"
"(bytes) of the open /proc/PID/fd directory `dir_fd` refers to: statx through its link,\n"
"with cached attributes only. Raises OSError as os.stat does (FileNotFoundError: the fd\n"
"was closed since it was listed).");

static PyObject *
stat_fd(PyObject *Py_UNUSED(module), PyObject *args)
{
    int dir_fd, rc;
    PyObject *name;
    struct statx st;

    if (!PyArg_ParseTuple(args, "iO!:stat_fd", &dir_fd, &PyBytes_Type, &name))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = statx(dir_fd, PyBytes_AS_STRING(name), AT_STATX_DONT_SYNC, WANTED, &st);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    return Py_BuildValue("(NIK)", identity(st.stx_ino, st.stx_dev_major, st.stx_dev_minor),
                         (unsigned)st.stx_mode, (unsigned long long)st.stx_blocks);
}

static double
monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* what time.monotonic() reads on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct fd_stat {
    int error;
    struct statx st;
};

static double
stamp(const struct statx_timestamp *t)
{
    return (double)t->tv_sec + (double)t->tv_nsec * 1e-9;
}

/* A host row's length and times, from the fd that measured its pages. */
static int
set_facts(PyObject *row, const struct statx *st)
{
    PyObject *facts[3];
    int i;
    if (!is_host_row(row))
        return 0;
    facts[0] = PyLong_FromUnsignedLongLong(st->stx_size);
    facts[1] = PyFloat_FromDouble(stamp(&st->stx_mtime));
    facts[2] = PyFloat_FromDouble(stamp(&st->stx_ctime));
    if (facts[0] == NULL || facts[1] == NULL || facts[2] == NULL) {
        for (i = 0; i < 3; i++)
            Py_XDECREF(facts[i]);
        return -1;
    }
    for (i = 0; i < 3; i++) /* each reference stolen, whatever the outcome */
        if (PyList_SetItem(row, ROW_SIZE + i, facts[i]) < 0) {
            for (i++; i < 3; i++)
                Py_DECREF(facts[i]);
            return -1;
        }
    return 0;
}

/* A host row for an object held by an fd and not mapped (by the fd's entry). */
static int
add_fd_row(PyObject *rows, PyObject *key, PyObject *entry, const struct statx *st)
{
    PyObject *row = new_row(Py_None, Py_None, 0, 0, 1, entry, 1, 0, 0), *allocated;
    int rc = -1;
    if (row == NULL)
        return -1;
    allocated = PyLong_FromUnsignedLongLong((unsigned long long)st->stx_blocks * 512);
    if (allocated != NULL && PyList_SetItem(row, ROW_ALLOCATED, allocated) == 0 &&
        set_facts(row, st) == 0)
        rc = PyDict_SetItem(rows, key, row);
    Py_DECREF(row);
    return rc;
}

/* (entry, st_size, st_blocks * 512) of one fd appended to held[key] */
static int
hold(PyObject *held, PyObject *key, PyObject *entry, const struct statx *st)
{
    PyObject *fds, *item;
    int rc;
    fds = PyDict_GetItemWithError(held, key);
    if (fds == NULL) {
        if (PyErr_Occurred())
            return -1;
        fds = PyList_New(0);
        rc = fds == NULL ? -1 : PyDict_SetItem(held, key, fds);
        Py_XDECREF(fds); /* held by `held` */
        if (rc < 0)
            return -1;
    }
    item = Py_BuildValue("(OKK)", entry, (unsigned long long)st->stx_size,
                         (unsigned long long)st->stx_blocks * 512);
    rc = item == NULL ? -1 : PyList_Append(fds, item);
    Py_XDECREF(item);
    return rc;
}

/* One statx-ed fd: counted in the row of its object, or kept for a link read. With
 * `devices` (the host view), an fd on none of them is no object and one on them that no
 * row has becomes a row of its own. With `held`, each fd of a row and each regular file
 * is also listed by its object. */
static int
add_fd(PyObject *entry, const struct fd_stat *got, PyObject *rows, PyObject *unmatched,
       PyObject *devices, PyObject *held, struct device_cache *cache)
{
    PyObject *key, *row, *allocated;
    int rc = -1;

    if (got->error == ENOENT || got->error == ESRCH)
        return 0; /* closed since the listing, or the process is gone */
    if (got->error)
        return PyList_Append(unmatched, entry); /* its filesystem refused: its link tells */
    if (devices != Py_None) {
        int member = on_device(devices, got->st.stx_dev_major, got->st.stx_dev_minor, cache);
        if (member <= 0)
            return member;
    }
    key = identity(got->st.stx_ino, got->st.stx_dev_major, got->st.stx_dev_minor);
    if (key == NULL)
        return -1;
    row = PyDict_GetItemWithError(rows, key);
    if (held != Py_None && !PyErr_Occurred() && (row != NULL || S_ISREG(got->st.stx_mode)) &&
        hold(held, key, entry, &got->st) < 0)
        goto done;
    if (row == NULL) {
        /* not a mapped object: a regular file (memfds and shm files are) may still be a
         * matched fd held unmapped, which its link tells */
        if (!PyErr_Occurred() && !S_ISREG(got->st.stx_mode))
            rc = 0;
        else if (!PyErr_Occurred())
            rc = devices != Py_None ? add_fd_row(rows, key, entry, &got->st)
                                    : PyList_Append(unmatched, entry);
        goto done;
    }
    if (row_check(row) < 0 || add_to_item(row, ROW_FDS, 1) < 0)
        goto done;
    rc = 0;
    if (PyList_GET_ITEM(row, ROW_ALLOCATED) == Py_None) { /* its pages, from its first fd */
        allocated = PyLong_FromUnsignedLongLong((unsigned long long)got->st.stx_blocks * 512);
        rc = allocated == NULL ? -1 : PyList_SetItem(row, ROW_ALLOCATED, allocated);
        if (rc == 0)
            rc = set_facts(row, &got->st);
    }
done:
    Py_DECREF(key);
    return rc;
}

PyDoc_STRVAR(stat_fds_doc,
"stat_fds(dir_fd, entries, rows, deadline, devices=None, held=None, /)\n--\n\n"
"statx every fd named in `entries` (a list of bytes) of the open /proc/PID/fd directory\n"
"`dir_fd`, and count each fd that refers to an object of `rows` (as maps_objects returns\n"
"them) in its row: its fds, and from the first its allocated bytes (st_blocks * 512).\n"
"Returns (unmatched, read): the entries a link read must decide (regular files that are none of `rows`, and fds the kernel\n"
"refused to stat) and how many entries were read: fewer than all when `deadline` (a\n"
"time.monotonic() value, or None) passed first; it is looked at before every 256 fds.\n"
"Fds closed since the listing are skipped. The GIL is released while the kernel works.\n\n"
"With `devices` (a set of st_dev ints; rows as maps_objects makes them with devices), the\n"
"host view: fds on none of those devices are skipped, a row's first fd also fills in its\n"
"length, mtime and ctime, and a regular file that no row has gets a row of its own\n"
"([None, None, 0, 0, fds, allocated, None, (entry, 1), False, size, mtime, ctime]);\n"
"only fds the kernel refused to stat are returned.\n\n"
"With `held` (a dict; inspect), each fd counted in a row and each regular file is also\n"
"listed by its object: held[key] is a list of (entry, st_size, st_blocks * 512).");

static PyObject *
stat_fds(PyObject *Py_UNUSED(module), PyObject *args)
{
    int dir_fd;
    PyObject *entries, *rows, *deadline_arg, *batch[BATCH], *unmatched, *devices = Py_None;
    PyObject *held = Py_None;
    double deadline = 0;
    Py_ssize_t total, first, i, n, read = 0;
    struct fd_stat *got;
    struct device_cache cache = {0, 0, 0, 0};
    unsigned int wanted;

    if (!PyArg_ParseTuple(args, "iO!O!O|OO:stat_fds", &dir_fd, &PyList_Type, &entries,
                          &PyDict_Type, &rows, &deadline_arg, &devices, &held))
        return NULL;
    if (held != Py_None && !PyDict_CheckExact(held)) {
        PyErr_SetString(PyExc_TypeError, "held must be a dict or None");
        return NULL;
    }
    if (devices != Py_None && !PyAnySet_Check(devices)) {
        PyErr_SetString(PyExc_TypeError, "devices must be a set of ints or None");
        return NULL;
    }
    wanted = (devices == Py_None ? WANTED : WANTED_HOST) | (held == Py_None ? 0 : STATX_SIZE);
    if (deadline_arg != Py_None) {
        deadline = PyFloat_AsDouble(deadline_arg);
        if (deadline == -1.0 && PyErr_Occurred())
            return NULL;
    }
    got = PyMem_Malloc(sizeof(*got) * BATCH);
    if (got == NULL)
        return PyErr_NoMemory();
    unmatched = PyList_New(0);
    if (unmatched == NULL)
        goto fail;
    /* the length is read again before each batch: the list may shrink meanwhile (another
     * thread while the GIL is released, or a key's __eq__ during a lookup) */
    for (first = 0; first < (total = PyList_GET_SIZE(entries)); first += n) {
        if (deadline_arg != Py_None && monotonic() > deadline)
            break;
        n = total - first < BATCH ? total - first : BATCH;
        /* the batch is held while the GIL is released */
        for (i = 0; i < n; i++) {
            batch[i] = PyList_GET_ITEM(entries, first + i);
            if (!PyBytes_Check(batch[i])) {
                PyErr_SetString(PyExc_TypeError, "entries must be bytes");
                while (i-- > 0)
                    Py_DECREF(batch[i]);
                goto fail;
            }
            Py_INCREF(batch[i]);
        }
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < n; i++)
            got[i].error = statx(dir_fd, PyBytes_AS_STRING(batch[i]), AT_STATX_DONT_SYNC,
                                 wanted, &got[i].st) == 0 ? 0 : errno;
        Py_END_ALLOW_THREADS
        for (i = 0; i < n; i++) {
            if (add_fd(batch[i], &got[i], rows, unmatched, devices, held, &cache) < 0) {
                for (; i < n; i++)
                    Py_DECREF(batch[i]);
                goto fail;
            }
            Py_DECREF(batch[i]);
        }
        read += n;
    }
    PyMem_Free(got);
    return Py_BuildValue("(Nn)", unmatched, read);
fail:
    PyMem_Free(got);
    Py_XDECREF(unmatched);
    return NULL;
}

static PyMethodDef methods[] = {
    {"maps_objects", maps_objects, METH_VARARGS, maps_objects_doc},
    {"stat_fd", stat_fd, METH_VARARGS, stat_fd_doc},
    {"stat_fds", stat_fds, METH_VARARGS, stat_fds_doc},
    {"pool_totals", pool_totals, METH_VARARGS, pool_totals_doc},
    {"unmeasured", unmeasured, METH_VARARGS, unmeasured_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hostpool.proc.bulkread",
    .m_doc = "The exporter's per-line, per-fd and per-object loops over /proc.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit_bulkread(void)
{
    return PyModuleDef_Init(&module);
}
