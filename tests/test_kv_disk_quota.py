"""The disk KV tier bounds each tenant's page files (`max_bytes_per_owner`): past it, that
tenant's least recently used files go, and no other tenant's."""

from __future__ import annotations

import os

import torch

from engine.kv.disk import DiskKV

SHAPE = (2, 2, 4, 1, 8)  # (num_layers, 2, page_size, kv_heads, head_dim)


def _write(disk: DiskKV, owner: str, keys: list[str]) -> None:
    pages = torch.randn(len(keys), *SHAPE)
    disk.write(keys, pages, lambda: None, owner)
    disk.flush()


def test_one_tenant_cannot_push_out_another(tmp_path) -> None:
    probe = DiskKV(tmp_path / "probe", "f" * 64, SHAPE, torch.float32)
    _write(probe, "x", ["probe"])
    page = probe.nbytes  # one file's bytes
    disk = DiskKV(tmp_path, "0" * 64, SHAPE, torch.float32, max_bytes=100 * page,
                  max_bytes_per_owner=4 * page)
    _write(disk, "victim", [f"v{i}" for i in range(3)])
    for i in range(20):  # the attacker writes 20 pages, oldest first
        _write(disk, "attacker", [f"a{i}"])
        os.utime(disk.dir / f"a{i}.kvpage", (i + 1, i + 1))
    assert disk.owner_bytes["attacker"] <= 4 * page
    assert {f"a{i}" for i in range(16, 20)} <= disk.index  # its most recent stay
    assert {f"v{i}" for i in range(3)} <= disk.index  # the victim's are untouched
    on_disk = {f.stem: f.stat().st_size for f in disk.dir.glob("*.kvpage")}
    assert len(on_disk) == 7 and disk.nbytes == sum(on_disk.values())
    assert disk.owner_bytes["victim"] == sum(on_disk[f"v{i}"] for i in range(3))
    # A restarted tier counts what it finds toward the folder's bound only.
    again = DiskKV(tmp_path, "0" * 64, SHAPE, torch.float32)
    assert again.nbytes == disk.nbytes and not again.owner_bytes
