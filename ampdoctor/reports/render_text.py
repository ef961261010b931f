"""Plain-text renderers: pure functions from report data to a string. They never print."""

from __future__ import annotations


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def info_text(info: dict) -> str:
    """``ampdoctor info`` as text, from :func:`ampdoctor.run.describe`'s data."""
    sc = info["scaler"]
    steps = info["steps"]
    span = f" (steps {info['first_step']}..{info['last_step']})" if steps else ""
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(info["kinds"].items()))
    lines = [
        f"run        {info['path']}",
        f"schema     version {info['schema_version']} (written by ampdoctor {info['written_by']}, "
        f"torch {info['torch_version']})",
        f"run id     {', '.join(info['run_ids'])}   started {info['started']}",
        f"device     {info['device']}   amp dtype {info['amp_dtype']}",
        f"scaler     {sc['class']}(init_scale={sc['init_scale']}, growth_factor={sc['growth_factor']}, "
        f"backoff_factor={sc['backoff_factor']}, growth_interval={sc['growth_interval']})",
        f"steps      {steps}{span}, {info['skipped_steps']} skipped",
        f"ranks      {len(info['ranks'])} ({', '.join(map(str, info['ranks']))}), world size "
        f"{info['world_size']}",
        f"tensors    {info['tensors']}",
        f"rows       {info['rows']} ({kinds})",
        f"on disk    {_size(info['size_bytes'])} in {info['segments']} segment(s)",
        f"ended      {'cleanly' if info['ended_cleanly'] else 'without close() (killed or still running)'}",
    ]
    lines += [f"warning    {w}" for w in info["warnings"]]
    return "\n".join(lines)
