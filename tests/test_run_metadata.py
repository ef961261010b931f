"""The footer metadata a run writes: every key is one that schema.py names."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

import ampdoctor
from ampdoctor.schema import META_KEYS, META_LEVEL, META_SCALER_CLASS, SCALER_META
from models import MLP, batches, mse


@pytest.mark.parametrize("enabled", [True, False])
def test_every_metadata_key_a_run_writes_is_named_in_the_schema(tmp_path, enabled):
    path = tmp_path / "run.parquet"
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampdoctor.wrap(torch.amp.GradScaler("cpu", enabled=enabled), model=model, path=path, level="full",
                            flush_every=2)
    for x, y in batches(3):
        scaler.scale(mse(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    segments = [pq.read_metadata(p).metadata for p in sorted(path.iterdir())]
    assert len(segments) >= 2  # flushed every two steps, and the final segment
    for metadata in segments:
        keys = {k.decode() for k in metadata} - {"ARROW:schema"}  # pyarrow's own
        assert keys <= set(META_KEYS), keys - set(META_KEYS)
        # only a disabled torch scaler lacks its settings (it has none)
        absent = {SCALER_META[name] for name in ("growth_factor", "backoff_factor", "growth_interval")}
        assert set(META_KEYS) - keys == (set() if enabled else absent)
        assert metadata[META_SCALER_CLASS.encode()] == b"torch.amp.grad_scaler.GradScaler"
        assert metadata[META_LEVEL.encode()] == b"full"
