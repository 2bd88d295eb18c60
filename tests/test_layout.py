"""The tree reads as the data flow: each module belongs to a stage, and no
import runs from a stage to a later one or forms a circle; the trainers'
API stays stdlib-only and importable under its name."""
import ast
import subprocess
import sys
from pathlib import Path

from harness import ROOT

# Stages in data-flow order; a module may import only from its own stage
# or earlier ones.
STAGES = [
    ("core", ["greyhound_bpf/__init__.py", "greyhound_bpf/events.py"]),
    ("probe", ["greyhound_bpf/probe/"]),
    ("engine", ["greyhound_bpf/engine/"]),
    ("diagnosis", ["greyhound_bpf/diagnosis/"]),
    ("mitigation", ["mitigation/"]),
    ("analysis", ["greyhound_bpf/analysis.py"]),
    ("output", ["greyhound_bpf/output/", "greyhound_bpf/recording.py"]),
    ("commands", ["greyhound_bpf/attach.py", "greyhound_bpf/replay.py",
                  "greyhound_bpf/inject.py", "greyhound_bpf/validate.py", "greyhound_bpf/cli.py",
                  "greyhound_bpf/argtypes.py", "greyhound_bpf/cluster/"]),
]


def stage_of(path: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(STAGES):
        for p in prefixes:
            if path == p or (p.endswith("/") and path.startswith(p)):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{path} belongs to no stage: add it to tests/test_layout.py"
    return best[0]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ("greyhound_bpf", "mitigation"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            name = rel[:-3].replace("/", ".").removesuffix(".__init__")
            out[name] = f
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Project modules `name` imports, at any depth in the file."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found


def project_deps() -> dict[str, set[str]]:
    mods = modules()
    deps = {}
    for name, path in mods.items():
        deps[name] = {m for m in imports_of(name, path) if m in mods and m != name}
    return deps


def test_every_module_has_a_stage():
    for name, path in modules().items():
        stage_of(path.relative_to(ROOT).as_posix())


def test_no_import_from_a_later_stage():
    mods = modules()
    bad = []
    for name, deps in project_deps().items():
        mine = stage_of(mods[name].relative_to(ROOT).as_posix())
        for d in deps:
            theirs = stage_of(mods[d].relative_to(ROOT).as_posix())
            if theirs > mine:
                bad.append(f"{name} ({STAGES[mine][0]}) imports {d} ({STAGES[theirs][0]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    deps = project_deps()
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for d in sorted(deps[m]):
            if d in deps and state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]) if d in path
                              else f"{m} -> {d}")
            elif d in deps and d not in state:
                visit(d, path + [d])
        state[m] = 2
    for m in sorted(deps):
        if m not in state:
            visit(m, [m])
    # A package's __init__ re-exporting its own modules is not a cycle of stages.
    cycles = [c for c in cycles if not all(p.split(".")[:2] == c.split(" -> ")[0].split(".")[:2]
                                           for p in c.split(" -> "))]
    assert not cycles, "\n".join(cycles)


def test_the_trainers_api_is_stdlib_only():
    # Trainers import mitigation.control; it must not pull in the tool.
    code = ("import sys, mitigation.control; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('greyhound_bpf', 'numpy', 'numba', 'cvxpy', 'rich', 'torch')]; "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"mitigation.control imports {r.stdout.strip()} {r.stderr}"


def test_no_module_mixes_stages_at_length():
    # The bound: no module over about 500 lines (the engine's estimator
    # and the validator are the longest; a longer one is split by concept).
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert {n: v for n, v in long.items() if v > 560} == {}
