"""``ampdoctor export RUN --tensorboard DIR``: a run's scalars, histograms and underflow rates
(:mod:`.series`) as TensorBoard event files, written with ``torch.utils.tensorboard.SummaryWriter``.

One subdirectory per rank, ``DIR/rank{N}``: TensorBoard lists each as a run of its own, so the
ranks' curves overlay on one chart with the same tags. Steps are the run's step numbers.
tensorboard is an optional dependency (``pip install "ampdoctor[tensorboard]"``); torch is
imported here, by the export only.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import AmpdoctorError
from ..read.run import Run, expect_run
from ..run_file.schema import META_RUN_ID
from .series import layer_points, layout, step_scalars

INSTALL_HINT = 'pip install "ampdoctor[tensorboard]"'
EVENT_PREFIX = "events.out.tfevents."


def rank_dir(logdir: str | os.PathLike, rank: int) -> Path:
    return Path(logdir) / f"rank{rank}"


def export_tensorboard(run: Run, logdir: str | os.PathLike) -> dict:
    """Write ``run`` as TensorBoard event files under ``logdir`` (``rank{N}/`` per rank). Returns
    what was written: ``{"path", "run_id", "logdir", "ranks": [{"rank", "dir", "steps", "scalars",
    "histograms"}]}`` (counts of points). Raises :class:`AmpdoctorError` when tensorboard is not
    installed, or when a rank's directory already holds event files (TensorBoard would show both
    exports as one run)."""
    expect_run(run, "export_tensorboard()")
    summary_writer = _summary_writer_class()
    earlier = sorted(Path(logdir).glob(f"rank*/{EVENT_PREFIX}*"))
    if earlier:
        raise AmpdoctorError(f"{earlier[0].parent}: already holds TensorBoard event files (TensorBoard would show "
                             f"both exports as one run); export into a new directory, or remove them first")
    scalars = step_scalars(run)
    writers: dict = {}
    counts: dict[int, dict] = {}

    def writer(rank: int):
        if rank not in writers:
            writers[rank] = summary_writer(log_dir=str(rank_dir(logdir, rank)), max_queue=1000, flush_secs=3600)
            counts[rank] = {"rank": rank, "dir": str(rank_dir(logdir, rank)), "steps": 0, "scalars": 0,
                            "histograms": 0}
        return writers[rank]

    completed = False
    try:
        for rank in sorted(scalars):
            w = writer(rank)
            for tag, (steps, values) in scalars.get(rank, {}).items():
                for step, value in zip(steps.tolist(), values.tolist()):
                    w.add_scalar(tag, value, global_step=step)
                counts[rank]["scalars"] += len(steps)
                if tag == "steps/scale":
                    counts[rank]["steps"] = len(steps)
        for rank, histograms, underflow in layer_points(run, layout(run)):
            w = writer(rank)
            for h in histograms:
                w.add_histogram_raw(h.tag, min=h.min, max=h.max, num=h.num, sum=float("nan"),
                                    sum_squares=h.sum_squares, bucket_limits=h.limits, bucket_counts=h.counts,
                                    global_step=h.step)
            for tag, step, value in underflow:
                w.add_scalar(tag, value, global_step=step)
            counts[rank]["histograms"] += len(histograms)
            counts[rank]["scalars"] += len(underflow)
        completed = True
    finally:
        for w in writers.values():
            w.close()
        if not completed:
            # No half export left behind: it would make a retry refuse the directory. Every event
            # file there is this export's (an earlier one was refused above).
            for partial in Path(logdir).glob(f"rank*/{EVENT_PREFIX}*"):
                partial.unlink(missing_ok=True)
    return {"path": str(run.path), "run_id": run.metadata.get(META_RUN_ID, ""), "logdir": str(logdir),
            "ranks": [counts[r] for r in sorted(counts)], "warnings": list(run.warnings)}


def _summary_writer_class():
    """``SummaryWriter``, or an error naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise AmpdoctorError(f"exporting to TensorBoard needs the tensorboard package ({exc}): "
                             f"{INSTALL_HINT}") from None
    return SummaryWriter
