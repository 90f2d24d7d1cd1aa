"""torch.save / torch.load / pickle of ctpu tensors: torch's device-module contract (`torch.ctpu.device`)."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch


def _round_trip(obj: Any, **load_kwargs: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load_kwargs)


def _ctpu_arange(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape).to(dtype).to("ctpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_save_load_bytesio_keeps_device_and_values(dtype: torch.dtype) -> None:
    x = _ctpu_arange(3, 4, dtype=dtype)
    y = _round_trip(x)
    assert y.device == torch.device("ctpu", 0) and y.dtype == dtype
    torch.testing.assert_close(y.cpu(), x.cpu())


def test_save_load_file(tmp_path: Path) -> None:
    x = _ctpu_arange(5)
    path = tmp_path / "x.pt"
    torch.save(x, path)
    y = torch.load(path)
    assert y.device.type == "ctpu"
    torch.testing.assert_close(y.cpu(), x.cpu())


def test_views_keep_sharing_their_storage() -> None:
    x = _ctpu_arange(3, 4)
    out = _round_trip({"x": x, "view": x[1:, ::2]})
    assert out["view"].untyped_storage().data_ptr() == out["x"].untyped_storage().data_ptr()
    torch.testing.assert_close(out["view"].cpu(), x[1:, ::2].cpu())


def test_empty_tensor_and_state_dict() -> None:
    assert _round_trip(torch.empty(0, device="ctpu")).device.type == "ctpu"
    model = torch.nn.Linear(4, 2).to("ctpu")
    state = _round_trip(model.state_dict())
    assert all(t.device.type == "ctpu" for t in state.values())
    torch.testing.assert_close(state["weight"].cpu(), model.weight.detach().cpu())


def test_pickle_and_deepcopy() -> None:
    x = _ctpu_arange(2, 3)
    param = torch.nn.Parameter(_ctpu_arange(2))
    for copied in (pickle.loads(pickle.dumps(x)), copy.deepcopy(x)):
        assert copied.device.type == "ctpu"
        torch.testing.assert_close(copied.cpu(), x.cpu())
    p = pickle.loads(pickle.dumps(param))
    assert isinstance(p, torch.nn.Parameter) and p.device.type == "ctpu" and p.requires_grad


def test_map_location_cpu() -> None:
    x = _ctpu_arange(2, 3)
    for location in ("cpu", torch.device("cpu"), {"ctpu:0": "cpu"}):
        y = _round_trip(x, map_location=location)
        assert y.device.type == "cpu"
        torch.testing.assert_close(y, x.cpu())


def test_cpu_checkpoint_loads_onto_ctpu() -> None:
    x = torch.randn(4, 4)
    for location in ("ctpu", "ctpu:0", torch.device("ctpu")):
        y = _round_trip(x, map_location=location)
        assert y.device == torch.device("ctpu", 0)
        torch.testing.assert_close(y.cpu(), x)


def test_map_location_to_a_missing_device_says_so() -> None:
    with pytest.raises(RuntimeError, match="device_count"):
        _round_trip(_ctpu_arange(2), map_location="ctpu:1")


def test_device_context_manager() -> None:
    with torch.ctpu.device(0):
        assert torch.ctpu.current_device() == 0
    with torch.ctpu.device(None), torch.ctpu.device(-1), torch.ctpu.device("ctpu"):
        pass
    with pytest.raises(ValueError, match="ctpu"):
        torch.ctpu.device("cpu")
    with pytest.raises(RuntimeError, match="invalid device index"), torch.ctpu.device(1):
        pass
