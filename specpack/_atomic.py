"""Atomic output directories: build in a temporary sibling, rename into place at the end."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from specpack.errors import OutputError


@contextlib.contextmanager
def staging_dir(out: Path, force: bool = False):
    """Yield a fresh temp dir next to `out`; on success it becomes `out`, on any failure
    (Ctrl-C included) it is removed and `out` is left as it was."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"output '{out}' already exists", hint="choose another path or pass --force")
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise OutputError(f"cannot write to '{parent}': {exc.strerror}",
                          hint="choose a writable location") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
        yield tmp
        _replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"disk full while writing '{out}'",
                              hint="free space or choose another location; nothing was written") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise OutputError(f"cannot write '{out}': {exc.strerror}",
                              hint="choose a writable location") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, out: Path) -> None:
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        return
    trash = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, trash)
    os.rename(tmp, out)
    shutil.rmtree(trash) if trash.is_dir() else trash.unlink()
