"""TorchTPU 0.2.0's public API on this project: every name, signature and ``tpu::`` op schema.

The reference is ``data/torchtpu_0_2_0_api.json``, written once from the ``torch-tpu`` 0.2.0
wheel by ``scripts/torchtpu_api_snapshot.py`` (the wheel is not in the repository). A name must
exist with the same parameters in the same order, of the same kinds, with the same literal
defaults; a property must be a settable attribute of its module; an enum must hold TorchTPU's
members. Each op schema must be registered under its exact name and read the same.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_tpu  # noqa: F401  (torch.tpu)

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "torchtpu_0_2_0_api.json").read_text())
_MISSING = object()


def _lookup(dotted: str) -> Any:
    """The object a dotted public name (``torch.tpu.ops.ragged_dot``) names here, or _MISSING."""
    module, _, name = dotted.rpartition(".")
    try:
        owner = importlib.import_module(module)
    except ImportError:
        return _MISSING
    return getattr(owner, name, _MISSING)


def _is_property(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    try:
        owner = importlib.import_module(module)
    except ImportError:
        return False
    return isinstance(inspect.getattr_static(type(owner), name, None), property)


def _params(obj: Any) -> list[list[Any]]:
    signature = inspect.signature(obj)
    out = []
    for p in signature.parameters.values():
        entry: list[Any] = [p.name, p.kind.name]
        if p.default is not inspect.Parameter.empty:
            entry.append(list(p.default) if isinstance(p.default, tuple) else p.default)
        out.append(entry)
    return out


def _difference(dotted: str, want: dict[str, Any]) -> str | None:
    """Why the project's ``dotted`` is not TorchTPU's (None when it is)."""
    kind = want["kind"]
    if kind == "property":
        return None if _is_property(dotted) else "missing, or not a property of its module"
    obj = _lookup(dotted)
    if obj is _MISSING:
        return "missing"
    if kind == "enum":
        if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
            return f"not an enum: {obj!r}"
        absent = sorted(set(want["members"]) - set(obj.__members__))
        return f"members {absent} missing" if absent else None
    if kind in ("function", "class"):
        if not callable(obj):
            return f"not callable: {obj!r}"
        got = _params(obj)
        expected = want["params"]
        if [p[:2] for p in got] != [p[:2] for p in expected]:
            return f"parameters {got} != TorchTPU's {expected}"
        for g, e in zip(got, expected):
            if len(g) != len(e) or (len(e) == 3 and e[2] != "<expr>" and g[2] != e[2]):
                return f"parameter {e[0]!r}: default {g[2:]} != TorchTPU's {e[2:]}"
    return None


def _report(section: str) -> tuple[int, list[str]]:
    names = SNAPSHOT[section]
    wrong = [f"{name}: {why}" for name, want in sorted(names.items()) if (why := _difference(name, want))]
    print(f"\nTorchTPU 0.2.0 {section} names: {len(names) - len(wrong)}/{len(names)} present with its signature")
    return len(names), wrong


def test_every_public_name_has_torchtpus_signature() -> None:
    total, wrong = _report("public")
    assert total == 71
    assert not wrong, "\n".join(wrong)


def test_internal_modules_torchrec_imports_have_torchtpus_names() -> None:
    total, wrong = _report("internal")
    assert total == 17
    assert not wrong, "\n".join(wrong)


def _registered(schema: str) -> torch._C.FunctionSchema | None:
    name = schema.split("(", 1)[0]
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.tpu, op, None)
    if packet is None or (overload or "default") not in packet.overloads():
        return None
    return getattr(packet, overload or "default")._schema


def test_every_tpu_op_schema_is_registered_under_its_exact_name() -> None:
    wrong = []
    for schema in SNAPSHOT["schemas"]:
        got = _registered(schema)
        want = torch._C.parse_schema(f"tpu::{schema}")
        if got is None:
            wrong.append(f"tpu::{schema}: missing")
        elif str(got) != str(want):
            wrong.append(f"tpu::{schema}: registered as {got}")
    print(f"\nTorchTPU 0.2.0 tpu:: op schemas: {len(SNAPSHOT['schemas']) - len(wrong)}/{len(SNAPSHOT['schemas'])}")
    assert len(SNAPSHOT["schemas"]) == 34
    assert not wrong, "\n".join(wrong)


def _torchrec_internal_uses() -> set[str]:
    """``torch_tpu._internal.<module>.<name>`` that the installed TorchRec's files import or use."""
    import torchrec

    uses = set()
    for path in Path(torchrec.__file__).parent.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "torch_tpu._internal" not in text:
            continue
        tree = ast.parse(text)
        modules = {}  # local name -> torch_tpu._internal module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_tpu._internal"):
                for alias in node.names:
                    if node.module == "torch_tpu._internal":
                        modules[alias.asname or alias.name] = f"torch_tpu._internal.{alias.name}"
                    else:
                        uses.add(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch_tpu._internal.") and alias.asname:
                        modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                uses.add(f"{modules[node.value.id]}.{node.attr}")
    return uses


def test_torchrecs_internal_imports_resolve() -> None:
    uses = _torchrec_internal_uses()
    assert uses, "the installed TorchRec imports nothing of torch_tpu._internal: is it TorchRec 1.9.2?"
    missing = sorted(u for u in uses if _lookup(u) is _MISSING)
    assert not missing, missing


@pytest.mark.parametrize("name", ["torch.tpu.ops.ragged_dot", "torch.tpu.set_rng_state"])
def test_the_check_sees_a_changed_signature(name: str) -> None:
    """The comparison is not vacuous: another parameter list is reported."""
    want = dict(SNAPSHOT["public"][name])
    want["params"] = [*want["params"], ["extra", "KEYWORD_ONLY"]]
    assert _difference(name, want) is not None


# --- the face in one package (torch_tpu/_internal) ------------------------------------------------


def _tpu_ops_named(part: str) -> set[str]:
    return {name.removeprefix("tpu::") for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("tpu::") and part in name}


def test_each_sparsecore_op_has_one_schema_and_torchtpus_spellings_only_as_aliases() -> None:
    """The ``tpu::`` ops of SparseCore lookups and updates: the project's own (defined once, in
    ``torch_tpu.ops.sparsecore``) and, beside them, only TorchTPU 0.2.0's pinned names (the wheel's
    list), each an alias of one of them; no private twin."""
    from torch_tpu.ops import sparsecore

    torchtpus = {schema.split("(")[0] for schema in SNAPSHOT["schemas"] if "sparse_dense_matmul" in schema}
    assert _tpu_ops_named("sparse_dense_matmul") == set(sparsecore.SCHEMAS) | torchtpus
    aliases = torchtpus & {f"_{name}" for name in sparsecore.SCHEMAS}
    assert aliases == {"_sparse_dense_matmul", "_sparse_dense_matmul_grad_with_sgd",
                       "_sparse_dense_matmul_grad_with_adagrad", "_sparse_dense_matmul_grad_with_adam"}
    for alias in aliases:  # a composite over its op: no kernel, lowering or fake of its own
        op = getattr(torch.ops.tpu, alias).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"), alias
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), alias


def test_import_torch_tpu_puts_one_finder_of_its_own_on_meta_path() -> None:
    import sys

    own = [type(f).__module__ for f in sys.meta_path
           if type(f).__module__.startswith("torch_tpu") and type(f).__module__ != "torch_tpu.runtime.after_import"]
    assert own == ["torch_tpu._internal.import_hook"]
    assert type(sys.meta_path[0]).__module__ == "torch_tpu._internal.import_hook"  # it guards TorchRec's modules


def test_an_installed_torch_tpu_distribution_wins_over_the_stand_in(tmp_path, monkeypatch) -> None:
    import importlib.metadata
    import sys

    assert importlib.metadata.version("torch-tpu") == "0.2.0+torchrec.tpu"
    info = tmp_path / "torch_tpu-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-tpu\nVersion: 9.9.9\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert importlib.metadata.version("torch-tpu") == "9.9.9"
    assert importlib.metadata.version("torch_tpu") == "9.9.9"
