"""Runs a benchmark module on the CPU at its small shapes (HISPARSE_BENCH_SMALL=1), in a
subprocess from the repository root, for the `tests/test_bench_*.py` checks."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    return dict(os.environ, HISPARSE_BENCH_SMALL="1", PYTHONPATH=ROOT)


def run_small(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` with small shapes; the completed process (output kept)."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


# Calls `<argv[1]>.main(args)` for each argument list of the JSON list argv[2], one after the
# other in this one process, and prints a JSON list of {returncode, stdout, stderr}: what
# `python -m <module> <args>` would have exited with and written (a SystemExit's message or an
# exception's traceback on stderr, exit status 1).
_MANY = """
import contextlib, importlib, io, json, sys, traceback
mod = importlib.import_module(sys.argv[1])
sys.argv[0] = mod.__file__  # the program name argparse prints, as under `python -m`
results = []
for args in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = mod.main(list(args))
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    results.append({"returncode": code or 0, "stdout": out.getvalue(),
                    "stderr": err.getvalue()})
print(json.dumps(results))
"""


def run_small_many(module: str, arg_lists, timeout: float = 600) -> dict:
    """`run_small(module, *args)` for every `args` of `arg_lists`, all in ONE subprocess (each
    a call of the module's `main`, in order), so the runs share one start-up (python, jax,
    the benchmark's imports: seconds each). Returns {tuple(args): a namespace with the
    returncode, stdout and stderr that run alone would have given}."""
    arg_lists = [tuple(a) for a in arg_lists]
    proc = subprocess.run([sys.executable, "-c", _MANY, module, json.dumps(arg_lists)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {a: SimpleNamespace(**r) for a, r in zip(arg_lists, results, strict=True)}


def refusal(module: str, *args: str, monkeypatch, capsys) -> str:
    """`<module>.main(args)` in this process (small shapes: the module's `SMALL` set, where it
    has one): it must refuse its arguments by exiting non-zero; returns what it said (stderr
    and the exit's message). A subprocess per refusal would spend seconds importing jax to
    check a parser."""
    mod = importlib.import_module(module)
    if hasattr(mod, "SMALL"):  # ncu_kernels reads its sizes inside the ops, after parsing
        monkeypatch.setattr(mod, "SMALL", True)
    with pytest.raises(SystemExit) as exc:
        mod.main(list(args))
    code = exc.value.code
    assert code not in (0, None), f"{module} {args} exited {code!r}"
    return capsys.readouterr().err + ("" if isinstance(code, int) else str(code))
