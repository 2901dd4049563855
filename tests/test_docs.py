"""The documentation stays true: links resolve, quoted commands exist and (where affordable)
reproduce their printed output, README stays short, and the package imports top-down.

Every command quoted in README.md or docs/*.md (``python ...`` in a code block or span) must
be classified below: a pytest command (its file and ``-k`` selection must exist: the suite
runs it), a command this test runs and whose output it compares with the block the docs
print, or one measured elsewhere (minutes of benchmarking), with the reason.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

# run here; their output must match a block the docs print (numbers within RTOL)
RUN = {
    "python examples/real_loop.py": 240,
    "python examples/explain.py": 240,
}
RTOL = 0.25  # measured errors move with the CPU's vector width; counts must match exactly
# measured by hand: they take minutes, or a second machine; each figure names its commit
ELSEWHERE = {
    "python examples/train_gpt.py": "2-3 minutes warm; tests/test_demo.py runs it at a tiny size",
    "python -m collage_compile.demo": "the same as examples/train_gpt.py",
    "python examples/train_llama.py": "a GPU; tests/test_demo.py runs it at a tiny size on CPU",
    "python examples/edq.py": "four 1M-element runs; tests/test_metrics.py checks the metrics",
    "python -m benchmarks.step": "minutes; tests/test_benchmarks.py runs it at a tiny size",
    "python -m benchmarks.compile_time": "cold compiles in fresh processes, minutes each",
    "python -m benchmarks.compile_profile": "a profiled cold compile, minutes",
    "python -m benchmarks.metrics_overhead": "minutes of timing",
    "python -m benchmarks.rounding": "timing, under a minute",
    "python -m benchmarks.host": "timing, a minute; tests/test_host_cost.py counts the host work",
    "python -m benchmarks.triton_compile": "Triton compiles, minutes; tests/test_benchmarks.py "
    "runs it at one layer",
    "python tools/probe_tiles.py": "what it prints is the machine's compiler's; "
    "tests/test_tiles.py checks the backend's answer to it",
    "python tools/probe_exact.py": "a GPU: exact mode's step against the fp32 step's, in ulps",
    "python tools/replay_all.py": "minutes of compiles; tests/test_replay.py pins the families",
    "python tools/third_party.py": "pytorch_optimizer and schedulefree, installed by hand; "
    "about 10 minutes",
}
_COMMAND = re.compile(r"(?:^|`|\$ )(python3? (?:-m [^\s`]+|[^\s`]+\.py)(?: [^`\n]*)?)", re.M)


def _quoted_commands() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for doc in DOCS:
        for match in _COMMAND.finditer(doc.read_text()):
            cmd = match.group(1).strip().rstrip("`").split("  #")[0].strip()
            cmd = cmd.split(" # ")[0].strip()
            out.setdefault(cmd, []).append(doc.name)
    return out


def _classify(cmd: str) -> str | None:
    if cmd.startswith(("python -m pytest", "python3 -m pytest")):
        return "pytest"
    if cmd in RUN:
        return "run"
    if any(cmd == k or cmd.startswith(k + " ") for k in ELSEWHERE):
        return "elsewhere"
    if cmd.startswith("python3 -m venv"):
        return "setup"
    return None


def test_every_quoted_command_is_classified():
    unknown = {c: d for c, d in _quoted_commands().items() if _classify(c) is None}
    assert not unknown, f"classify these commands in tests/test_docs.py: {unknown}"


def test_quoted_pytest_commands_select_existing_tests():
    for cmd in _quoted_commands():
        if _classify(cmd) != "pytest":
            continue
        args = cmd.split()
        if args[3:] in ([], ["-n", "2"]):
            continue  # the whole suite: README's test command (two workers: CI's 2 cores)
        files = [a for a in args if a.startswith("tests/") and a.endswith(".py")]
        assert files, cmd
        text = "\n".join((ROOT / f).read_text() for f in files)
        assert all((ROOT / f).exists() for f in files), cmd
        if "-k" in args:
            assert args.index("-k") + 1 < len(args), f"{cmd}: keep a quoted command on one line"
            expr = args[args.index("-k") + 1]
            words = [w for w in re.split(r"\W+", expr) if w and w not in ("and", "or", "not")]
            tests = re.findall(r"def (test_\w+)", text)
            for w in words:
                assert any(w in t for t in tests), f"{cmd}: -k {w!r} selects no test"


def _blocks() -> list[list[str]]:
    blocks, current = [], None
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                if current is None:
                    current = []
                else:
                    blocks.append(current)
                    current = None
            elif current is not None:
                current.append(line)
    return blocks


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _same_numbers(expected: str, actual: str) -> bool:
    e, a = _NUMBER.findall(expected), _NUMBER.findall(actual)
    if len(e) != len(a) or _NUMBER.sub("#", expected) != _NUMBER.sub("#", actual):
        return False
    for x, y in zip(e, a):
        if "." in x or "e" in x:
            if abs(float(x) - float(y)) > RTOL * max(abs(float(x)), 1e-12):
                return False
        elif x != y:
            return False
    return True


# output that names the ops Dynamo traced: the docs quote torch 2.13's (2.11 traces AdamW's
# second moment into mul_ + add_, not mul_ + copy_)
TRACE_SPECIFIC = {"python examples/explain.py"}


@pytest.mark.parametrize("cmd", list(RUN))
def test_quoted_output_is_what_the_command_prints(cmd):
    assert cmd in _quoted_commands(), f"{cmd} is no longer quoted: drop it from RUN"
    if cmd in TRACE_SPECIFIC and not torch.__version__.startswith("2.13"):
        pytest.skip(f"the docs quote what torch 2.13 prints, not {torch.__version__}")
    proc = subprocess.run(
        [sys.executable, *cmd.split()[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN[cmd],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    block = next((b for b in _blocks() if b and b[0] == lines[0]), None)
    assert block is not None, f"no block in the docs starts with {lines[0]!r}"
    block = [ln for ln in block if ln.strip()]
    assert len(block) == len(lines), (block, lines)
    for expected, actual in zip(block, lines):
        assert _same_numbers(expected, actual), (
            f"docs say\n  {expected}\nthe command printed\n  {actual}"
        )


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: pathlib.Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            out.add(title.replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    for doc in DOCS:
        for target in _LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.exists(), f"{doc.name}: {target} does not exist"
            if anchor:
                assert anchor in _anchors(path), f"{doc.name}: no heading for #{anchor} in {file}"


def test_readme_stays_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move reference detail to docs/"


def _imports() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, at module level or
    inside a function (a lazy import is a dependency all the same)."""
    files = {
        **{f"collage_compile.{p.stem}": p for p in (ROOT / "collage_compile").glob("*.py")},
        **{f"collage_compile.passes.{p.stem}": p for p in (ROOT / "passes").glob("*.py")},
    }
    files = {k.removesuffix(".__init__"): v for k, v in files.items()}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "collage_compile"
            ):
                # ``from package import module`` imports that module; anything else, the
                # module named (a package's __init__ when it is one)
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in files] or [node.module]
                deps.update(t for t in targets if t in files and t != name)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files and a.name != name)
        graph[name] = deps
    return graph


def test_the_package_imports_top_down_without_a_circle():
    graph = _imports()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = [*path[path.index(d) :], d]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "collage_compile.diagnostics" in graph and not graph["collage_compile.diagnostics"]
