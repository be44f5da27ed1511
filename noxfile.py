"""Sessions CI runs: `nox` runs them all, `nox -s tests` one of them."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests", "examples", "docs"]

# The torch release the suite is pinned to; the package itself only requires a lower bound.
CONSTRAINTS = ("-c", "constraints.txt")


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[lint]")
    session.run("mypy")


@nox.session
def tests(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[test,cli]")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def examples(session: nox.Session) -> None:
    """Run every script in examples/; each must exit 0."""
    session.install(*CONSTRAINTS, "-e", ".")
    for script in sorted(Path("examples").glob("*.py")):
        if "torchrun" in script.name:
            session.run("torchrun", "--standalone", "--nproc_per_node=2", str(script))
        else:
            session.run("python", str(script))


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly: any warning fails the build."""
    # mkdocstrings reads the package's source statically: the docs extra is all it needs.
    pyproject = nox.project.load_toml("pyproject.toml")
    session.install(*CONSTRAINTS, *pyproject["project"]["optional-dependencies"]["docs"])
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
