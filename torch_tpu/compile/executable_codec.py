"""A compiled single-device JAX program as plain bytes and back, without pickle.

``jax.experimental.serialize_executable`` pickles the executable's Python wrapper, and loading a
pickle runs whatever code it names. Here the wrapper's fields are written as JSON (shapes, dtypes,
layouts, memory kinds, names, donation), the pytree structures of the inputs and outputs as JAX's
own treedef protobuf, and the executable as the bytes PJRT serialized it to (native code: the
cache directory's trust policy and each entry's digest, :mod:`xla_cache`, guard those).

Only what this encoding reproduces exactly is encoded: :func:`encode` rebuilds every field from
its own output and compares it with the original, and returns None for a program it cannot
reproduce (effects, host callbacks, constants, custom pytree nodes, mutable or multi-device inputs).
"""

from __future__ import annotations

import json
from typing import Any

from torch_tpu.runtime._jax import jax

FORMAT = 1
_LEN_BYTES = 8


def encode(compiled: Any) -> bytes | None:
    """``compiled`` (a ``jax.stages.Compiled``) as bytes for :func:`decode`, or None when it is
    not a plain single-device program this encoding reproduces."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if not _plain(compiled, unloaded):
        return None
    try:
        trees = (compiled.in_tree.serialize_using_proto(), compiled.out_tree.serialize_using_proto())
    except Exception:  # noqa: BLE001  a custom pytree node: no protobuf form
        return None
    arg_infos = jax.tree.leaves(compiled.args_info)
    try:
        meta = _describe(compiled, unloaded, arg_infos)
        rebuilt = _rebuild(json.loads(json.dumps(meta)), *trees)
    except (TypeError, ValueError, KeyError):  # a dtype or layout this encoding does not describe
        return None
    if rebuilt != _original_parts(compiled, unloaded, arg_infos):
        return None
    executable = unloaded.backend.serialize_executable(unloaded.xla_executable)
    meta["sizes"] = [len(executable), *map(len, trees)]
    header = json.dumps(meta).encode()
    return len(header).to_bytes(_LEN_BYTES, "little") + header + executable + b"".join(trees)


def _describe(compiled: Any, unloaded: Any, arg_infos: list[Any]) -> dict[str, Any]:
    """The program's Python parts as JSON-ready values (TypeError: a part it cannot describe)."""
    debug = unloaded.all_args_info.debug_info if unloaded.all_args_info is not None else None
    return {
        "format": FORMAT, "device": unloaded.device_list[0].id, "name": unloaded.name, "committed": unloaded.committed,
        "kept": sorted(unloaded.kept_var_idx), "no_kwargs": compiled._no_kwargs,
        "in_avals": [_aval_desc(a) for a in unloaded.input_avals],
        "out_avals": [_aval_desc(a) for a in unloaded.output_avals],
        "in_memory": [s.memory_kind for s in unloaded.input_shardings],
        "out_memory": [s.memory_kind for s in unloaded.output_shardings],
        "args": [[_aval_desc(i._aval), i.donated] for i in arg_infos],
        "all_args": None if debug is None else [_aval_desc(a) for a in unloaded.all_args_info.in_avals],
        "debug": None if debug is None else [debug.traced_for, debug.func_src_info, debug.arg_names],
        "layouts": {name: [_layout_desc(x) for x in getattr(unloaded, name)]
                    for name in ("xla_in_layouts", "dispatch_in_layouts", "xla_out_layouts")},
    }


def decode(blob: bytes) -> Any:
    """The loaded ``jax.stages.Compiled`` that :func:`encode` wrote as ``blob``, on the local
    device it was compiled for; raises ValueError (or what JSON and PJRT raise) on anything else."""
    from jax._src import stages
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc

    header_len = int.from_bytes(blob[:_LEN_BYTES], "little")
    meta = json.loads(blob[_LEN_BYTES:_LEN_BYTES + header_len])
    if meta.get("format") != FORMAT:
        raise ValueError(f"executable format {meta.get('format')!r}, this reader knows {FORMAT}")
    sizes, start = meta["sizes"], _LEN_BYTES + header_len
    if len(blob) != start + sum(sizes):
        raise ValueError(f"{len(blob) - start} bytes after the header, it lists {sum(sizes)}")
    executable = blob[start:start + sizes[0]]
    in_tree = blob[start + sizes[0]:start + sizes[0] + sizes[1]]
    parts = _rebuild(meta, in_tree, blob[start + sizes[0] + sizes[1]:])
    device = next((d for d in jax.local_devices() if d.id == meta["device"]), None)
    if device is None:
        raise ValueError(f"compiled for device {meta['device']}, which this process does not have")
    devices = xc.DeviceList((device,))
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=device.client.deserialize_executable(executable, executable_devices=devices),
        device_list=devices, backend=device.client, input_avals=parts["in_avals"],
        input_shardings=[jax.sharding.SingleDeviceSharding(device, memory_kind=k) for k in meta["in_memory"]],
        output_avals=parts["out_avals"],
        output_shardings=[jax.sharding.SingleDeviceSharding(device, memory_kind=k) for k in meta["out_memory"]],
        committed=parts["committed"], name=parts["name"], unordered_effects=[], ordered_effects=[], keepalive=[],
        host_callbacks=[], kept_var_idx=parts["kept"], mut=None, xla_in_layouts=parts["xla_in_layouts"],
        dispatch_in_layouts=parts["dispatch_in_layouts"], xla_out_layouts=parts["xla_out_layouts"],
        all_args_info=_all_args_info(parts["all_args_info"]), pgle_profiler=None)
    args_info = parts["in_tree"].unflatten([stages.ArgInfo(a, d) for a, d in parts["args"]])
    return stages.Compiled(unloaded.load(), [], args_info, parts["out_tree"], no_kwargs=parts["no_kwargs"])


def _plain(compiled: Any, unloaded: Any) -> bool:
    """Whether ``compiled`` is a program this encoding describes: one device, no effects,
    callbacks, constants or mutable inputs, every input and output on that device."""
    from jax._src.interpreters import pxla

    if type(unloaded) is not pxla.UnloadedMeshExecutable or len(unloaded.device_list) != 1:
        return False
    if (unloaded.unordered_effects or unloaded.ordered_effects or unloaded.keepalive or unloaded.host_callbacks
            or unloaded.mut is not None or unloaded.pgle_profiler is not None or compiled._params.const_args):
        return False
    device = unloaded.device_list[0]
    return all(type(s) is jax.sharding.SingleDeviceSharding and s._device == device
               for s in (*unloaded.input_shardings, *unloaded.output_shardings))


def _original_parts(compiled: Any, unloaded: Any, arg_infos: list[Any]) -> dict[str, Any]:
    debug = unloaded.all_args_info.debug_info if unloaded.all_args_info is not None else None
    return {
        "in_avals": list(unloaded.input_avals), "out_avals": list(unloaded.output_avals),
        "committed": unloaded.committed, "name": unloaded.name, "kept": set(unloaded.kept_var_idx),
        "xla_in_layouts": list(unloaded.xla_in_layouts), "dispatch_in_layouts": list(unloaded.dispatch_in_layouts),
        "xla_out_layouts": list(unloaded.xla_out_layouts),
        "all_args_info": None if debug is None else (list(unloaded.all_args_info.in_avals),
                                                     (debug.traced_for, debug.func_src_info, debug.arg_names)),
        "args": [(i._aval, i.donated) for i in arg_infos],
        "in_tree": compiled.in_tree, "out_tree": compiled.out_tree, "no_kwargs": compiled._no_kwargs,
    }


def _rebuild(meta: dict[str, Any], in_tree: bytes, out_tree: bytes) -> dict[str, Any]:
    """The Python parts of the program from ``meta`` and the treedef protobufs (the fields
    :func:`_original_parts` reads, with the debug info in its comparable form)."""
    registry = jax.tree_util.default_registry
    treedef = jax.tree_util.PyTreeDef
    all_args = meta["all_args"]
    debug = meta["debug"]
    return {
        "in_avals": [_aval(d) for d in meta["in_avals"]], "out_avals": [_aval(d) for d in meta["out_avals"]],
        "committed": bool(meta["committed"]), "name": str(meta["name"]), "kept": {int(i) for i in meta["kept"]},
        **{name: [_layout(d) for d in descs] for name, descs in meta["layouts"].items()},
        "all_args_info": None if all_args is None else (
            [_aval(d) for d in all_args], (debug[0], debug[1], None if debug[2] is None else tuple(debug[2]))),
        "args": [(_aval(a), bool(donated)) for a, donated in meta["args"]],
        "in_tree": treedef.deserialize_using_proto(registry, in_tree),
        "out_tree": treedef.deserialize_using_proto(registry, out_tree),
        "no_kwargs": bool(meta["no_kwargs"]),
    }


def _all_args_info(comparable: tuple[list[Any], tuple[Any, ...]] | None) -> Any:
    from jax._src import core
    from jax._src.interpreters import pxla

    if comparable is None:
        return None
    avals, (traced_for, src, arg_names) = comparable
    return pxla.AllArgsInfo(avals, core.DebugInfo(traced_for, src, arg_names, None))


def _aval_desc(aval: Any) -> list[Any]:
    from jax._src import core

    if type(aval) is not core.ShapedArray:
        raise TypeError(f"{type(aval).__name__} is not a plain array type")
    return [list(aval.shape), aval.dtype.name, bool(aval.weak_type)]


def _aval(desc: list[Any]) -> Any:
    from jax._src import core

    shape, dtype, weak = desc
    return core.ShapedArray(tuple(int(s) for s in shape), jax.numpy.dtype(dtype), weak_type=bool(weak))


def _layout_desc(layout: Any) -> list[Any] | None:
    if layout is None:
        return None
    return [list(layout.major_to_minor), None if layout.tiling is None else [list(t) for t in layout.tiling],
            layout.sub_byte_element_size_in_bits]


def _layout(desc: list[Any] | None) -> Any:
    from jax._src.layout import Layout

    if desc is None:
        return None
    major_to_minor, tiling, sub_byte = desc
    return Layout(tuple(major_to_minor), None if tiling is None else tuple(map(tuple, tiling)), int(sub_byte))
