"""The results page, ``BENCHMARKS.md``: every number on it comes from a JSON file of ``benchmarks/results/h200/``,
written by one command of :data:`~benchmarks.results.sources.STAGES` at one commit on one GPU.

    python -m benchmarks.results --measure --stages model graphs report-cp4   # a GPU: writes the JSON files
    python -m benchmarks.results --out BENCHMARKS.md                         # anywhere: the page, its plots and
                                                                             # docs/report from those files

- ``sources.py``: each JSON file, the command that writes it and its stage (the page prints the same commands);
- ``measure.py``: runs stages, each command in its own process with its timeout;
- ``data.py``, ``sections.py``, ``page.py``, ``plots.py``: the page from the files alone.
- ``readme.py``: the README's figure paragraphs (between ``<!-- results:NAME -->`` marker lines) from the same
  files, rewritten by the same command;
- ``planner.py``: the planner's measured constants (``csattn/parallel/plan/measured.py``) from the same files,
  written by the same command (``csattn`` does not import ``benchmarks``).
"""

from .measure import run_stages
from .page import render_page
from .sources import STAGES, Source

__all__ = ["STAGES", "Source", "render_page", "run_stages"]
