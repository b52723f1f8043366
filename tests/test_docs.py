"""The documentation: the site in docs/ builds without a warning, and README.md stays a short front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300

# [text](target) and ![alt](target); a target ends at whitespace or the closing bracket.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link or anchor, or a page missing from mkdocs.yml's nav, fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner is not a warning of ours
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, (
        f"`python -m mkdocs build --strict` failed (exit {result.returncode}); mkdocs and "
        f"mkdocs-material come with the dev extras (pip install -e '.[dev]'):\n"
        f"{result.stdout}{result.stderr}"
    )


def test_the_readme_is_a_short_front_page() -> None:
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines, over {MAX_README_LINES}: move the detail to a page in docs/ "
        "and link to it from the README's feature table")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_readmes_example_runs_as_written(tmp_path: Path) -> None:
    """The front page's one example, copied as a reader would and run from another directory: it trains a
    step on a local cluster, prints the step's statistics and saves a checkpoint where it says."""
    [example] = re.findall(r"## One example\n\n```python\n(.*?)```", README.read_text(), re.S)
    (tmp_path / "example.py").write_text(example)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    loss, step_time, samples_per_s, bubble, stash = result.stdout.strip().splitlines()[-1].split(maxsplit=4)
    assert float(loss) > 0 and float(step_time) > 0 and float(samples_per_s) > 0 and 0 <= float(bubble) < 1
    assert stash.startswith("[") and stash.endswith("]")  # the peak stash of each stage
    assert [version.name for version in (tmp_path / "checkpoints" / "run1").glob("v*")] == ["v000001"]


def _relative_links(text: str) -> list[str]:
    """Every link target in Markdown ``text`` that is a path in this repository, anchors dropped."""
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize(("text", "expected"), [
    ("see [GPUs](docs/gpus.md) and [auto](docs/parallelism.md#choosing)", ["docs/gpus.md", "docs/parallelism.md"]),
    ("![timeline](docs/timeline.png \"a title\")", ["docs/timeline.png"]),
    ("[site](https://example.org/docs/x.md), [here](#layout), [me](mailto:a@b)", []),
])
def test_relative_links_are_found(text: str, expected: list[str]) -> None:
    assert _relative_links(text) == expected


def test_the_readmes_links_into_docs_exist() -> None:
    links = [link for link in _relative_links(README.read_text()) if link.startswith(("docs/", "./docs/"))]
    assert links, "README.md links into docs/ (its feature table does)"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README.md links to files that are not in the repository: {missing}"
