"""Engine throughput of two or more source trees, alternated in one run (the device machine has no git history).

``prepare`` (here, where git is) writes a commit's package into a folder of the working tree that git does not ignore,
so the device tool carries it (delete it before committing); ``run`` (on the device) runs ``llmplug bench throughput``
once per tree and pass, each in its own process started in that tree's folder, the trees' order reversed every other
pass (A B, B A, ...), and prints every run's wall and share of the floor. Compare walls within one run: the floor's
ceilings are measured in each process.

Usage:
    python benchmarks/tree_ab.py prepare 62c8669 .ab/head
    python benchmarks/tree_ab.py run --trees head=.ab/head new=. --passes 2 -- --model llama-1b --workloads a b c
    python benchmarks/tree_ab.py run --trees off=. on=.,--greedy-ring=16 -- --model llama-1b --workloads a b

Everything after ``--`` goes to ``llmplug bench throughput`` (``--no-stock`` is added), after a tree's own arguments
(``NAME=FOLDER,ARG,...``: the same tree under two settings). JSON (every run's file and a summary) to ``$OUT`` (or
``.ab/out``).
"""

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = ("llmplug", "llmplug_cli.py", "benchmarks")  # what a tree needs to run the command


def prepare(rev: str, folder: Path) -> None:
    """``rev``'s package (``PACKAGE``) extracted into ``folder``."""
    archive = subprocess.run(["git", "archive", rev, *PACKAGE], check=True, capture_output=True).stdout
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    print(f"{rev} -> {folder}")


def run(trees: dict[str, Path], passes: int, bench_args: list[str], out: Path,
        tree_args: dict[str, list[str]] | None = None) -> list[dict]:
    """Each tree ``passes`` times, alternating (with its own ``tree_args[name]`` first); returns one row per run and
    workload."""
    out.mkdir(parents=True, exist_ok=True)
    rows, tree_args = [], tree_args or {}
    for p in range(passes):
        order = list(trees.items()) if p % 2 == 0 else list(trees.items())[::-1]
        for name, folder in order:
            path = (out / f"tree_ab_{p + 1}_{name}.json").resolve()
            cmd = [sys.executable, "-m", "llmplug.cli", "bench", "throughput", *tree_args.get(name, []), *bench_args,
                   "--no-stock", "--out", str(path)]
            done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
            if done.returncode != 0 or not path.exists():
                print(f"pass {p + 1} {name}: failed (exit {done.returncode})\n{done.stderr[-2000:]}", flush=True)
                rows.append({"pass": p + 1, "tree": name, "error": done.stderr[-2000:]})
                continue
            for key, r in json.loads(path.read_text())["runs"].items():
                rows.append({"pass": p + 1, "tree": name, "workload": key, "wall_s": r["wall_s"],
                             "fraction_of_floor": r["fraction_of_floor"]})
                print(f"pass {p + 1} {name} ({key}): {r['wall_s']:.3f} s, {100 * (r['fraction_of_floor'] or 0):.1f}%",
                      flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare", help="write a commit's package into a folder")
    p.add_argument("rev")
    p.add_argument("folder", type=Path)
    r = sub.add_parser("run", help="alternate the trees' throughput runs")
    r.add_argument("--trees", nargs="+", required=True,
                   help="NAME=FOLDER[,ARG...] of each tree ('.' is the working tree; ARGs go to its runs alone)")
    r.add_argument("--passes", type=int, default=2)
    r.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of llmplug bench throughput")
    args = parser.parse_args()
    if args.what == "prepare":
        prepare(args.rev, args.folder)
        return
    trees, tree_args = {}, {}
    for item in args.trees:
        name, sep, spec = item.partition("=")
        folder, *extra = spec.split(",")
        if not sep or not Path(folder, "llmplug").is_dir():
            raise SystemExit(f"--trees {item!r}: expected NAME=FOLDER[,ARG...] with the package in FOLDER/llmplug")
        trees[name], tree_args[name] = Path(folder).resolve(), extra
    bench = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    out = Path(os.environ.get("OUT", ".ab/out"))
    rows = run(trees, args.passes, bench, out, tree_args)
    (out / "tree_ab.json").write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()},
                                                  "tree_args": tree_args, "bench": bench, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
