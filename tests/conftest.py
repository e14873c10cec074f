"""Shared fixtures: one export cache per test session, so each tiny model is exported once."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def export_cache_dir(tmp_path_factory):
    """Point ort_offload's export cache at a session directory (and restore the env after)."""
    path = tmp_path_factory.mktemp("export_cache")
    old = os.environ.get("ORT_OFFLOAD_CACHE_DIR")
    os.environ["ORT_OFFLOAD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("ORT_OFFLOAD_CACHE_DIR", None)
    else:
        os.environ["ORT_OFFLOAD_CACHE_DIR"] = old
