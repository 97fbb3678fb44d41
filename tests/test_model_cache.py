"""The model cache (`~/.cache/switchboard/models`) when processes fill it at once: servers
started together, or test workers, each converting the same checkpoint. Whoever finishes first
publishes the folder; the others use it (engine.config.publish_dir)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.config import publish_dir
from engine.runner.synthetic import MARKER, synthetic_dir


def _at_once(n: int, fn) -> list[Path]:
    start = threading.Barrier(n)

    def run(_):
        start.wait()
        return fn()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_a_folder_published_second_keeps_the_first(tmp_path: Path) -> None:
    """As two conversions of one GGUF (`convert_gguf`) end: the second rename finds the first's
    folder in place and keeps it; a folder in the way that is not finished is an error."""
    out = tmp_path / "m"
    for name, text in (("a", "first"), ("b", "second")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        publish_dir(tmp_path / name, out, "config.json")
    assert (out / "config.json").read_text() == "first"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    half = tmp_path / "half"
    half.mkdir()
    (half / "partial").write_text("")
    with pytest.raises(OSError):
        publish_dir(tmp_path / "c", half, "config.json")


def test_synthetic_folders_written_at_once_share_one_folder(tmp_path: Path) -> None:
    outs = _at_once(8, lambda: synthetic_dir("synthetic:tiny", tmp_path))
    assert len(set(outs)) == 1 and (outs[0] / MARKER).is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [outs[0].name]
