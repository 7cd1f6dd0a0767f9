"""sonar-kernels: Triton grouped-GEMM kernels for Mixture-of-Experts expert MLPs."""

from sonar_kernels.autograd import grouped_mlp, moe_mlp
from sonar_kernels.integrations import transformers as _transformers
from sonar_kernels.nn import SonarExperts
from sonar_kernels.optim import ExpertAdamW, SonarAdamW
from sonar_kernels.specs import clamped_swiglu

__version__ = "0.1.0"

# The one statement beyond re-exports: experts_implementation="sonar" in transformers once its models are
# imported, before or after this package, without importing transformers here (register_when_imported).
_transformers.register_when_imported()

__all__ = [
    "ExpertAdamW",
    "SonarAdamW",
    "SonarExperts",
    "__version__",
    "clamped_swiglu",
    "grouped_mlp",
    "moe_mlp",
]
