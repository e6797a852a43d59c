"""torch glue, imported only when a caller asks for tensors (torch is an optional dependency)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from pagekeeper_client.ring import RingError, StepTables, TorchStepTables, TorchTables

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


_torch_module: Any = None


def import_torch() -> Any:
    """Import torch (once) or say clearly that the worker extra is missing."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is installed in the dev venv
            raise RingError(
                "torch is needed for tensor views of the tables: install pagekeeper[worker]"
            ) from exc
        _torch_module = torch
    return _torch_module


_readonly_warning_done = False


def from_numpy(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """``torch.from_numpy`` without the one-time warning for read-only (zero-copy) views.

    A tensor over a read-only mapping must not be written: doing so faults, which is the
    point of mapping it read-only.
    """
    global _readonly_warning_done
    torch_module = import_torch()
    if array.flags.writeable or _readonly_warning_done:
        tensor: torch.Tensor = torch_module.from_numpy(array)
        return tensor
    # torch warns about read-only arrays once per process; catching warnings costs ~10 us,
    # so only the first such call pays for it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch_module.from_numpy(array)
    _readonly_warning_done = True
    return tensor


def step_to_torch(
    step: StepTables, device: str | torch.device | None, *, non_blocking: bool
) -> TorchStepTables:
    """CPU tensors over the step's arrays, copied to ``device`` when one is given."""
    target = None if device is None else import_torch().device(device)
    to_device = target is not None and target.type != "cpu"
    tables = []
    for t in step.tables:
        tensors = [from_numpy(t.block_table), from_numpy(t.row_lengths), from_numpy(t.slot_mapping)]
        if to_device:
            tensors = [x.to(target, non_blocking=non_blocking) for x in tensors]
        tables.append(
            TorchTables(
                t.group_id, t.kernel_block_size, tensors[0], tensors[1], tensors[2], t.pad_id
            )
        )
    return TorchStepTables(step.step_seq, step.epoch, step.num_reqs, tuple(tables))


def cuda_available() -> bool:
    """True when torch is importable and sees a CUDA device (never raises)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
