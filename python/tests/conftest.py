import os
import sys

# The tests import the installed wheel (`deepep_kernels`), never the source tree, so that they
# test what was built. Refuse to run against the source folder by accident.
_here = os.path.dirname(os.path.abspath(__file__))
_src = os.path.dirname(_here)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _src]
