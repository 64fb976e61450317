"""examples/resolve_demo.py's command line: every bad argument is refused before any work,
with exit status 2 and one line naming the flag and the rule; a small run (which drifts by
the whole selection each step) stays exact."""

from __future__ import annotations

import argparse

import pytest

import hisparse_jax
from examples import resolve_demo
from tests.test_cli import check_help

PROG = "resolve_demo.py"


@pytest.fixture
def no_work(monkeypatch):
    """Building the demo's config fails the test: the argument had to be refused before."""
    def boom(*args, **kwargs):
        pytest.fail("a bad argument reached HiSparseConfig (work ran before the check)")
    monkeypatch.setattr(hisparse_jax, "HiSparseConfig", boom)


def refused(argv, capsys) -> str:
    """Runs main(argv), expects exit status 2, returns the one error line (after the usage
    lines), with no traceback."""
    with pytest.raises(SystemExit) as exc:
        resolve_demo.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith(f"{PROG}: error: ")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err
    return errors[0]


@pytest.mark.parametrize("flag, value, rule", [
    ("--turnover", "2", "[0, 1]"), ("--turnover", "-0.1", "[0, 1]"),
    ("--turnover", "nan", "[0, 1]"), ("--turnover", "lots", "[0, 1]"),
    ("--requests", "0", ">= 1"), ("--context", "-5", ">= 1"), ("--top-k", "0", ">= 1"),
    ("--hot-size", "0", ">= 1"), ("--block-size", "0", ">= 1"), ("--row-width", "0", ">= 1"),
    ("--steps", "0", ">= 1"), ("--seed", "-1", ">= 0"), ("--requests", "2.5", "int"),
])
def test_bad_value_is_refused_at_parsing(flag, value, rule, capsys, no_work):
    line = refused([flag, value], capsys)
    assert f"argument {flag}:" in line and rule in line and value in line


@pytest.mark.parametrize("argv, names", [
    (["--top-k", "5000"], ["--top-k 5000", "--context 4096"]),
    (["--hot-size", "128"], ["--hot-size 128", "--top-k 256"]),
    (["--top-k", "300", "--hot-size", "40000"], ["--hot-size 40000", "32768"]),
    (["--row-width", "100"], ["--row-width 100", "multiple of 8"]),
    (["--context", "300", "--top-k", "256", "--turnover", "0.5"],
     ["--top-k 256", "--turnover 0.5", "--context 300"]),
    (["--requests", str(10**9)], ["--requests", "--context", "--row-width", "RAM"]),
])
def test_rules_between_flags_are_checked_before_any_work(argv, names, capsys, no_work):
    line = refused(argv, capsys)
    for name in names:
        assert name in line


def test_every_flag_has_help_and_one_default():
    p = resolve_demo.build_parser()
    check_help(p, p.format_help())


def test_whole_selection_drifting_stays_exact(capsys):
    """--turnover 1 replaces every selected position each step: new picks come from outside
    the selection, so a context of just 2 * top_k positions is enough."""
    resolve_demo.main(["--requests", "2", "--context", "16", "--top-k", "8", "--hot-size", "8",
                       "--block-size", "8", "--row-width", "8", "--steps", "3",
                       "--turnover", "1"])
    out = capsys.readouterr().out
    assert "all 3 steps exact" in out


def test_argument_types_directly():
    assert resolve_demo.fraction("0") == 0.0 and resolve_demo.fraction("1") == 1.0
    assert resolve_demo.positive_int("3") == 3 and resolve_demo.seed_int("0") == 0
    for fn, text in [(resolve_demo.fraction, "1.01"), (resolve_demo.positive_int, "0"),
                     (resolve_demo.seed_int, "-1")]:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)
