"""The run file's Arrow schema, its version and its metadata keys (docs/run-file.md)."""

from __future__ import annotations

import json

import pyarrow as pa

from .hist_column import HIST_TYPE

# 2: `hist` is a variable-length list<int64> (version 1: fixed_size_list<int32>[bins], which
# pyarrow before 26 cannot read back with null rows; hist_column.py says why).
SCHEMA_VERSION = 2

# Binade histogram defaults: bin i counts floor(log2|g|) == HIST_MIN_EXP + i, clamped at both ends.
# 2^-56 .. 2^7 covers every true gradient that fp16 can hold at any scale up to 2^32.
HIST_MIN_EXP = -56
HIST_BINS = 64

# Row kinds: "step" (one per step and rank), "param_grad", "param", and the module taps'.
MODULE_KINDS = ("output", "grad_output")
# The operands FP8 would cast, per GEMM layer (level="full"; gemm_operands.py): each call's input and
# output gradient, each layer's weight; every step.
GEMM_KINDS = ("gemm_input", "gemm_weight", "gemm_grad_output")
FINE_BINS = 2048  # counts in a `fine_hist` (stats/fine_hist.py: the top 12 bits of a float32 magnitude)
ROOT_NAME = "(model)"  # the `name` of module rows of the model itself (its qualified name is "")

# What a run records (the `record.level` metadata value; RecordOptions.level).
LEVELS = ("steps", "params", "full")

# Metadata keys (all values are strings). Every segment carries these; the scaler keys are absent
# for a disabled scaler, and older runs may lack the later ones (readers treat absent as unknown).
META_SCHEMA_VERSION = "ampdoctor.schema_version"
META_VERSION = "ampdoctor.version"
META_TORCH_VERSION = "torch.version"
META_WRITER = "ampdoctor.writer"          # one writer = one recording process on one rank
META_SEGMENT = "ampdoctor.segment"        # 0-based segment number within the writer
META_FINAL = "ampdoctor.final"            # "true" on the segment written by close()
META_RANK = "rank"
META_WORLD_SIZE = "world_size"
META_DEVICE = "device"                    # device type of the gradients: "cuda", "cpu", ...
META_AMP_DTYPE = "amp.dtype"              # autocast dtype: "float16", "bfloat16" or "float32"
META_SCALER_CLASS = "scaler.class"
# The framework whose own arguments set the scaler ("lightning", "fabric", "accelerate"), where the
# run came through it (an ampdoctor integration, or a Lightning model); absent otherwise and
# in runs before 2026-11-28. The recommendation's line to paste is then in that framework's words.
META_SCALER_FRAMEWORK = "scaler.framework"
META_SCALER_ENABLED = "scaler.enabled"    # "true" / "false"
META_INIT_SCALE = "scaler.init_scale"     # the scale when recording started
META_GROWTH_FACTOR = "scaler.growth_factor"
META_BACKOFF_FACTOR = "scaler.backoff_factor"
META_GROWTH_INTERVAL = "scaler.growth_interval"
META_HIST_MIN_EXP = "hist.min_exp"
META_HIST_BINS = "hist.bins"
META_RUN_ID = "run.id"
META_RUN_STARTED = "run.started"          # ISO 8601 with time zone, one-second resolution
META_LEVEL = "record.level"               # "steps", "params" or "full"
META_DROPPED_STEPS = "record.dropped_steps"
# Steps queued but not written because the process ended before the writer could take them (its
# exit deadline, writer.py): nonzero only on a final segment; absent in runs before 2026-11-26.
META_UNWRITTEN_AT_EXIT = "record.unwritten_at_exit"
# JSON object: module name -> class name, for the modules whose name ends in an index (the
# children of nn.Sequential / nn.ModuleList: "blocks.0", "mlp.2"), so reports can say what "mlp.2"
# is. Written only when the scaler was given `model=`; absent in older runs.
META_MODULE_TYPES = "model.module_types"
# JSON object: GEMM layer name -> class name, the layers whose operands are recorded (gemm_* rows);
# written at level="full" only; absent in runs before 2026-11-27.
META_GEMM_LAYERS = "model.gemm_layers"

# The scaler's settings as metadata keys, by ScalerConfig field name.
SCALER_META = {"init_scale": META_INIT_SCALE, "growth_factor": META_GROWTH_FACTOR,
               "backoff_factor": META_BACKOFF_FACTOR, "growth_interval": META_GROWTH_INTERVAL}

META_KEYS = (
    META_SCHEMA_VERSION, META_VERSION, META_TORCH_VERSION, META_WRITER, META_SEGMENT, META_FINAL, META_RANK,
    META_WORLD_SIZE, META_DEVICE, META_AMP_DTYPE, META_SCALER_CLASS, META_SCALER_ENABLED, *SCALER_META.values(),
    META_HIST_MIN_EXP, META_HIST_BINS, META_RUN_ID, META_RUN_STARTED, META_LEVEL, META_DROPPED_STEPS,
    META_UNWRITTEN_AT_EXIT, META_MODULE_TYPES, META_GEMM_LAYERS, META_SCALER_FRAMEWORK,
)


def meta_number(text: str | None) -> int | float | None:
    """A numeric metadata value: an int where it is integral, else a float; None when absent,
    empty (a disabled scaler in older runs) or not a number."""
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else value


def meta_names(text: str | None) -> dict[str, str]:
    """A JSON-object metadata value of names ({module name: class name}: `model.module_types`,
    `model.gemm_layers`); {} when absent, not JSON or not such an object (entries whose value is
    not a string are left out)."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, str)}


_STRING = pa.dictionary(pa.int32(), pa.string())


def run_schema(metadata: dict[str, str] | None = None) -> pa.Schema:
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
        # `hist.bins` counts per full row (the metadata says how many), null on light rows.
        pa.field("hist", HIST_TYPE),
        # Zeros lying in an all-zero row or column (structure, not underflow; stats.zero_line_elements).
        # Null on light rows and in runs written before it existed.
        pa.field("n_zero_lines", pa.int64()),
        # Gradient elements that are 0 here but not in a float32 shadow of the same backward: the
        # underflow, measured (measured steps, `measure_every`; underflow_probe.py). Null where not
        # measured, and in runs written before it existed.
        pa.field("n_underflow", pa.int64()),
        # Measured rows of parameter gradients (and the step row, when all were measured): the
        # elements counted in `n_underflow` by the binade of their float32 shadow's magnitude,
        # unscaled, as `hist` bins them. Null elsewhere and in runs written before it existed.
        pa.field("underflow_hist", HIST_TYPE),
        # Module rows (`output`, `grad_output`) only: the module call's number in the step (in the
        # order calls began), its enclosing tapped call, and the calls whose returned tensors it
        # received as arguments. Null on other rows.
        pa.field("call", pa.int32()),
        pa.field("parent", pa.int32()),
        pa.field("inputs", pa.list_(pa.int32())),
        # Module rows: those of `inputs` received only after untapped code computed with them (not
        # call_graph.PASSES: an inline autograd Function, `x * s`, a cast). Null on other rows and
        # in runs written before it existed (nothing known: every input counts as passed on).
        pa.field("computed_inputs", pa.list_(pa.int32())),
        # GEMM operand rows (`gemm_*`) on module-sampled steps: nonzero elements counted by the top 12
        # bits of their float32 magnitude (stats/fine_hist.py: 8 bins per binade, 2048 in all). Null on
        # other rows and in runs written before it existed.
        pa.field("fine_hist", pa.list_(pa.int64())),
        # GEMM operand rows of layers that block formats convert (not convolutions), on the
        # module-sampled steps of the `module_every` cadence: the operand's block statistics
        # (stats/block_stats.py; run_file/block_bins.py LAYOUT: 3,201 numbers). Null on other rows
        # and in runs written before it existed.
        pa.field("block_stats", pa.list_(pa.float64())),
    ]
    return pa.schema(fields, metadata=metadata)


COLUMNS = tuple(run_schema().names)
