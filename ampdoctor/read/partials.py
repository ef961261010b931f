"""The run's aggregates as engine-neutral SQL: partial aggregates per segment that combine exactly,
for an engine that runs where the run is (Spark, Trino, DuckDB; docs/sql.md).

A run directory is a Parquet dataset. Over it, as a table ``run_rows`` with one more column,
``segment`` (what file a row came from: Spark's ``input_file_name()``, Trino's ``"$path"``,
DuckDB's ``filename``), :data:`STEP_PARTIALS` and :data:`LAYER_PARTIALS` aggregate each segment
on its own (a map step: any number of workers, any split of the files), and
:data:`COMBINE_STEPS` and :data:`COMBINE_LAYERS` combine the partials (tables ``step_partials`` and
``layer_partials``) into:

* per step, merged over ranks (step rows with a valid scale, as the report reads them): the
  loss scale (of the lowest rank),
  whether any rank skipped it, recorded and non-finite losses, elements, zeros and the largest
  finite gradient peak;
* per layer (name, kind): its full observations, zero and subnormal rates, largest finite peak,
  smallest nonzero magnitude and non-finite observations.

Every partial is a count, an integer sum, a maximum, a minimum or a logical or, so the combined
figures are exactly those of one pass, in any order. Where the report shows the same figure they
are its own, exactly (tests/test_partials.py): each step's scale and whether it was skipped, and
each layer's observations, zero and subnormal rates, peak, smallest magnitude and non-finite
observations. The step's elements, zeros and peak are the rows' own sums and maximum (the report's
step series reads them differently: a light step's zeros are carried from its sample, an overflowed
step's peak is none). Only portable SQL: no engine's own functions
(finite means between ±3.5e38, which NaN is not on any of the three), ``min_by`` and ``bool_or``
(Spark 3.0, Trino and DuckDB have both).

What SQL cannot combine is not here: the underflow figures come from the layer scan's
calibration, which carries each tensor's measured structure and sampled histograms along its
steps (:mod:`ampdoctor.analysis.calibration`), and the recommendation from replaying the scaler
over the steps. Rows that a later process of the run recorded again (``Segment.until``, a run
resumed from an earlier checkpoint) are counted twice by the SQL alone; :func:`run_partials`
leaves them out, as every command does.
"""

from __future__ import annotations

import pyarrow as pa

from .engine import FINITE, NONFINITE, Session, arrow_of

STEP_PARTIALS = f"""
SELECT segment, step,
       MIN(rank) AS first_rank,
       MIN_BY(scale, rank) AS first_rank_scale,
       BOOL_OR(skipped) AS skipped,
       CAST(SUM(CASE WHEN loss IS NOT NULL THEN 1 ELSE 0 END) AS BIGINT) AS losses,
       CAST(SUM(CASE WHEN loss IS NOT NULL AND NOT {FINITE.format(x="loss")} THEN 1 ELSE 0 END) AS BIGINT)
           AS nonfinite_losses,
       CAST(SUM(numel) AS BIGINT) AS numel,
       CAST(SUM(n_zero) AS BIGINT) AS n_zero,
       MAX(CASE WHEN {FINITE.format(x="amax")} THEN amax END) AS amax
FROM run_rows
WHERE kind = 'step' AND scale >= 0 AND scale < 3.5e38
GROUP BY segment, step
"""

LAYER_PARTIALS = f"""
SELECT segment, name, kind,
       CAST(SUM(CASE WHEN n_zero IS NOT NULL THEN 1 ELSE 0 END) AS BIGINT) AS observations,
       CAST(SUM(CASE WHEN n_zero IS NOT NULL THEN numel ELSE 0 END) AS BIGINT) AS observed_numel,
       CAST(SUM(n_zero) AS BIGINT) AS n_zero,
       CAST(SUM(n_subnormal) AS BIGINT) AS n_subnormal,
       CAST(SUM(CASE WHEN {NONFINITE} THEN 1 ELSE 0 END) AS BIGINT) AS nonfinite,
       MAX(CASE WHEN NOT {NONFINITE} AND {FINITE.format(x="amax")} THEN amax END) AS amax,
       MIN(CASE WHEN {FINITE.format(x="amin")} THEN amin END) AS amin
FROM run_rows
WHERE kind IN ('param_grad', 'grad_output', 'output')
GROUP BY segment, name, kind
"""

COMBINE_STEPS = """
SELECT step,
       MIN_BY(first_rank_scale, first_rank) AS scale,
       BOOL_OR(skipped) AS skipped,
       CAST(SUM(losses) AS BIGINT) AS losses,
       CAST(SUM(nonfinite_losses) AS BIGINT) AS nonfinite_losses,
       CAST(SUM(numel) AS BIGINT) AS numel,
       CAST(SUM(n_zero) AS BIGINT) AS n_zero,
       MAX(amax) AS amax
FROM step_partials
GROUP BY step
ORDER BY step
"""

COMBINE_LAYERS = """
SELECT name, kind,
       CAST(SUM(observations) AS BIGINT) AS observations,
       CASE WHEN SUM(observations) > 0
            THEN CAST(SUM(n_zero) AS DOUBLE) / GREATEST(SUM(observed_numel), 1) END AS zero_rate,
       CASE WHEN SUM(observations) > 0
            THEN CAST(SUM(n_subnormal) AS DOUBLE) / GREATEST(SUM(observed_numel), 1) END AS subnormal_rate,
       CAST(SUM(nonfinite) AS BIGINT) AS nonfinite,
       MAX(amax) AS amax,
       MIN(amin) AS amin
FROM layer_partials
GROUP BY name, kind
ORDER BY name, kind
"""


def run_partials(run, segments_per_part: int | None = None) -> tuple[pa.Table, pa.Table]:
    """(``step_partials``, ``layer_partials``) of a read run, computed by the embedded engine on
    the run's rows (superseded ones left out): one part per segment, as a cluster's workers would
    compute them. ``segments_per_part``: instead, group that many segments into one part (any
    grouping combines to the same figures)."""
    key = "segment" if not segments_per_part else f"segment // {int(segments_per_part)}"
    with Session(run) as session:
        view = f"(SELECT * REPLACE ({key} AS segment) FROM rows) AS run_rows"
        return (session.query(STEP_PARTIALS.replace("FROM run_rows", f"FROM {view}")),
                session.query(LAYER_PARTIALS.replace("FROM run_rows", f"FROM {view}")))


def combine(step_partials: pa.Table, layer_partials: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The per-step and per-layer figures (:data:`COMBINE_STEPS`, :data:`COMBINE_LAYERS`) of
    partials computed anywhere (Arrow tables of :data:`STEP_PARTIALS`' and
    :data:`LAYER_PARTIALS`' columns), combined by the embedded engine."""
    import duckdb

    connection = duckdb.connect(":memory:")
    try:
        connection.register("step_partials", step_partials)
        connection.register("layer_partials", layer_partials)
        return arrow_of(connection.sql(COMBINE_STEPS)), arrow_of(connection.sql(COMBINE_LAYERS))
    finally:
        connection.close()
