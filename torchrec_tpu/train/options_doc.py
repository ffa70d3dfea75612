"""docs/TRAINING_OPTIONS.md from the config's own fields: every option of ``train`` (and the
``profile`` flags it shares) with its default and its whole text, whose first sentence is its
``--help`` line. Regenerate with ``python -m torchrec_tpu.train.options_doc > docs/TRAINING_OPTIONS.md``;
``tests/train/test_options_doc.py`` keeps the file current."""

from __future__ import annotations

import dataclasses

from torchrec_tpu.train.config import OPTIONS, SHORTHANDS, TrainConfig


def options_markdown() -> str:
    """The reference page: one table per config group, one row per option."""
    defaults = TrainConfig()
    lines = ["# Training options", "",
             "Every option of `torchrec-tpu train` as a flag (`--batch-size`) and a YAML key (`batch_size` or "
             "`batch-size`, in the file given to `--config`); explicit flags override the file. Generated from "
             "`torchrec_tpu/train/config.py` by `python -m torchrec_tpu.train.options_doc`.", ""]
    for group in dataclasses.fields(TrainConfig):
        doc = (group.default_factory.__doc__ or "").strip()  # type: ignore[union-attr]
        lines += [f"## {group.name}", "", doc, "", "| option | default | what it does |", "|---|---|---|"]
        for name, (owner, f) in OPTIONS.items():
            if owner != group.name:
                continue
            choices = f.metadata.get("choices")
            what = f.metadata["details"].rstrip(".")
            if choices:
                what += f"; one of {', '.join(f'`{c}`' for c in choices)}"
            lines.append(f"| `--{name.replace('_', '-')}` | `{defaults.option(name)}` | {what.replace('|', '/')} |")
        lines.append("")
    lines += ["## shorthands", "", "| flag | what it does |", "|---|---|"]
    lines += [f"| `--{name.replace('_', '-')}` | {shorthand.help} |" for name, shorthand in SHORTHANDS.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
