"""Sessions CI runs.

`nox` runs the checks on the pinned torch: lint, typecheck, tests-2.13, examples, docs.
`nox -t tests` runs the test suite on every supported torch release: the floor declared in
pyproject.toml, the release constraints.txt pins, and the newest release on the package index.
`nox -t ci` is all of them; `.ci/run` runs the same set as three streams side by side (`nox`,
`nox -t floor`, `nox -t newest`). See docs/torch-versions.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

PYPROJECT = nox.project.load_toml("pyproject.toml")


def _floor_release() -> str:
    """The oldest torch release pyproject.toml allows: `torch>=2.11` gives "2.11.0"."""
    for requirement in PYPROJECT["project"]["dependencies"]:
        found = re.fullmatch(r"torch>=(\d+)\.(\d+)", requirement.replace(" ", ""))
        if found:
            return f"{found[1]}.{found[2]}.0"
    raise SystemExit("pyproject.toml must require torch as `torch>=X.Y`")


def _pinned_release() -> str:
    """The torch release constraints.txt pins the suite to."""
    found = re.search(r"^torch==([\d.]+)$", Path("constraints.txt").read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit("constraints.txt must pin torch as `torch==X.Y.Z`")
    return found[1]


# The releases the suite runs on. The floor and the pinned release are read from the files that
# declare them, so the floor CI tests is always the one users are promised. NEWEST is the newest
# torch release on the package index: bump it when torch releases (docs/torch-versions.md).
FLOOR = _floor_release()
PINNED = _pinned_release()
NEWEST = "2.15.0"
RELEASES = [FLOOR, PINNED, NEWEST]


def _minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


PINNED_TESTS = f"tests-{_minor(PINNED)}"
nox.options.sessions = ["lint", "typecheck", PINNED_TESTS, "examples", "docs"]

# Every session but the tests of other releases installs the pinned torch.
CONSTRAINTS = ("-c", "constraints.txt")


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["ci"])
def typecheck(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[lint,testing]")
    session.run("mypy")


def _tests(session: nox.Session, torch: str) -> None:
    if torch == PINNED:
        constraints = Path("constraints.txt").resolve()
    else:
        # Other releases come from the package index: a CUDA build (about 3 GB of wheels) that
        # runs on CPU. The session's virtualenv is kept, so later runs install nothing.
        constraints = Path(session.create_tmp()) / "constraints.txt"
        constraints.write_text(f"torch=={torch}\n")
    # PIP_CONSTRAINT replaces any machine-wide pip constraint file (a local mirror may cap torch
    # below the newest release) with ours, so the session gets exactly the release it names.
    session.install("-e", ".[test,cli]", env={"PIP_CONSTRAINT": str(constraints)})
    # The release under test, checked rather than assumed (a local build is `2.13.0+cpu`).
    session.run(
        "python",
        "-c",
        "import sys, torch; print('torch', torch.__version__); "
        "sys.exit(torch.__version__.split('+')[0] != sys.argv[1])",
        torch,
    )
    # Any non-zero exit fails the session, including pytest's 5 (no tests collected).
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


def _tests_session(torch: str, role: str) -> None:
    def tests(session: nox.Session) -> None:
        _tests(session, torch)

    tests.__doc__ = f"The test suite on torch {torch}."
    nox.session(name=f"tests-{_minor(torch)}", tags=["tests", "ci", role])(tests)


# One session per release: tests-2.11, tests-2.13, tests-2.15; `nox -t tests` runs them all,
# `nox -t floor` and `nox -t newest` one each (.ci/run runs them beside `nox`).
for _release, _role in zip(RELEASES, ["floor", "pinned", "newest"], strict=True):
    _tests_session(_release, _role)


@nox.session(tags=["ci"])
def examples(session: nox.Session) -> None:
    """Run every script in examples/; each must exit 0."""
    # test: transformers and accelerate, which the integrations' examples train with.
    session.install(*CONSTRAINTS, "-e", ".[testing,test]")
    for script in sorted(Path("examples").glob("*.py")):
        if "torchrun" in script.name:
            session.run("torchrun", "--standalone", "--nproc_per_node=2", str(script))
        else:
            session.run("python", str(script))


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly: any warning fails the build."""
    # mkdocstrings reads the package's source statically: the docs extra is all it needs.
    session.install(*CONSTRAINTS, *PYPROJECT["project"]["optional-dependencies"]["docs"])
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
    # --strict cannot see an example rendered as text: look at the built HTML.
    session.run("python", "docs/_ext/check_rendered.py", "site")
