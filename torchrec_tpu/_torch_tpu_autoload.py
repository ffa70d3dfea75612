"""Entry point for PyTorch's device-backend autoload (the ``torch.backends`` entry-point group).

PyTorch calls every registered autoload hook on ``import torch`` unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0. Registering "tpu" renames PrivateUse1 for the whole process, so
the hook only acts when the user opts in with TORCH_TPU_AUTOLOAD=1. It lives outside the
``torch_tpu`` package because importing any ``torch_tpu`` submodule runs the package's
registration.
"""

from tpu_facts import knobs


def autoload() -> None:
    if knobs.AUTOLOAD.on():
        import torch_tpu  # noqa: F401
