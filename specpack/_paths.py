"""Walking input directories safely: relative POSIX paths only, no escaping links."""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from specpack.errors import InputError

IGNORED_NAMES = {".git", ".gitattributes", ".gitignore", ".github", ".cache", ".DS_Store",
                 ".huggingface"}


def check_relpath(rel: str, where: str) -> str:
    """Return `rel` if it is a plain relative POSIX path inside its root, else raise."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel or not p.parts:
        raise InputError(f"{where}: path '{rel}' escapes its directory or is not a relative POSIX path",
                         hint="file names in model directories must be plain relative paths")
    return p.as_posix()


def _hf_cache_root(root: Path) -> Path | None:
    """`<repo>` when `root` is `<repo>/snapshots/<rev>` of a Hugging Face cache, or a folder inside it (a
    release's `dspark/`), else None."""
    for snapshot in (root, *root.parents):
        if snapshot.parent.name == "snapshots" and snapshot.parent.parent.name.startswith("models--"):
            return snapshot.parent.parent
    return None


def _link_target_ok(link: Path, root: Path) -> bool:
    target = link.resolve()
    allowed = [root.resolve()]
    cache = _hf_cache_root(root)
    if cache is not None:
        allowed.append((cache / "blobs").resolve())
    return target.is_file() and any(target.is_relative_to(a) for a in allowed)


def walk_files(root: Path) -> list[str]:
    """Every regular file under `root` as sorted relative POSIX paths.

    Symlinks are followed only when they stay inside `root` (or inside the blobs of the Hugging
    Face cache repo that holds `root`); any other link is an error, listed with the rest.
    """
    root = Path(root)
    files, problems = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_NAMES)
        for name in sorted(filenames):
            if name in IGNORED_NAMES:
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() and not _link_target_ok(path, root):
                problems.append(f"{rel} -> {os.readlink(path)} points outside {root}")
            elif path.is_file():
                files.append(rel)
            else:
                problems.append(f"{rel} is not a regular file")
    if problems:
        raise InputError(f"{root}: unsafe entries", problems=problems,
                         hint="replace links that leave the directory with the files themselves")
    return files


def others_can_write(paths) -> list[str]:
    """Each of `paths` (and every directory above it, up to /) that someone other than this user or root
    owns or may write: a file there could be swapped for another between a check and its use, as
    sshd's StrictModes refuses. A sticky directory owned by this user or root (/tmp) only lets each
    user replace their own entries, so it passes."""
    me, seen, problems = os.geteuid(), set(), []
    for path in paths:
        for p in [Path(path), *Path(path).parents]:
            if p in seen:
                continue
            seen.add(p)
            st = os.stat(p)
            sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
            if st.st_uid not in (me, 0):
                problems.append(f"{p}: owned by uid {st.st_uid}, not this user ({me}) or root")
            elif st.st_mode & 0o022 and not sticky:
                who = " and ".join(w for w, bit in (("its group", 0o020), ("everyone", 0o002)) if st.st_mode & bit)
                problems.append(f"{p}: writable by {who} (mode {stat.S_IMODE(st.st_mode):o})")
    return problems
