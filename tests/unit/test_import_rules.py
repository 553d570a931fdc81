"""The layers' import rules (docs/design.md, "Layers and import rules"), checked statically.

Every module under llmq/ is parsed (never imported), so the whole check takes well under a second.
What counts is what runs **at import time**, as a fresh interpreter would load it:

- top-level imports, also inside `try` / `if` / class bodies; not those inside functions (the
  CLI imports the worker only inside its commands) nor under `if TYPE_CHECKING:`;
- transitively: a module loads everything the llmq modules it imports load, and importing
  `llmq.a.b` runs `llmq/__init__.py` and `llmq/a/__init__.py` first;
- `from package import Name`, where the package exports Name lazily (PEP 562 `__getattr__` over
  `_EXPORTS`), loads the submodule Name comes from;
- a third-party import counts as its dotted name (`torch`, `torch.nn`); what that package imports
  in turn is not followed (as import-linter's forbidden contracts).

llmq/ holds links to the top-level folders (protocol/, broker/, ...): modules are found by walking
llmq/ through them, and a test below checks the walk saw every file of those folders.

NOTE: not import-linter: its graph counts imports inside functions too, so every lazy import the
rules allow (the CLI's commands importing the worker) would need an exception of its own.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYER_FOLDERS = ("protocol", "broker", "worker", "gateway", "cli", "jobs")

# module -> prefixes of modules it must not load at import time
RULES = {
    "llmq.broker.keys": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.client": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.aio": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.embedded": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.multiplex": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.result_reader": ("torch", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.broker.aio_result_reader": ("torch", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.broker.control": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.worker.engine.request": ("torch", "redis"),
    "llmq.worker.engine.outputs": ("torch", "redis"),
    "llmq.worker.engine.sampling_params": ("torch", "redis"),
    "llmq.worker.engine.config": ("torch", "redis"),
    "llmq.worker.engine.block_pool": ("torch", "redis"),
    "llmq.worker.engine.kv_cache_manager": ("torch", "redis"),
    "llmq.worker.engine.scheduler": ("torch", "redis"),
    "llmq.worker.engine.parallel_sampling": ("torch", "redis"),
    "llmq.worker.engine.detokenizer": ("torch", "redis"),
    # NOTE: the gate compiles grammars with it: only the runner's half needs torch, lazily.
    "llmq.worker.engine.structured_output": ("torch", "redis", "llmq.broker"),
    "llmq.worker.engine.input_processor": ("torch", "redis"),
    "llmq.worker.metrics": ("torch", "redis"),
    "llmq.worker.heartbeat_counters": ("torch", "redis"),
    "llmq.worker.health_server": ("torch", "redis"),
    "llmq.worker.engine.model_runner": ("redis",),
    "llmq.worker.engine.sampler": ("redis",),
    "llmq.worker.engine.model.llama": ("redis", "llmq.broker"),
    "llmq.worker.engine.model.loader": ("redis", "llmq.broker"),
    "llmq.worker.engine.engine_core": ("redis",),
    "llmq.worker.worker": ("llmq.cli",),
    "llmq.cli.main": ("torch", "llmq.worker.engine.model", "llmq.worker.engine.engine_core",
                      "llmq.jobs", "pyarrow", "datasets"),
    **{f"llmq.gateway.{name}": ("torch", "llmq.worker", "llmq.cli")
       for name in ("app", "completions", "files", "batches", "batch_job", "batch_store",
                    "openai_batch", "openai_request", "openai_response", "api_keys",
                    "pool_view", "state", "settings", "metrics", "errors", "dashboard",
                    "dashboard_session", "dead_letter_view", "pool_series")},
}
# Every module of a layer: the wire contract is the bottom (nothing of llmq but itself, no redis,
# no torch); the broker and the gateway never load torch or anything above them; the worker's
# process layer never the CLI or the gateway. (The engine's rule is below; the CLI has none.)
LAYER_RULES = {
    "llmq.protocol": ("torch", "redis", "llmq.broker", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.broker": ("torch", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.gateway": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.worker": ("llmq.cli", "llmq.gateway"),
    # dataset jobs: over the producer side only; pyarrow and datasets only inside the functions
    # of the formats that need them, so JSONL and CSV jobs run without them
    "llmq.jobs": ("torch", "llmq.worker", "llmq.gateway", "llmq.cli", "pyarrow", "datasets",
                  "yaml"),
}
# The engine: no redis, nothing of the broker (its wire contract is llmq.protocol), the gateway or
# the CLI, and nothing of llmq.worker above llmq.worker.engine.
ENGINE_FORBIDDEN = ("redis", "llmq.broker", "llmq.cli", "llmq.gateway")


@dataclass
class ImportGraph:
    """What each module of a package loads at import time: llmq modules and third-party names."""

    package: str
    files: dict[str, Path] = field(default_factory=dict)  # module name -> source file
    direct: dict[str, set[str]] = field(default_factory=dict)
    # package -> {name: submodule} of its PEP 562 lazy exports (a module-level `__getattr__`
    # over an `_EXPORTS` dict, as llmq.worker.engine.model has): `from package import name`
    # runs that submodule at import time
    lazy: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def scan(cls, package_dir: Path) -> ImportGraph:
        graph = cls(package_dir.name)
        # NOTE: followlinks: the layer folders are links inside llmq/.
        for folder, _, names in os.walk(package_dir, followlinks=True):
            rel = Path(folder).relative_to(package_dir.parent)
            for name in names:
                if name.endswith(".py"):
                    parts = rel.parts if name == "__init__.py" else (*rel.parts, name[:-3])
                    graph.files[".".join(parts)] = Path(folder) / name
        trees = {module: ast.parse(path.read_text(encoding="utf-8"), str(path))
                 for module, path in graph.files.items()}
        for module, tree in trees.items():
            if graph.is_package(module) and (exports := _lazy_exports(tree)):
                graph.lazy[module] = {name: f"{module}.{sub}" for name, sub in exports.items()}
        for module, tree in trees.items():
            graph.direct[module] = graph._imports_of(module, tree)
        return graph

    def is_package(self, module: str) -> bool:
        return self.files.get(module, Path()).name == "__init__.py"

    def _imports_of(self, module: str, tree: ast.Module) -> set[str]:
        found: set[str] = set()
        for node in _import_time_nodes(tree.body):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif node.module != "__future__":
                base = self._absolute(module, node.module, node.level)
                found.add(base)
                # `from pkg import name`: name may be a submodule, which is then loaded too
                found.update(f"{base}.{a.name}" for a in node.names
                             if f"{base}.{a.name}" in self.files)
                found.update(self.lazy[base][a.name] for a in node.names
                             if a.name in self.lazy.get(base, {}))
        return found

    def _absolute(self, module: str, name: str | None, level: int) -> str:
        if level == 0:
            assert name is not None
            return name
        parts = module.split(".")
        package = parts if self.is_package(module) else parts[:-1]
        base = package[:len(package) - (level - 1)]
        return ".".join([*base, name] if name else base)

    def loaded_by(self, module: str) -> set[str]:
        """Every name loaded by importing `module`: llmq modules (with their parent packages) and
        third-party dotted names, transitively through llmq modules."""
        assert module in self.files, f"no module {module} under {self.package}/"
        loaded: set[str] = set()
        todo = [module]
        while todo:
            name = todo.pop()
            for prefix in _with_parents(name):
                if prefix in loaded:
                    continue
                loaded.add(prefix)
                if prefix in self.files:
                    todo.extend(self.direct[prefix])
        return loaded


def _import_time_nodes(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when a module body runs."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue  # runs when called, not when imported
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            out.extend(_import_time_nodes(node.orelse))
        else:  # if / try / with / for / class bodies run at import time
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    out.extend(_import_time_nodes([child]))
                elif isinstance(child, ast.excepthandler | ast.match_case):
                    out.extend(_import_time_nodes(child.body))
    return out


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """A package's `_EXPORTS = {"Name": "submodule"}`, if a module-level `__getattr__` serves it."""
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values,
                                                      strict=True)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: ImportGraph, module: str, forbidden: tuple[str, ...]) -> list[str]:
    """What `module` loads that falls under one of the `forbidden` prefixes."""
    return sorted(name for name in graph.loaded_by(module)
                  if any(_under(name, p) for p in forbidden))


GRAPH = ImportGraph.scan(ROOT / "llmq")
LAYERED_MODULES = sorted(m for m in GRAPH.files if any(_under(m, layer) for layer in LAYER_RULES))
ENGINE_MODULES = sorted(m for m in GRAPH.files if _under(m, "llmq.worker.engine"))


@pytest.mark.parametrize("module", sorted(RULES))
def test_module_imports_only_what_its_layer_allows(module: str) -> None:
    # Given the module's import-time imports, followed through every llmq module they load
    found = violations(GRAPH, module, RULES[module])
    # Then none of the forbidden packages comes with it
    assert found == [], f"{module} loads {found[:5]}"


@pytest.mark.parametrize("module", LAYERED_MODULES)
def test_every_module_keeps_to_its_layer(module: str) -> None:
    (layer,) = [layer for layer in LAYER_RULES if _under(module, layer)]
    found = violations(GRAPH, module, LAYER_RULES[layer])
    assert found == [], f"{module} loads {found[:5]}"


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_nothing_in_the_engine_talks_to_redis_or_reaches_up(module: str) -> None:
    # Then no redis, nothing of the broker, and of llmq.worker only the engine (and the package)
    found = violations(GRAPH, module, ENGINE_FORBIDDEN)
    found += [m for m in sorted(GRAPH.loaded_by(module)) if _under(m, "llmq.worker")
              and m != "llmq.worker" and not _under(m, "llmq.worker.engine")]
    assert found == [], f"{module} loads {found[:5]}"


def test_every_file_of_the_layer_folders_is_seen_through_the_links() -> None:
    # Given the top-level folders llmq/ links to
    on_disk = {f"llmq.{path.relative_to(ROOT).with_suffix('').as_posix().replace('/', '.')}"
               .removesuffix(".__init__")
               for folder in LAYER_FOLDERS for path in (ROOT / folder).rglob("*.py")}
    # Then the graph has every one of their modules (a walk that skipped links would have none)
    assert on_disk - set(GRAPH.files) == set()
    assert len(on_disk) > 100


def test_an_indirect_import_through_a_linked_folder_is_caught(tmp_path: Path) -> None:
    # Given a package whose layers are links, where `low.a` reaches `heavy` only through
    # `high.b`, imported inside a try block, `low.d` through `high`'s lazy export of `b`, and
    # `low.c` imports it only inside a function
    (tmp_path / "src" / "low").mkdir(parents=True)
    (tmp_path / "src" / "high").mkdir()
    (tmp_path / "src" / "low" / "__init__.py").write_text("")
    (tmp_path / "src" / "high" / "__init__.py").write_text(
        '_EXPORTS = {"Heavy": "b"}\n\ndef __getattr__(name):\n    pass\n')
    (tmp_path / "src" / "low" / "a.py").write_text("try:\n    from ..high import b\nexcept "
                                                   "ImportError:\n    b = None\n")
    (tmp_path / "src" / "low" / "c.py").write_text("def f():\n    import heavy\n")
    (tmp_path / "src" / "high" / "b.py").write_text("import heavy.sub\n")
    (tmp_path / "src" / "low" / "d.py").write_text("from ..high import Heavy\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for name in ("low", "high"):
        (tmp_path / "pkg" / name).symlink_to(tmp_path / "src" / name)
    # When the graph of pkg is built
    graph = ImportGraph.scan(tmp_path / "pkg")
    # Then the indirect import counts (also through a lazy export), one inside a function does not
    assert violations(graph, "pkg.low.a", ("heavy",)) == ["heavy", "heavy.sub"]
    assert violations(graph, "pkg.low.a", ("pkg.high",)) == ["pkg.high", "pkg.high.b"]
    assert violations(graph, "pkg.low.c", ("heavy",)) == []
    assert violations(graph, "pkg.low.d", ("heavy",)) == ["heavy", "heavy.sub"]
