"""The floating-point formats on the model command lines: ``--format`` / ``--rs-format`` /
``--ag-format`` on every CLI with the communication options (choices checked by argparse, the
config they make), ``models.compare``'s setting names with formats in either phase and its
format flags, and ``models.traffic.wire_vs_bf16`` (the field of ``models.eval --json``)."""

import argparse

import pytest

from jax_flashcomm.codec import spec
from models import cli, traffic
from models.compare import build_parser


def _parse(*argv):
    parser = argparse.ArgumentParser()
    cli.add_common(parser)
    return parser, parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,rs,ag", [
    (("--format", "nvfp4"), "nvfp4", "nvfp4"),
    (("--rs-format", "nvfp4", "--ag-format", "fp8"), "nvfp4", "fp8"),
    (("--format", "fp8", "--ag-format", "int", "--ag-bits", "6"), "fp8", "int"),
])
def test_format_flags_make_the_config(argv, rs, ag):
    parser, args = _parse("--comm", "flash", *argv)
    cli.check_comm(parser, args)
    config = cli.comm_from_args(args).config
    assert (config.phase1_format, config.phase2_format) == (rs, ag)
    assert rs in cli.describe(args)


def test_bad_format_and_exact_with_a_format_are_errors(capsys):
    with pytest.raises(SystemExit):
        _parse("--comm", "flash", "--format", "fp4")
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    parser, args = _parse("--comm", "exact", "--format", "fp8")
    with pytest.raises(SystemExit):
        cli.check_comm(parser, args)
    assert "does not quantize" in capsys.readouterr().err


@pytest.mark.parametrize("name,kind,formats,bits", [
    ("nvfp4", "flash", ("nvfp4", "nvfp4"), (4, 4)),
    ("nvfp4/fp8", "flash", ("nvfp4", "fp8"), (4, 8)),
    ("int4/fp8", "flash", ("int", "fp8"), (4, 8)),
    ("fp8/int6", "flash", ("fp8", "int"), (8, 6)),
    ("int4/8", "flash", ("int", "int"), (4, 8)),
    ("overlap+mxfp4", "flash+overlap", ("mxfp4", "mxfp4"), (4, 4)),
])
def test_compare_settings_with_formats(name, kind, formats, bits):
    label, comm = cli.parse_setting(name)
    c = comm.config
    assert (label, comm.kind) == (name, kind) and c.min_bytes == 0
    assert (c.phase1_format, c.phase2_format) == formats
    assert (c.phase1_bits, c.phase2_bits) == bits


@pytest.mark.parametrize("name", ["nvfp4/", "fp4", "nvfp4/x", "overlap+", "int8+nvfp4"])
def test_unknown_compare_settings(name):
    with pytest.raises(ValueError, match="unknown setting"):
        cli.parse_setting(name)


def test_compare_format_flags_add_a_setting():
    args = build_parser().parse_args(["--rs-format", "nvfp4", "--ag-format", "fp8"])
    assert cli.format_setting(args.format, args.rs_format, args.ag_format) == "nvfp4/fp8"
    assert cli.format_setting(None, "nvfp4", None) == "nvfp4/int8"
    assert cli.format_setting("fp8", None, None) == "fp8"
    assert cli.format_setting(None, None, None) is None


def test_wire_vs_bf16():
    _, nvfp4 = cli.parse_setting("nvfp4")           # 1 spike per group (auto, 4 bits)
    assert traffic.wire_vs_bf16(nvfp4) == (64 + 8 + 1 + 3) / 128 / 2
    _, mixed = cli.parse_setting("nvfp4/fp8")
    assert traffic.wire_vs_bf16(mixed) == pytest.approx(
        (spec.wire_bytes_per_element(4, 128, 1, "nvfp4")
         + spec.wire_bytes_per_element(8, 128, 0, "fp8")) / 4)
    _, int8 = cli.parse_setting("int8")
    assert traffic.wire_vs_bf16(int8) == spec.wire_bytes_per_element(8, 128) / 2
    assert traffic.wire_vs_bf16(cli.parse_setting("exact")[1]) == 1.0


@pytest.mark.parametrize("name,flags", [
    ("exact", ["--comm", "exact"]),
    ("overlap", ["--comm", "overlap"]),
    ("int4/fp8", ["--comm", "flash", "--bits", "4", "--ag-format", "fp8", "--min-bytes", "0"]),
    ("overlap+nvfp4", ["--comm", "flash+overlap", "--format", "nvfp4", "--min-bytes", "0"]),
    ("int4/8", ["--comm", "flash", "--bits", "4", "--ag-bits", "8", "--ag-format", "int",
                "--min-bytes", "0"]),
    ("auto6", ["--comm", "auto", "--bits", "6"]),
    ("overlap+auto", ["--comm", "auto+overlap", "--bits", "8"]),
])
def test_a_setting_name_and_its_flags_build_the_same_comm(name, flags):
    """One settings language: a models.compare setting name and the --comm / option flags it
    stands for parse to the same options and build the same TPComm."""
    parser, args = _parse(*flags)
    cli.check_comm(parser, args)
    assert cli.parse_setting(name)[1] == args.tp_comm == cli.comm_from_args(args)
