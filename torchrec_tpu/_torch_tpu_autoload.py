"""Entry point for PyTorch's device-backend autoload (the ``torch.backends`` entry-point group).

PyTorch calls every registered autoload hook on ``import torch`` unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0. Registering "tpu" renames PrivateUse1 for the whole process, so
the hook only acts when the user opts in with TORCH_TPU_AUTOLOAD=1. It lives outside the
``torch_tpu`` package because importing any ``torch_tpu`` submodule runs the package's
registration.
"""

import os


def autoload() -> None:
    if os.environ.get("TORCH_TPU_AUTOLOAD", "0") == "1":
        import torch_tpu  # noqa: F401
