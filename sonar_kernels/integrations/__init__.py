"""Integrations with other libraries (transformers, torchtitan); each module imports its library."""
