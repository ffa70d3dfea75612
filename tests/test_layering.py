"""docs/ARCHITECTURE.md's package table holds: each top-level package imports only the packages
below it (every import, lazy ones inside functions too, read from the source with ``ast``)."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """``path`` parsed once for all the rules here (several read the same files; none changes a tree)."""
    return ast.parse(path.read_text(), filename=str(path))


PACKAGES = ("tpu_facts", "xla_cache", "pipelines", "torch_tpu", "sparsecore", "torchrec_tpu")
# package -> the project packages it may import (docs/ARCHITECTURE.md, "may import")
ALLOWED = {
    "tpu_facts": set(),
    "xla_cache": {"tpu_facts"},  # its knobs
    "pipelines": {"tpu_facts", "torch_tpu"},  # tpu_facts: knobs; torch_tpu: only ray_data's optional placement
    # of batches on the tpu device
    "torch_tpu": {"tpu_facts", "xla_cache", "sparsecore"},  # sparsecore only lazily, in the SparseCore ops
    "sparsecore": {"tpu_facts", "xla_cache"},
    "torchrec_tpu": set(PACKAGES),
}


def _imported_packages(path: Path) -> set[str]:
    tree = _tree(path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


def test_every_package_imports_only_the_packages_below_it() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            wrong = _imported_packages(path) - ALLOWED[package] - {package}
            if wrong:
                offenders.append(f"{path.relative_to(REPO_ROOT)} imports {sorted(wrong)}")
    assert not offenders, "\n".join(offenders)



def _import_nodes(path: Path, lazy: bool) -> list[tuple[str, bool]]:
    """(module named, at module level?) of each absolute import in ``path`` (``from pkg import mod``
    names ``pkg.mod``; every import when ``lazy``, else only those Python runs at import)."""
    tree = _tree(path)
    top = {id(n) for n in _module_level(tree.body)}
    found = []
    for node in ast.walk(tree) if lazy else _module_level(tree.body):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
    return found


# torch_tpu modules that may import sparsecore, and only inside functions: the SparseCore ops'
# kernels (their math is sparsecore.csr_math), TorchTPU's per-table preprocessing op and TorchRec's
# import hook (both served from sparsecore)
TORCH_TPU_SPARSECORE_USERS = re.compile(
    r"torch_tpu\.ops\.sparsecore\w*|torch_tpu\._internal\.(import_hook|raw_sparsecore)")


def test_torch_tpu_imports_sparsecore_only_lazily_in_its_sparsecore_ops() -> None:
    """What torch_tpu shares with sparsecore sits below both (``xla_cache.native_build`` builds
    either's C++, ``tpu_facts`` holds the buckets): no other torch_tpu module imports sparsecore."""
    offenders = []
    for module, path in _torch_tpu_modules().items():
        for name, top in _import_nodes(path, lazy=True):
            if name.split(".")[0] != "sparsecore":
                continue
            if not TORCH_TPU_SPARSECORE_USERS.fullmatch(module):
                offenders.append(f"{module} imports {name}")
            elif top:
                offenders.append(f"{module} imports {name} at module level (import it inside the kernel)")
    assert not offenders, "\n".join(offenders)


def test_sparsecore_backends_sit_above_the_rest_of_sparsecore() -> None:
    """The backends build on the engine's formats and math; nothing outside ``sparsecore/backends/``
    imports one of them (the math of ``csr_math`` is shared by the backends, not borrowed from one)."""
    offenders = [f"{path.relative_to(REPO_ROOT)} imports {name}"
                 for path in sorted((REPO_ROOT / "sparsecore").rglob("*.py")) if "backends" not in path.parts
                 for name, _ in _import_nodes(path, lazy=True) if name.startswith("sparsecore.backends")]
    assert not offenders, "\n".join(offenders)


# --- torchrec_tpu's subpackages (docs/ARCHITECTURE.md, "Contracts between packages") ----------------

TORCHREC_TPU = REPO_ROOT / "torchrec_tpu"
# subpackage -> the subpackages it may import (every import, lazy ones too); each may also import
# torchrec_tpu's loose modules (errors, launcher, rank_agreement, rank_watch, topology, ...), which
# import only each other
SUBPACKAGE_ALLOWED = {
    "sharding": set(),
    "planner": set(),
    "experimental": set(),
    "pipeline": {"sharding"},  # the train pipeline: input dist of the sharded EBC ahead of the step
    "train": {"planner", "sharding", "pipeline"},
    "hstu": {"sharding", "train"},
    "inference": {"planner", "sharding", "train"},
    "profiling": {"planner", "sharding", "train"},
}
# Lazy imports across the rules, each named with its reason (none now: `train`, `profile`, `infer` and
# Ray Train reach HSTU through the model registry, train/model_kinds.py, which names it by module path).
SUBPACKAGE_LAZY_EXCEPTIONS: set[tuple[str, str]] = set()


def _torchrec_tpu_part(module: str) -> str | None:
    """The subpackage ``module`` is in; None for a loose module (``torchrec_tpu.errors``)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "torchrec_tpu":
        return None
    return parts[1] if (TORCHREC_TPU / parts[1]).is_dir() else None


def test_torchrec_tpu_subpackages_import_only_the_ones_below_them() -> None:
    modules = _project_modules()
    assert sorted(p.name for p in TORCHREC_TPU.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists()) == sorted(SUBPACKAGE_ALLOWED)
    offenders = []
    for module, path in modules.items():
        if module.split(".")[0] != "torchrec_tpu" or module == "torchrec_tpu":
            continue
        part = _torchrec_tpu_part(module)
        for name, top in _import_nodes(path, lazy=True):
            target = name if name in modules else name.rsplit(".", 1)[0]
            if target.split(".")[0] != "torchrec_tpu" or target == "torchrec_tpu":
                continue
            other = _torchrec_tpu_part(target)
            if other is None or other == part:
                continue
            allowed = set() if part is None else SUBPACKAGE_ALLOWED[part]
            lazy_ok = not top and (module, target) in SUBPACKAGE_LAZY_EXCEPTIONS
            if other not in allowed and not lazy_ok:
                where = "a loose module" if part is None else part
                offenders.append(f"{module} ({where}) imports {target} ({other})")
    assert not offenders, "\n".join(offenders)


# --- torch_tpu's rooms (docs/architecture/torch_tpu.md, "The rooms") ----------------------------

TORCH_TPU = REPO_ROOT / "torch_tpu"
ROOMS = ("runtime", "ops", "eager", "compile", "distributed")
# room -> the rooms it may import (every import, lazy ones inside functions too)
ROOM_ALLOWED = {
    "runtime": set(),
    "ops": {"runtime"},
    "eager": {"runtime", "ops"},
    "compile": {"runtime", "ops", "eager"},
    "distributed": {"runtime"},
}
# Lazy imports (inside a function) across the rules, each named with its reason (none now:
# torch.tpu.topology_aware_mesh, which made runtime import distributed, is installed by the face).
LAZY_EXCEPTIONS: set[tuple[str, str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _torch_tpu_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(TORCH_TPU.rglob("*.py"))}


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements Python runs at import: the body, into if/try/with/class blocks, not functions."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody"):
            out.extend(_module_level(getattr(node, field, []) or []))
        for handler in getattr(node, "handlers", []) or []:
            out.extend(_module_level(handler.body))
    return out


def _targets(node: ast.stmt, modules: dict[str, Path]) -> set[str]:
    """The torch_tpu modules an import statement loads (a ``from pkg import mod`` loads ``pkg.mod``)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                 for alias in node.names]
    return {n for n in names if n in modules}


def _imports(path: Path, modules: dict[str, Path], module_level: bool) -> set[str]:
    tree = _tree(path)
    nodes = _module_level(tree.body) if module_level else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        found |= _targets(node, modules)
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


# TorchTPU's face: every TorchTPU 0.2.0 name (torch.tpu's, its tpu:: ops and the aliases of the
# SparseCore ops, torch_tpu._internal.pallas ...), in one package over the rooms (TorchTPU's own path)
FACE = "_internal"


def test_torch_tpu_has_only_rooms_the_face_and_its_init() -> None:
    loose = sorted(p.name for p in TORCH_TPU.glob("*.py"))
    rooms = sorted(p.name for p in TORCH_TPU.iterdir()
                   if p.is_dir() and (p / "__init__.py").exists() and p.name != FACE)
    assert rooms == sorted(ROOMS), rooms
    assert loose == ["__init__.py"], loose  # the one place that registers everything


def test_no_room_imports_torchtpus_face() -> None:
    """The face imports the rooms; a room never imports it (every import, lazy ones too): TorchTPU's
    names are added to the device from above, not written into it."""
    modules = _torch_tpu_modules()
    offenders = [f"{module} imports {target}" for module, path in modules.items() if _room(module)
                 for target in sorted(_imports(path, modules, module_level=False))
                 if target == f"torch_tpu.{FACE}" or target.startswith(f"torch_tpu.{FACE}.")]
    assert not offenders, "\n".join(offenders)


def test_each_torch_tpu_room_imports_only_the_rooms_it_may() -> None:
    modules = _torch_tpu_modules()
    offenders = []
    for module, path in modules.items():
        room = _room(module)
        if room is None:
            continue  # torch_tpu/__init__.py: the one place that registers everything
        top = _imports(path, modules, module_level=True)
        every = _imports(path, modules, module_level=False)
        for target in sorted(every):
            other = _room(target)
            if other is None and target != "torch_tpu":
                continue
            if target == "torch_tpu":
                offenders.append(f"{module} imports the torch_tpu package itself (import what it needs from its room)")
            elif other != room and other not in ROOM_ALLOWED[room]:
                lazy_ok = target not in top and (room, module, f"torch_tpu.{other}") in LAZY_EXCEPTIONS
                if not lazy_ok:
                    offenders.append(f"{module} ({room}) imports {target} ({other})")
    assert not offenders, "\n".join(offenders)


def test_torch_tpu_module_level_imports_have_no_cycle() -> None:
    modules = _torch_tpu_modules()
    graph = {m: _imports(p, modules, module_level=True) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_torch_tpu_tests_mirror_its_rooms() -> None:
    """tests/torch_tpu/<room>/ tests each room; at its top only whole-device tests and shared helpers."""
    tests = REPO_ROOT / "tests" / "torch_tpu"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted(ROOMS), folders
    assert len(list(tests.glob("test_*.py"))) <= 5, sorted(p.name for p in tests.glob("test_*.py"))


# --- torch_tpu.compile's subpackages (docs/architecture/torch_tpu.md, "The rooms", compile/) -------

COMPILE = TORCH_TPU / "compile"
# subpackage -> the subpackages it may import (every import, lazy ones too)
COMPILE_ALLOWED = {
    "program": set(),  # one FX graph as one compiled program: the base
    "collectives": {"program"},
    "dynamo": {"program", "collectives"},  # torch.compile(backend="tpu")
    "step": {"program", "collectives"},  # train_step
}


def _compile_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["torch_tpu", "compile"] and len(parts) > 2 else None


def test_compile_holds_only_its_subpackages() -> None:
    loose = sorted(p.name for p in COMPILE.glob("*.py"))
    parts = sorted(p.name for p in COMPILE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert loose == ["__init__.py"], loose
    assert parts == sorted(COMPILE_ALLOWED), parts


def test_each_compile_subpackage_imports_only_the_ones_below_it() -> None:
    """Also: no subpackage imports ``torch_tpu.compile`` itself (the package init imports them all),
    and a subpackage's ``__init__`` imports nothing (importing one part loads no other)."""
    modules = _torch_tpu_modules()
    offenders = []
    for module, path in modules.items():
        part = _compile_part(module)
        if part is None:
            continue
        every = _imports(path, modules, module_level=False)
        if path.name == "__init__.py" and every:
            offenders.append(f"{module} (a subpackage init) imports {sorted(every)}")
        for target in sorted(every):
            other = _compile_part(target)
            if target == "torch_tpu.compile":
                offenders.append(f"{module} imports the torch_tpu.compile package itself")
            elif other is not None and other != part and other not in COMPILE_ALLOWED[part]:
                offenders.append(f"{module} ({part}) imports {target} ({other})")
    assert not offenders, "\n".join(offenders)


# --- public seams: no module reaches into another's private names ---------------------------------

# (module, the other module's private name, why it stays private)
PRIVATE_EXCEPTIONS = {
    # pickles written by torch.save name this function: a rename would break loading saved files
    ("torch_tpu.runtime.serialization", "_rebuild_tpu_tensor"),
}


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((REPO_ROOT / package).rglob("*.py"))}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_reaches(path: Path, modules: dict[str, Path]) -> set[str]:
    """``from other import _name`` and ``other_module._name`` where ``other`` is a project module
    imported by this file (attributes of objects are not counted: only of imported modules)."""
    tree = _tree(path)
    module_aliases: dict[str, str] = {}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module in modules:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    module_aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif _private(alias.name):
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    module_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases):
            found.add(f"{module_aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    modules = _project_modules()
    offenders = []
    for module, path in modules.items():
        for reach in sorted(_private_reaches(path, modules)):
            owner, name = reach.rsplit(".", 1)
            if owner != module and (module, name) not in PRIVATE_EXCEPTIONS:
                offenders.append(f"{module} uses {reach}")
    assert not offenders, "\n".join(offenders)


def test_no_module_reads_a_tpu_tensors_storage_through_a_private_attribute() -> None:
    offenders = [str(p.relative_to(REPO_ROOT)) for package in PACKAGES
                 for p in sorted((REPO_ROOT / package).rglob("*.py")) if re.search(r"\._box\b", p.read_text())]
    assert not offenders, offenders


# A TpuTensor's layout over its storage: the other rooms read it, only the runtime sets it
# (``torch_tpu.runtime.tensor``: make_alias, set_layout, share_storage, wrap_owned, ...).
LAYOUT_ATTRIBUTES = {"storage_box", "whole_storage", "dtype_view", "math_bits"}
RETIRED_LAYOUT_ATTRIBUTES = {"_full", "_reinterpreted", "_math_bits"}


def test_only_the_runtime_sets_a_tpu_tensors_layout() -> None:
    offenders = []
    for module, path in _project_modules().items():
        if module.startswith("torch_tpu.runtime."):
            continue
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr in RETIRED_LAYOUT_ATTRIBUTES:
                offenders.append(f"{module}:{node.lineno} uses .{node.attr}")
            elif node.attr in LAYOUT_ATTRIBUTES and isinstance(node.ctx, (ast.Store, ast.Del)):
                offenders.append(f"{module}:{node.lineno} sets .{node.attr}")
    assert not offenders, "\n".join(offenders)


def _imported_test_modules(tree: ast.AST) -> list[str]:
    """Test modules (``test_*``) that ``tree`` imports: ``import tests.a.test_b``, ``from tests.a.test_b
    import x``, ``from tests.a import test_b``, also in the source of a child process held in a string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.rsplit(".", 1)[-1].startswith("test_"):
                found.append(node.module)
            elif node.module.split(".")[0] == "tests":
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.startswith("tests.") and a.name.rsplit(".", 1)[-1].startswith("test_")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                found += _imported_test_modules(ast.parse(node.value))
            except SyntaxError:
                pass  # prose, not code
    return found


def test_no_test_module_imports_another() -> None:
    """What tests share lives in helper modules (conftest.py, ``*_cases.py``, ...), not in test files."""
    offenders = [f"{path.relative_to(REPO_ROOT)} imports {module}"
                 for path in sorted((REPO_ROOT / "tests").rglob("*.py"))
                 for module in _imported_test_modules(_tree(path))]
    assert not offenders, "\n".join(offenders)


def test_a_test_module_imported_in_any_form_is_caught() -> None:
    # spelled as templates: the rule reads this file too
    forms = [form.format(m="test_b") for form in ("import tests.a.{m}", "from tests.a.{m} import x",
                                                  "from tests.a import {m} as t",
                                                  "run(['python', '-c', 'from tests.a import {m}'])")]
    assert [_imported_test_modules(ast.parse(form)) for form in forms] == [["tests.a.test_b"]] * 4
    assert _imported_test_modules(ast.parse("from tests.a import b_cases\nprint('import this')")) == []


def test_no_submodule_imports_from_its_package_init_while_the_init_imports_it() -> None:
    """``pkg/__init__.py`` importing ``pkg.mod`` while ``mod`` does ``from pkg import x``: a circle
    through a half-initialised package (import ``pkg.x`` by its full name instead)."""
    modules = _project_modules()
    offenders = []
    for package, init in modules.items():
        if init.name != "__init__.py":
            continue
        for child in sorted(_imports(init, modules, module_level=True)):
            if not child.startswith(f"{package}.") or child not in modules:
                continue
            tree = _tree(modules[child])
            if any(isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == package
                   for node in _module_level(tree.body)):
                offenders.append(f"{package} <-> {child}")
    assert not offenders, "\n".join(offenders)


KNOB_REGISTRY = "tpu_facts.knobs"
PROJECT_VARIABLE = re.compile(r"(TORCH_TPU|TORCHREC_TPU|TPU_DIST)_[A-Z0-9_]+")


def _environment_reads(tree: ast.AST) -> list[ast.AST]:
    """The keys of ``os.environ.get(k)``, ``os.getenv(k)``, ``os.environ[k]`` (read), ``k in os.environ``."""
    def environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if (node.func.attr == "get" and environ(node.func.value)) or node.func.attr == "getenv":
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and environ(node.value) and isinstance(node.ctx, ast.Load):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            keys.append(node.left)
    return keys


def test_project_environment_variables_are_read_only_through_the_knob_registry() -> None:
    """Every TORCH_TPU_* / TORCHREC_TPU_* / TPU_DIST_* variable is a ``tpu_facts.knobs.Knob``: no other
    module names one as a string, nor reads the environment by a knob's name (``knob.name``, an
    ``*_ENV`` alias of one): it asks the knob (``value``, ``text``, ``on``, ``integer``)."""
    offenders = []
    for module, path in _project_modules().items():
        if module == KNOB_REGISTRY:
            continue
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and PROJECT_VARIABLE.fullmatch(node.value):
                offenders.append(f"{module}:{node.lineno} names {node.value!r}")
        for key in _environment_reads(tree):
            if re.search(r"\bknobs\.|_ENV\b|\.name\b", ast.unparse(key)):
                offenders.append(f"{module}:{key.lineno} reads os.environ[{ast.unparse(key)}]")
    assert not offenders, "\n".join(offenders)


def test_every_on_off_mode_is_a_switch() -> None:
    """A scoped boolean mode is a ``tpu_facts.switches.Switch`` (``with switch.on():``), not a
    ``ContextVar`` of its own with a hand-written set / reset."""
    offenders = []
    for module, path in _project_modules().items():
        if module == "tpu_facts.switches":
            continue
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and _call_name(node) == "ContextVar"
                    and any(k.arg == "default" and isinstance(k.value, ast.Constant)
                            and isinstance(k.value.value, bool) for k in node.keywords)):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, "\n".join(offenders)


# --- one sparse-backend vocabulary ----------------------------------------------------------------

BACKEND_REGISTRY = "sparsecore.backends"  # sparsecore/backends/__init__.py: BackendName, XLA, OPS, ...


def _backend_named(node: ast.AST) -> bool:
    """A name, attribute, parameter or call whose identifier says it holds a backend."""
    if isinstance(node, ast.Call):
        node = node.func
    ident = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None) or ""
    return "backend" in ident.lower()


def _call_name(call: ast.Call) -> str:
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None) or ""


def _backend_literals(node: ast.AST | None, names: set[str]) -> list[str]:
    """The backend names written as string literals in ``node`` (itself, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for element in node.elts for name in _backend_literals(element, names)]
    return []


def _backend_name_literals(tree: ast.AST, names: set[str]) -> list[str]:
    """Where a backend name is spelled as a literal for a backend: compared with, assigned to,
    defaulted to or passed as something named *backend* (or to a call named so; not
    ``torch.compile``'s), bound to an UPPER_CASE constant, or a class's ``name`` attribute."""
    values: list[ast.AST | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_backend_named(o) for o in operands):
                values += operands
        elif isinstance(node, ast.Call) and _call_name(node) != "compile":  # (torch.compile's are Dynamo's)
            values += [k.value for k in node.keywords if k.arg and "backend" in k.arg.lower()]
            values += node.args if _backend_named(node) else []
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults),
                     *zip(a.kwonlyargs, a.kw_defaults)]
            values += [default for arg, default in pairs if _backend_named(arg)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                ident = getattr(target, "id", None) or getattr(target, "attr", None) or ""
                if _backend_named(target) or ident.isupper() or ident == "name":
                    values.append(node.value)
    return [f"line {v.lineno}: {name!r}" for v in values for name in _backend_literals(v, names)]


def test_sparse_backends_are_named_only_by_their_registry() -> None:
    """``sparsecore.backends`` defines the backend names (``BackendName``); everything else (the
    train CLI's choices, the sharded tables, the step layout, the backends' own ``name``) takes
    them from there, never spelling one as a string where a backend is meant."""
    from typing import get_args

    from sparsecore.backends import BackendName

    names = set(get_args(BackendName))
    offenders = []
    for module, path in _project_modules().items():
        # (torch_tpu's backends are torch.compile's and torch.distributed's, and its "tpu" a device)
        if module == BACKEND_REGISTRY or module.split(".")[0] not in ("sparsecore", "torchrec_tpu"):
            continue
        offenders += [f"{module} {where}"
                      for where in _backend_name_literals(_tree(path), names)]
    assert not offenders, "\n".join(offenders)
