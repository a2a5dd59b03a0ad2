# GPU check for the DeepEP package (pkgs/deep-ep): DeepEP's own tests from its pinned source,
# run with the Python environment of torch + this deep_ep, one process per GPU:
#   tests/test_intranode.py   --num-processes N   always
#   tests/test_low_latency.py --num-processes N   when built with NVSHMEM
# N = the largest of 1, 2, 4, 8 not above the GPUs in the sandbox (the tests' default expert
# counts, 256 and 288, divide evenly by these). Needs a builder with the "cuda" system feature
# (docs/nix.md, "GPU runner"), like checks/gpu.nix. Exposed as deep-ep.gpuCheck and in the
# flake's `gpuChecks`.
{ lib
, runCommand
, deep-ep
,
}:
runCommand "deep-ep-gpu-check-${deep-ep.version}"
{
  requiredSystemFeatures = [ "cuda" ];
  nativeBuildInputs = [ deep-ep.pythonEnv ];
  tests = "${deep-ep.src}/tests";
  withNvshmem = if deep-ep.withNvshmem then "1" else "";
  # NVLink SHARP multicast is not available in every sandbox/VM (DeepEP disables it for
  # NVSHMEM itself; NCCL, used by torch.distributed in the tests, must not try it either).
  NVSHMEM_DISABLE_NVLS = "1";
  NCCL_NVLS_ENABLE = "0";
  # The sandbox network is loopback only; tests/utils.py init_dist reads MASTER_ADDR/PORT.
  NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME = "lo";
  NCCL_SOCKET_IFNAME = "lo";
  MASTER_ADDR = "127.0.0.1";
  MASTER_PORT = "8361";
  LD_LIBRARY_PATH = "/run/opengl-driver/lib";
  passthru = { inherit deep-ep; };
  meta.description = "DeepEP ${deep-ep.version}'s intranode${lib.optionalString deep-ep.withNvshmem " and low-latency"} tests on the builder's GPUs";
}
  ''
    set -euo pipefail
    mkdir -p "$out"
    if ! ls /dev/nvidia0 >/dev/null 2>&1; then
      echo "no /dev/nvidia0 in the build sandbox: this builder advertises the 'cuda' feature but does not" >&2
      echo "mount the GPU; see docs/nix.md (programs.nix-required-mounts)." >&2
      exit 1
    fi
    gpus=$(ls /dev | grep -c '^nvidia[0-9][0-9]*$')
    n=1
    for c in 2 4 8; do if [ "$gpus" -ge "$c" ]; then n=$c; fi; done
    export HOME="$TMPDIR"
    cp -r "$tests" tests
    chmod -R u+w tests
    cd tests
    echo "== $gpus GPU(s); DeepEP tests with --num-processes $n" | tee "$out/summary.log"
    python test_intranode.py --num-processes "$n" 2>&1 | tee "$out/test_intranode.log"
    echo "test_intranode.py --num-processes $n: passed" | tee -a "$out/summary.log"
    if [ -n "$withNvshmem" ]; then
      python test_low_latency.py --num-processes "$n" 2>&1 | tee "$out/test_low_latency.log"
      echo "test_low_latency.py --num-processes $n: passed" | tee -a "$out/summary.log"
    fi
  ''
