"""RMS norms of the supported models: one Triton pass forward and one backward, plain torch as the reference."""
from .function import RMSNormFunction, rms_norm, triton_supports
from .reference import MODES, compute_dtype, rms_norm_reference, rms_normalised

__all__ = ["MODES", "RMSNormFunction", "compute_dtype", "rms_norm", "rms_norm_reference", "rms_normalised",
           "triton_supports"]
