"""What a reader does with a bad label or dense value, by name (no heavy imports: the training
and inference CLIs offer these as flag choices; :mod:`pipelines.bad_values` applies them).

``error``: stop, naming file, row and column; ``skip``: drop the row (counted); ``clamp``: clamp
the value into range (a NaN label's row is skipped)."""

POLICIES: tuple[str, ...] = ("error", "skip", "clamp")
