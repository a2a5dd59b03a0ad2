# The flake's per-release GPU checks, gpuChecks.<system>."nvshmem-matrix-<v>" (built by
# ./nvshmem-matrix.nix): which NVSHMEM releases get one and how each calls the release-matrix
# runner python/scripts/nvshmem-matrix.sh, the same runner GPU machines without Nix use, so the
# Nix and non-Nix paths run the same test definitions. Builtins only: checks/pure.nix tests it
# with Debian's Nix 2.8 (nvshmemMatrix* tests).
#
# One check per release of the lock with a CUDA 13 build for `system` (our kernels are built with
# CUDA 13; from 3.3.20 on). Each runs the suites
#   ours         our GPU tests (python/tests/gpu) at 2 and 4 ranks, on however many GPUs there are
#   conformance  DeepEP v1.2.1's tests/test_intranode.py and tests/test_low_latency.py, unchanged,
#                on our package at 2 ranks
#   deep-ep      the same two files on DeepEP built against that release; left out where
#                pkgs/deep-ep/pairings.json refuses the pairing (the package throws at evaluation,
#                DeepEP <= 1.2.1 with NVSHMEM >= 3.5.19), with the reason in `why`
{ system
, releases ? import ../pkgs/nvshmem/releases.nix
, pairings ? null
,
}:
let
  n = import ../pkgs/nvshmem/lib.nix;
  d = import ../pkgs/deep-ep/lib.nix;
  inherit (builtins) concatStringsSep elem filter;

  cudaMajor = "13";
  deepEpVersion = d.defaultVersion;
  ranks = [ 2 4 ];

  problemFor = v: d.pairingProblem ({ deepep = deepEpVersion; nvshmem = v; } // (if pairings == null then { } else { data = pairings; }));

  entry = v:
    let problem = problemFor v;
    in {
      name = "nvshmem-matrix-${n.attrVersion v}";
      version = v;
      inherit cudaMajor;
      # The package attribute of that release (pkgs/default.nix, ../pkgs/nvshmem/lib.nix attrPlan).
      nvshmemAttr = "nvshmem_${n.attrVersion v}_cuda${cudaMajor}";
      deepEp = problem == null;
      suites = [ "ours" "conformance" ] ++ (if problem == null then [ "deep-ep" ] else [ ]);
      why =
        if problem == null then ""
        else "the deep-ep suite is left out: pkgs/deep-ep/pairings.json refuses DeepEP ${deepEpVersion} with NVSHMEM ${v}, so packages.deep-ep is not built against it";
    };
in
{
  inherit cudaMajor deepEpVersion ranks;

  checks = map entry (filter (v: elem cudaMajor (n.cudaMajorsFor releases v system)) (n.versions releases));

  # The runner's arguments for one entry (`--record` and `--out` are added by the builder, they
  # name $out): the release's NVSHMEM prefix, our wheel built against it (a folder holding the
  # .whl), DeepEP's pinned source for its tests/ (`--deep-ep-tests`: the runner never builds
  # DeepEP here) and, where DeepEP is built against the release, that build's site-packages; the
  # commit to record when the flake knows it (the sandbox has no git checkout).
  runnerArgs = { entry, nvshmem, wheel, deepEpSrc, deepEpSite ? null, commit ? null }:
    [ "--nvshmem" nvshmem "--wheel" wheel ]
    ++ (if entry.deepEp then [ "--deep-ep-site" deepEpSite ] else [ ])
    ++ [ "--deep-ep-tests" deepEpSrc "--suites" (concatStringsSep "," entry.suites) "--ranks" (concatStringsSep " " (map toString ranks)) ]
    ++ (if commit == null then [ ] else [ "--commit" commit ]);
}
