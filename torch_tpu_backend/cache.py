"""The on-disk compile cache: compiled graphs keyed by graph, shapes, configuration and compiler version.

An entry is a pickle behind a header holding its SHA-256; an entry that fails the check, does not unpickle,
or holds another object than the caller expects (`expect=`) is treated as absent (deleted and rebuilt),
never as an error. A cache directory that cannot be written (a file, a read-only folder) warns once and the
compiler runs without the cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("ctpu.cache")
_MAGIC = b"CTPUCACHE1\n"
_PACKAGES = ("device_sim", "fx_passes", "codegen", "ptx_kernels", "torch_tpu_backend")
_unusable: set[Path] = set()  # directories already reported as unusable (warned once each)
_unusable_lock = threading.Lock()


def cache_dir() -> Path | None:
    """$CTPU_CACHE_DIR, else ~/.cache/ctpu; CTPU_CACHE=0 disables the cache."""
    if os.environ.get("CTPU_CACHE", "1") == "0":
        return None
    return Path(os.environ.get("CTPU_CACHE_DIR") or Path.home() / ".cache" / "ctpu")


@functools.cache
def compiler_version() -> str:
    """A hash of the compiler's own sources: any change to them invalidates every entry."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def make_key(*parts: Any) -> str:
    h = hashlib.sha256(compiler_version().encode())
    for part in parts:
        h.update(repr(part).encode() if not isinstance(part, bytes) else part)
        h.update(b"\0")
    return h.hexdigest()


def load(directory: Path | None, key: str, expect: type | tuple[type, ...] = object) -> Any | None:
    """The value stored under key, or None: absent, unreadable, corrupt, or not an instance of `expect`."""
    if directory is None:
        return None
    path = directory / f"{key}.pkl"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("bad header")
        digest, payload = data[len(_MAGIC):len(_MAGIC) + 64], data[len(_MAGIC) + 64:]
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch")
        value = pickle.loads(payload)
        if not isinstance(value, expect):
            raise TypeError(f"holds a {type(value).__qualname__}, expected {_type_names(expect)}")
        return value
    except Exception as e:  # a corrupt entry is a miss, never a failure
        log.warning("ctpu compile cache: ignoring corrupt entry %s (%s); rebuilding", path.name, e)
        path.unlink(missing_ok=True)
        return None


def _type_names(expect: type | tuple[type, ...]) -> str:
    return " or ".join(t.__qualname__ for t in (expect if isinstance(expect, tuple) else (expect,)))


def store(directory: Path | None, key: str, value: Any) -> None:
    if directory is None or directory in _unusable:
        return
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an unpicklable result simply is not cached
        log.info("ctpu compile cache: not caching %s (%s)", key[:12], e)
        return
    data = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + payload
    tmp: str | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / f"{key}.pkl")  # atomic: readers never see half an entry
    except OSError as e:  # not a directory, read-only, full: compile without the cache
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        _report_unusable(directory, e)


def _report_unusable(directory: Path, err: OSError) -> None:
    with _unusable_lock:
        if directory in _unusable:
            return
        _unusable.add(directory)
    not_a_dir = isinstance(err, NotADirectoryError) or directory.is_file()
    reason = "not a directory" if not_a_dir else err.strerror or str(err)
    warnings.warn(f"ctpu compile cache: cannot write to {directory} ({reason}); compiling without "
                  "the cache (set CTPU_CACHE_DIR to a writable folder, or CTPU_CACHE=0)", RuntimeWarning,
                  stacklevel=3)


def cached(directory: Path | None, key: str, build: Callable[[], Any],
           expect: type | tuple[type, ...] = object) -> tuple[Any, bool]:
    """(value, hit): the cached value for key if it is an `expect`, or build() stored under it."""
    value = load(directory, key, expect)
    if value is not None:
        return value, True
    value = build()
    store(directory, key, value)
    return value, False
