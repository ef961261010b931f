"""The footer metadata a run writes: every key is one that schema.py names."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

import ampdoctor
from ampdoctor.run_file.schema import (META_KEYS, META_LEVEL, META_MODULE_TYPES, META_SCALER_CLASS, META_SCALER_FRAMEWORK,
                                       SCALER_META)
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
        # ... and scaler.framework is written only for a run that came through a framework
        assert set(META_KEYS) - keys == (set() if enabled else absent) | {META_SCALER_FRAMEWORK}
        assert metadata[META_SCALER_CLASS.encode()] == b"torch.amp.grad_scaler.GradScaler"
        assert metadata[META_LEVEL.encode()] == b"full"


# -- model.module_types: what the indexed modules are ------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Stack(torch.nn.Module):
    """Indexed modules at two depths: a ModuleList of blocks and a Sequential head."""

    def __init__(self, wrap_blocks=lambda block: block) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([wrap_blocks(_Block()) for _ in range(2)])
        self.head = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


_TYPES = {"blocks.0": "_Block", "blocks.1": "_Block", "head.0": "Linear", "head.1": "ReLU", "head.2": "Linear"}


def _record_stack(path, net, **options):
    import json

    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = ampdoctor.GradScaler("cpu", path=path, **options)
    for x, y in batches(2):
        scaler.scale(mse(net, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler.close()
    metadata = [pq.read_metadata(p).metadata for p in sorted(path.iterdir())]
    values = {m.get(META_MODULE_TYPES.encode()) for m in metadata}
    assert len(values) == 1  # every segment carries the same value
    value = values.pop()
    return None if value is None else json.loads(value)


def test_module_types_name_the_indexed_modules_as_the_rows_do(tmp_path):
    torch.manual_seed(0)
    model = _Stack()
    path = tmp_path / "run.parquet"
    types = _record_stack(path, model, model=model, level="full")
    assert types == _TYPES
    frame = ampdoctor.load(path)
    assert set(_TYPES) <= set(frame.loc[frame["kind"] == "output", "name"])  # the rows' own names


def test_module_types_skip_wrapper_levels(tmp_path):
    """Activation checkpointing wraps each block: ``blocks.0`` is a CheckpointWrapper holding the block at
    ``blocks.0._checkpoint_wrapped_module``; the rows say ``blocks.0``, and that is the block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = _Stack(wrap_blocks=checkpoint_wrapper)
    types = _record_stack(tmp_path / "run.parquet", model, model=model)
    assert types == _TYPES


def test_module_types_absent_without_model_and_capped(tmp_path):
    from ampdoctor.record.run_metadata import MAX_MODULE_TYPES, module_types

    torch.manual_seed(0)
    model = _Stack()
    assert _record_stack(tmp_path / "run.parquet", model) is None  # no model=: nothing to say
    assert module_types(model, limit=3) == dict(list(_TYPES.items())[:3])
    many = torch.nn.ModuleList([torch.nn.Identity() for _ in range(MAX_MODULE_TYPES + 50)])
    capped = module_types(many)
    assert len(capped) == MAX_MODULE_TYPES and capped[str(MAX_MODULE_TYPES - 1)] == "Identity"


# -- scaler.framework: whose arguments set the scaler ----------------------------------------------

@pytest.mark.parametrize("module, expected", [
    ("lightning.pytorch.core.module", "lightning"), ("pytorch_lightning.core.module", "lightning"),
    ("lightning.fabric.wrappers", "fabric"), ("my_project.models", None)])
def test_a_model_s_framework_is_told_by_its_classes(module, expected):
    """A LightningModule (or Fabric's wrapper) anywhere in the model's class hierarchy: Lightning
    builds its scaler from its own arguments (issue 40). Class names only are read."""
    from torch import nn
    from ampdoctor.record.run_metadata import framework_of

    base = type("Base", (nn.Module,), {"__module__": module})
    user_model = type("UserModel", (base,), {"__module__": "train"})
    assert framework_of(user_model()) == expected
