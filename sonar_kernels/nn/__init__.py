"""nn.Module wrappers."""

from sonar_kernels.nn.experts import SonarExperts

__all__ = ["SonarExperts"]
