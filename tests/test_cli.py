"""The CLI: thin commands, one-line errors with exit code 2, never a traceback."""

import json
import shlex
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from ampdoctor.cli.commands import main
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
    assert data["steps"] == 6 and data["tensors"] == 6 and data["schema_version"] == 2


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
            "assert ampdoctor.GradScaler.__module__ == 'ampdoctor.record.scaler' and 'torch' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    for flag in ("--help", "--version"):
        probe = ("import sys; from ampdoctor.cli.commands import main\n"
                 "try:\n    main([%r])\nexcept SystemExit as exc:\n    assert not exc.code\n"
                 "assert 'torch' not in sys.modules and 'pandas' not in sys.modules\n") % flag
        subprocess.run([sys.executable, "-c", probe], check=True, timeout=120, capture_output=True)


def test_reading_a_run_imports_no_torch(tmp_path):
    """Every command that reads a run works without torch (about a second and 300 MiB less), so a
    report on a laptop or in CI needs no torch build; the ``ampdoctor.report`` and
    ``ampdoctor.postmortem`` functions too."""
    path = tmp_path / "run.parquet"
    record(path, steps=4, init_scale=2.0**24)
    probe = ("import sys\nfrom ampdoctor.cli.commands import main\n"
             "for args in (['info'], ['report'], ['report', '--format', 'html'], ['simulate'], ['layers'],\n"
             "             ['postmortem', '--format', 'md'], ['watch'], ['compare', %r]):\n"
             "    try:\n        main([*args[:1], %r, *args[1:]])\n"
             "    except SystemExit as exc:\n        assert not exc.code, (args, exc.code)\n"
             "import ampdoctor\n"
             "assert ampdoctor.report(%r)['scale']['skipped_steps'] > 0\n"
             "assert ampdoctor.postmortem(%r)['status']\n"
             "assert 'torch' not in sys.modules, 'a reading command imported torch'\n") % ((str(path),) * 4)
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=300, capture_output=True)


def test_an_internal_error_is_one_line_unless_a_traceback_is_asked_for(tmp_path, monkeypatch):
    path = tmp_path / "run.parquet"
    record(path)

    def broken(run):
        return 1 / 0

    monkeypatch.setattr("ampdoctor.read.run.describe", broken)
    monkeypatch.delenv("AMPDOCTOR_DEBUG", raising=False)
    result = CliRunner().invoke(main, ["info", str(path)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "internal error: ZeroDivisionError" in result.output and "--traceback" in result.output
    for args, env in ((["--traceback", "info", str(path)], {}), (["info", str(path)], {"AMPDOCTOR_DEBUG": "1"})):
        result = CliRunner().invoke(main, args, env=env)
        assert isinstance(result.exception, ZeroDivisionError) and result.exit_code == 1


def test_every_simulate_setting_has_help(cli):
    """Each setting of `simulate` says what it does and what it defaults to."""
    from ampdoctor.cli.commands import simulate

    options = {p.name: p for p in simulate.params if isinstance(p, click.Option)}
    for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                 "min_scale", "max_scale"):
        assert options[name].help and "[default:" in options[name].help, name
    text = cli.invoke(main, ["simulate", "--help"], terminal_width=100).output
    assert "Factor by which the scale grows" in text and "Steps in a row without overflow" in text
    assert "Lowest scale a backoff may reach" in text and "Highest scale growth may reach" in text


def test_the_cut_layer_table_names_the_run_to_list_them_all(cli, tmp_path):
    from models import train_recorded

    path = tmp_path / "my runs" / "it's here.parquet"  # a space and a quote: shell-quoted
    path.parent.mkdir()
    train_recorded(path, steps=4)
    result = cli.invoke(main, ["report", str(path), "--top", "2"])
    assert result.exit_code == 0, result.output
    hint = [line for line in result.output.splitlines() if "more (ampdoctor layers" in line]
    assert len(hint) == 1 and "RUN" not in hint[0], hint
    command = hint[0].split("(", 1)[1].rsplit(")", 1)[0]
    assert shlex.split(command) == ["ampdoctor", "layers", str(path), "--top", "N"]


def test_simulate_lines_fit_100_columns(cli, tmp_path):
    from models import train_recorded

    path = tmp_path / ("a-rather-long-directory-name-for-a-run" * 2) / "run.parquet"
    path.parent.mkdir()
    train_recorded(path, steps=20, init_scale=2.0**24, loss_factor=1e-3)
    result = cli.invoke(main, ["simulate", str(path), "--init-scale", "2**20", "--growth-factor", "1.5",
                               "--backoff-factor", "0.25", "--growth-interval", "123456", "--hysteresis", "3",
                               "--min-scale", "2**-10", "--max-scale", "2**30"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100, [line for line in lines if len(line) > 100]
    # Every setting is still printed, wrapped rather than cut.
    joined = " ".join(lines)
    for part in ("init_scale=2**20", "growth_factor=1.5", "backoff_factor=0.25", "growth_interval=123456",
                 "hysteresis=3", "min_scale=2**-10", "max_scale=2**30", "overflow threshold"):
        assert part in joined, part
