"""nn.Module wrappers."""

from sonar_kernels.nn.experts import SonarExperts
from sonar_kernels.nn.sharding import fully_shard_dense

__all__ = ["SonarExperts", "fully_shard_dense"]
