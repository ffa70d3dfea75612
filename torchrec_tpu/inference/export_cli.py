"""``torchrec-tpu export``: flags -> :func:`torchrec_tpu.inference.export.export_model`."""

from __future__ import annotations

import argparse
import sys

from pipelines.output_paths import check_outputs_apart
from torchrec_tpu.inference.table_dtypes import TABLE_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="DLRM / DLRM-DCN checkpoint of 'torchrec-tpu train': a checkpoint root (its latest) "
                             "or one version directory")
    parser.add_argument("--table-dtype", choices=TABLE_DTYPES, default="int8",
                        help="dtype of the exported embedding tables: int8 / int4 row-wise quantized with a per-row "
                             "fp16 scale and bias as FBGEMM's inference TBE stores them; fp16 / bf16 a cast")
    parser.add_argument("-o", "--output", required=True,
                        help="new directory for the model: tables, towers (a torch.export program), model.json and "
                             "a manifest of hashes; 'infer --model' and torchrec_tpu.inference.export.load_model "
                             "load it with no checkpoint or training config")


def run(args: argparse.Namespace) -> int:
    """A missing checkpoint is reported before torch is imported."""
    from pathlib import Path

    from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint

    checkpoint = resolve_checkpoint(Path(args.checkpoint))  # FileNotFoundError: not a checkpoint
    check_outputs_apart([("--output", args.output)], [("--checkpoint", args.checkpoint)])
    from torchrec_tpu.inference.export import export_model, load_model

    output = export_model(checkpoint, args.output, args.table_dtype)
    model = load_model(output)  # what infer --model will load: verified once here
    print(f"exported {checkpoint} (step {model.step}) to {output}: tables {model.table_dtype}, "
          f"{model.table_bytes:,} bytes")
    return 0


if __name__ == "__main__":  # as ``torchrec-tpu export``: the one entry point reports the errors
    from torchrec_tpu.cli import main

    sys.exit(main(["export", *sys.argv[1:]]))
