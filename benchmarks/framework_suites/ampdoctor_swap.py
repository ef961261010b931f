"""pytest plugin (``-p ampdoctor_swap``): run a framework's own tests with ampdoctor's scaler.

Acts at import, so before conftest and test modules import the framework. $AMPDOCTOR_SWAP picks:
  substituted  torch.amp.GradScaler (and torch.{cuda,cpu}.amp.GradScaler) become subclasses of
               ampdoctor.GradScaler that record to a fresh directory under $AMPDOCTOR_SWAP_DIR;
  wrapped      every torch scaler, once constructed, goes through ampdoctor.wrap(scaler, path=...).
Scalers are never closed here, and the framework's fixtures (thread police included) stay as they are.
A spawned child that unpickles a scaler imports this module again and patches itself the same way.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading

import torch

import ampdoctor
from ampdoctor.record.scaler import _Recording

MODE = os.environ.get("AMPDOCTOR_SWAP", "")
REAL = torch.amp.GradScaler


def fresh_path() -> str:
    return tempfile.mkdtemp(prefix="scaler-", dir=os.environ.get("AMPDOCTOR_SWAP_DIR"))


class SubstitutedGradScaler(ampdoctor.GradScaler):
    def __init__(self, *args, path=None, **kwargs):
        super().__init__(*args, path=path or fresh_path(), **kwargs)


def _fixed_device(device: str) -> type:
    """Stand-in for torch.<device>.amp.GradScaler, whose arguments lack ``device``."""
    class GradScaler(SubstitutedGradScaler):
        def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000, enabled=True, **kwargs):
            super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, **kwargs)
    GradScaler.__qualname__ = f"Substituted_{device}_GradScaler"
    return GradScaler


def substitute() -> None:
    torch.amp.GradScaler = torch.amp.grad_scaler.GradScaler = SubstitutedGradScaler
    torch.cuda.amp.GradScaler = _fixed_device("cuda")
    torch.cpu.amp.GradScaler = _fixed_device("cpu")


_depth = threading.local()


def _wrapping_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _depth.n = depth
        if depth == 0 and not isinstance(self, _Recording):  # outermost __init__ done; not ampdoctor's own
            ampdoctor.wrap(self, path=fresh_path())
    return __init__


def wrap_on_construction() -> None:
    classes = [REAL, *REAL.__subclasses__()]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        classes.append(ShardedGradScaler)
    except ImportError:
        pass
    for cls in dict.fromkeys(classes):
        if "__init__" in cls.__dict__ and not issubclass(cls, _Recording):
            cls.__init__ = _wrapping_init(cls.__dict__["__init__"])


if not getattr(torch.amp, "_ampdoctor_swap", None):
    torch.amp._ampdoctor_swap = MODE
    {"substituted": substitute, "wrapped": wrap_on_construction, "": lambda: None}[MODE]()
