"""Which run, rank and world a recording belongs to.

Every rank of a run shares one ``run.id``: ``$AMPDOCTOR_RUN_ID``, or torchrun's
``$TORCHELASTIC_RUN_ID`` when set, else rank 0's, broadcast once at construction (a collective,
on this rank's own GPU under NCCL). A resumed run continues the latest run at its path.
"""

from __future__ import annotations

import os
import uuid
import warnings

import torch

from ..run_file.names import latest_run_id as footers_run_id


def env_run_id() -> str | None:
    for key in ("AMPDOCTOR_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(key)
        if value and value != "none":  # torchrun's default rendezvous id is "none"
            return value
    return None


def broadcast_device(model: torch.nn.Module | None) -> torch.device | None:
    """The device this rank's collectives use: NCCL's default is ``torch.cuda.current_device()``,
    which is GPU 0 on every rank that never called ``set_device``. The model's device when it is
    on a GPU; else, under NCCL, ``LOCAL_RANK``'s GPU when this process sees that many (one GPU per
    process through ``CUDA_VISIBLE_DEVICES`` sees only GPU 0); else the backend's default (None)."""
    if model is not None:
        for p in model.parameters():
            if p.device.type == "cuda":
                return p.device
            break  # on the CPU or meta (deferred initialization): no help
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        local = os.environ.get("LOCAL_RANK")
        if local is not None and int(local) < torch.cuda.device_count():
            return torch.device("cuda", int(local))
        return torch.device("cuda", torch.cuda.current_device())
    return None


def shared_run_id(world_size: int, resume_at: str | os.PathLike | None = None,
                   model: torch.nn.Module | None = None) -> str | None:
    # Resuming: the latest run at the path, unless the user named the run (torchrun makes a new
    # rendezvous id at every launch, so its id cannot say which run is resumed).
    explicit = os.environ.get("AMPDOCTOR_RUN_ID") or None
    env = env_run_id()
    if explicit is not None or (resume_at is None and env is not None):
        return explicit or env
    dist = torch.distributed
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        box = [(latest_run_id(resume_at) or env or uuid.uuid4().hex) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, device=broadcast_device(model))
        return box[0]
    shared = latest_run_id(resume_at) or env
    if shared is None and world_size > 1:
        warnings.warn(f"ampdoctor: {world_size} ranks but torch.distributed is not initialized and no "
                      f"AMPDOCTOR_RUN_ID is set: the ranks cannot agree on one run id, so each will be read as a "
                      f"run of its own; create the scaler after init_process_group, or set AMPDOCTOR_RUN_ID",
                      RuntimeWarning, stacklevel=4)
    return shared


def latest_run_id(path: str | os.PathLike | None) -> str | None:
    """The id of the latest run at ``path`` (the one a resumed run continues), or None."""
    if path is None:
        return None
    return footers_run_id(path)


def rank_and_world(rank: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), dist.get_world_size()
    return (int(os.environ.get("RANK", 0)) if rank is None else rank,
            int(os.environ.get("WORLD_SIZE", 1)))
