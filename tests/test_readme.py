"""Every ```python block of README.md runs as written (CPU, small sizes), each in a fresh namespace, so a
reader can copy any one of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_snippets():
    assert len(BLOCKS) >= 3  # Use, Context parallelism, CUDA graphs (a lost fence would skip them silently)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    code = BLOCKS[index]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():  # the snippets seed torch; leave the suite's RNG as it was
            exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():  # a snippet that failed before its own destroy_process_group
            dist.destroy_process_group()
