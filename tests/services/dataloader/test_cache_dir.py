"""data.cache_dir defaults to the user's cache folder, not one relative to the working directory:
runs started anywhere (the examples, `make run`) share one build of the default corpus."""

import os

from meshtrain.services.common.cache import user_cache_dir
from meshtrain.services.dataloader.config import DataConfig


def test_meshtrain_cache_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "mc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert DataConfig().cache_dir == str(tmp_path / "mc")


def test_then_xdg_cache_home_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("MESHTRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == str(tmp_path / "xdg" / "meshtrain")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == str(tmp_path / "home" / ".cache" / "meshtrain")


def test_an_explicit_cache_dir_is_kept(monkeypatch, tmp_path):
    assert DataConfig(cache_dir=str(tmp_path)).cache_dir == str(tmp_path)
    assert os.path.isabs(DataConfig().cache_dir)  # never relative to the working directory


def test_the_tests_use_the_checkouts_ignored_cache():
    # tests/conftest.py: tests without --data.cache_dir stay out of the user's cache
    assert os.environ["MESHTRAIN_CACHE"].endswith(os.path.join(".cache", "meshtrain"))
