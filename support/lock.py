"""
One writer per output folder: a lock file holding the process id, which a killed run does not leave
stuck. The scripts take it through cli.claim_folder; weights/prepare.py, which cli.py itself calls to
prepare the default model, takes it from here, so the imports run one way.
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: support.lock is not a script: "
             "the scripts lock their output folders with it: run generate.py, train.py or a research script")

import atexit
import os
import time
from pathlib import Path

from support import files

LOCK_LIMIT = 64  # bytes: a process id is at most 7 digits; a lock file larger than this is none of ours


def claim_folder(flag, path, wait=0.0, say=None):
    """One writer per output folder: PATH/.lock holds this process's id, made atomically. A live process's lock
    is refused in one line (or, with wait > 0, waited for that many seconds first, said once through say); a
    dead one's (a run that was killed) is replaced, so nothing stays stuck. The lock goes with release_folders()
    (run() calls it when the script's work ends), release_folder(path), or when this process ends."""
    lock, me = Path(path) / ".lock", str(os.getpid())
    deadline, stale, said = time.monotonic() + wait, 0, False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = holder_of(flag, path, lock)
            if holder == me:
                return
            if holder.isdigit() and alive(int(holder)):
                if time.monotonic() < deadline:
                    if say and not said:
                        say(f"waiting for process {holder}, which is writing into {path}")
                        said = True
                    time.sleep(0.2)
                    continue
                other = f", or pass another {flag}" if flag.startswith("--") else ""
                raise ValueError(f"{flag} {path}: another run (process {holder}) is writing into this folder: "
                                 f"wait for it to end{other}") from None
            stale += 1
            if stale > 3:
                raise ValueError(f"{flag} {path}: could not take {lock}: remove it if no run is writing there")
            lock.unlink(missing_ok=True)  # left by a run that was killed
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        HELD.append(lock)
        return


HELD = []  # the locks this process holds


def release_folder(path):
    """Remove this process's lock on PATH alone (one it held for a moment, as weights/prepare.py its cache); a lock
    file another process has since taken is left alone."""
    lock = Path(path) / ".lock"
    if lock in HELD:
        HELD.remove(lock)
        try:
            mine = holder_of("", path, lock) == str(os.getpid())
        except ValueError:  # replaced by something that is no lock: not ours to remove
            mine = False
        if mine:
            lock.unlink(missing_ok=True)


def holder_of(flag, path, lock):
    """The process id a lock file holds, as text ("" once it is gone). Read as a handed folder's file is: a
    regular file of at most LOCK_LIMIT bytes, opened without following a link and without blocking (fstat, then
    read), so a named pipe (which blocked forever), a link to /dev/zero (read until memory ran out) or a huge file
    is refused in one line naming it."""
    if not os.path.lexists(lock):
        return ""
    try:
        return files.read_limited(lock, LOCK_LIMIT, follow=False).decode("utf-8", "replace").strip()
    except ValueError as e:
        if not os.path.lexists(lock):  # removed meanwhile (its run ended)
            return ""
        raise ValueError(f"{flag} {path}: cannot take its lock: {e}".lstrip(" ")) from None


@atexit.register
def release_folders():
    """Remove every lock this process holds."""
    for lock in list(HELD):
        release_folder(lock.parent)


def alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: no signal, only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
