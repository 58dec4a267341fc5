"""The documentation: the site builds offline with warnings as errors, the README's links resolve.

(The commands shown in README.md and on the site are parsed with the real parser in
tests/test_hardening_cli.py.) The site build is skipped, saying why, where MkDocs is not
installed (the `docs` extra), except under CI (`CI=true`), which installs it and must build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)   # not comments in code
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"<img [^>]*src=\"([^\"]+)\"", text)


def test_every_relative_link_of_the_readme_resolves():
    readme = ROOT / "README.md"
    links = [link for link in _links(readme.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:", link)]
    assert len(links) >= 10
    for link in links:
        target, _, anchor = link.partition("#")
        path = (ROOT / target).resolve() if target else readme
        assert path.exists(), f"README.md links to {link}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"README.md links to {link}: no heading #{anchor} in {path.name}"


def test_readme_is_short_and_its_quick_start_installs_what_the_demo_ends_with():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    install = next(line for line in quick.splitlines() if line.startswith("pip install") and "sgraf demo" in line)
    assert "serve" in install.split("-e", 1)[1], "the demo ends with `sgraf serve`, which needs the serve extra"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = next(line for line in text.splitlines() if line.startswith("pip install") and "pytest" in line)
    assert test_command in ci.splitlines(), ".ci/run must run the README's test command verbatim"
    assert "docs" in test_command


def test_the_site_builds_offline_with_warnings_as_errors(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI must build the documentation, but MkDocs is not installed (the docs extra)")
        pytest.skip("MkDocs is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (site / "index.html").is_file() and (site / "reference" / "model" / "index.html").is_file()
    reference = (site / "reference" / "model" / "index.html").read_text(encoding="utf-8")
    assert "encode_captions" in reference and "ModelConfig" in reference   # generated from the docstrings
    for page in site.rglob("*.html"):   # offline: nothing fetched from elsewhere
        html = page.read_text(encoding="utf-8")
        assert "fonts.googleapis" not in html and "cdn." not in html, page
        assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?://", html), page


def test_every_environment_variable_sgraf_reads_is_in_the_reference():
    """The reference's table lists each `SGRAF_*` variable the package reads, and no other."""
    read = set()
    for path in (ROOT / "src" / "sgraf").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        read |= set(re.findall(r"""(?:environ(?:\.get)?[\[(]\s*|switched_on\(|Routes?\()["'](SGRAF_[A-Z_]+)["']""",
                               text))
        read |= set(re.findall(r"""forced_route\(["'](SGRAF_[A-Z_]+)["']""", text))
    table = (ROOT / "docs" / "reference" / "index.md").read_text(encoding="utf-8").split("## Environment variables")[1]
    listed = set(re.findall(r"`(SGRAF_[A-Z_]+)`", table.split("\n\n::: ")[0]))
    from sgraf.user_cache import SWITCHES

    assert read >= {"SGRAF_CACHE_DIR", "SGRAF_JOIN_TIMEOUT", "SGRAF_WORD_ROUTE", "SGRAF_COMPILE", *SWITCHES}, read
    assert read == listed, (read - listed, listed - read)


def test_every_command_but_demo_and_serve_takes_json_as_the_docs_say():
    import argparse

    from sgraf.cli import build_parser

    def leaves(parser, name=""):
        subs = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
        if not subs:
            yield name, parser
        for action in subs:
            for child, sub in action.choices.items():
                yield from leaves(sub, f"{name} {child}".strip())

    without = sorted(name for name, parser in leaves(build_parser())
                     if not any("--json" in action.option_strings for action in parser._actions))
    assert without == ["demo", "serve"]
    for path in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        assert "but `demo`" in path.read_text(encoding="utf-8").replace("all but", "but"), path


# the Python snippets that open with these lines, in these files: run as written, in a folder
# holding what they read (a demo's layout, with tiny random models)
SNIPPETS = [("README.md", "import numpy as np\nimport sgraf\n"),
            ("docs/model.md", "import numpy as np\nimport torch\n"),
            ("docs/guides/search-and-serve.md", "import numpy as np\nfrom sgraf import Matcher")]


@pytest.mark.parametrize("path,opening", SNIPPETS, ids=[path for path, _ in SNIPPETS])
def test_the_python_snippets_run_as_written(tmp_path, monkeypatch, path, opening):
    """Three had used `images`, `captions` or `features` without defining them: NameError pasted."""
    import numpy as np
    import torch

    from sgraf.checkpoint import save_model
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.model.sgraf import SGRAF

    text = (ROOT / path).read_text(encoding="utf-8")
    start = text.index("```python\n" + opening) + len("```python\n")
    code = text[start:text.index("```", start)]
    demo = tmp_path / "sgraf-demo"
    (demo / "data").mkdir(parents=True)
    np.save(demo / "data" / "test_ims.npy", np.random.default_rng(0).standard_normal((10, 4, 12)).astype(np.float32))
    vocab = Vocabulary.from_words("a red green blue square circle triangle left right of".split())
    for seed, module in enumerate(("sgr", "saf")):
        torch.manual_seed(seed)
        model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=12, word_dim=8, embed_size=16, sim_dim=8,
                                  num_regions=4, module=module, sgr_step=2))
        (demo / "runs" / module).mkdir(parents=True)
        save_model(model, demo / "runs" / module / "best.pt", vocab=vocab)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, f"{path} snippet", "exec"), namespace)
    assert np.isfinite(np.asarray(namespace["scores"])).all()
