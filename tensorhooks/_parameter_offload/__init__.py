"""offload_parameters: parameters kept in host memory, streamed to the device per block.

- `offload_parameters`: the hooks that stream a block's parameters and land its gradients.
- `blocks`: which modules are blocks, and the slots of their parameters and buffers.
- `transfers`: host↔device copies (`CudaTransfer` on a side stream, or your own).
"""

from .streaming import ParameterOffloadHandle, offload_parameters
from .transfers import CudaTransfer, ParameterTransfer

__all__ = ["CudaTransfer", "ParameterOffloadHandle", "ParameterTransfer", "offload_parameters"]
