"""offload_parameters: parameters kept in host memory, streamed to the device per block.

- `handle`: `offload_parameters` itself and the handle it returns.
- `streaming`: the hooks that stream a block's parameters and land its gradients.
- `slots`: one parameter or buffer, where its value is, and how changes made under it are seen.
- `blocks`: which modules are blocks, and the checks of the arguments.
- `transfers`: host↔device copies (`CudaTransfer` on a side stream, or your own).
"""

from .handle import ParameterOffloadHandle, offload_parameters
from .transfers import CudaTransfer, ParameterTransfer

__all__ = ["CudaTransfer", "ParameterOffloadHandle", "ParameterTransfer", "offload_parameters"]
