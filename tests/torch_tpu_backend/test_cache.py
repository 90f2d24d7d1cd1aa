"""The compile cache: hits, keys that change with their inputs, corrupt or mistyped entries rebuilt, and an
unusable cache folder that warns once and compiles without the cache."""

from __future__ import annotations

import os
import warnings
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


def test_entry_holding_another_object_is_ignored_and_rebuilt(tmp_path: Path) -> None:
    key = cache.make_key("g2")
    cache.store(tmp_path, key, "not a compiled graph")  # well formed: header and checksum are right
    assert cache.cached(tmp_path, key, lambda: {"program": 1}, expect=dict) == ({"program": 1}, False)
    assert cache.cached(tmp_path, key, lambda: {"program": 2}, expect=dict) == ({"program": 1}, True)
    assert cache.load(tmp_path, key, expect=(list, str)) is None and not (tmp_path / f"{key}.pkl").exists()


def test_compile_survives_cache_entries_of_another_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry the compiler writes is swapped for a well-formed entry of another object: the next
    compile ignores them, rebuilds, and computes the right answer."""
    import torch

    monkeypatch.setenv("CTPU_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CTPU_CACHE", raising=False)
    x = torch.randn(4, 8)

    def run() -> torch.Tensor:
        torch._dynamo.reset()
        return torch.compile(lambda t: (t * 2).exp(), backend="ctpu")(x)

    run()
    entries = sorted(tmp_path.glob("*.pkl"))
    assert entries
    for path in entries:
        cache.store(tmp_path, path.stem, "not an executable")
    torch.testing.assert_close(run(), (x * 2).exp())
    assert not any(cache.load(tmp_path, p.stem) == "not an executable" for p in entries)


@pytest.fixture
def fresh_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_unusable", set())


@pytest.mark.usefixtures("fresh_unusable")
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_unusable_cache_dir_warns_once_and_builds(tmp_path: Path, where: str) -> None:
    file = tmp_path / "file"
    file.write_text("not a folder")
    directory = file if where == "a file" else file / "cache"
    with pytest.warns(RuntimeWarning, match=rf"cannot write to {directory} \(not a directory\); compiling without"):
        assert cache.cached(directory, cache.make_key("a"), lambda: 1) == (1, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per directory
        assert cache.cached(directory, cache.make_key("b"), lambda: 2) == (2, False)
    assert file.read_text() == "not a folder"


@pytest.mark.usefixtures("fresh_unusable")
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_cache_dir_warns_and_builds(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        with pytest.warns(RuntimeWarning, match="cannot write to"):
            assert cache.cached(directory, cache.make_key("a"), lambda: 1) == (1, False)
        assert list(directory.iterdir()) == []
    finally:
        directory.chmod(0o700)


@pytest.mark.usefixtures("fresh_unusable")
def test_compile_with_an_unusable_cache_dir_runs_on_the_ctpu(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import torch_tpu_backend.stats as ctpu_stats

    file = tmp_path / "file"
    file.write_text("")
    monkeypatch.setenv("CTPU_CACHE_DIR", str(file))
    torch._dynamo.reset()
    ctpu_stats.reset()
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda t: torch.exp(t) * 2.0, backend="ctpu")(x)
    torch.testing.assert_close(out, torch.exp(x) * 2.0)
    messages = [str(w.message) for w in caught]
    assert sum("compiling without the cache" in m for m in messages) == 1
    assert not any("internal compiler error" in m for m in messages), messages
    assert ctpu_stats.last().kernels_launched == 1 and not ctpu_stats.last().fallback_ops
