"""
Every file the scripts write goes through one door, so that no write can leave half a file, a file only its
owner can read, or a traceback:

    files.write_atomic(path, data)            # bytes or str, whole or not at all
    files.write_with(path, lambda tmp: ...)    # a writer that wants a file name (torch.save, savefig)

The data goes to a temporary file beside `path`, gets the mode a new file gets (0666 less the umask: 0644 as a
rule; safetensors and tempfile make 0600, which kept a shared adapter from the people it was shared with), and
only then replaces `path` (os.replace, atomic): a full disk, a denied write or a kill leaves what was there whole
and no temporary file behind. A full disk or a denied write is one ValueError line naming the file and what to do
(os_error_line; cli.run says it as `error: ...`), never a bare "[Errno 28]".

A folder a user is handed (a run folder, a model folder, an export) is data: no write follows a link planted in
it, and no read of it is unbounded:

    files.append_text(path, line)             # a log line, through an O_NOFOLLOW open of a regular file
    files.refuse_link(path) / refuse_links(paths)   # a symbolic link where a file will be written: one line
    files.read_limited(path, limit)           # a regular file's bytes, its kind and size checked first
    files.sha256_of(path)                     # a file's digest, read in blocks (a 4 GB file, not 4 GB of memory)

write_with refuses a link at `path` too (os.replace would replace the link, but a link there was planted: the
user is told, not its target written or the link silently dropped).

weights_identity names a model by the bytes of its weights (every tensor's, through the files), so that a
resumed run or a merged results table refuses other weights under the same config (same name, same shapes).
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: support.files is not a script: "
             "the scripts use it to write their files: run generate.py, train.py or a research script")

import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space, or the user's quota spent
DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _umask():
    """This process's umask (os.umask can only be read by setting it: set back at once, at import)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


NEW_FILE_MODE = 0o666 & ~_umask()  # what open(path, "w") would give a new file


# -----------------------------------------------------------------------------
# Writing


def is_temporary(name):
    """Whether a file name is one of write_with's (or write_many's) temporaries: ".NAME.XXXXXXXX.tmp", left only by a
    process killed mid-write (a folder check that refuses files it did not write lets these pass)."""
    return name.startswith(".") and name.endswith(".tmp")


def write_atomic(path, data):
    """`data` (bytes, or str written as UTF-8) at `path`, whole or not at all (write_with)."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    write_with(path, lambda tmp: Path(tmp).write_bytes(payload))


def write_with(path, writer):
    """writer(tmp) writes the file at the temporary name tmp (in path's folder); then tmp gets NEW_FILE_MODE and
    replaces path. On any failure tmp is removed and path is as it was; an OSError (or a writer's error that says
    the disk is full: safetensors' and torch's name no errno) is ValueError with one line (os_error_line)."""
    path = Path(path)
    refuse_link(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.",
                                   suffix=".tmp")
        os.close(fd)
    except OSError as e:
        raise ValueError(os_error_line(e, path, whole=True)) from None
    try:
        writer(tmp)
        os.chmod(tmp, NEW_FILE_MODE)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ValueError(os_error_line(e, path, whole=True)) from None
        if isinstance(e, Exception) and disk_full_text(e):
            raise ValueError(os_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), path, True)) from None
        raise


def write_many(paths, writer):
    """Several files that belong together (an adapter's .safetensors and its .json), each whole or not at all:
    writer(tmps) writes them at temporary names of the same file names (tmps, in the order of paths) inside a
    temporary folder beside the first; each then gets NEW_FILE_MODE and replaces its path, in order. On any failure
    before the first replace, every temporary file goes and every path is as it was; errors as write_with's."""
    import shutil

    paths = [Path(p) for p in paths]
    refuse_links(paths)
    folder = paths[0].parent if str(paths[0].parent) else Path(".")
    try:
        tmp_dir = Path(tempfile.mkdtemp(dir=folder, prefix=f".{paths[0].name}.", suffix=".tmp"))
    except OSError as e:
        raise ValueError(os_error_line(e, paths[0], whole=True)) from None
    try:
        tmps = [tmp_dir / p.name for p in paths]
        writer(tmps)
        for tmp in tmps:
            os.chmod(tmp, NEW_FILE_MODE)
        for tmp, path in zip(tmps, paths):
            os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if isinstance(e, OSError):
            raise ValueError(os_error_line(e, paths[0], whole=True)) from None
        if isinstance(e, Exception) and disk_full_text(e):
            raise ValueError(os_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), paths[0], True)) from None
        raise
    shutil.rmtree(tmp_dir, ignore_errors=True)


def append_text(path, text):
    """`text` appended to `path` (a log: made if missing, with the mode a new file gets) through an O_NOFOLLOW,
    non-blocking open: a symbolic link there (dangling or not) is refused (refuse_link's line), and so is anything
    but a regular file (a named pipe would block the run). Errors as one ValueError line (os_error_line)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):  # O_NOFOLLOW: the last name is a link
            refuse_link(path)
        if e.errno == errno.ENXIO:  # a named pipe no process reads
            raise ValueError(not_a_file_line(path, "a named pipe")) from None
        raise ValueError(os_error_line(e, path)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(not_a_file_line(path, kind_of(path)))
        payload = text.encode("utf-8")
        while payload:  # os.write may write part of it (a full disk raises)
            payload = payload[os.write(fd, payload):]
    except OSError as e:
        raise ValueError(os_error_line(e, path)) from None
    finally:
        os.close(fd)


def refuse_link(path, flag=None):
    """ValueError naming `path` when it is a symbolic link (dangling or not): a file written or appended there would
    land wherever the link points, outside the folder the user named (a handed folder may hold one)."""
    if os.path.islink(path):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        who = f"{flag} " if flag else ""
        raise ValueError(f"{who}{path} is a symbolic link{target}: nothing is written through a link this run did not "
                         f"make; remove the link, or pass another folder")


def refuse_links(paths, flag=None):
    """refuse_link for each of `paths`: the first link is named."""
    for p in paths:
        refuse_link(p, flag)


def not_a_file_line(path, kind):
    return f"{path} is {kind}, not a regular file: move it away, or pass another folder"


def disk_full_text(e):
    """Whether an exception without an errno says the disk is full (safetensors: "No space left on device (os
    error 28)"; torch: "file write failed")."""
    text = str(e)
    return "No space left" in text or "os error 28" in text or "file write failed" in text


def os_error_line(e, path=None, whole=False):
    """One line for an OSError, naming the file and what to do: a full disk and a denied write said in words,
    anything else with its own reason (strerror) and the file. whole: the write was atomic (write_with), so what
    was there before is unchanged, and the line says so."""
    where = path if path is not None else getattr(e, "filename", None)  # the file meant, not a temporary name
    where = f" {where}" if where is not None else ""
    if e.errno in FULL:
        kept = "; what was there before is unchanged" if whole else ""
        return (f"cannot write{where}: No space left on device (the disk is full): free some space, or write to "
                f"another folder, then run the same command again{kept}")
    if e.errno in DENIED:
        why = "the file system is read-only" if e.errno == errno.EROFS else "permission denied"
        if whole:  # write_with: a write
            return f"cannot write{where}: {why}: pass a folder you can write to; what was there before is unchanged"
        return f"cannot access{where}: {why}: use a file or folder you may read (and, for an output, write)"
    reason = e.strerror or " ".join(str(e).split()) or type(e).__name__
    return f"{reason}:{where}" if where else reason


# -----------------------------------------------------------------------------
# What a file is, said in words


def kind_of(path):
    """What is at `path`, in words, for a message: "missing", "a folder", "a file", "a symlink loop",
    "a broken symlink", "a device", "a named pipe", "a socket", or "unreadable (REASON)"."""
    import stat

    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if e.errno == errno.ENOENT:
            return "a broken symlink" if os.path.islink(p) else "missing"
        if e.errno == errno.ENOTDIR:
            return "missing"
        return f"unreadable ({e.strerror})"
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


# -----------------------------------------------------------------------------
# Bounded reads: a file's kind and size checked before it is read


def read_limited(path, limit, flag=None, follow=True):
    """The bytes of the regular file at `path`, at most `limit` of them; one ValueError line naming it (and flag)
    for anything else: a named pipe, device, socket or folder (seen by fstat on a non-blocking open, so a pipe
    cannot hang the read, and a device such as /dev/zero is never read), or more than `limit` bytes (said from
    its size before reading; the read stops at limit + 1 bytes, so a file that grows meanwhile is refused too).
    follow=False: a symbolic link at `path` is refused as well (O_NOFOLLOW; a lock file is only ever ours)."""
    who = f"{flag} " if flag else ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        if not follow and (e.errno == errno.ELOOP or os.path.islink(path)):
            raise ValueError(f"{who}{path} is a symbolic link, not a file this project wrote: remove it") from None
        raise ValueError(f"{who}{os_error_line(e, path)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{who}{not_a_file_line(path, kind_of(path))}")
        if st.st_size > limit:
            raise ValueError(f"{who}{path} is {st.st_size} bytes, more than the {limit} such a file can be: "
                             f"not read; pass the right file")
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:
            raise ValueError(f"{who}{path} grew past {limit} bytes while it was read: not read; pass the right file")
        return b"".join(chunks)
    except OSError as e:
        raise ValueError(f"{who}{os_error_line(e, path)}") from None
    finally:
        os.close(fd)


def check_regular(path, flag=None):
    """ValueError (one line) unless `path` is a regular file (after links): a named pipe given as a checkpoint or
    a weights file would block its reader forever."""
    kind = kind_of(path)
    if kind != "a file":
        raise ValueError(f"{flag + ' ' if flag else ''}{not_a_file_line(path, kind)}")


def sha256_of(path, flag=None):
    """The sha256 (hex) of a regular file's bytes, read in blocks: a 4 GB file costs a block of memory, not 4 GB."""
    check_regular(path, flag)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -----------------------------------------------------------------------------
# The identity of a model's weights


CACHE_NAME = ".weights-id.json"  # beside the run (its --out): the digest of each model folder it read, by stat
CACHE_LIMIT = 1 << 20  # bytes: a few hundred model folders' entries; a larger one is made again


def weight_files(folder):
    """The files that hold a model folder's weights and config: config.json and every *.safetensors."""
    folder = Path(folder)
    return [folder / "config.json"] + sorted(folder.glob("*.safetensors"))


def weights_identity(folder, cache_dir=None):
    """A digest (16 hex) of every byte of the model's weights and config (config.json and each *.safetensors, by
    name): another folder of the same config with one tensor changed anywhere gets another identity; a copy of the
    same files, the same one. Hashing reads every byte (~1 s a GB), so a run keeps it beside itself (keep_identity:
    cache_dir/.weights-id.json, with each file's size, modification time and inode) once its checks have passed, and
    it is read back from there while those are unchanged. cache_dir None: no cache read."""
    folder = Path(folder).resolve()
    entry = read_cache(Path(cache_dir) / CACHE_NAME if cache_dir is not None else None).get(str(folder))
    if isinstance(entry, dict) and entry.get("files") == file_stats(folder) and isinstance(entry.get("id"), str):
        return entry["id"]
    h = hashlib.sha256()
    for f in weight_files(folder):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:16]


def file_identity(path):
    """A digest (16 hex) of every byte of one file (an adapter's .safetensors): the key a result is made by."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()[:16]


def keep_identity(folder, cache_dir, identity):
    """weights_identity's answer kept in cache_dir/.weights-id.json for the next run on that folder (a cache: one
    that cannot be written is left out, and the next run hashes again)."""
    folder, cache = Path(folder).resolve(), Path(cache_dir) / CACHE_NAME
    known = read_cache(cache)
    entry = dict(files=file_stats(folder), id=identity)
    if known.get(str(folder)) == entry:
        return
    known[str(folder)] = entry
    try:
        write_atomic(cache, json.dumps(known, indent=1) + "\n")
    except ValueError:
        pass


def file_stats(folder):
    """{file name: [size, modification time (ns), inode]} of a model folder's weight_files: the cache's key."""
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino] for f in weight_files(folder)}


def read_cache(path):
    """The identity cache's dict, or {} (none, or unreadable: it is made again)."""
    if path is None or not path.is_file():
        return {}
    try:
        known = json.loads(read_limited(path, CACHE_LIMIT))
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
