"""Marks shared by test modules."""

import pytest

from dbsn.runtime.config import cpp_compiler

# inductor (torch.compile's default backend) on a CPU builds C++ kernels
needs_cpp_compiler = pytest.mark.skipif(
    cpp_compiler() is None, reason="inductor on a CPU needs a C++ compiler; none found"
)
