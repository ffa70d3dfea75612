"""Traced ``train_step`` programs in the persistent compile cache (level ``steps``).

Tracing a step (``make_fx`` twice, then the FX -> JAX translation) takes 1-2 s; a second process
training the same model skips it: the step's program is stored as a serialized ``jax.export``
with what its outputs update, and its XLA executable is stored serialized beside it
(:mod:`torch_tpu.compile.program.executables`).

The key covers everything the trace reads besides tensor values: the call's
:class:`~torch_tpu.compile.step.step_trace.StepSignature` (shapes, dtypes, optimizer settings and
state layout, batch structure), the model's tensor names, every submodule's class (the code of
each class in its MRO and the source file defining it; files by their identity,
:mod:`torch_tpu.compile.program.sources`) and non-tensor attributes (tensor
attributes by content), the loss function's code, closure and defaults, the optimizer's class,
the source of each top-level package defining one of those classes or the loss function (every
``.py`` file under it; an installed package by its version), torch_tpu's own source, and the
torch / jax versions. Steps of models with forward/backward hooks, or of optimizers with step
hooks, are not stored (a hook's effect is not part of the key). Anything the key cannot describe
exactly (an object whose ``repr`` shows its address) makes a key no other process produces: a
miss, never a stale program.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import sysconfig
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torch_tpu.compile.program.graph as compiled_graph
import xla_cache
from torch_tpu.compile.program.sources import file_identity, tree_identity
from torch_tpu.compile.step.step_trace import LossFn, StepSignature
from torch_tpu.runtime import persistent_cache
from torch_tpu.runtime._jax import jax

_class_digests: dict[type, str] = {}
_package_digests: dict[str, str] = {}  # per step_key call: files may change between compiles
_INSTALLED = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                   | {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()})
# module bookkeeping that never changes a trace (hook dicts are checked apart)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _package_digest(module_name: str) -> str:
    """The source of the top-level package defining ``module_name``: every ``.py`` file under it
    (all of them, imported or not, so the key does not depend on what a process imported), or
    its version where it is installed."""
    top = module_name.partition(".")[0]
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if not path:
        return f"{top}:"
    root = Path(path).resolve()
    if any(root.is_relative_to(installed) for installed in _INSTALLED):
        return f"{top}:{getattr(module, '__version__', '')}"
    if root.name != "__init__.py":  # a single-file module, e.g. the script being run
        return f"{top}:{file_identity(root)}"
    digest = _package_digests.get(top)
    if digest is None:
        digest = _package_digests[top] = tree_identity(root.parent)
    return f"{top}:{digest}"


def _code_digest(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    return hashlib.sha256(_code_text(code).encode()).hexdigest() if code is not None else _describe(fn)


def _code_text(code: types.CodeType) -> str:
    """What marshal writes of ``code``, as text of the code alone: marshal's bytes also depend on
    each constant's reference count and on which strings are interned, which differ between
    processes (a step key from them missed the cache in every later job)."""
    fields = (code.co_qualname, code.co_filename, code.co_firstlineno, code.co_argcount, code.co_posonlyargcount,
              code.co_kwonlyargcount, code.co_flags, code.co_code, code.co_names, code.co_varnames,
              code.co_freevars, code.co_cellvars, code.co_linetable, code.co_exceptiontable)
    return f"{fields!r}:{_const_text(code.co_consts)}"


def _const_text(value: Any) -> str:
    if isinstance(value, types.CodeType):
        return f"code({_code_text(value)})"
    if isinstance(value, tuple):
        return f"({','.join(map(_const_text, value))})"
    if isinstance(value, frozenset):  # its order follows string hashes, seeded per process
        return f"frozenset({','.join(sorted(map(_const_text, value)))})"
    return f"{type(value).__name__}:{value!r}"


def _class_digest(cls: type) -> str:
    digest = _class_digests.get(cls)
    if digest is None:
        h = hashlib.sha256()
        for base in cls.__mro__:
            if base is object:
                continue
            h.update(f"{base.__module__}.{base.__qualname__}".encode())
            h.update(file_identity(_source_file(base)).encode())
            for name, value in sorted(vars(base).items()):
                target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                target = _dynamo_enabled(target.fget if isinstance(target, property) else target)
                if isinstance(target, types.FunctionType):
                    h.update(f"{name}:{_code_digest(target)}".encode())
        digest = _class_digests[cls] = h.hexdigest()
    return digest


def _dynamo_enabled(fn: Any) -> Any:
    """``fn`` without TorchDynamo's ``disable`` wrappers, which change nothing outside Dynamo.
    Dynamo wraps every torch optimizer's ``_init_group`` when it is first used in a process: a
    class digested before that would key a step apart from the same class digested after."""
    while getattr(fn, "_torchdynamo_disable", False) and hasattr(fn, "_torchdynamo_orig_callable"):
        fn = fn._torchdynamo_orig_callable
    return fn


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:  # built in, or defined in code without a file (python -c)
        return None


def _describe(value: Any, depth: int = 0) -> str:
    """A stable text for ``value`` that changes whenever the trace could."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
        return repr(value)
    if depth > 4:
        return f"<{type(value).__qualname__} at {id(value)}>"  # too deep: unique to this process
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(map(lambda v: _describe(v, depth + 1), value)) if isinstance(value, (set, frozenset)) \
            else [_describe(v, depth + 1) for v in value]
        return f"{type(value).__name__}({','.join(items)})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_describe(k, depth + 1)}:{_describe(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.Tensor):
        return compiled_graph.tensor_digest(value).hex()
    if isinstance(value, dist.ProcessGroup):  # its ranks, in this process's world
        return f"group:{dist.get_world_size()}:{dist.get_process_group_ranks(value)}"
    if isinstance(value, types.FunctionType):
        cells = _cell_values(value)
        return (f"fn:{value.__module__}.{value.__qualname__}:{_code_digest(value)}:"
                f"{_describe(cells, depth + 1)}:{_describe(value.__defaults__, depth + 1)}")
    if isinstance(value, types.MethodType):
        return f"method:{_describe(value.__func__, depth + 1)}:{_describe(value.__self__, depth + 1)}"
    if isinstance(value, (types.BuiltinFunctionType, types.ModuleType, type)):
        return f"{type(value).__name__}:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    if isinstance(value, nn.Module):
        return f"module:{_module_digest(value, depth + 1)}"
    attrs = getattr(value, "__dict__", None)
    if attrs is not None and type(value).__repr__ is object.__repr__:
        return f"{type(value).__qualname__}:{_class_digest(type(value))}:{_describe(attrs, depth + 1)}"
    return f"{type(value).__qualname__}:{value!r}"


def _cell_values(fn: types.FunctionType) -> list[Any]:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # not assigned yet
            continue
    return values


def _has_hooks(module: nn.Module) -> bool:
    return any(value for key, value in vars(module).items()
               if key.startswith(("_forward", "_backward")) and "hook" in key)


def _module_digest(model: nn.Module, depth: int = 0) -> str:
    h = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        h.update(f"{name}|{_class_digest(type(module))}|".encode())
        attrs = {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS or k == "training"}
        h.update(_describe(dict(sorted(attrs.items())), depth).encode())
    return h.hexdigest()


def _hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether module or optimizer hooks (global or ``optimizer``'s) would run in the trace."""
    from torch.nn.modules import module as module_impl
    from torch.optim import optimizer as optimizer_impl

    return (any(getattr(module_impl, name) for name in dir(module_impl)
                if name.startswith("_global_") and name.endswith("hooks"))
            or bool(optimizer_impl._global_optimizer_pre_hooks or optimizer_impl._global_optimizer_post_hooks)
            or bool(getattr(optimizer, "_optimizer_step_pre_hooks", None))
            or bool(getattr(optimizer, "_optimizer_step_post_hooks", None)))


def step_key(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | None,
             param_names: Sequence[str], other_names: Sequence[str], signature: StepSignature,
             input_grads: Sequence[int], group: dist.ProcessGroup | None = None) -> str | None:
    """The cache key of the step ``signature`` traces (an SPMD step over ``group``'s ranks), or
    None when it cannot be cached."""
    if xla_cache.cache_dir() is None or _hooks(optimizer) or any(_has_hooks(m) for m in model.modules()):
        return None
    _package_digests.clear()
    classes = {c for m in model.modules() for c in type(m).__mro__} | set(type(optimizer).__mro__)
    packages = {c.__module__ for c in classes} | {__name__, getattr(loss_fn, "__module__", None) or ""}
    h = hashlib.sha256()
    for part in (jax.__version__, torch.__version__, compiled_graph.registry_fingerprint(),
                 torch.get_default_dtype(), repr(signature), list(param_names), list(other_names),
                 list(input_grads), _describe(group), _module_digest(model), _describe(loss_fn),
                 _class_digest(type(optimizer)), sorted({_package_digest(p) for p in packages})):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def load(key: str) -> tuple[Any, dict[str, Any]] | None:
    """(the ``jax.export.Exported`` step, its metadata) stored under ``key``, or None."""
    stored = xla_cache.load(persistent_cache.STEP_LEVEL, key, _decode)  # a corrupt entry: None
    if stored is not None:
        persistent_cache.counters.step_disk_hits += 1
    return stored


def _decode(blob: bytes) -> tuple[Any, dict[str, Any]]:
    """What :func:`store` wrote: an 8-byte header length, the JSON metadata, the program."""
    header_len = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8:8 + header_len])
    return jax.export.deserialize(bytearray(blob[8 + header_len:])), meta


def store(key: str, exported: Any, meta: dict[str, Any]) -> None:
    """Store ``exported`` (the step's program) with ``meta`` (JSON: what its outputs update)."""
    header = json.dumps(meta).encode()
    blob = len(header).to_bytes(8, "little") + header + bytes(exported.serialize())
    xla_cache.store(persistent_cache.STEP_LEVEL, key, blob)
