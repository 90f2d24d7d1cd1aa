"""HBM copies of the host (CPU) tensors compiled launches read, kept across launches: a CPU model's weights
are uploaded once, not on every call (every generated token).

A copy belongs to the tensor's storage (held by a weak reference: when the storage dies its copies are freed,
and a new storage never finds an old storage's copy, even at a reused address) and to the view the program
reads (offset, sizes, strides, dtype, and the program's element type). It is written again when the tensor's
version counter moved, i.e. after any in-place update PyTorch tracks (`with torch.no_grad(): w.mul_(2)`,
`load_state_dict`, an optimizer step). Writes PyTorch does not count are not seen: through `w.data`, a numpy
view of the tensor, or another process's memory; `torch.ctpu.empty_cache()` drops every copy.

A launch that finds HBM full drops every copy and tries again once (`evict`; ctpu_target.launch_executable).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


class HbmAllocator(Protocol):
    """What the copies need of runtime.HbmAllocator (not imported: the runtime imports this module)."""

    def alloc(self, nbytes: int) -> int: ...

    def release(self, addr: int) -> None: ...


@dataclass
class _Copy:
    addr: int
    nbytes: int
    version: int


@dataclass
class _StorageCopies:
    ref: weakref.ref[torch.UntypedStorage]
    copies: dict[Hashable, _Copy] = field(default_factory=dict)  # view key -> its copy


def _view(tensor: torch.Tensor, view_key: Hashable) -> Hashable:
    """What a copy of `tensor`'s storage holds: the view (offset, sizes, strides, dtype) and the program's form."""
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, view_key


class ResidentCopies:
    """The resident copies on one device. `address` is the one entry point; thread-safe.

    A storage's death (a weakref callback: any thread, at any time, also inside this class's own allocation
    when a garbage collection runs) frees its copies at once if the lock is free, else when the holder is done.
    """

    def __init__(self, allocator: HbmAllocator) -> None:
        self._allocator = allocator
        self._storages: dict[int, _StorageCopies] = {}  # id(storage) -> its copies
        self._lock = threading.Lock()
        self._dead: list[int] = []  # ids of storages that died while the lock was held
        self.launch_lock = threading.RLock()  # held by a launch from its first upload to its last read

    def address(self, tensor: torch.Tensor, view_key: Hashable, pack: Callable[[], np.ndarray],
                hbm: np.ndarray) -> tuple[int, int]:
        """The HBM address of `tensor`'s copy (packed by `pack` when it is new or stale) and the bytes written
        to HBM for it now (0 when the copy was current)."""
        key = _view(tensor, view_key)
        with self._lock:
            try:
                entry = self._entry(tensor.untyped_storage())
                copy = entry.copies.get(key)
                if copy is not None and copy.version == tensor._version:
                    return copy.addr, 0
                bits = pack()
                if copy is None or copy.nbytes != bits.nbytes:
                    if copy is not None:
                        self._allocator.release(copy.addr)
                        del entry.copies[key]
                    copy = _Copy(self._allocator.alloc(bits.nbytes), bits.nbytes, -1)
                    entry.copies[key] = copy
                hbm[copy.addr : copy.addr + bits.nbytes] = bits
                copy.version = tensor._version
                return copy.addr, bits.nbytes
            finally:
                self._free_dead()

    def written_back(self, tensor: torch.Tensor, view_key: Hashable, bumps_to_come: int) -> None:
        """A launch wrote `tensor`'s copy in place and `tensor` was given the same values: the copy is current
        for the tensor's version now plus the `bumps_to_come` the caller makes without changing the values."""
        with self._lock:
            try:
                copy = self._entry(tensor.untyped_storage()).copies.get(_view(tensor, view_key))
                if copy is not None:
                    copy.version = tensor._version + bumps_to_come
            finally:
                self._free_dead()

    def evict(self) -> int:
        """Free every copy (callers hold `launch_lock`: no launch is reading one); returns the bytes freed."""
        freed = 0
        with self._lock:
            try:
                for entry in self._storages.values():
                    for copy in entry.copies.values():
                        self._allocator.release(copy.addr)
                        freed += copy.nbytes
                    entry.copies.clear()
            finally:
                self._free_dead()
        return freed

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for e in self._storages.values() for c in e.copies.values())

    def _entry(self, storage: torch.UntypedStorage) -> _StorageCopies:
        sid = id(storage)
        entry = self._storages.get(sid)
        if entry is not None and entry.ref() is not storage:  # a dead storage's id, reused before its callback
            self._drop(sid)
            entry = None
        if entry is None:
            entry = _StorageCopies(weakref.ref(storage, lambda _, sid=sid: self._died(sid)))
            self._storages[sid] = entry
        return entry

    def _died(self, sid: int) -> None:
        self._dead.append(sid)  # atomic; freed now if nobody holds the lock, else by the holder on its way out
        if self._lock.acquire(blocking=False):
            try:
                self._free_dead()
            finally:
                self._lock.release()

    def _free_dead(self) -> None:
        while self._dead:
            self._drop(self._dead.pop())

    def _drop(self, sid: int) -> None:
        entry = self._storages.get(sid)
        if entry is None or entry.ref() is not None:  # already dropped, or the id is a live storage's now
            return
        del self._storages[sid]
        for copy in entry.copies.values():
            self._allocator.release(copy.addr)
