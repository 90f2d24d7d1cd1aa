"""fx_passes: FX graph passes between PyTorch (torch_tpu_backend) and code generation (codegen).

    normalize -> pattern fusion -> generic fusion -> partition        (run_passes)

Importing this package registers the `ctpu` custom operators (ops.py) once. This package imports
torch only; nothing of codegen, device_sim or torch_tpu_backend. See docs/fx_passes.md.
"""

from . import ops
from .decompositions import decomposition_table
from .errors import CtpuDynamicShapeError, CtpuFallbackWarning, CtpuPassError
from .fuse import FusedGroup, fuse_elementwise, inline_fused_kernels
from .groups import FusionGroup, fusion_groups
from .normalize import normalize
from .partition import Partition, Segment, fallback_reason, fallback_summary, partition
from .patterns import PATTERN_PASSES
from .pipeline import PassReport, run_passes

__all__ = [
    "PATTERN_PASSES",
    "CtpuDynamicShapeError",
    "CtpuFallbackWarning",
    "CtpuPassError",
    "FusedGroup",
    "FusionGroup",
    "Partition",
    "PassReport",
    "Segment",
    "decomposition_table",
    "fallback_reason",
    "fallback_summary",
    "fuse_elementwise",
    "fusion_groups",
    "inline_fused_kernels",
    "normalize",
    "ops",
    "partition",
    "run_passes",
]
