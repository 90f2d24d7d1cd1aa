"""The on-disk compile cache: compiled graphs keyed by graph, shapes, configuration and compiler version.

An entry is a pickle behind a header holding its SHA-256; an entry that fails the check or does not
unpickle is treated as absent (deleted and rebuilt), never as an error.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("ctpu.cache")
_MAGIC = b"CTPUCACHE1\n"
_PACKAGES = ("device_sim", "fx_passes", "codegen", "ptx_kernels", "torch_tpu_backend")


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


def load(directory: Path | None, key: str) -> Any | None:
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
        return pickle.loads(payload)
    except Exception as e:  # a corrupt entry is a miss, never a failure
        log.warning("ctpu compile cache: ignoring corrupt entry %s (%s); rebuilding", path.name, e)
        path.unlink(missing_ok=True)
        return None


def store(directory: Path | None, key: str, value: Any) -> None:
    if directory is None:
        return
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an unpicklable result simply is not cached
        log.info("ctpu compile cache: not caching %s (%s)", key[:12], e)
        return
    directory.mkdir(parents=True, exist_ok=True)
    data = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + payload
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, directory / f"{key}.pkl")  # atomic: readers never see half an entry


def cached(directory: Path | None, key: str, build: Callable[[], Any]) -> tuple[Any, bool]:
    """(value, hit): the cached value for key, or build() stored under it."""
    value = load(directory, key)
    if value is not None:
        return value, True
    value = build()
    store(directory, key, value)
    return value, False
