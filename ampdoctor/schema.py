"""The run file's Arrow schema, its version and its metadata keys (DESIGN.md, "The run file")."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

# Binade histogram defaults: bin i counts floor(log2|g|) == HIST_MIN_EXP + i, clamped at both ends.
# 2^-56 .. 2^7 covers every true gradient that fp16 can hold at any scale up to 2^32.
HIST_MIN_EXP = -56
HIST_BINS = 64

KINDS = ("step", "param_grad", "grad_output", "output", "param")

# Metadata keys present in every segment (all values are strings).
META_SCHEMA_VERSION = "ampdoctor.schema_version"
META_VERSION = "ampdoctor.version"
META_TORCH_VERSION = "torch.version"
META_WRITER = "ampdoctor.writer"          # one writer = one recording process on one rank
META_SEGMENT = "ampdoctor.segment"        # 0-based segment number within the writer
META_FINAL = "ampdoctor.final"            # "true" on the segment written by close()
META_RANK = "rank"
META_KEYS = (
    META_SCHEMA_VERSION, META_VERSION, META_TORCH_VERSION, "scaler.class", "scaler.init_scale",
    "scaler.growth_factor", "scaler.backoff_factor", "scaler.growth_interval", "amp.dtype", "device",
    "world_size", "hist.min_exp", "hist.bins", "run.id", "run.started", "record.level", "record.dropped_steps",
)

_STRING = pa.dictionary(pa.int32(), pa.string())


def run_schema(hist_bins: int = HIST_BINS, metadata: dict[str, str] | None = None) -> pa.Schema:
    """The Arrow schema of one segment; ``metadata`` becomes the file's key-value metadata."""
    fields = [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("kind", _STRING, nullable=False),
        pa.field("name", _STRING, nullable=False),
        pa.field("order", pa.int32()),
        pa.field("dtype", _STRING, nullable=False),
        pa.field("numel", pa.int64(), nullable=False),
        pa.field("scale", pa.float32(), nullable=False),
        pa.field("skipped", pa.bool_(), nullable=False),
        pa.field("loss", pa.float32()),
        pa.field("amax", pa.float32()),
        pa.field("amin", pa.float32()),
        pa.field("l2", pa.float32()),
        # Counts are null only on light module rows (flight recorder: only `amax` is measured).
        pa.field("n_zero", pa.int64()),
        pa.field("n_subnormal", pa.int64()),
        pa.field("n_nan", pa.int64()),
        pa.field("n_inf", pa.int64()),
        pa.field("hist", pa.list_(pa.int32(), hist_bins)),
        # Zeros lying in an all-zero row or column (structure, not underflow; stats.zero_line_elements).
        # Null on light rows and in runs written before it existed.
        pa.field("n_zero_lines", pa.int64()),
        # Module rows (`output`, `grad_output`) only: the module call's number in the step (in the
        # order calls began), its enclosing tapped call, and the calls whose returned tensors it
        # received as arguments. Null on other rows.
        pa.field("call", pa.int32()),
        pa.field("parent", pa.int32()),
        pa.field("inputs", pa.list_(pa.int32())),
    ]
    return pa.schema(fields, metadata=metadata)


COLUMNS = tuple(run_schema().names)
