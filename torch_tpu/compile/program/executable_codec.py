"""A compiled JAX program as plain bytes and back, without pickle: a single-device program, or
an SPMD program over several devices (one per process of a multi-controller job) whose inputs and
outputs are laid out by one mesh.

``jax.experimental.serialize_executable`` pickles the executable's Python wrapper, and loading a
pickle runs whatever code it names. Here the wrapper's fields are written as JSON (shapes, dtypes,
layouts, memory kinds, names, donation), the pytree structures of the inputs and outputs as JAX's
own treedef protobuf, and the executable as the bytes PJRT serialized it to (native code: the
cache directory's trust policy and each entry's digest, :mod:`xla_cache`, guard those).

Only what this encoding reproduces exactly is encoded: :func:`encode` rebuilds every field from
its own output and compares it with the original, and returns None for a program it cannot
reproduce (effects, host callbacks, constants, custom pytree nodes, mutable inputs, shardings other
than one device's or one mesh's ``NamedSharding``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from torch_tpu.runtime._jax import jax

FORMAT = 2  # 2: the devices and shardings of multi-device programs
_LEN_BYTES = 8


def encode(compiled: Any) -> bytes | None:
    """``compiled`` (a ``jax.stages.Compiled``) as bytes for :func:`decode`, or None when it is
    not a plain program (one device, or one mesh of devices) this encoding reproduces."""
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
    except (TypeError, ValueError, KeyError, AttributeError):  # a dtype or layout this encoding does not describe
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
        "format": FORMAT, "devices": [d.id for d in unloaded.device_list], "mesh": _mesh_desc(unloaded),
        "in_shardings": [_sharding_desc(s) for s in unloaded.input_shardings],
        "out_shardings": [_sharding_desc(s) for s in unloaded.output_shardings],
        "name": unloaded.name, "committed": unloaded.committed,
        "kept": sorted(unloaded.kept_var_idx), "no_kwargs": compiled._no_kwargs,
        "in_avals": [_aval_desc(a) for a in unloaded.input_avals],
        "out_avals": [_aval_desc(a) for a in unloaded.output_avals],
        "args": [[_aval_desc(i._aval), i.donated] for i in arg_infos],
        "all_args": None if debug is None else [_aval_desc(a) for a in unloaded.all_args_info.in_avals],
        "debug": None if debug is None else [debug.traced_for, debug.func_src_info, debug.arg_names],
        "layouts": {name: [_layout_desc(x) for x in getattr(unloaded, name)]
                    for name in ("xla_in_layouts", "dispatch_in_layouts", "xla_out_layouts")},
    }


def decode(blob: bytes) -> Any:
    """The loaded ``jax.stages.Compiled`` that :func:`encode` wrote as ``blob``, on the devices it
    was compiled for; raises ValueError (or what JSON and PJRT raise) on anything else."""
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
    devices = xc.DeviceList(tuple(parts["devices"]))
    client = parts["devices"][0].client
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=client.deserialize_executable(executable, executable_devices=devices),
        device_list=devices, backend=client, input_avals=parts["in_avals"], input_shardings=parts["in_shardings"],
        output_avals=parts["out_avals"], output_shardings=parts["out_shardings"],
        committed=parts["committed"], name=parts["name"], unordered_effects=[], ordered_effects=[], keepalive=[],
        host_callbacks=[], kept_var_idx=parts["kept"], mut=None, xla_in_layouts=parts["xla_in_layouts"],
        dispatch_in_layouts=parts["dispatch_in_layouts"], xla_out_layouts=parts["xla_out_layouts"],
        all_args_info=_all_args_info(parts["all_args_info"]), pgle_profiler=None)
    args_info = parts["in_tree"].unflatten([stages.ArgInfo(a, d) for a, d in parts["args"]])
    return stages.Compiled(unloaded.load(), [], args_info, parts["out_tree"], no_kwargs=parts["no_kwargs"])


def _plain(compiled: Any, unloaded: Any) -> bool:
    """Whether ``compiled`` is a program this encoding describes: no effects, callbacks, constants
    or mutable inputs, every input and output on its one device, or laid out by one mesh over its
    devices."""
    from jax._src.interpreters import pxla

    if type(unloaded) is not pxla.UnloadedMeshExecutable:
        return False
    if (unloaded.unordered_effects or unloaded.ordered_effects or unloaded.keepalive or unloaded.host_callbacks
            or unloaded.mut is not None or unloaded.pgle_profiler is not None or compiled._params.const_args):
        return False
    shardings = (*unloaded.input_shardings, *unloaded.output_shardings)
    devices = tuple(unloaded.device_list)
    if len(devices) == 1:
        return all(type(s) is jax.sharding.SingleDeviceSharding and s._device == devices[0] for s in shardings)
    mesh = _mesh_of(unloaded)
    return mesh is not None and set(mesh.devices.flat) == set(devices) and all(
        type(s) is jax.sharding.NamedSharding and s.mesh == mesh for s in shardings)


def _mesh_of(unloaded: Any) -> Any:
    """The mesh of a multi-device program's first sharding (None: a single-device program, or none)."""
    shardings = (*unloaded.input_shardings, *unloaded.output_shardings)
    if len(unloaded.device_list) == 1 or not shardings:
        return None
    return getattr(shardings[0], "mesh", None)


def _mesh_desc(unloaded: Any) -> dict[str, Any] | None:
    mesh = _mesh_of(unloaded)
    if mesh is None:
        return None
    return {"devices": [d.id for d in mesh.devices.flat], "shape": list(mesh.devices.shape),
            "axes": list(mesh.axis_names), "types": [t.name for t in mesh.axis_types]}


def _sharding_desc(sharding: Any) -> list[Any]:
    """``[memory kind, None]`` for one device's, ``[memory kind, spec]`` for the mesh's, the spec's
    entries None, an axis name or a list of them (TypeError: another kind of entry)."""
    if type(sharding) is jax.sharding.SingleDeviceSharding:
        return [sharding.memory_kind, None]
    spec = []
    for entry in sharding.spec:
        if entry is not None and not isinstance(entry, (str, tuple)):
            raise TypeError(f"partition spec entry {entry!r}")
        spec.append(list(entry) if isinstance(entry, tuple) else entry)
    return [sharding.memory_kind, spec]


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
        "devices": list(unloaded.device_list), "in_shardings": list(unloaded.input_shardings),
        "out_shardings": list(unloaded.output_shardings),
    }


def _rebuild(meta: dict[str, Any], in_tree: bytes, out_tree: bytes) -> dict[str, Any]:
    """The Python parts of the program from ``meta`` and the treedef protobufs (the fields
    :func:`_original_parts` reads, with the debug info in its comparable form)."""
    registry = jax.tree_util.default_registry
    treedef = jax.tree_util.PyTreeDef
    all_args = meta["all_args"]
    debug = meta["debug"]
    devices = _devices(meta["devices"])
    mesh = None if meta["mesh"] is None else jax.sharding.Mesh(
        np.array(_devices(meta["mesh"]["devices"]), dtype=object).reshape(meta["mesh"]["shape"]),
        tuple(meta["mesh"]["axes"]), axis_types=tuple(jax.sharding.AxisType[t] for t in meta["mesh"]["types"]))
    return {
        "devices": devices,
        **{name: [_sharding(desc, devices, mesh) for desc in meta[name]] for name in ("in_shardings", "out_shardings")},
        **{name: [_aval(d, mesh) for d in meta[name]] for name in ("in_avals", "out_avals")},
        "committed": bool(meta["committed"]), "name": str(meta["name"]), "kept": {int(i) for i in meta["kept"]},
        **{name: [_layout(d) for d in descs] for name, descs in meta["layouts"].items()},
        "all_args_info": None if all_args is None else (
            [_aval(d, mesh) for d in all_args], (debug[0], debug[1], None if debug[2] is None else tuple(debug[2]))),
        "args": [(_aval(a, mesh), bool(donated)) for a, donated in meta["args"]],
        "in_tree": treedef.deserialize_using_proto(registry, in_tree),
        "out_tree": treedef.deserialize_using_proto(registry, out_tree),
        "no_kwargs": bool(meta["no_kwargs"]),
    }


def _devices(ids: list[int]) -> list[Any]:
    """The devices of this job with ``ids`` (ValueError: one it does not have)."""
    by_id = {d.id: d for d in jax.devices()}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"compiled for devices {missing}, which this job does not have")
    return [by_id[int(i)] for i in ids]


def _sharding(desc: list[Any], devices: list[Any], mesh: Any) -> Any:
    memory_kind, spec = desc
    if spec is None:
        if len(devices) != 1:
            raise ValueError(f"a single-device sharding in a program over {len(devices)} devices")
        return jax.sharding.SingleDeviceSharding(devices[0], memory_kind=memory_kind)
    if mesh is None:
        raise ValueError("a mesh sharding in a program without a mesh")
    return jax.sharding.NamedSharding(mesh, _partition_spec(spec), memory_kind=memory_kind)


def _partition_spec(entries: list[Any]) -> Any:
    return jax.sharding.PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def _all_args_info(comparable: tuple[list[Any], tuple[Any, ...]] | None) -> Any:
    from jax._src import core
    from jax._src.interpreters import pxla

    if comparable is None:
        return None
    avals, (traced_for, src, arg_names) = comparable
    return pxla.AllArgsInfo(avals, core.DebugInfo(traced_for, src, arg_names, None))


def _aval_desc(aval: Any) -> list[Any]:
    """``[shape, dtype, weak]``, and the partition spec over the program's mesh where the type
    carries one (a multi-device program's)."""
    from jax._src import core

    if type(aval) is not core.ShapedArray:
        raise TypeError(f"{type(aval).__name__} is not a plain array type")
    desc = [list(aval.shape), aval.dtype.name, bool(aval.weak_type)]
    if not aval.sharding.mesh.empty:
        desc.append(_sharding_desc(aval.sharding)[1])
    return desc


def _aval(desc: list[Any], mesh: Any = None) -> Any:
    from jax._src import core

    shape, dtype, weak, *spec = desc
    sharding = None
    if spec:
        if mesh is None:
            raise ValueError("an array type over a mesh in a program without one")
        sharding = jax.sharding.NamedSharding(mesh.abstract_mesh, _partition_spec(spec[0]))
    return core.ShapedArray(tuple(int(s) for s in shape), jax.numpy.dtype(dtype), weak_type=bool(weak),
                            sharding=sharding)


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
