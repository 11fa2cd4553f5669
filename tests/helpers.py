"""Shared builders for the test suite."""

from __future__ import annotations
