"""When a forward may read a tensor's values back into Python.

``int(t.max())`` or ``bool(mask.all())`` inside a forward is free eager on the CPU, a graph break
inside ``torch.compile`` and, on a GPU, a host-device sync that stalls the stream. So the spine
reads data only where ``reads_data`` says it may; elsewhere the checks are made at the batch
boundary, asserted by the device without waiting (``torch._assert_async``), or left to an index
bound, and masks are always built. Callers use it through this module (``data_checks.reads_data``)
so that a test can take the GPU's path on a CPU by patching this one name.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reads_data(t: Tensor) -> bool:
    """Whether a forward may read ``t``'s values back into Python: only eager on the CPU."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()
