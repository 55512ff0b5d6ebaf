"""The repository stands on its own: every link and every named document resolves inside it, and the
package metadata installs without setuptools' deprecation warnings (issue 62 points 6 and 7)."""

import re
import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAMED_DOC = re.compile(r"(?<![\w/.-])((?:\.\./|[\w.-]+/)*[A-Z][\w-]*\.md)\b")
# files of artifacts and of published releases, not of this repository
NOT_OURS = {"README.target.md", "README_WEIGHTS.md", "TARGET_README.md"}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def _inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


@pytest.mark.parametrize("doc", _tracked("*.md"), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (doc.parent / target.split("#")[0]).resolve()
        if not (_inside(path) and path.exists()):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what the repository does not hold: {broken}"


def test_every_named_document_is_in_the_repository():
    """A mention such as `../shared/DESIGN.md` or `RELEASES.md pair 2` points a reader at notes that
    only the team has: what a user needs lives in docs/."""
    assert NAMED_DOC.findall("see ../shared/DESIGN.md and RELEASES.md pair 2") == ["../shared/DESIGN.md", "RELEASES.md"]
    names = {p.name for p in _tracked()} | NOT_OURS
    missing = []
    for source in set(_tracked("*.md", "*.py", "Makefile", "*.toml", ".ci/*")) - {Path(__file__).resolve()}:
        for mention in NAMED_DOC.findall(source.read_text(errors="replace")):
            outside = mention.startswith("../") and not _inside(source.parent / mention)
            if outside or Path(mention).name not in names:
                missing.append(f"{source.relative_to(ROOT)}: {mention}")
    assert not missing, "documents named but not in the repository:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("doc, most", [("README.md", 300), ("BENCHMARKS.md", 500)])
def test_the_front_pages_stay_short(doc, most):
    """README is the front door and BENCHMARKS today's results (issue 52): the rest lives in docs/ and
    bench/HISTORY.md."""
    lines = len((ROOT / doc).read_text().splitlines())
    assert lines <= most, f"{doc} has {lines} lines (at most {most}): move detail to docs/ or bench/HISTORY.md"


def test_package_metadata_has_no_deprecated_fields():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    deprecations = [str(w.message).splitlines()[0] for w in caught if "Deprecat" in w.category.__name__]
    assert not deprecations, deprecations
    assert dist.metadata.license_expression == "Apache-2.0"
