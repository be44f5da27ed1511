"""Sessions CI runs: `nox` runs them all, `nox -s tests` one of them."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests"]

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
    session.install(*CONSTRAINTS, "-e", ".[test]")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})
