"""A self-contained model directory (``torchrec-tpu export``) and :func:`load_model` to serve it.

The directory holds ``model.json`` (format, the dense features, each table's feature, rows, dim
and dtype, the checkpoint's step), a ``manifest.json`` of every file's size and sha256 (the
checkpoints' own, :mod:`torchrec_tpu.train.checkpoint.manifest`), and:

- ``tables.pt``: the embedding tables at their dtype (:mod:`torchrec_tpu.inference.quantized_tables`),
  ``<feature>.weight`` and, int8 / int4, ``<feature>.scale_bias``: tensors only, read with
  ``torch.load(weights_only=True)``;
- ``towers.pt2``: the dense arch, interaction and over arch as a ``torch.export`` program,
  ``(dense float32[B, dense features], pooled float32[B, features, dim]) -> logits float32[B, 1]``.

:func:`load_model` needs nothing else (no checkpoint, no training config) and runs no code from
the files: each is checked against the manifest's hash first (a changed file is refused by name),
and the program's archive must hold its weights as raw tensor bytes, nothing pickled.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from pipelines.schema import CRITEO, DatasetSchema
from torchrec_tpu.inference.export_files import MODEL, TABLES, TOWERS
from torchrec_tpu.inference.model import InferenceModel, load_inference_model
from torchrec_tpu.inference.quantized_tables import QuantizedTable, held_bytes, host_embedding_bags
from torchrec_tpu.inference.scoring import PooledDLRM, Towers
from torchrec_tpu.inference.table_dtypes import TABLE_DTYPES
from torchrec_tpu.train.checkpoint.manifest import MANIFEST_FILE, manifest_of, verify_checkpoint

FORMAT = "torchrec-tpu-model/1"
_EXAMPLE_BATCH = 4  # rows of the example inputs the towers are exported with (the batch dim stays dynamic)


def export_model(checkpoint: str | Path, output: str | Path, table_dtype: str,
                 schema: DatasetSchema = CRITEO) -> Path:
    """Write the model of ``checkpoint`` with its tables at ``table_dtype`` into the new directory
    ``output`` (written beside it, then renamed: it exists complete or not at all)."""
    output = Path(output)
    if output.exists():
        raise ValueError(f"--output={str(output)!r} exists; give a new directory")
    model = load_inference_model(checkpoint, schema, table_dtype)
    if model.zch is not None:  # a model directory without the remap would score raw ids as rows
        raise ValueError(f"checkpoint {checkpoint} was trained with --zch: export does not carry its managed-"
                         "collision remap yet; score it with `torchrec-tpu infer --checkpoint`")
    if model.multi_hot is not None:  # a model directory without the expansion would score one id per feature
        raise ValueError(f"checkpoint {checkpoint} was trained with --multi-hot-sizes: export does not carry its "
                         "id expansion yet; score it with `torchrec-tpu infer --checkpoint`")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}.", dir=output.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's is 0o700
        _write(model, schema, staging)
        os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def _write(model: InferenceModel, schema: DatasetSchema, directory: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for feature, table in model.tables.items():
        # clones: a view would save its whole storage (the TBE's rows of every table)
        tensors[f"{feature}.weight"] = table.weight.clone()
        if table.scale_bias is not None:
            tensors[f"{feature}.scale_bias"] = table.scale_bias.clone()
    torch.save(tensors, directory / TABLES)
    dim = next(iter(model.tables.values())).dim
    example = (torch.zeros(_EXAMPLE_BATCH, len(schema.dense)), torch.zeros(_EXAMPLE_BATCH, len(model.tables), dim))
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(Towers(model.dlrm).eval(), example, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, directory / TOWERS)
    description = {
        "format": FORMAT, "step": model.step, "dense_features": list(schema.dense),
        "tables": [{"feature": f, "rows": t.rows, "dim": t.dim, "dtype": t.dtype} for f, t in model.tables.items()],
    }
    (directory / MODEL).write_text(json.dumps(description, indent=1))
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest_of(directory), indent=1))


def load_model(directory: str | Path) -> InferenceModel:
    """The model of an exported ``directory`` (``load_model(M).predict(batch)``), its files
    verified first (ValueError naming the file that does not match the manifest)."""
    directory = Path(directory)
    description = read_description(directory)
    _check_no_pickle(directory / TOWERS)
    tensors = torch.load(directory / TABLES, weights_only=True, map_location="cpu")
    tables = {}
    for entry in description["tables"]:
        feature = entry["feature"]
        table = QuantizedTable(entry["dtype"], int(entry["dim"]), tensors.pop(f"{feature}.weight", None),
                               tensors.pop(f"{feature}.scale_bias", None))
        if table.weight is None or table.rows != int(entry["rows"]):
            raise ValueError(f"model directory {directory}: {TABLES} has no table of {entry['rows']} rows for "
                             f"feature {feature!r}")
        tables[feature] = table
    towers = torch.export.load(directory / TOWERS).module()
    ebc, tables = host_embedding_bags(tables)
    return InferenceModel(PooledDLRM(ebc, towers, len(tables)),
                          tuple(t.rows for t in tables.values()), int(description["step"]),
                          description["tables"][0]["dtype"], tables, table_bytes=held_bytes(ebc, tables))


def read_description(directory: Path) -> dict[str, Any]:
    """``model.json`` of the model ``directory``, after every file is checked against the manifest
    (CheckpointError, a ValueError, naming the file that differs)."""
    if not (directory / MODEL).is_file():
        raise FileNotFoundError(f"{directory} is not an exported model: it has no {MODEL} "
                                "(write one with 'torchrec-tpu export')")
    verify_checkpoint(directory, required=(MODEL, TABLES, TOWERS), noun="exported model")
    path = directory / MODEL
    try:
        description = json.loads(path.read_text())
        dtypes = {str(entry["dtype"]) for entry in description["tables"]}
        int(description["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a model description ({type(error).__name__}: {error})") from None
    if description.get("format") != FORMAT:
        raise ValueError(f"{path}: format {description.get('format')!r}, this version reads {FORMAT!r}")
    if len(dtypes) != 1 or not dtypes <= set(TABLE_DTYPES):
        raise ValueError(f"{path}: table dtypes {sorted(dtypes)}, expected one of {list(TABLE_DTYPES)}")
    return description


def _check_no_pickle(path: Path) -> None:
    """Refuse a ``torch.export`` archive whose loading would unpickle: pickled weights or
    constants, or example inputs that are not plain tensors (``torch.export.load`` would fall back
    to a full unpickle of them)."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            pickled = False
            if name.endswith(("_weights_config.json", "_constants_config.json")):
                entries = json.loads(archive.read(name)).get("config", {}).values()
                pickled = any(e.get("use_pickle") or not str(e.get("path_name", "")).startswith(("weight_", "tensor_"))
                              for e in entries)
            elif name.endswith(".pt") and "/data/sample_inputs/" not in name:
                pickled = True  # legacy weights or constants: a pickle
            elif "/data/sample_inputs/" in name:
                try:
                    torch.load(archive.open(name), weights_only=True)
                except Exception:  # noqa: BLE001  anything weights_only refuses
                    pickled = True
            if pickled:
                raise ValueError(f"{path}: {name} holds pickled objects; an exported model holds tensors only")
