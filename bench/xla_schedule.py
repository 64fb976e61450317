"""The order in which XLA runs a compiled program's work, from an `--xla_dump_to` directory:
for each dumped module whose name matches, the entry computation's instructions after
optimizations, one line each (kernels, copies, asynchronous calls and what lies between a
call's start and its done), so that a schedule can be read without the whole dump.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*packed_step.*" python3 ...
    python3 -m bench.xla_schedule /tmp/dump [--module packed_step] [--output FILE]
"""

from __future__ import annotations

import argparse
import pathlib
import re

_SKIP = ("parameter", "constant", "get-tuple-element", "bitcast", "tuple")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S.*?\s([a-z\-]+)\(")


def entry_schedule(text: str) -> list[str]:
    """One line per scheduled instruction of the entry computation that may do work (all but
    `_SKIP`), with its name, for custom calls the target, and the stream it is annotated
    with, if any."""
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    out = []
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m or m.group(2) in _SKIP:
            continue
        name, kind = m.groups()
        extra = re.search(r'custom_call_target="([^"]+)"', line)
        stream = re.search(r'_xla_stream_annotation="(\d+)"', line)
        kernel = re.search(r'"name"\s*:\s*"([^"]+)"', line)
        out.append(" ".join(filter(None, [
            kind, name, extra and extra.group(1), kernel and kernel.group(1),
            stream and f"stream={stream.group(1)}"])))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dump_dir")
    p.add_argument("--module", default="", help="a part of the module names to keep")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    lines = []
    files = sorted(pathlib.Path(args.dump_dir).glob("*after_optimizations.txt"))
    for f in files:
        if args.module not in f.name:
            continue
        sched = entry_schedule(f.read_text())
        lines += [f"# {f.name}: {len(sched)} instructions doing work"] + sched + [""]
    text = "\n".join(lines)
    if args.output:
        pathlib.Path(args.output).write_text(text)
    print(text[:4000])


if __name__ == "__main__":
    main()
