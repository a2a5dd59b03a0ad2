"""One NVSHMEM per process, checked from the process's own /proc/self/maps.

    python nvshmem-maps.py --expect DIR [--call MODULE.FUNCTION] MODULE...
    python nvshmem-maps.py --at-most-one MODULE...

Imports torch, then each MODULE (DeepEP's deep_ep, our deepep_kernels), optionally calls a
function that loads NVSHMEM's host library (deepep_kernels loads it on first use:
deepep_kernels._native.nvshmem_host_check), then reads /proc/self/maps and lists every distinct
file named libnvshmem_host.so* that is mapped. With --expect DIR exactly one must be mapped and
it must lie in DIR (the lib/ directory of the NVSHMEM the device code was built with; both sides
resolved with realpath, as the kernel shows mapped files by their real path). With --at-most-one
(an extension built without NVSHMEM) torch's own, if any, may be the only one. A --call that
loads the library and closes it again leaves nothing mapped when nothing else holds a copy;
then the path it reports is judged instead. Prints what it found; exits 1 on a violation. Used by pkgs/deep-ep (install check), checks/deep-ep-gpu.nix and
checks/gpu.nix; `deepep-nix doctor --maps-python` applies the same rule
(generator/src/doctor/maps.rs).
"""

import argparse
import importlib
import os
import sys


def mapped_nvshmem_host_libs(maps_text):
    """Distinct paths of mapped libnvshmem_host.so* files, in first-seen order."""
    seen = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if os.path.basename(path).startswith("libnvshmem_host.so") and path not in seen:
            seen.append(path)
    return seen


def main():
    ap = argparse.ArgumentParser()
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--expect", metavar="DIR")
    group.add_argument("--at-most-one", action="store_true")
    ap.add_argument("--call", action="append", default=[], metavar="MODULE.FUNCTION")
    ap.add_argument("modules", nargs="*")
    args = ap.parse_args()

    import torch  # noqa: F401  (first, as user code does: its NVSHMEM, if any, loads here)

    for name in args.modules:
        importlib.import_module(name)
    reported = []
    for target in args.call:
        module, _, function = target.rpartition(".")
        result = getattr(importlib.import_module(module), function)()
        # deepep_kernels._native.nvshmem_host_check returns (path it loaded, version) and closes
        # the library again (the binding holds it only while NVSHMEM runs; NVSHMEM's host
        # library is not NODELETE, so it is unmapped unless something else holds it).
        if isinstance(result, tuple) and result and isinstance(result[0], str):
            reported.append(result[0])

    with open("/proc/self/maps") as f:
        paths = mapped_nvshmem_host_libs(f.read())
    what = ", ".join(["torch"] + args.modules + [c + "()" for c in args.call])
    print(f"nvshmem-maps: after {what}: {len(paths)} libnvshmem_host.so.3 mapped")
    for p in paths:
        print(f"  {p}")

    if args.at_most_one:
        if len(paths) > 1:
            sys.exit("nvshmem-maps: more than one NVSHMEM host library in one process (see above)")
        return
    want = os.path.realpath(args.expect)
    if not paths and reported:
        # Nothing else holds a copy (torch maps none): the call loaded one and closed it. Judge
        # what it reported: a path must lie in `want`; the bare SONAME was found through the
        # extension's RUNPATH, which its package's install check pins to `want`.
        for r in reported:
            if os.path.isabs(r) and os.path.dirname(os.path.realpath(r)) != want:
                sys.exit(f"nvshmem-maps: the call loaded {r}, not the NVSHMEM host library the device code was built with (in {want})")
        print(f"nvshmem-maps: ok, no copy stays mapped; the call loaded {', '.join(reported)} (the one in {want}) and closed it")
        return
    if len(paths) != 1:
        sys.exit(f"nvshmem-maps: expected exactly one libnvshmem_host.so.3, from {want}; found {len(paths)}")
    got = os.path.dirname(os.path.realpath(paths[0]))
    if got != want:
        sys.exit(f"nvshmem-maps: the NVSHMEM host library mapped is {paths[0]}, not the one the device code was built with (in {want})")
    print(f"nvshmem-maps: ok, the one in {want}")


if __name__ == "__main__":
    main()
