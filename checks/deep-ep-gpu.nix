# GPU check for the DeepEP package (pkgs/deep-ep): DeepEP's own tests from its pinned source,
# run with the Python environment of torch + this deep_ep, one process per GPU:
#   tests/test_intranode.py   --num-processes N   always
#   tests/test_low_latency.py --num-processes N   when built with NVSHMEM
# N = the largest of 1, 2, 4, 8 not above the GPUs in the sandbox (the tests' default expert
# counts, 256 and 288, divide evenly by these). First, one NVSHMEM per process: a Python of that
# environment imports torch and deep_ep and its /proc/self/maps must show exactly one
# libnvshmem_host.so.3, the one DeepEP's device code was built with (deep-ep.nvshmemLibDir;
# ./nvshmem-maps.py), or, for the intranode-only build, at most torch's own. Needs a builder
# with the "cuda" system feature
# (docs/nix.md, "GPU runner"), like checks/gpu.nix. Exposed as deep-ep.gpuCheck and in the
# flake's `gpuChecks`.
{ lib
, runCommand
, deep-ep
,
}:
let
  sandbox = import ./gpu-sandbox.nix;
in
runCommand "deep-ep-gpu-check-${deep-ep.version}"
  (sandbox.env // {
    requiredSystemFeatures = [ "cuda" ];
    nativeBuildInputs = [ deep-ep.pythonEnv ];
    tests = "${deep-ep.src}/tests";
    withNvshmem = if deep-ep.withNvshmem then "1" else "";
    mapsCheck = ./nvshmem-maps.py;
    mapsRule = if deep-ep.withNvshmem then "--expect ${deep-ep.nvshmemLibDir}" else "--at-most-one";
    # tests/utils.py init_dist reads MASTER_ADDR/PORT (loopback: the sandbox has no other network).
    MASTER_ADDR = "127.0.0.1";
    MASTER_PORT = "8361";
    LD_LIBRARY_PATH = "/run/opengl-driver/lib";
    passthru = { inherit deep-ep; };
    meta.description = "DeepEP ${deep-ep.version}'s intranode${lib.optionalString deep-ep.withNvshmem " and low-latency"} tests on the builder's GPUs";
  })
  ''
    set -euo pipefail
    mkdir -p "$out"
    ${sandbox.requireGpu}
    gpus=$(ls /dev | grep -c '^nvidia[0-9][0-9]*$')
    n=1
    for c in 2 4 8; do if [ "$gpus" -ge "$c" ]; then n=$c; fi; done
    export HOME="$TMPDIR"
    cp -r "$tests" tests
    chmod -R u+w tests
    cd tests
    echo "== one NVSHMEM per process (import torch, deep_ep; /proc/self/maps)" | tee "$out/summary.log"
    # shellcheck disable=SC2086
    python "$mapsCheck" $mapsRule deep_ep 2>&1 | tee "$out/nvshmem-maps.log"
    echo "== $gpus GPU(s); DeepEP tests with --num-processes $n" | tee -a "$out/summary.log"
    python test_intranode.py --num-processes "$n" 2>&1 | tee "$out/test_intranode.log"
    echo "test_intranode.py --num-processes $n: passed" | tee -a "$out/summary.log"
    if [ -n "$withNvshmem" ]; then
      python test_low_latency.py --num-processes "$n" 2>&1 | tee "$out/test_low_latency.log"
      echo "test_low_latency.py --num-processes $n: passed" | tee -a "$out/summary.log"
    fi
  ''
