"""Write TorchTPU's public API, read from an unpacked ``torch-tpu`` wheel, as a pinned JSON list.

    pip download torch-tpu==0.2.0 --no-deps -d /tmp/w && unzip -q /tmp/w/*.whl -d /tmp/w/unpacked
    python scripts/torchtpu_api_snapshot.py /tmp/w/unpacked \
        -o tests/torch_tpu/data/torchtpu_0_2_0_api.json

Nothing of the wheel is imported or run: the Python sources are read with ``ast`` and the op
schemas are the printable strings of its glue libraries. The list holds

* ``public``: every name of ``torch_tpu/_internal/public_api.py``'s ``_PUBLIC_MODULES`` table
  (``torch.tpu``, ``torch.tpu.ops`` ...), and ``internal``: the ``__all__`` names of the
  ``torch_tpu._internal`` modules libraries import (TorchRec's TPU code: ``pallas``, ``sync``,
  ``profiler``). Each is ``{"kind": ..., "params": [...]}``: kind ``function``, ``class``,
  ``property``, ``enum`` (with ``members``) or ``value``; params (functions and class
  constructors) as ``[name, kind, default]`` with the kind of ``inspect.Parameter`` and the
  default when it is a plain literal (``"<expr>"`` for another expression, absent for none).
* ``schemas``: every ``tpu::`` op schema (one list, the same in every glue library).

``tests/torch_tpu/test_torchtpu_api_parity.py`` checks the project against the list.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

INTERNAL_MODULES = ("torch_tpu._internal.pallas", "torch_tpu._internal.sync", "torch_tpu._internal.profiler")
NO_DEFAULT = object()
_SCHEMA = re.compile(rb"^_?[a-z][a-z0-9_]*(?:\.[a-z_]+)?\(.*\) -> .+$")
_PRINTABLE = re.compile(rb"[\x20-\x7e]{8,}")


class Wheel:
    """The Python modules of an unpacked wheel, parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            base = self.root.joinpath(*name.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            if path is None:
                return None
            self._trees[name] = ast.parse(path.read_text(), filename=str(path))
        return self._trees[name]


# --- resolving a dotted name to its definition --------------------------------------------------------


class Found:
    """What a name is bound to: a definition node in its module, a module, or an expression."""

    def __init__(self, node: ast.AST | None, module: str, owner: ast.ClassDef | None = None,
                 expr: ast.expr | None = None) -> None:
        self.node, self.module, self.owner, self.expr = node, module, owner, expr


def _binding(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last statement of ``body`` binding ``name``: a def, class, assignment or import."""
    found = None
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            found = stmt
        elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            found = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            found = stmt if stmt.value is not None else found
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
                found = stmt
    return found


def resolve_in_module(wheel: Wheel, module: str, name: str) -> Found | None:
    tree = wheel.module(module)
    if tree is None:
        return None
    stmt = _binding(tree.body, name)
    if stmt is None:
        return _from_stages(wheel, module, tree.body, name, None)
    return _follow(wheel, module, stmt, name, None)


def _follow(wheel: Wheel, module: str, stmt: ast.stmt, name: str, owner: ast.ClassDef | None) -> Found | None:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return Found(stmt, module, owner)
    if isinstance(stmt, ast.ImportFrom):
        alias = next(a for a in stmt.names if (a.asname or a.name) == name)
        source = stmt.module or ""
        if wheel.module(f"{source}.{alias.name}") is not None:
            return Found(None, f"{source}.{alias.name}")
        return resolve_in_module(wheel, source, alias.name)
    if isinstance(stmt, ast.Import):
        alias = next(a for a in stmt.names if (a.asname or a.name.split(".")[0]) == name)
        return Found(None, alias.name if alias.asname else alias.name.split(".")[0])
    value = stmt.value  # type: ignore[union-attr]
    return resolve_expr(wheel, module, value, owner) or Found(None, module, owner, value)


def resolve_expr(wheel: Wheel, module: str, expr: ast.expr, owner: ast.ClassDef | None) -> Found | None:
    if isinstance(expr, ast.Name):
        if owner is not None and (stmt := _binding(owner.body, expr.id)) is not None:
            return _follow(wheel, module, stmt, expr.id, owner)
        return resolve_in_module(wheel, module, expr.id)
    if isinstance(expr, ast.Attribute):
        base = resolve_expr(wheel, module, expr.value, owner)
        return resolve_member(wheel, base, expr.attr) if base is not None else None
    return None


def resolve_member(wheel: Wheel, base: Found, name: str) -> Found | None:
    if base.node is None and base.expr is None:  # a module
        return resolve_in_module(wheel, base.module, name)
    if isinstance(base.node, ast.ClassDef):
        return resolve_in_class(wheel, base.module, base.node, name)
    return None


def resolve_in_class(wheel: Wheel, module: str, cls: ast.ClassDef, name: str) -> Found | None:
    stmt = _binding(cls.body, name)
    if stmt is not None:
        return _follow(wheel, module, stmt, name, cls)
    for base in cls.bases:
        found = resolve_expr(wheel, module, base, None)
        if found is not None and isinstance(found.node, ast.ClassDef):
            member = resolve_in_class(wheel, found.module, found.node, name)
            if member is not None:
                return member
    tree = wheel.module(module)
    return _from_stages(wheel, module, tree.body, name, cls) if tree is not None else None


def _from_stages(wheel: Wheel, module: str, body: list[ast.stmt], name: str, owner: ast.ClassDef | None,
                 ) -> Found | None:
    """A name served through a ``__tt_api_stages__`` map: its ``ApiStageInfo(value=...)``."""
    stmt = _binding(body, "__tt_api_stages__")
    if stmt is None or not isinstance(getattr(stmt, "value", None), ast.Dict):
        return None
    for key, value in zip(stmt.value.keys, stmt.value.values):  # type: ignore[union-attr]
        if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Call):
            expr = next((k.value for k in value.keywords if k.arg == "value"), None)
            if expr is not None:
                return resolve_expr(wheel, module, expr, None) or Found(None, module, owner, expr)
    return None


# --- describing a definition ---------------------------------------------------------------------------


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(ast.unparse(target).rsplit(".", 1)[-1])
    return names


def _default(expr: ast.expr) -> Any:
    try:
        return ast.literal_eval(expr)
    except ValueError:
        return "<expr>"


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> list[list[Any]]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [NO_DEFAULT] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[list[Any]] = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([arg.arg, kind] + ([] if default is NO_DEFAULT else [_default(default)]))
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL"])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append([arg.arg, "KEYWORD_ONLY"] + ([] if default is None else [_default(default)]))
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD"])
    return out[1:] if bound else out


def _constructor(wheel: Wheel, module: str, cls: ast.ClassDef) -> list[list[Any]] | None:
    for name in ("__init__", "__new__"):
        found = resolve_in_class(wheel, module, cls, name)
        if found is not None and isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return params(found.node, bound=True)
    return None


def describe(wheel: Wheel, found: Found | None, where: str) -> dict[str, Any]:
    node = None if found is None else found.node
    if isinstance(node, ast.ClassDef):
        bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
        if bases & {"Enum", "IntEnum", "StrEnum"}:
            members = [t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets
                       if isinstance(t, ast.Name) and not t.id.startswith("_")]
            return {"kind": "enum", "members": sorted(members)}
        return {"kind": "class", "params": _constructor(wheel, found.module, node)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        decorators = _decorators(node)
        if "property" in decorators:
            return {"kind": "property"}
        bound = found.owner is not None and "staticmethod" not in decorators
        return {"kind": "function", "params": params(node, bound)}
    if found is not None and found.expr is not None and isinstance(found.expr, ast.Call):
        called = resolve_expr(wheel, found.module, found.expr.func, found.owner)
        if called is not None and isinstance(called.node, ast.ClassDef) and any(
                _binding(called.node.body, "__get__") is not None for _ in [0]):
            return {"kind": "value"}  # a descriptor instance: an attribute
    if found is not None and found.node is None and found.expr is None:
        return {"kind": "module"}
    if found is None:
        raise SystemExit(f"cannot resolve {where} in the wheel")
    return {"kind": "value"}


# --- the public table -----------------------------------------------------------------------------------


def _eval(expr: ast.expr, consts: dict[str, Any]) -> Any:
    """``_PUBLIC_MODULES``' entries: strings, f-strings of module constants, ``_tpu_attr(...)``,
    ``Property(...)``, ``ModuleSpec(exports=...)``."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name):
        return consts[expr.id]
    if isinstance(expr, ast.JoinedStr):
        return "".join(str(_eval(v.value if isinstance(v, ast.FormattedValue) else v, consts)) for v in expr.values)
    if isinstance(expr, ast.Dict):
        return {_eval(k, consts): _eval(v, consts) for k, v in zip(expr.keys, expr.values)}
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
        fn = expr.func.id
        if fn == "_tpu_attr":
            return f"{consts['_TPU_DEVICE_CLASS']}.{_eval(expr.args[0], consts)}"
        if fn == "Property":
            return ("property", _eval(expr.args[0], consts))
        if fn == "ModuleSpec":
            return {k.arg: _eval(k.value, consts) for k in expr.keywords if k.arg == "exports"}
    raise SystemExit(f"public_api.py: cannot read {ast.unparse(expr)}")


def public_table(wheel: Wheel) -> dict[str, dict[str, Any]]:
    tree = wheel.module("torch_tpu._internal.public_api")
    if tree is None:
        raise SystemExit(f"{wheel.root}: no torch_tpu/_internal/public_api.py (not an unpacked torch-tpu wheel?)")
    consts: dict[str, Any] = {}
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        if not isinstance(target, ast.Name) or getattr(stmt, "value", None) is None:
            continue
        if target.id == "_PUBLIC_MODULES":
            return {mod: spec.get("exports", {}) for mod, spec in _eval(stmt.value, consts).items()}
        try:
            consts[target.id] = _eval(stmt.value, consts)
        except SystemExit:
            pass  # not a constant the table uses
    raise SystemExit("public_api.py: no _PUBLIC_MODULES table")


def _resolve_target(wheel: Wheel, target: str) -> Found | None:
    module, qualname = target.split(":", 1)
    first, *rest = qualname.split(".")
    found = resolve_in_module(wheel, module, first)
    for name in rest:
        found = resolve_member(wheel, found, name) if found is not None else None
    return found


def public_names(wheel: Wheel) -> dict[str, dict[str, Any]]:
    out = {}
    for module, exports in public_table(wheel).items():
        for name, target in sorted(exports.items()):
            where = f"{module}.{name}"
            if isinstance(target, tuple):
                out[where] = {"kind": "property"}
                continue
            out[where] = describe(wheel, _resolve_target(wheel, target), where)
    return out


def internal_names(wheel: Wheel) -> dict[str, dict[str, Any]]:
    out = {}
    for module in INTERNAL_MODULES:
        tree = wheel.module(module)
        names = next(ast.literal_eval(s.value) for s in tree.body  # type: ignore[union-attr]
                     if isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in s.targets))
        for name in sorted(names):
            found = resolve_in_module(wheel, module, name)
            if found is None or (found.node is None and found.expr is None):
                # pallas/__init__ serves its names lazily from its pallas submodule
                found = resolve_in_module(wheel, f"{module}.{module.rsplit('.', 1)[1]}", name)
            out[f"{module}.{name}"] = describe(wheel, found, f"{module}.{name}")
    return out


def schemas(root: Path) -> list[str]:
    """The ``tpu::`` op schemas of every glue library (they must agree)."""
    libraries = sorted(root.glob("torch_tpu/csrc/common/glue_*/libpywrap_*_common.so"))
    if not libraries:
        raise SystemExit(f"{root}: no torch_tpu/csrc/common/glue_*/libpywrap_*_common.so")
    found: dict[str, set[str]] = {}
    for lib in libraries:
        strings = (m.group(0) for m in _PRINTABLE.finditer(lib.read_bytes()))
        found[lib.name] = {" ".join(s.decode().split()).replace("( ", "(") for s in strings
                           if _SCHEMA.match(s) and not s.startswith(b"aten")}
    first, *others = found.values()
    if any(o != first for o in others):
        raise SystemExit(f"the glue libraries disagree on the tpu:: schemas: {sorted(found)}")
    return sorted(first)


def _format(snapshot: dict[str, Any]) -> str:
    """The JSON with one line per name and per schema (readable diffs)."""
    lines = ["{", f' "distribution": {json.dumps(snapshot["distribution"])},']
    for section in ("public", "internal"):
        entries = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(snapshot[section].items())]
        lines += [f' "{section}": {{', ",\n".join(entries), " },"]
    lines += [' "schemas": [', ",\n".join(f"  {json.dumps(s)}" for s in snapshot["schemas"]), " ]", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel_dir", type=Path, help="an unpacked torch-tpu wheel (holds torch_tpu/)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the JSON list to write")
    args = parser.parse_args(argv)
    wheel = Wheel(args.wheel_dir)
    version = next(args.wheel_dir.glob("torch_tpu-*.dist-info"), None)
    snapshot = {
        "distribution": version.name.removesuffix(".dist-info") if version else "torch_tpu",
        "public": public_names(wheel),
        "internal": internal_names(wheel),
        "schemas": schemas(args.wheel_dir),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(_format(snapshot))
    print(f"{args.output}: {len(snapshot['public'])} public names, {len(snapshot['internal'])} internal names, "
          f"{len(snapshot['schemas'])} schemas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
