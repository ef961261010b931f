"""The CLI: thin commands, one-line errors with exit code 2, never a traceback."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ampdoctor.cli import main
from test_run import record


@pytest.fixture
def cli():
    return CliRunner()


def test_info_text_and_json(cli, run_path):
    record(run_path)
    text = cli.invoke(main, ["info", str(run_path)])
    assert text.exit_code == 0, text.output
    assert "steps      6 (steps 0..5), 0 skipped" in text.output
    assert "ended      cleanly" in text.output
    data = json.loads(cli.invoke(main, ["info", str(run_path), "--format", "json"]).output)
    assert data["steps"] == 6 and data["tensors"] == 6 and data["schema_version"] == 1


@pytest.mark.parametrize("setup,message", [
    (lambda p: None, "no such file"),
    (lambda p: p.write_text("hi"), "not a Parquet file"),
    (lambda p: p.mkdir(), "empty directory"),
])
def test_info_bad_input_is_one_line_exit_2(cli, tmp_path, setup, message):
    target = tmp_path / "thing"
    setup(target)
    result = cli.invoke(main, ["info", str(target)])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_demo_writes_a_run_that_info_reads(cli, tmp_path):
    out = tmp_path / "demo.parquet"
    result = cli.invoke(main, ["demo", "--out", str(out), "--steps", "8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert f"ampdoctor report {out}" in result.output
    info = json.loads(cli.invoke(main, ["info", str(out), "--format", "json"]).output)
    assert info["steps"] == 8 and info["amp_dtype"] == "float16" and info["tensors"] == 29


def test_demo_refuses_cuda_without_a_gpu(cli, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = cli.invoke(main, ["demo", "--device", "cuda", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "CUDA is not available" in result.output


def test_simulate_takes_scales_as_the_reports_print_them(cli, run_path):
    """The reports print scales as ``2**24``: the same text is accepted back, as is ``2^24``."""
    record(run_path)
    outputs = []
    for text in ("2**10", "2^10", "1024", "1.024e3"):
        result = cli.invoke(main, ["simulate", str(run_path), "--init-scale", text, "--max-scale", "2**20",
                                   "--format", "json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        assert data["config"]["init_scale"] == 1024.0 and data["config"]["max_scale"] == 2.0**20
        outputs.append(data)
    assert all(o == outputs[0] for o in outputs)
    for bad in ("2**x", "0", "-2**3", "-2**4", "nan"):
        result = cli.invoke(main, ["simulate", str(run_path), "--init-scale", bad])
        assert result.exit_code == 2, (bad, result.output)
        assert "Traceback" not in result.output and "--init-scale" in result.output


def test_import_and_help_load_neither_torch_nor_pandas():
    """A training script's ``import ampdoctor`` pulls no analysis stack, and ``--help`` and
    ``--version`` answer without importing torch (seconds and hundreds of MiB)."""
    code = ("import sys, ampdoctor\n"
            "from ampdoctor import cli\n"
            "heavy = [m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert ampdoctor.GradScaler.__module__ == 'ampdoctor.scaler' and 'torch' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    for flag in ("--help", "--version"):
        probe = ("import sys; from ampdoctor.cli import main\n"
                 "try:\n    main([%r])\nexcept SystemExit as exc:\n    assert not exc.code\n"
                 "assert 'torch' not in sys.modules and 'pandas' not in sys.modules\n") % flag
        subprocess.run([sys.executable, "-c", probe], check=True, timeout=120, capture_output=True)


def test_reading_a_run_imports_no_torch(tmp_path):
    """Every command that reads a run works without torch (about a second and 300 MiB less), so a
    report on a laptop or in CI needs no torch build; the ``ampdoctor.report`` and
    ``ampdoctor.postmortem`` functions too."""
    path = tmp_path / "run.parquet"
    record(path, steps=4, init_scale=2.0**24)
    probe = ("import sys\nfrom ampdoctor.cli import main\n"
             "for args in (['info'], ['report'], ['report', '--format', 'html'], ['simulate'], ['layers'],\n"
             "             ['postmortem', '--format', 'md']):\n"
             "    try:\n        main([*args[:1], %r, *args[1:]])\n"
             "    except SystemExit as exc:\n        assert not exc.code, (args, exc.code)\n"
             "import ampdoctor\n"
             "assert ampdoctor.report(%r)['scale']['skipped_steps'] > 0\n"
             "assert ampdoctor.postmortem(%r)['status']\n"
             "assert 'torch' not in sys.modules, 'a reading command imported torch'\n") % ((str(path),) * 3)
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=300, capture_output=True)


def test_an_internal_error_is_one_line_unless_a_traceback_is_asked_for(tmp_path, monkeypatch):
    path = tmp_path / "run.parquet"
    record(path)

    def broken(run):
        return 1 / 0

    monkeypatch.setattr("ampdoctor.run.describe", broken)
    monkeypatch.delenv("AMPDOCTOR_DEBUG", raising=False)
    result = CliRunner().invoke(main, ["info", str(path)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "internal error: ZeroDivisionError" in result.output and "--traceback" in result.output
    for args, env in ((["--traceback", "info", str(path)], {}), (["info", str(path)], {"AMPDOCTOR_DEBUG": "1"})):
        result = CliRunner().invoke(main, args, env=env)
        assert isinstance(result.exception, ZeroDivisionError) and result.exit_code == 1
