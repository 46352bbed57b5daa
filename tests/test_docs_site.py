"""The documentation site builds in strict mode (a broken link, anchor or reference fails it), holds every page of
its nav, a reference generated from the code, and pages that a real browser renders: Debian's chromium, headless,
on the home page and a notebook page (a screenshot that is not blank, the page's title, the notebook's cells)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# MkDocs' plugins print a notice about MkDocs 2 on every build; it says nothing about this site
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


def _mkdocs(config: Path, out: Path, cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **QUIET, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(out)], cwd=cwd, env=env, capture_output=True, text=True, timeout=280)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = _mkdocs(ROOT / "mkdocs.yml", out, ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    return out


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for v in values:
            out += _nav_pages(v) if isinstance(v, list) else [v]
    return out


def _built(site: Path, page: str) -> Path:
    stem = page.rsplit(".", 1)[0]
    return site / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_page_and_the_generated_reference(site):
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = _nav_pages(nav)
    assert len(pages) >= 40, pages
    missing = [p for p in pages if not _built(site, p).is_file()]
    assert not missing, missing
    from omegaconf import OmegaConf

    from kvlab.config.help import field_help
    from kvlab.config.schema import compose
    from kvlab.core.figures import TABLE

    figures = _built(site, "reference/figures.md").read_text()
    assert all(f"<code>{f.name}</code>" in figures for f in TABLE)
    config = _built(site, "reference/config.md").read_text()
    composed = compose([])
    fields = [p for p in field_help() if OmegaConf.select(composed, p, default="absent") != "absent"]
    assert len(fields) > 100 and all(f"<code>{p}</code>" in config for p in fields), [
        p for p in fields if f"<code>{p}</code>" not in config]
    for name in ("cluster.ctx_instances", "sim.rate", "transport.mode"):
        assert f"<code>{name}</code>" in config, name
    api = _built(site, "reference/api/transports.md").read_text()
    assert "kvlab.transports.Transport" in api and "connect" in api  # mkdocstrings rendered the seam
    assert "TTFT is, and what it is not" in _built(site, "index.md").read_text()


@pytest.mark.slow
def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The site's own validation settings, on two pages: one link to a page that does not exist, one to an anchor
    that does not."""
    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nplugins:")[0])
    for broken in ("[gone](missing.md)", "[gone](index.md#no-such-heading)"):
        (tmp_path / "docs").mkdir(exist_ok=True)
        (tmp_path / "docs" / "index.md").write_text("# Home\n\ntext\n")
        (tmp_path / "docs" / "other.md").write_text(f"# Other\n\n{broken}\n")
        config = {k: ours[k] for k in ("validation", "theme")} | {"site_name": "t", "docs_dir": "docs"}
        (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
        p = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "out", tmp_path)
        assert p.returncode != 0 and "Aborted" in p.stdout + p.stderr, (broken, p.stdout + p.stderr)


def _browser(url: str, png: Path) -> str:
    """The DOM chromium built for ``url`` after its scripts ran, and a screenshot of it into ``png``."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1400"]
    for extra in ([f"--screenshot={png}"], ["--dump-dom"]):
        p = subprocess.run([*flags, *extra, url], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _not_blank(png: Path) -> None:
    from matplotlib import image

    pixels = image.imread(png)[..., :3]
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1200, pixels.shape
    ink = (pixels.mean(axis=2) < 0.6).mean()  # text, code and the header bar
    assert pixels.std() > 0.05 and 0.01 < ink < 0.6, (png, pixels.std(), ink)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed here (.ci/run installs it: apt-get install chromium)")
def test_the_home_page_and_a_notebook_page_render_in_a_headless_browser(site, tmp_path):
    assert CHROMIUM, "CI must have chromium: .ci/run installs it"
    shots = Path(os.environ.get("KVLAB_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    home = _browser(_built(site, "index.md").as_uri(), shots / "home.png")
    _not_blank(shots / "home.png")
    assert "<title>kvlab</title>" in home and "What kvlab's TTFT is, and what it is not" in home
    assert 'class="md-header' in home and 'class="md-nav' in home  # Material's layout, not bare HTML
    page = _built(site, "notebooks/01_quickstart.ipynb")
    notebook = _browser(page.as_uri(), shots / "notebook.png")
    _not_blank(shots / "notebook.png")
    assert "<title>kvlab quickstart - kvlab</title>" in notebook, notebook[:2000]
    assert "jp-Notebook" in notebook and "jp-CodeCell" in notebook  # the cells, rendered
    assert "run_transfer" in notebook  # its first code cell
