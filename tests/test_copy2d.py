"""`kernels.copy2d.copy_rows`: rows at a pitch copied between pinned host memory and the device
in one driver call, against torch's copy; the per-row fallback past the driver's pitch limit."""

from __future__ import annotations

import pytest
import torch

from kernels import copy2d


def test_rows_must_be_contiguous():
    t = torch.zeros(4, 6, 8)
    assert copy2d._rows(t[:, 1:3]) == (2 * 8 * 4, 6 * 8 * 4)
    with pytest.raises(ValueError, match="not rows at a pitch"):
        copy2d._rows(t[:, :, :4])
    with pytest.raises(ValueError, match="not rows at a pitch"):
        copy2d._rows(torch.zeros(5))


@pytest.mark.gpu
@pytest.mark.parametrize("fallback", [False, True])
def test_copy_rows_matches_torch(fallback, monkeypatch):
    if fallback:  # every pitch over the limit: a torch copy per row
        monkeypatch.setattr(copy2d, "max_pitch", lambda index: 0)
    torch.manual_seed(0)
    stream = torch.cuda.Stream()
    dev = torch.randn(6, 2, 50, 3, 8, device="cuda").to(torch.bfloat16)
    host = torch.zeros(6, 2, 70, 3, 8, dtype=torch.bfloat16, pin_memory=True)
    # device -> host: 12 rows of 7 pages, pitches 50 and 70 pages
    stream.wait_stream(torch.cuda.current_stream())
    copy2d.copy_rows(host[:, :, 40:47].flatten(0, 1), dev[:, :, 3:10].flatten(0, 1), stream)
    stream.synchronize()
    assert torch.equal(host[:, :, 40:47], dev[:, :, 3:10].cpu())
    assert not host[:, :, :40].any() and not host[:, :, 47:].any()
    # host -> device, one layer's K and V (2 rows)
    back = torch.zeros_like(dev)
    stream.wait_stream(torch.cuda.current_stream())
    copy2d.copy_rows(back[4, :, 20:27], host[4, :, 40:47], stream)
    stream.synchronize()
    assert torch.equal(back[4, :, 20:27], dev[4, :, 3:10])
    assert back[4, :, :20].count_nonzero() == 0 and back[:4].count_nonzero() == 0
    with pytest.raises(ValueError, match="copy_rows"):
        copy2d.copy_rows(back[4, :, 20:26], host[4, :, 40:47], stream)
