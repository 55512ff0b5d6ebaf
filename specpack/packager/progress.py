"""Progress bars for long work (hashing, copying): tqdm on stderr, off when not wanted."""

from __future__ import annotations

import contextlib
import threading


class _NullBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def byte_bar(total: int, desc: str, enabled: bool):
    """A thread-safe byte counter bar; a no-op when `enabled` is false."""
    if not enabled:
        yield _NullBar()
        return
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              leave=False) as bar:
        class _Bar:
            def update(self, n: int) -> None:
                with lock:
                    bar.update(n)

        yield _Bar()
