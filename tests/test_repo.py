"""Repository habits: the README's set-up commands and what CI runs agree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks if "python3 -m venv" in b]


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("ctpu demo") and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_readme_python_example_runs_on_the_ctpu() -> None:
    """The README's example, verbatim: it compiles, runs on the simulator, and nothing falls back."""
    import torch

    import torch_tpu_backend.stats as ctpu_stats

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    torch._dynamo.reset()
    ctpu_stats.reset()  # the count of this example alone, not of the tests before it
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    s = ctpu_stats.last()
    assert s.kernels_launched == 1 and not s.fallback_ops
    assert tuple(namespace["y"].shape) == (16, 32)  # type: ignore[attr-defined]


def test_readme_generate_example_gives_eager_tokens() -> None:
    """The README's generate() example, verbatim (a ctpu model, a compiled forward, a static cache): its tokens
    are eager PyTorch's."""
    import torch

    from torch_tpu_backend.llama_demo import tiny_llama

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    example = next(b for b in blocks if ".generate(" in b)
    torch._dynamo.reset()
    namespace: dict[str, object] = {"print": lambda *_: None}
    exec(compile(example, "README.md", "exec"), namespace)
    ids = namespace["ids"].cpu()  # type: ignore[attr-defined]
    with torch.no_grad():
        expected = tiny_llama().generate(ids, max_new_tokens=8, do_sample=False, use_cache=True,
                                         cache_implementation="static")
    assert namespace["out"].cpu().tolist() == expected.tolist()  # type: ignore[attr-defined]
