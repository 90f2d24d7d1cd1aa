"""CTPU_DUMP_DIR: every compiler stage of every compiled graph, written as files a person can read.

    CTPU_DUMP_DIR=dump python model.py
    dump/graph_000_<hash>/00_fx_before.txt, 01_fx_after_passes.txt, 02_mlir_before.mlir, ...,
                          NN_assembly.s, NN_bundles.txt, NN_program.bin, summary.json
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path
from typing import Any

_counter = itertools.count()


def dump_root(option: str | os.PathLike[str] | None = None) -> Path | None:
    """The dump directory: the compile option if given, else $CTPU_DUMP_DIR, else None (no dumping)."""
    root = option or os.environ.get("CTPU_DUMP_DIR")
    return Path(root) if root else None


class GraphDump:
    """Writes the stages of one compiled graph, numbered in the order they happen."""

    def __init__(self, root: Path | None, graph_key: str) -> None:
        self.dir: Path | None = None
        self._stage = itertools.count()
        if root is not None:
            self.dir = Path(root) / f"graph_{next(_counter):03d}_{graph_key[:12]}"
            self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def stage(self, name: str, content: str | bytes, ext: str = "txt") -> None:
        if self.dir is None:
            return
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        path = self.dir / f"{next(self._stage):02d}_{safe}.{ext}"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    def summary(self, data: dict[str, Any]) -> None:
        if self.dir is not None:
            (self.dir / "summary.json").write_text(json.dumps(data, indent=2, default=str))
