"""Hashing each byte once: files are hashed while copied, or read once after a hard link."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

CHUNK = 8 << 20


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def place_file(src: Path, dst: Path, progress: Callable[[int], None] | None = None,
               link: bool = True) -> str:
    """Put `src` at `dst` (hard link when possible, else copy) and return its SHA-256."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src.resolve(), dst)
            return sha256_file(dst, progress)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
    return _copy_hashing(src, dst, progress)


def _copy_hashing(src: Path, dst: Path, progress) -> str:
    h = hashlib.sha256()
    with open(src, "rb", buffering=0) as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            h.update(chunk)
            fout.write(chunk)
            if progress:
                progress(len(chunk))
    shutil.copystat(src, dst)
    return h.hexdigest()


def parallel_map(fn, items: Iterable, workers: int | None = None) -> list:
    """`fn` over `items` on threads: hashlib and file I/O release the GIL."""
    items = list(items)
    workers = workers or min(4, os.cpu_count() or 1, max(1, len(items)))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))
