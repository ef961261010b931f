"""Whether the reading side says exactly what an earlier commit said: every command's JSON on every run.

Run it once per tree, each writing what the commands printed, then compare the two files:

    git worktree add /tmp/base <commit>
    PYTHONPATH=/tmp/base python benchmarks/reading_identity.py collect RUNS... --out /tmp/before.json
    python benchmarks/reading_identity.py collect RUNS... --out /tmp/after.json
    python benchmarks/reading_identity.py compare /tmp/before.json /tmp/after.json

``RUNS`` are run directories, or folders searched for them (a directory holding ``part-*.parquet``
files): for example the test suite's runs, kept with ``pytest --basetemp=DIR``. Each command runs in
this process through the CLI (``CliRunner``), so the output is the user's, exit code included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMANDS = (["info"], ["report"], ["layers"], ["postmortem"], ["simulate"], ["fp8"])


def runs_under(roots: list[str]) -> list[Path]:
    """Every run directory at or under ``roots`` (a directory holding a segment), sorted."""
    found = set()
    for root in map(Path, roots):
        candidates = [root] if root.is_dir() else []
        candidates += [p for p in root.rglob("*") if p.is_dir()] if root.is_dir() else []
        found.update(p for p in candidates if any(p.glob("part-*.parquet")))
    return sorted(found)


def collect(roots: list[str], out: str) -> None:
    from click.testing import CliRunner

    import ampdoctor
    from ampdoctor.cli import main

    results = {}
    runner = CliRunner()
    runs = runs_under(roots)
    for i, run in enumerate(runs):
        for command in COMMANDS:
            result = runner.invoke(main, [*command, str(run), "--format", "json"])
            results[f"{run} {' '.join(command)}"] = {"exit": result.exit_code, "output": result.output}
        print(f"\r{i + 1}/{len(runs)} runs", end="", file=sys.stderr)
    print(file=sys.stderr)
    Path(out).write_text(json.dumps({"ampdoctor": str(Path(ampdoctor.__file__).parent), "results": results}))


def compare(before: str, after: str) -> int:
    a, b = (json.loads(Path(p).read_text())["results"] for p in (before, after))
    differ = [k for k in sorted(a) if a[k] != b.get(k)]
    missing = sorted(set(a) ^ set(b))
    print(f"{len(a)} outputs compared: {len(a) - len(differ)} identical, {len(differ)} differ"
          + (f", {len(missing)} in one file only" if missing else ""))
    for key in differ[:20]:
        print(f"  differs: {key} (exit {a[key]['exit']} -> {b.get(key, {}).get('exit')})")
    return 1 if differ or missing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("collect")
    c.add_argument("roots", nargs="+")
    c.add_argument("--out", required=True)
    d = sub.add_parser("compare")
    d.add_argument("before")
    d.add_argument("after")
    args = parser.parse_args()
    if args.what == "collect":
        collect(args.roots, args.out)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
