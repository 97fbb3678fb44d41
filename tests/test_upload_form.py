"""An adapter upload's multipart body parsed as it arrives (gateway/adapters/form.py): the files
land in the staging folder byte for byte however the body is cut into chunks, and every
malformed form is a 4xx naming its problem; staging folders of dead uploads are removed. The
HTTP side (status codes, nothing stored) is tests/test_hostile_uploads.py's."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.adapters.form import CHUNK, MAX_FILES, StagedForm
from gateway.adapters.shared import STALE_STAGING_S, staging_dir
from gateway.errors import APIError

BOUNDARY = b"b0undary"
TYPE = "multipart/form-data; boundary=b0undary"


def body(parts: list[tuple[str, str | None, bytes]]) -> bytes:
    """(field, file name or None, data) parts as a browser or curl frames them."""
    out = b""
    for field, filename, data in parts:
        disposition = f'form-data; name="{field}"' + (f'; filename="{filename}"'
                                                       if filename is not None else "")
        out += (b"--" + BOUNDARY + b"\r\nContent-Disposition: " + disposition.encode()
                + b"\r\nContent-Type: application/octet-stream\r\n\r\n" + data + b"\r\n")
    return out + b"--" + BOUNDARY + b"--\r\n"


async def chunks(data: bytes, sizes: list[int]) -> AsyncIterator[bytes]:
    i = 0
    for n in sizes:
        yield data[i : i + n]
        i += n
    yield data[i:]


def read(tmp: Path, data: bytes, sizes: list[int] = (), limit: int = 1 << 30,
         content_type: str = TYPE) -> StagedForm:
    form = StagedForm(tmp)
    asyncio.run(form.read(chunks(data, list(sizes)), content_type, limit))
    return form


def test_files_land_whole_however_the_body_is_cut(tmp_path: Path) -> None:
    """Random bytes (CRLFs and boundary-like runs included) in two files, 9 MB in all, the
    body cut at random places (so the parser is fed it in pieces of about `CHUNK`, split
    anywhere): the staging folder holds them exactly, with the name field and each file's
    size; a file under another field is read past."""
    rng = random.Random(0)
    weights = rng.randbytes(9_000_000) + b"\r\n--b0undar" * 50
    config = b'{"r": 4, "peft_type": "LORA"}'
    data = body([("files", "adapter_config.json", config), ("name", None, b"poet"),
                 ("other", "ignored.bin", b"x" * 1000),
                 ("files", "adapter_model.safetensors", weights)])
    cuts = [1] * 50 + [rng.randrange(1, 300_000) for _ in range(60)]
    assert sum(cuts) > 2 * CHUNK
    for k, sizes in enumerate(([], cuts)):
        staging = tmp_path / str(k)
        staging.mkdir()
        form = read(staging, data, sizes)
        assert form.name == "poet"
        assert form.sizes == {"adapter_config.json": len(config),
                              "adapter_model.safetensors": len(weights)}
        assert sorted(p.name for p in staging.iterdir()) == sorted(form.sizes)
        assert (staging / "adapter_model.safetensors").read_bytes() == weights
        assert (staging / "adapter_config.json").read_bytes() == config


@pytest.mark.parametrize(("data", "limit", "content_type", "status", "phrase"), [
    (body([("files", "a", b"x")]), 1 << 20, "multipart/form-data", 400, "no boundary"),
    (b"--b0undary\r\nnot a header line\r\n\r\n", 1 << 20, TYPE, 400, "invalid multipart body"),
    (body([("files", "../a", b"x")]), 1 << 20, TYPE, 400, "bad file name '../a'"),
    (body([("files", "a", b"x"), ("files", "a", b"y")]), 1 << 20, TYPE, 400, "sent twice"),
    (body([("files", f"f{i}", b"x") for i in range(MAX_FILES + 1)]), 1 << 20, TYPE, 400,
     f"more than {MAX_FILES} files"),
    (body([(f"x{i}", None, b"x") for i in range(5)]), 1 << 20, TYPE, 400, "more than 4 fields"),
    (body([("files", "a", b"x" * 5000)]), 4096, TYPE, 413, "exceeds 4096 bytes"),
])
def test_a_malformed_form_is_a_clear_4xx(tmp_path: Path, data: bytes, limit: int,
                                         content_type: str, status: int, phrase: str) -> None:
    with pytest.raises(APIError) as e:
        read(tmp_path, data, [7] * (len(data) // 7), limit, content_type)
    assert e.value.status == status and phrase in e.value.message, e.value.message


def test_staging_left_by_a_dead_upload_is_removed(tmp_path: Path) -> None:
    """A staging folder nothing wrote into for an hour (its process died mid-upload) goes when
    the next upload stages; one written into a minute ago (a slow upload) stays."""
    root = tmp_path / ".staging"
    for name, age in (("dead", STALE_STAGING_S + 60), ("slow", 60.0)):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_model.safetensors").write_bytes(b"x" * 100)
        for p in (root / name, root / name / "adapter_model.safetensors"):
            os.utime(p, (time.time() - age,) * 2)
    fresh = staging_dir(SimpleNamespace(store_dir=tmp_path))
    assert sorted(p.name for p in root.iterdir()) == sorted(["slow", fresh.name])
