"""The compile cache: hits, keys that change with their inputs, corrupt entries rebuilt."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_tpu_backend import cache


def test_hit_after_store_and_key_sensitivity(tmp_path: Path) -> None:
    calls = []
    key = cache.make_key("graph", (2, 3), "small")
    value, hit = cache.cached(tmp_path, key, lambda: calls.append(1) or {"bundles": [1, 2]})
    assert not hit and value == {"bundles": [1, 2]}
    value, hit = cache.cached(tmp_path, key, lambda: calls.append(1) or "rebuilt")
    assert hit and value == {"bundles": [1, 2]} and len(calls) == 1
    assert cache.make_key("graph", (2, 4), "small") != key
    assert cache.make_key("graph", (2, 3), "large") != key


def test_corrupt_entries_are_ignored_and_rebuilt(tmp_path: Path) -> None:
    key = cache.make_key("g")
    cache.store(tmp_path, key, [1, 2, 3])
    path = tmp_path / f"{key}.pkl"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a payload bit
    path.write_bytes(bytes(data))
    value, hit = cache.cached(tmp_path, key, lambda: "fresh")
    assert (value, hit) == ("fresh", False)
    path.write_bytes(b"garbage")
    assert cache.load(tmp_path, key) is None and not path.exists()
    assert cache.cached(tmp_path, key, lambda: "again") == ("again", False)


def test_disabled_cache_always_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTPU_CACHE", "0")
    assert cache.cache_dir() is None
    assert cache.cached(None, "k", lambda: 5) == (5, False)
