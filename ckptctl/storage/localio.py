"""Local files at the speed of the disk: in-kernel copies, early write-back, and the
syncs that make files and folders durable. Used by every writer of local files (promote's
transfers, consolidate's outputs, the small-file batches of a local store).

>>> import os, tempfile
>>> a, b = tempfile.TemporaryFile(), tempfile.TemporaryFile()
>>> _ = a.write(b"abcdef"); a.flush()
>>> kernel_copy(a.fileno(), b.fileno(), 0, 6), start_writeback(b.fileno(), 0, 6)
(6, True)
"""
from __future__ import annotations

import errno
import os
from typing import Sequence

#: ``sync_file_range`` flag: start write-out of the range's dirty pages, do not wait.
_SYNC_FILE_RANGE_WRITE = 2
_libc_fns: dict[str, object] = {}


def _libc(name: str, *argtypes, restype=None):
    """libc's function ``name`` with ``argtypes`` (made once; ``restype`` where it
    returns other than an int), or None where there is none."""
    if name not in _libc_fns:
        import ctypes

        try:
            fn = getattr(ctypes.CDLL(None, use_errno=True), name)
            fn.argtypes = list(argtypes)
            if restype is not None:
                fn.restype = restype
        except (OSError, AttributeError):
            fn = None
        _libc_fns[name] = fn
    return _libc_fns[name]


def _errno_error(path: str) -> OSError:
    import ctypes

    n = ctypes.get_errno()
    return OSError(n, os.strerror(n), path)


def kernel_copy(src_fd: int, dst_fd: int, offset: int, n: int, dst_offset: int | None = None) -> int:
    """Copy ``n`` bytes at ``offset`` of ``src_fd`` to ``dst_offset`` (default the same)
    of ``dst_fd`` in the kernel (``copy_file_range``; ``pread``/``pwrite`` where the
    filesystems cannot); returns the bytes copied (fewer: the source ended).

    >>> import os, tempfile
    >>> a, b = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    >>> _ = a.write(b"abcdef"); a.flush()
    >>> kernel_copy(a.fileno(), b.fileno(), 2, 10), os.pread(b.fileno(), 9, 0)
    (4, b'\\x00\\x00cdef')
    """
    dst_offset = offset if dst_offset is None else dst_offset
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < n:
        if use_kernel:
            try:
                got = os.copy_file_range(src_fd, dst_fd, min(n - done, 1 << 30),
                                         offset + done, dst_offset + done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_kernel = False
                continue
        else:
            data = os.pread(src_fd, min(n - done, 8 << 20), offset + done)
            got = len(data)
            view = memoryview(data)
            while view:
                view = view[os.pwrite(dst_fd, view, dst_offset + done + got - len(view)):]
        if got == 0:
            break
        done += got
    return done


#: O_DIRECT wants the buffer's address, the file offset and the length aligned to the
#: device's logical block size: 4 KiB covers every block size in use
DIRECT_ALIGN = 4096
#: file systems (``st_dev``) that refused O_DIRECT (tmpfs, older ZFS): buffered from then on
_no_direct: set[int] = set()


def aligned_buffer(n: int):
    """A writable buffer of ``n`` bytes at a page-aligned address (an anonymous map: the
    kernel hands out zeroed pages as they are first written, with no ``memset`` pass the
    way ``bytearray(n)`` makes one), fit for :func:`write_at`'s O_DIRECT writes.

    >>> b = aligned_buffer(8192); memoryview(b)[:3] = b"abc"; b[:4] == b"abc" + bytes(1)
    True
    """
    import mmap

    return mmap.mmap(-1, max(n, 1))


def _address(mv: memoryview) -> int | None:
    import ctypes

    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):  # read-only (bytes) or empty
        return None


def write_at(path: str, data, offset: int) -> None:
    """Write ``data`` at ``offset`` of the existing file ``path``. The aligned bulk goes
    with O_DIRECT, straight from ``data`` to the disk, past the page cache (an aligned
    address, offset and length: :func:`aligned_buffer`'s parts at part-size offsets);
    the rest (a file's last bytes, or all of an unaligned write) through the page cache.
    A download never reads what it wrote back (it hashed the parts as they arrived), so
    filling the page cache with it only costs: on this kind of VM the same 2 GiB
    ``pwrite`` from a hot buffer took 0.4-5.6 s through the page cache (fresh pages the
    host must back) and 0.7-0.8 s with O_DIRECT. Durability still comes from the fsync of
    the whole file (O_DIRECT does not make the file's size and extents durable). A file
    system that refuses O_DIRECT (tmpfs) is written through the page cache.

    >>> import tempfile
    >>> f = tempfile.NamedTemporaryFile(); b = aligned_buffer(8195)
    >>> memoryview(b)[:] = b"x" * 8195; write_at(f.name, b, 0)  # 8,192 direct, 3 buffered
    >>> os.path.getsize(f.name), open(f.name, "rb").read() == b"x" * 8195
    (8195, True)
    """
    mv = memoryview(data).cast("B")
    n, done = mv.nbytes, 0
    bulk = n - n % DIRECT_ALIGN
    address = _address(mv) if bulk and offset % DIRECT_ALIGN == 0 else None
    if address is not None and address % DIRECT_ALIGN == 0:
        done = _write_direct(path, mv[:bulk], offset)
    if done < n:
        fd = os.open(path, os.O_WRONLY)
        try:
            while done < n:
                done += os.pwrite(fd, mv[done:], offset + done)
        finally:
            os.close(fd)


def _write_direct(path: str, mv: memoryview, offset: int) -> int:
    """Bytes of ``mv`` written at ``offset`` with O_DIRECT (0 where the file system
    refuses it; raises other errors, a full disk among them)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return 0
    if _no_direct and os.stat(path).st_dev in _no_direct:
        return 0
    try:
        fd = os.open(path, os.O_WRONLY | flag)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _no_direct.add(os.stat(path).st_dev)  # tmpfs: no O_DIRECT open, not asked again
        return 0
    done = 0
    try:
        dev = os.fstat(fd).st_dev
        while done < mv.nbytes:
            try:
                got = os.pwrite(fd, mv[done:], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _no_direct.add(dev)  # alignment this device will not take: buffered
                return done
            done += got
            if got % DIRECT_ALIGN:
                break  # a short write left the rest unaligned: through the page cache
    finally:
        os.close(fd)
    return done


#: reads this large or larger into an aligned buffer are worth asking where the bytes are
DIRECT_READ_MIN = 1 << 20


def read_at(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from byte ``offset`` of the open file ``fd``; the bytes read (fewer:
    the file ended). Where fewer than half of the range's
    pages are in the page cache (a cold source) and the read is large and aligned (an
    :func:`aligned_buffer`'s part at a part-size offset), the aligned bulk is read with
    O_DIRECT, straight from the disk into ``buf``: on this kind of VM a fresh page-cache
    page is one the host must back first (2 GiB cold, 4 readers, into buffers written
    with O_DIRECT: 1.86 s and 0.15 sys s read with O_DIRECT, 2.0-2.7 s and 0.6-1.6 sys s
    through the page cache). A warm range is read from the page cache as always.

    >>> import tempfile
    >>> f = tempfile.NamedTemporaryFile(); _ = f.write(b"abcdef"); f.flush()
    >>> b = memoryview(bytearray(4)); read_at(f.fileno(), b, 2), bytes(b)
    (4, b'cdef')
    """
    buf = buf.cast("B")
    n = 0
    address = _address(buf) if len(buf) >= DIRECT_READ_MIN else None
    if address is not None and address % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0:
        share = _cached_share(fd, offset, len(buf))
        if share is not None and share < 0.5:
            n = _read_direct(fd, buf[:len(buf) - len(buf) % DIRECT_ALIGN], offset)
    while n < len(buf):
        k = os.preadv(fd, [buf[n:]], offset + n)
        if k == 0:
            break
        n += k
    return n


def _cached_share(fd: int, offset: int, n: int) -> float | None:
    """The share of the pages of ``[offset, offset + n)`` of ``fd`` in the page cache
    (``mincore`` of a mapping nothing touches), or None where that cannot be asked."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    map_ = _libc("mmap", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                 ctypes.c_int, ctypes.c_long, restype=ctypes.c_void_p)
    mincore = _libc("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    unmap = _libc("munmap", ctypes.c_void_p, ctypes.c_size_t)
    if map_ is None or mincore is None or unmap is None or n <= 0:
        return None
    start = offset - offset % page
    length = offset + n - start
    addr = map_(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = (length + page - 1) // page
        vec = ctypes.create_string_buffer(pages)
        if mincore(addr, length, vec) != 0:
            return None
        return (pages - vec.raw.count(0)) / pages  # bit 0 of each byte: resident
    finally:
        unmap(addr, length)


def _read_direct(src_fd: int, mv: memoryview, offset: int) -> int:
    """Bytes of ``mv`` filled from ``offset`` of the open file ``src_fd`` with O_DIRECT
    (0 where the file system refuses it or there is no ``/proc``; fewer where the file
    ends). The O_DIRECT descriptor is a new open of ``src_fd``'s own inode (through
    ``/proc/self/fd``), never of its path: a file renamed over it meanwhile is not read,
    and the caller's descriptor keeps its flags for the readers sharing it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not mv.nbytes:
        return 0
    dev = os.fstat(src_fd).st_dev
    if dev in _no_direct:
        return 0
    try:
        fd = os.open(f"/proc/self/fd/{src_fd}", os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return 0
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _no_direct.add(dev)
        return 0
    done = 0
    try:
        while done < mv.nbytes:
            try:
                got = os.preadv(fd, [mv[done:]], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _no_direct.add(dev)
                return done
            done += got
            if got == 0 or got % DIRECT_ALIGN:
                break  # the file ended (or a short read left the rest unaligned)
    finally:
        os.close(fd)
    return done


#: ``statfs`` ``f_type`` of ext2/3/4: their ``copy_file_range`` is a byte copy through
#: the page cache (no reflink, no server-side copy) and they take O_DIRECT
_EXT_MAGIC = 0xEF53


def copies_through_memory(path: str) -> bool:
    """True where a local copy onto ``path`` (a file or folder, or the nearest existing
    folder above it) is faster read into memory and written with O_DIRECT than copied in
    the kernel: ext2/3/4. On this kind of VM a fresh page-cache page is one the host must
    back first, and ``copy_file_range`` fills the destination's (2 GiB, buffered read +
    O_DIRECT write 0.9-1.6 s and 0.3 sys s; ``copy_file_range`` 1.2-2.3 s and 0.8-1.8 sys
    s; ``cp`` 2.9-5.7 s). Elsewhere the kernel copy stays: XFS and btrfs reflink it,
    NFS copies on the server, tmpfs has no O_DIRECT. False where ``statfs`` is missing.

    >>> import tempfile; isinstance(copies_through_memory(tempfile.gettempdir()), bool)
    True
    """
    import ctypes

    fn = _libc("statfs", ctypes.c_char_p, ctypes.c_void_p)
    if fn is None or not getattr(os, "O_DIRECT", 0):
        return False
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on Linux
    if fn(os.fsencode(path or "."), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value == _EXT_MAGIC


def start_writeback(fd: int, offset: int, n: int) -> bool:
    """Start writing ``n`` bytes at ``offset`` of ``fd`` back to the disk now, without
    waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; Linux). Left alone, the kernel
    holds a copy's dirty pages until its background threshold (10% of RAM) or the final
    fsync, which then waits for all of them at once: started part by part, the write-back
    runs while the next part is still being read, and the page cache holds little dirty
    data (consolidate of 2.5 GB: at most 266 MiB dirty instead of 2,272 MiB, which on a
    training node stalls every other writer). Durability still comes from the fsync;
    this is only when the writes begin. False where the call does not exist or fails
    (nothing to report: the fsync that follows reports any error).

    >>> import tempfile
    >>> f = tempfile.TemporaryFile(); _ = f.write(b"x"); f.flush()
    >>> start_writeback(f.fileno(), 0, 1)
    True
    """
    import ctypes

    fn = _libc("sync_file_range", ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
               ctypes.c_uint)
    return fn is not None and fn(fd, offset, n, _SYNC_FILE_RANGE_WRITE) == 0


def sync_files(paths: Sequence[str]) -> None:
    """Make the bytes of the local files ``paths`` durable: one ``syncfs`` of each file
    system they are on (Linux), which writes them all back at once, else an fsync of each.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp(), "x"); _ = p.write_bytes(b"1"); sync_files([str(p)])
    """
    import ctypes

    syncfs = _libc("syncfs", ctypes.c_int)
    if syncfs is None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return
    done: set[int] = set()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            dev = os.fstat(fd).st_dev
            if dev not in done:
                if syncfs(fd) != 0:
                    raise _errno_error(p)
                done.add(dev)
        finally:
            os.close(fd)


def sync_dir(folder: str) -> None:
    """Make a folder's entries (files created, renamed or removed in it) durable. A file
    system that cannot fsync a folder (EINVAL) has nothing more to offer: not an error.

    >>> import tempfile; sync_dir(tempfile.mkdtemp())
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
