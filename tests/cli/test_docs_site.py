"""The documentation site (``mkdocs.yml``, ``docs/``) builds with ``mkdocs build --strict``: a
link between pages to a missing page or anchor, a page left out of the nav or a nav entry
without its page is a warning, and a warning fails the build. The README keeps the first hour
and links into docs/, so those links must name pages that exist."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300

pytest.importorskip("mkdocs", reason="mkdocs is not installed (the `test` extra pins it)")
pytest.importorskip("material", reason="mkdocs-material is not installed (the `test` extra)")


def test_the_docs_site_builds_strict_without_a_warning(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # not --quiet: it drops the warnings before strict mode counts them, and the build passes
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert run.returncode == 0 and not warnings, (
        f"mkdocs build --strict failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    built = [stem for stem in pages
             if (site / ("" if stem == "index" else stem) / "index.html").is_file()]
    assert built == pages, f"pages not built: {sorted(set(pages) - set(built))}"
    # a table or list that Python-Markdown did not take as one (no blank line before it, a
    # nested list indented by 2) is printed as a paragraph of pipes and dashes
    unrendered = [(html.parent.name, m.group(1)[:80])
                  for html in site.rglob("index.html")
                  for m in re.finditer(r"<p>(.*?)</p>", html.read_text(), re.S)
                  if re.search(r"\n(\| |- |\d+\. )", m.group(1))]
    assert not unrendered, f"markdown left as text: {unrendered}"


def test_the_readme_links_to_docs_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10, f"the README links to {len(links)} docs pages"
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing, f"the README links to missing docs pages: {missing}"
    assert not re.search(r"\]\(#", text), "the README links to a section it no longer has"
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, (
        f"the README has {lines} lines, over {README_MAX_LINES} (the reference goes in docs/)")


def test_the_configuration_reference_follows_the_dataclasses_and_presets():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    from apbv.config import RuntimeConfig

    for section in dataclasses.fields(RuntimeConfig):
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            assert f"`{section.name}.{f.name}`" in page, f"{section.name}.{f.name} is not listed"
