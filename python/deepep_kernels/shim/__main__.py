"""``python -m deepep_kernels.shim``: prints the directory to put on PYTHONPATH; --help says so."""

import sys

from . import PATH

USAGE = """usage: python -m deepep_kernels.shim [--help]

Prints the directory that holds the shim's deep_ep package (it makes `import deep_ep` load
deepep_kernels). Put it on PYTHONPATH:

    export PYTHONPATH="$(python -m deepep_kernels.shim)${PYTHONPATH:+:$PYTHONPATH}"

Or, in code, before the first `import deep_ep`: import deepep_kernels.shim; deepep_kernels.shim.install()
Both refuse (ImportError) when a real DeepEP is importable too; set DEEPEP_KERNELS_SHADOW_DEEP_EP=1
to shadow it on purpose."""


def main(argv) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if argv:
        print(f"deepep_kernels.shim: unknown argument {argv[0]!r} (it takes none; --help explains)", file=sys.stderr)
        return 2
    print(PATH)
    return 0


sys.exit(main(sys.argv[1:]))
