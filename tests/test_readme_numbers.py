"""README.md's performance figures are the results page's: each measured paragraph is what ``python -m
benchmarks.results`` renders from ``benchmarks/results/h200/`` now, and every figure with a unit (ms, GiB, TFLOP/s,
tokens/s, %, a ratio like 6.21x) anywhere in the README's prose is a number BENCHMARKS.md shows.

The checks are functions of a README path, so an edited copy can be checked by hand:

    python -c "from pathlib import Path; from tests.test_readme_numbers import figure_errors as f; \\
               print(*f(Path('/tmp/README.md'), Path('BENCHMARKS.md')), sep='\\n')"
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README, PAGE, JSON_DIR = ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "results" / "h200"

# a number (or a few joined by "and", "vs", "/"), then a unit: a time, a size, a rate, a share or a ratio ("6.21x",
# not "4 x 8k")
_NUM = r"(?<![\w.,])\d[\d,]*(?:\.\d+)?k?"
FIGURE = re.compile(rf"(?P<nums>{_NUM}(?:(?:\s(?:and|vs|to|or)\s|\s?/\s?){_NUM})*)(?:\s?(?:ms|s|[KMG]iB|[MGT]B|TFLOP/s|"
                    rf"tokens/s)(?![\w/])|\s?%|x(?!\w))")
# figures in the prose that are not measurements, with the reason; each phrase must still be in the README
NOT_MEASURED = {
    "overlapping 4x compressor": "CSA's compression ratio",
    "128x compressor": "HCA's compression ratio",
    "(2 GiB each at 32k tokens with H = 64, d = 512)": "the size of one bf16 [T, H, d] tensor, by arithmetic",
    "(1 GiB by default)": "AttentionConfig.workspace_bytes's default",
}


def _prose(text: str) -> str:
    """``text`` with its fenced code blocks (commands and code, whose numbers are arguments) and the
    :data:`NOT_MEASURED` phrases blanked out, lines kept where they were."""
    text = re.sub(r"^```.*?^```$", lambda m: re.sub(r"[^\n]", " ", m[0]), text, flags=re.S | re.M)
    for phrase in NOT_MEASURED:
        text = re.sub(r"\s+".join(map(re.escape, phrase.split())), lambda m: re.sub(r"\S", " ", m[0]), text)
    return text


def figure_errors(readme: Path, page: Path) -> list[str]:
    """One line per figure of ``readme``'s prose whose numbers ``page`` (the results page) does not all show, and
    per :data:`NOT_MEASURED` phrase the README no longer holds."""
    raw, shown = Path(readme).read_text(), Path(page).read_text()
    flat = " ".join(raw.split())
    errors = [f"NOT_MEASURED names {phrase!r}, which {readme} no longer holds: remove it from the list"
              for phrase in NOT_MEASURED if phrase not in flat]
    text = _prose(raw)
    for m in FIGURE.finditer(text):
        missing = [n for n in re.findall(_NUM, m["nums"])
                   if not re.search(rf"(?<![\w.,]){re.escape(n)}(?![\d]|[.,]\d)", shown)]
        if missing:
            line = text.count("\n", 0, m.start()) + 1
            figure = " ".join(m[0].split())
            errors.append(f"{readme}:{line}: {', '.join(missing)} in {figure!r} is not on {page.name}; render the "
                          "figure from benchmarks/results/ (benchmarks/results/readme.py) or remove it")
    return errors


def stale_paragraphs(readme: Path, json_dir: Path = JSON_DIR, tmp: Path | None = None) -> list[str]:
    """One line per marked figure paragraph of ``readme`` that differs from what ``python -m benchmarks.results``
    renders from ``json_dir`` now (rendered into ``tmp``, laid out as the repository)."""
    from benchmarks.results import render_page
    from benchmarks.results.readme import MARKER

    tmp = Path(tmp)
    (tmp / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    shutil.copytree(json_dir, tmp / "benchmarks" / "results" / "h200")
    copy = tmp / "README.md"
    shutil.copy(readme, copy)
    render_page(tmp / "benchmarks" / "results" / "h200", tmp / "BENCHMARKS.md", tmp / "docs" / "benchmarks",
                tmp / "docs" / "report", readme=copy)
    now = {m["name"]: m["body"] for m in MARKER.finditer(copy.read_text())}
    was = {m["name"]: m["body"] for m in MARKER.finditer(Path(readme).read_text())}
    return [f"{readme}: the {name!r} figures are not what the results JSON renders now (python -m "
            f"benchmarks.results rewrites them):\n  README:   {was.get(name)!r}\n  rendered: {body!r}"
            for name, body in now.items() if was.get(name) != body]


def test_readme_figures_are_on_the_results_page():
    errors = figure_errors(README, PAGE)
    assert not errors, "\n".join(errors)


def test_readme_figure_paragraphs_and_page_are_current(tmp_path):
    pytest.importorskip("matplotlib")  # the page's plots, rendered beside it
    errors = stale_paragraphs(README, JSON_DIR, tmp_path)
    assert not errors, "\n".join(errors)
    rendered = (tmp_path / "BENCHMARKS.md").read_text()
    assert rendered == PAGE.read_text(), "BENCHMARKS.md is not what its JSON renders now: python -m benchmarks.results"


def test_figure_check_fails_on_a_changed_figure(tmp_path):
    """The check is not vacuous: one figure changed by hand in a copy is reported, by both checks."""
    pytest.importorskip("matplotlib")
    text = README.read_text()
    marked = next(re.finditer(r"(?<![\w.])\d+\.\d\dx", text.split("<!-- results:model", 1)[1]))[0]
    edited = tmp_path / "edited" / "README.md"
    edited.parent.mkdir()
    edited.write_text(text.replace(marked, "9.99x", 1))
    assert any("'9.99x'" in e for e in figure_errors(edited, PAGE))
    assert len(stale_paragraphs(edited, JSON_DIR, tmp_path / "render")) == 1
    assert not figure_errors(README, PAGE)


def test_fill_readme_needs_each_marker_once():
    from benchmarks.results.readme import fill_readme

    paragraphs = {"model": "54.2k tokens/s", "cp": "3.96x less"}
    text = "a\n<!-- results:model (note) -->\nold\nlines\n<!-- /results:model -->\nb\n"
    with pytest.raises(ValueError, match=r"missing \['cp'\]"):
        fill_readme(text, paragraphs)
    with pytest.raises(ValueError, match=r"unknown \['kernels'\]"):
        fill_readme(text + "<!-- results:kernels -->\nx\n<!-- /results:kernels -->\n", {"model": "y"})
    both = text + "<!-- results:cp -->\n<!-- /results:cp -->\n"
    filled = fill_readme(both, paragraphs)
    assert filled == ("a\n<!-- results:model (note) -->\n54.2k tokens/s\n<!-- /results:model -->\nb\n"
                      "<!-- results:cp -->\n3.96x less\n<!-- /results:cp -->\n")
    assert fill_readme(filled, paragraphs) == filled


def test_a_missing_result_names_its_file_and_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.results import render_page
    from benchmarks.results.readme import MissingResult

    json_dir = tmp_path / "json"
    shutil.copytree(JSON_DIR, json_dir)
    (json_dir / "model_512k.json").unlink()
    copy = tmp_path / "README.md"
    shutil.copy(README, copy)
    with pytest.raises(MissingResult, match="model_512k.json"):
        render_page(json_dir, tmp_path / "BENCHMARKS.md", tmp_path / "plots", tmp_path / "report", readme=copy)
    assert copy.read_text() == README.read_text() and not (tmp_path / "BENCHMARKS.md").exists()
