"""Hypothesis strategies shared by the test modules: random autograd programs and hook sets."""

from __future__ import annotations
