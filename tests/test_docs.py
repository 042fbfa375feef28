"""The documentation site builds with `mkdocs build --strict`: no broken link, no missing page, the
API reference's docstrings found, and the generated settings and CLI references filled in."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the [docs] extra is not installed")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    families = sorted(p.stem for p in (ROOT / "docs" / "families").glob("*.md"))
    assert (site / "families" / "index.html").is_file()  # the families' overview
    for family in set(families) - {"index"}:
        assert (site / "families" / family / "index.html").is_file(), family
    settings = (site / "reference" / "settings" / "index.html").read_text()
    assert "max_tokens" in settings and "cfg_scale" in settings
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "--max-tokens" in cli
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "generate_diffusion" in api and "batch_generate_diffusion" in api
