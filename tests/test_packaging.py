"""What a user of the project gets: `switchboard serve` starts without the optional Redis
package (the offline GPU machine has none), and the project's docs point only at files the
project ships."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from conftest import ROOT, SERVE_FLAGS, THREADS, _wait_for_banner


def test_serve_starts_and_answers_without_redis(tmp_path: Path) -> None:
    blocked = tmp_path / "site" / "redis"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('redis is not installed here')\n")
    log = tmp_path / "serve.log"
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0",
           "--adapter-dir", str(tmp_path / "adapters"), *SERVE_FLAGS]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
                                     **THREADS})
    try:
        url = _wait_for_banner(proc, log, timeout=300)
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()  # SIGTERM drains and exits 0
    assert "redis" not in log.read_text().lower(), log.read_text()


def test_docs_point_only_inside_the_project() -> None:
    """Users have the repository, not the team's machines: no link may leave it."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        text = doc.read_text()
        assert "../shared" not in text, doc
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
