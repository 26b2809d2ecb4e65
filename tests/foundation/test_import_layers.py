"""The house's layers (DESIGN.md "Layout"): imports run only downward, and no modules import
each other in a loop. An AST walk over every module of ``pptrace``, ``dashboards`` and
``instrumented_model`` — function-local imports included, since a lazy import is an arrow
all the same — checked against the arrows written once below.

The layers, lowest first; a module may import its own layer and every layer below it.
``GROUPS`` are the two that stand apart from the line: what each may import is listed.
``PENDING`` and ``PENDING_LOOPS`` are the arrows and loops of today's tree that break the
rule, each with the change that removes it (issue 22). The test fails on any other upward
arrow or loop, and on a pending one that is gone (so the lists only shrink).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pptrace", "dashboards", "instrumented_model")

#: (layer, the modules or folders in it), lowest first.
LAYERS = (
    ("foundation", ("pptrace/__init__.py", "pptrace/vocab.py", "pptrace/naming.py", "pptrace/topology.py",
                    "pptrace/errors.py", "pptrace/output.py", "pptrace/progress.py", "pptrace/sweeps.py")),
    ("schedules", ("pptrace/schedules/",)),
    ("instrumentation", ("pptrace/ranges.py", "pptrace/integrations/", "pptrace/instrument.py")),
    # import: one trace file -> one rank's table
    ("ingest", ("pptrace/ingest/",)),
    # query primitives over an events table
    ("timeline", ("pptrace/timeline/",)),
    # rank tables -> one frozen Run
    ("run", ("pptrace/run/",)),
    ("analyzers", ("pptrace/analyzers/",)),
    ("analysis", ("pptrace/caveats.py", "pptrace/analysis.py", "pptrace/whatif/", "pptrace/diff/")),
    ("export", ("pptrace/export/",)),
    ("cli", ("pptrace/cli.py", "pptrace/__main__.py")),
)
#: groups beside the line: (group, its modules, the layers and groups it may import).
GROUPS = (
    # display only: draws the report and a timeline table it is given, computes nothing
    ("dashboards", ("dashboards/",), ("foundation",)),
    # the reference trainer: instrumented like a user's trainer, schedules from pptrace
    ("trainer", ("instrumented_model/",), ("foundation", "schedules", "instrumentation")),
)
#: who may import a group from the line (the line's layers never import a group otherwise)
GROUP_USERS = {"dashboards": ("analysis", "export"), "trainer": ("cli",)}

#: today's arrows that break the rule: (importer, imported) -> the change that removes it
PENDING: dict = {}
#: today's import loops (each within one layer) -> the change that breaks it
PENDING_LOOPS: dict = {}


def _modules() -> dict[str, Path]:
    """dotted module name -> file, for every module of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The module ``name`` lands in: itself, or the package that holds it (``from x import
    y`` where y is a name, not a module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, module: str, modules: dict) -> set[str]:
    """The modules of the packages that ``path`` imports (every import statement in it)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            # ``from p import x``: module p.x where x is one, else a name of p
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    """file (relative path) -> the files it imports."""
    modules = _modules()
    rel = {m: p.relative_to(ROOT).as_posix() for m, p in modules.items()}
    return {rel[m]: {rel[t] for t in imports_of(p, m, modules)} for m, p in modules.items()}


def _place(path: str) -> str:
    """The layer or group of a file."""
    for name, members in (*LAYERS, *((g, m) for g, m, _ in GROUPS)):
        if any(path == m or (m.endswith("/") and path.startswith(m)) for m in members):
            return name
    raise AssertionError(f"{path} is in no layer: add it to LAYERS or GROUPS in {Path(__file__).name}")


def allowed(importer: str, imported: str) -> bool:
    a, b = _place(importer), _place(imported)
    order = [name for name, _ in LAYERS]
    groups = {g: may for g, _, may in GROUPS}
    if a == b:
        return True
    if a in groups:
        return b in groups[a]
    if b in groups:
        return a in GROUP_USERS.get(b, ())
    return order.index(b) < order.index(a)


def violations(arrows: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in arrows.items() for b in targets if not allowed(a, b)}


def cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The import loops: strongly connected sets of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(arrows.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return out


def _pending_arrows() -> set[tuple[str, str]]:
    return set(PENDING)


def test_every_module_has_a_layer():
    for path in graph():
        _place(path)


def test_imports_run_only_downward():
    found = violations(graph())
    new = sorted(found - _pending_arrows())
    assert not new, "upward imports (fix them, or give the layers a reason): " + "; ".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(_pending_arrows() - found)
    assert not gone, "pending arrows no longer in the tree (remove them from PENDING): " + "; ".join(
        f"{a} -> {b}" for a, b in gone)


def test_no_import_loops_but_the_pending_ones():
    loops = {tuple(c) for c in cycles(graph())}
    assert not loops - set(PENDING_LOOPS), f"import loops: {sorted(loops - set(PENDING_LOOPS))}"
    assert not set(PENDING_LOOPS) - loops, f"pending loops gone (remove them): {sorted(set(PENDING_LOOPS) - loops)}"


def test_the_check_fails_on_an_upward_import():
    """The rule bites: an analyzer importing the CLI, the ingest layer importing an analyzer,
    the trainer importing the analysis, and a loop between two layers are all caught."""
    arrows = graph()
    for a, b in (("pptrace/analyzers/p2p.py", "pptrace/cli.py"), ("pptrace/ingest/frame.py", "pptrace/analyzers/p2p.py"),
                 ("instrumented_model/model.py", "pptrace/analysis.py"), ("dashboards/figures.py", "pptrace/run/build.py")):
        assert b in arrows and not allowed(a, b), (a, b)
        assert (a, b) in violations({**arrows, a: arrows[a] | {b}})
    looped = {**arrows, "pptrace/vocab.py": arrows["pptrace/vocab.py"] | {"pptrace/topology.py"},
              "pptrace/topology.py": arrows["pptrace/topology.py"] | {"pptrace/vocab.py"}}
    assert ["pptrace/topology.py", "pptrace/vocab.py"] in cycles(looped)


def test_the_walk_sees_function_local_and_relative_imports(tmp_path):
    modules = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.a": tmp_path / "pkg" / "a.py",
               "pkg.b": tmp_path / "pkg" / "b.py", "pkg.sub": tmp_path / "pkg" / "sub" / "__init__.py",
               "pkg.sub.c": tmp_path / "pkg" / "sub" / "c.py"}
    for path in modules.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    modules["pkg.sub.c"].write_text("def f():\n    from ..b import thing\n    import pkg.a\n")
    assert imports_of(modules["pkg.sub.c"], "pkg.sub.c", modules) == {"pkg.b", "pkg.a"}
    modules["pkg.a"].write_text("from .sub import c\nfrom . import b\n")
    assert imports_of(modules["pkg.a"], "pkg.a", modules) == {"pkg.sub.c", "pkg.b"}
