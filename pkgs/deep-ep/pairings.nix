# DeepEP upstream sources and which DeepEP x NVSHMEM pairings are known good or known broken.
# Data only (read by ./lib.nix, which pkgs/deep-ep/package.nix and checks/deep-ep-pure.nix use).
#
#   sources.<deepep version>   fetchFromGitHub arguments of the tagged release. The hash is the
#                              NAR hash of the tag's tree (`git archive v1.2.1` of
#                              deepseek-ai/DeepEP: no submodules, no .gitattributes, so no
#                              export-ignore; hashed with `deepep-nix hash DIR`).
#   broken                     rules: a DeepEP version range x NVSHMEM version range that does
#                              not work for the listed modes, why, the fix and the sources. A
#                              build with the NVSHMEM kernels (internode + low-latency) of a
#                              pairing that a rule covers is refused at evaluation unless the
#                              DeepEP source is declared to carry the rule's fix
#                              (`knownFixes = [ "<id>" ]`, for a patched or newer source).
#   good                       pairings run on real hardware, with what ran and where.
#
# Version ranges: `atLeast` / `atMost` are inclusive, absent = unbounded; versions compare with
# builtins.compareVersions (3.3.9 < 3.3.20).
{
  sources = {
    "1.2.1" = {
      owner = "deepseek-ai";
      repo = "DeepEP";
      tag = "v1.2.1";
      # Commit 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee (2025-09-15). nixpkgs' own
      # python3Packages.deep-ep pins the same value for this tag.
      hash = "sha256-xURR3uBAwKjDTNEG9p/vRRhH4Ldiz/u6kD/a+DPn5/Q=";
      # DeepEP v1.2.1 third-party/README.md: "DeepEP is compatible with upstream NVSHMEM 3.3.9
      # and later" (see the rule below for the exception found since).
      nvshmemMinimum = "3.3.9";
    };
  };

  broken = [
    {
      id = "rc-qp-layout-3.5.19";
      deepep = { atMost = "1.2.1"; };
      nvshmem = { atLeast = "3.5.19"; };
      modes = [ "internode" "low-latency" ];
      why = ''
        DeepEP <= 1.2.1 picks a peer's RC queue pair from NVSHMEM's IBGDA device state as
        rcs[pe * num_rc_per_pe * num_devices + id] (csrc/kernels/ibgda_device.cuh, ibgda_get_rc),
        the PE-major layout of NVSHMEM <= 3.4.5. NVSHMEM 3.5.19 added QP-specific APIs and stores
        RC QPs QP-major, PE-interleaved, so DeepEP posts work on a QP of another PE: internode dispatch
        times out ("DeepEP error: timeout (dispatch CPU)") or the first RDMA dispatch faults with
        an illegal memory access.'';
      fix = "pin NVSHMEM <= 3.4.5 (nvshmem_3_4_5, the default `nvshmem`), or build a DeepEP that has the fix (DeepEP PR #564, merged to main 2026-01-20 as 29d31c0 but lost again in the v2 restructure, or PR #696) and declare it with knownFixes = [ \"rc-qp-layout-3.5.19\" ]; no tagged DeepEP release has it yet";
      sources = [
        "https://github.com/deepseek-ai/DeepEP/issues/553 (timeout with NVSHMEM 3.5.19 on two H100 RoCE clusters)"
        "https://github.com/deepseek-ai/DeepEP/pull/564 (merged: RC selection updated for the NVSHMEM 3.5 layout, backwards compatible at compile time)"
        "https://github.com/deepseek-ai/DeepEP/issues/764 (the #564 change is missing from the legacy kernels after the v2 update)"
        "https://github.com/deepseek-ai/DeepEP/pull/696 (open: queue * npes + pe for NVSHMEM >= 3.5.19, layout chosen from NVSHMEM's version macros; names NVIDIA/nvshmem@ce9d487 as the layout change)"
        "https://github.com/vllm-project/vllm/pull/58159 (open: vLLM patches DeepEP with PR #696 when building against NVSHMEM >= 3.5.19)"
      ];
    }
    {
      id = "nvshmem-older-than-3.3.9";
      deepep = { atLeast = "1.2.1"; atMost = "1.2.1"; };
      nvshmem = { atMost = "3.3.8"; };
      modes = [ "internode" "low-latency" ];
      why = "DeepEP v1.2.1 supports upstream NVSHMEM 3.3.9 and later only (older releases needed DeepEP's own NVSHMEM patch).";
      fix = "use NVSHMEM 3.3.9 to 3.4.5 (nvshmem_3_4_5, the default `nvshmem`)";
      sources = [ "https://github.com/deepseek-ai/DeepEP/blob/v1.2.1/third-party/README.md" ];
    }
  ];

  good = [
    {
      deepep = "1.2.1";
      nvshmem = "3.4.5";
      cudaMajor = "13";
      modes = [ "intranode" "low-latency" ];
      evidence = "this project's 2x H200 machine (2026-11-30): DeepEP v1.2.1 built against the nvidia-nvshmem-cu13 3.4.5 wheel (torch 2.11.0+cu130, CUDA 13.0); tests/test_intranode.py and tests/test_low_latency.py with --num-processes 2 pass";
      source = "kernels/BENCHMARKS.md, \"Headline vs DeepEP v1.2.1 on the same machine\"";
    }
  ];
}
