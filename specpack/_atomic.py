"""Atomic writes: new outputs are built in a hidden sibling and renamed into place; in-place changes
are journaled transactions. What a killed process leaves behind is cleaned up by the next run.

Every hidden name carries the PID of the process that made it:

    .NAME.PID.XXXXXXXX.partial   an output being built or downloaded (`staging_dir`)
    .NAME.old-PID                the output it replaces, for a moment (`staging_dir --force`)
    .NAME.PID.update             an in-place change of NAME: staged files, a journal, the files it
                                 replaced (`Transaction`)

`clean_stale(NAME)` removes the partials whose process is gone (`os.kill(pid, 0)` fails), puts a
moved-aside output back when nothing replaced it, and rolls an interrupted update back; it never
touches one whose process is alive, nor names it did not make.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from specpack.errors import OutputError

log = logging.getLogger(__name__)

JOURNAL = "journal.json"
DONE = "done"


def umask_mode(base: int = 0o666) -> int:
    """`base` as the process umask leaves it: the mode any new file (0o666) or directory (0o777) gets."""
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, with the mode the umask gives any other file (save_file writes 0600, which a
    service account or a container running as another user cannot read)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    Path(path).chmod(umask_mode())


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (one we may not signal counts as alive)."""
    if pid <= 0:
        return True  # not a PID we wrote: never treat it as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _leftovers(out: Path) -> list[tuple[Path, str, int]]:
    """(path, kind, pid) of every hidden name beside `out` that specpack made for it."""
    name = re.escape(out.name)
    patterns = {"partial": rf"\.{name}\.(\d+)\.[A-Za-z0-9_]+\.partial", "old": rf"\.{name}\.old-(\d+)",
                "update": rf"\.{name}\.(\d+)\.update"}
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(out.parent):
            for kind, pattern in patterns.items():
                m = re.fullmatch(pattern, entry.name)
                if m:
                    found.append((Path(entry.path), kind, int(m.group(1))))
    return sorted(found)


def interrupted_updates(out: Path) -> list[str]:
    """Names of in-place changes of `out` whose process died before finishing them."""
    return [path.name for path, kind, pid in _leftovers(Path(out).absolute())
            if kind == "update" and not pid_alive(pid)]


def clean_stale(out: Path) -> None:
    """Remove or roll back what dead processes left beside `out` (see the module docstring).
    An update of `out` by a live process is an OutputError: two writers would corrupt it."""
    out = Path(out).absolute()
    for path, kind, pid in _leftovers(out):
        if pid_alive(pid):
            if kind == "update":
                raise OutputError(f"'{out}' is being changed by process {pid} ({path.name})",
                                  hint="wait for that command to finish; if it was killed, run again")
            continue
        if kind == "partial":
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed stale partial output %s (process %d is gone)", path.name, pid)
        elif kind == "old":
            _clean_old(out, path, pid)
        else:
            _roll_back(out, path)
            log.warning("rolled back the interrupted change of %s in %s (process %d is gone)", out.name,
                        path.name, pid)


def _clean_old(out: Path, old: Path, pid: int) -> None:
    if os.path.lexists(out):
        _remove(old)
        log.warning("removed stale replaced output %s (process %d is gone)", old.name, pid)
    else:  # killed between moving the old output aside and renaming the new one in
        os.rename(old, out)
        log.warning("restored %s from %s (process %d is gone)", out.name, old.name, pid)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextlib.contextmanager
def staging_dir(out: Path, force: bool = False):
    """Yield a fresh temp dir next to `out`; on success it becomes `out`, on any failure
    (Ctrl-C included) it is removed and `out` is left as it was. `out` may not be a symbolic link:
    replacing the link would leave the data where it points, replacing that would surprise."""
    out = Path(out)
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale(out)  # first: it may put back an output a dead process had moved aside
        _check_output(out, force)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise OutputError(f"cannot write to '{parent}': {exc.strerror}",
                          hint="choose a writable location") from None
    try:
        tmp.chmod(umask_mode(0o777))  # mkdtemp makes it private; the result is an ordinary directory
        yield tmp
        _replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _os_error(exc, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_output(out: Path, force: bool) -> None:
    if out.is_symlink():
        raise OutputError(f"output '{out}' is a symbolic link (to {os.readlink(out)}); specpack does not "
                          "write through or replace links",
                          hint=f"pass the directory itself ({out.resolve()}), or remove the link")
    if out.exists() and not force:
        raise OutputError(f"output '{out}' already exists", hint="choose another path or pass --force")


def _os_error(exc: OSError, out: Path) -> Exception:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing '{out}'",
                           hint="free space or choose another location; nothing was written")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write '{out}': {exc.strerror}", hint="choose a writable location")
    return exc


def _replace(tmp: Path, out: Path) -> None:
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    trash = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, trash)
    os.rename(tmp, out)
    _remove(trash)


# ---- in-place transactions ----

class Transaction:
    """Replace (or delete) paths inside the directory `root` all together, or not at all.

    `stage(rel)` returns where the new content of `rel` goes (a file or a directory to fill);
    `delete(rel)` removes it. `commit()` writes a journal, then for each path in order moves the old
    one aside and the new one in, then marks the journal done. An error or Ctrl-C during the commit
    rolls back at once; a killed process is rolled back by the next `clean_stale(root)`. Use it
    through `transaction(root)`."""

    def __init__(self, root: Path):
        self.root = Path(root).absolute()
        self.dir = self.root.with_name(f".{self.root.name}.{os.getpid()}.update")
        self.units: dict[str, bool] = {}  # rel -> delete
        self.pending = False  # the journal is written and the change neither done nor undone
        self.dir.mkdir()

    def stage(self, rel: str) -> Path:
        self.units[rel] = False
        path = self.dir / "new" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def delete(self, rel: str) -> None:
        self.units[rel] = True

    def staged(self, rel: str) -> Path:
        return self.dir / "new" / rel

    def commit(self) -> None:
        missing = [rel for rel, delete in self.units.items() if not delete and not os.path.lexists(self.staged(rel))]
        if missing:
            raise RuntimeError(f"staged paths were never written: {missing}")  # a bug in the caller
        _write_atomic(self.dir / JOURNAL, json.dumps({"units": list(self.units.items())}))
        self.pending = True
        try:
            for rel, delete in self.units.items():
                _swap_in(self.root, self.dir, rel, delete)
            _write_atomic(self.dir / DONE, "")
        except BaseException:
            _undo_all(self.root, self.dir)  # if this fails too, the next run finishes it
            self.pending = False
            raise
        self.pending = False

    def close(self) -> None:
        """Remove the staging dir (with the replaced files), unless a change in it is half done."""
        if not self.pending:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def transaction(root: Path):
    """A `Transaction` on `root`, committed when the block ends without an error. Stale ones of dead
    processes are rolled back first; a live one is an OutputError."""
    clean_stale(Path(root))
    try:
        txn = Transaction(root)
    except FileExistsError:
        raise OutputError(f"'{root}' is already being changed by this process") from None
    except OSError as exc:
        raise _os_error(exc, Path(root)) from None
    try:
        yield txn
        txn.commit()
    except OSError as exc:
        raise _os_error(exc, Path(root)) from None
    finally:
        txn.close()


def _swap_in(root: Path, txn: Path, rel: str, delete: bool) -> None:
    cur, old, new = root / rel, txn / "old" / rel, txn / "new" / rel
    if os.path.lexists(cur):
        old.parent.mkdir(parents=True, exist_ok=True)
        os.rename(cur, old)
    if delete:
        _prune_empty(root, cur.parent)
    else:
        cur.parent.mkdir(parents=True, exist_ok=True)
        os.rename(new, cur)


def _undo_all(root: Path, txn: Path) -> None:
    """Put back every path of the journal in `txn` (each step is a rename, so this can be re-run
    after being interrupted itself)."""
    units = json.loads((txn / JOURNAL).read_text())["units"]
    for rel, delete in reversed(units):
        cur, old, new = root / rel, txn / "old" / rel, txn / "new" / rel
        if not delete and not os.path.lexists(new) and os.path.lexists(cur):
            new.parent.mkdir(parents=True, exist_ok=True)
            os.rename(cur, new)  # the new one was in place: take it out again
        if os.path.lexists(old):
            cur.parent.mkdir(parents=True, exist_ok=True)
            os.rename(old, cur)
        _prune_empty(root, cur.parent)


def _roll_back(root: Path, txn: Path) -> None:
    """Finish a dead process's transaction: undo it unless it was done (or its directory is gone),
    then drop its dir."""
    if root.is_dir() and (txn / JOURNAL).exists() and not (txn / DONE).exists():
        _undo_all(root, txn)
    shutil.rmtree(txn)


def _prune_empty(root: Path, folder: Path) -> None:
    """Remove `folder` and its parents below `root` while they are empty (an artifact holds none)."""
    while folder != root and folder.is_relative_to(root):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
