"""Inductor's kernels live in the user's cache directory, so a later run on the host loads them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.core.serving.entry import compile_caches


def _unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set first, so that monkeypatch restores the variable as it was whatever compile_caches writes.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-the-test")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")


def test_inductor_caches_go_under_the_users_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _unset(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "rlfleet" / "inductor")
    assert (tmp_path / "xdg" / "rlfleet" / "inductor").is_dir()


def test_a_cache_directory_the_user_set_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert not (tmp_path / "xdg").exists()


def test_an_unwritable_cache_home_leaves_torchs_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _unset(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    compile_caches()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
