"""Point every Binder link at the repository named in ``pyproject.toml`` (``[project.urls]``).

The README's and the notebooks' Binder links are written from one place: ``Repository`` (the GitHub
URL) and ``Binder`` (``https://mybinder.org/v2/gh/OWNER/NAME/BRANCH``) in ``[project.urls]``. When the
repository is published (or moves), run::

    python scripts/set_repository.py you/trainmem_nb            # rewrite pyproject, README, notebooks
    python scripts/set_repository.py you/trainmem_nb --branch dev
    python scripts/set_repository.py --check                    # exit 1 if any link disagrees

Only the ``https://mybinder.org/v2/gh/<owner>/<name>/<branch>`` prefix of each link is rewritten; the
notebook cells and their outputs are otherwise untouched (a text replacement, no re-execution).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
#: A Binder launch link's prefix: owner, name and branch (the query that follows is kept).
BINDER = re.compile(r"https://mybinder\.org/v2/gh/(?P<slug>[\w.-]+/[\w.-]+)/(?P<branch>[\w./-]+?)(?=[?)\"\s]|$)")
SLUG = re.compile(r"^[\w.-]+/[\w.-]+$")


def configured() -> tuple[str, str]:
    """``(owner/name, branch)`` from pyproject's ``[project.urls]`` (Binder's slug must equal Repository's)."""
    text = PYPROJECT.read_text(encoding="utf-8")  # two plain lines of [project.urls] (no TOML parser on 3.10)
    urls = {key: m.group(1) if (m := re.search(rf'(?m)^{key} = "(.*)"$', text)) else "" for key in ("Repository", "Binder")}
    repo = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+)", urls["Repository"])
    binder = BINDER.fullmatch(urls["Binder"])
    if not repo or not binder:
        raise SystemExit(f"pyproject.toml [project.urls]: Repository={urls['Repository']!r} and Binder="
                         f"{urls['Binder']!r} must be https://github.com/OWNER/NAME and "
                         "https://mybinder.org/v2/gh/OWNER/NAME/BRANCH")
    if binder.group("slug") != repo.group(1):
        raise SystemExit(f"pyproject.toml: the Binder URL names {binder.group('slug')}, the Repository {repo.group(1)}")
    return repo.group(1), binder.group("branch")


def files() -> list[Path]:
    """Every file with Binder links: the README and the notebooks."""
    return [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]


def links(path: Path) -> list[tuple[str, str]]:
    """``(slug, branch)`` of every Binder link in `path`."""
    return [(m.group("slug"), m.group("branch")) for m in BINDER.finditer(path.read_text(encoding="utf-8"))]


def rewrite(slug: str, branch: str) -> list[Path]:
    """Set pyproject's URLs and every link to `slug` on `branch`; returns the files changed."""
    changed = []
    text = PYPROJECT.read_text(encoding="utf-8")
    new = re.sub(r'(?m)^Repository = ".*"$', f'Repository = "https://github.com/{slug}"', text)
    new = re.sub(r'(?m)^Binder = ".*"$', f'Binder = "https://mybinder.org/v2/gh/{slug}/{branch}"', new)
    for path, old, updated in [(PYPROJECT, text, new)] + [
            (p, t, BINDER.sub(f"https://mybinder.org/v2/gh/{slug}/{branch}", t))
            for p in files() for t in [p.read_text(encoding="utf-8")]]:
        if updated != old:
            path.write_text(updated, encoding="utf-8")
            changed.append(path)
    return changed


def check() -> list[str]:
    """Every link that does not point at pyproject's repository and branch."""
    slug, branch = configured()
    return [f"{p.relative_to(ROOT)}: {s}/{b} (pyproject: {slug}/{branch})" for p in files() for s, b in links(p)
            if (s, b) != (slug, branch)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("slug", nargs="?", help="OWNER/NAME on GitHub")
    ap.add_argument("--branch", default=None, help="branch Binder builds (default: the one in pyproject, else main)")
    ap.add_argument("--check", action="store_true", help="only check that every link agrees with pyproject")
    args = ap.parse_args(argv)
    if args.check or not args.slug:
        bad = check()
        for line in bad:
            print(f"[binder] {line}", file=sys.stderr)
        print(f"[binder] {'all links agree with pyproject' if not bad else f'{len(bad)} link(s) disagree'}")
        return 1 if bad else 0
    if not SLUG.match(args.slug):
        ap.error(f"{args.slug!r} is not OWNER/NAME")
    branch = args.branch or configured()[1]
    for path in rewrite(args.slug, branch):
        print(f"[binder] rewrote {path.relative_to(ROOT)}")
    return 1 if check() else 0


if __name__ == "__main__":
    sys.exit(main())
