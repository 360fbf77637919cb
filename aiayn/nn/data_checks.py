"""When a forward may read a tensor's values back into Python (a graph break compiled, a sync on a GPU).
Callers go through this module's ``reads_data`` so that a test can patch this one name."""

from __future__ import annotations

import torch
from torch import Tensor


def reads_data(t: Tensor) -> bool:
    """Whether a forward may read ``t``'s values back into Python: only eager on the CPU."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()
