"""sonar-kernels: Triton grouped-GEMM kernels for Mixture-of-Experts expert MLPs."""

from sonar_kernels.autograd import grouped_mlp, moe_mlp
from sonar_kernels.nn import SonarExperts
from sonar_kernels.optim import ExpertAdamW, SonarAdamW

__version__ = "0.1.0"

__all__ = ["ExpertAdamW", "SonarAdamW", "SonarExperts", "__version__", "grouped_mlp", "moe_mlp"]
