"""AUC of ``infer`` at every ``--table-dtype`` against fp32, on the same held-out rows.

Per preset, a DLRM is trained on synthetic data (``torchrec-tpu train``; its last file held out),
then the whole ``infer`` job scores the held-out file with the checkpoint's tables at fp32, fp16,
bf16, int8 and int4 (``--device cpu``: the host's tables). Each line gives the job's offline AUC, its
difference from fp32's, the issue's bound (int8 within 0.001, fp16 / bf16 within 0.0002; int4
reports its loss) and the dtype and bytes of the tables the job held, as ``infer`` prints them.
AUC does not depend on the box's load, so these figures count on a busy box too.

Presets: ``default`` is ``torchrec-tpu train``'s data and model (DLRM, 26 tables capped at 100k rows
x 16); ``mlperf`` the model of ``bench_inference.py --preset mlperf`` (DLRM-DCNv2, dim 128, MLPerf's
cardinalities capped at 100k rows), trained on fewer rows (each step costs ~20x more).

    .venv/bin/python bench/bench_inference_quality.py [--preset default mlperf] [--train-rows N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import quiet_box
from bench_inference import PRESETS

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.inference.job import InferenceConfig, run_inference
from torchrec_tpu.inference.table_dtypes import TABLE_DTYPES
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import run_job

BOUNDS = {"fp16": 0.0002, "bf16": 0.0002, "int8": 0.001}  # |AUC - fp32's| the issue allows; int4: reported
TRAIN_ROWS = {"default": 65_536, "mlperf": 16_384}
# the trainer's learning rates; at its 0.05 the mlperf model diverges in its first steps
LEARNING_RATES = {"default": {}, "mlperf": dict(dense_lr=0.005, sparse_lr=0.005)}
FILES = 5  # the last held out


def quality(preset: str, train_rows: int | None, root: Path) -> list[str]:
    """Lines of the AUC of each table dtype for ``preset``'s model, trained in ``root``."""
    rows = train_rows or TRAIN_ROWS[preset]
    model = {k: v for k, v in PRESETS[preset].items() if k != "max_steps"}
    model.setdefault("num_embeddings", 100_000)
    model.setdefault("dense_arch", f"64,{model['embedding_dim']}")
    per_file = rows // (FILES - 1)
    data = SyntheticConfig(num_rows=per_file * FILES, seed=7, max_cardinality=int(model["num_embeddings"]),
                           rows_per_file=per_file, row_group_size=min(per_file, 8192))
    generate(data, root / "data", progress=False)
    checkpoint = run_job(TrainConfig.from_options(
        data=str(root / "data"), batch_size=512, eval_files=1, log_dir=str(root / "logs"), progress=False,
        dense_device="cpu", **LEARNING_RATES[preset], **model)).checkpoint_dir
    held_out = sorted((root / "data").glob("*.parquet"))[-1]
    lines = [f"preset {preset}: {model['model']}, dim {model['embedding_dim']}, trained on {rows:,} rows; "
             f"AUC on the {per_file:,} held-out rows of {held_out.name}"]
    fp32 = None
    for dtype in ("fp32", *(d for d in TABLE_DTYPES if d != "fp32")):
        summary = run_inference(InferenceConfig(data=str(held_out), checkpoint=str(checkpoint),
                                                output=str(root / f"out-{dtype}"), table_dtype=dtype, device="cpu",
                                                progress=False))
        (auc, _), = summary.auc.values()
        fp32 = auc if fp32 is None else fp32
        delta = auc - fp32
        bound = BOUNDS.get(dtype)
        verdict = ("(reference)" if dtype == "fp32" else f"(target |delta| <= {bound}: "
                   f"{'met' if abs(delta) <= bound else 'MISSED'})" if bound else "(loss reported, no target)")
        lines.append(f"  {dtype:<5} AUC {auc:.6f}  delta {delta:+.6f} {verdict:<34} tables {summary.table_dtype}, "
                     f"{summary.table_bytes / 2**20:,.1f} MiB held")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", choices=tuple(PRESETS), default=list(PRESETS))
    parser.add_argument("--train-rows", type=int, default=None, help="rows trained on (default: the preset's)")
    args = parser.parse_args()
    lines = []
    for preset in args.preset:
        with tempfile.TemporaryDirectory(prefix="bench-infer-quality-") as tmp:
            lines += quality(preset, args.train_rows, Path(tmp))
    print("\n".join(lines))


if __name__ == "__main__":
    quiet_box.run(main)
