"""sonar-kernels: Triton grouped-GEMM kernels for Mixture-of-Experts expert MLPs."""

from sonar_kernels.autograd import grouped_mlp, moe_mlp
from sonar_kernels.nn import SonarExperts
from sonar_kernels.optim import ExpertAdamW, SonarAdamW
from sonar_kernels.specs import clamped_swiglu

__version__ = "0.1.0"

__all__ = [
    "ExpertAdamW",
    "SonarAdamW",
    "SonarExperts",
    "__version__",
    "clamped_swiglu",
    "grouped_mlp",
    "moe_mlp",
]
