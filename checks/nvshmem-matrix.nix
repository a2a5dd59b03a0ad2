# gpuChecks.<system>."nvshmem-matrix-<v>": for each NVSHMEM release of the lock with a CUDA 13
# build (./nvshmem-matrix-plan.nix), python/scripts/nvshmem-matrix.sh on the builder's GPUs with
#   - that release as this repository builds it (packages.nvshmem_<v>_cuda13), preloaded by the
#     runner so that it is the NVSHMEM the process has before anything else loads one;
#   - our Python package with cubins for every CUDA 13 release of the lock, this one included
#     (packages.deepep-kernels-python with `extraNvshmem`; one wheel for all checks, from the
#     `dist` output), which follows the release the runner loaded first;
#   - DeepEP v1.2.1 built against it (pkgs/deep-ep/package.nix with that `nvshmem` and
#     oneNvshmem = "rebuild-torch", so that the extension links exactly that release; left out
#     where pairings.json refuses the pairing), and DeepEP's pinned source for its test files
#     (--deep-ep-tests: the runner builds nothing in the sandbox);
#   - Python with torch (CUDA on, without NVSHMEM of its own when nixpkgs' torch links one: the
#     same torch.override { withNvshmem = false; } the DeepEP package then uses), numpy, pytest
#     and pip.
# Several ranks (2 and 4 for our tests, 2 for DeepEP's files) on however many GPUs there are, as
# the runner does without Nix. $out holds the runner's record (record.json, results schema 2,
# kind "nvshmem-matrix") and its logs. Needs the "cuda" system feature, like ./gpu.nix.
#
# nixpkgs pieces used (declarations read in NixOS/nixpkgs):
#   - buildPythonPackage's `dist` output: pkgs/development/interpreters/python/
#     mk-python-derivation.nix (outputs ++ optional withDistOutput "dist" for pyproject = true;
#     pythonOutputDistHook moves dist/*.whl there; maturinBuildHook leaves the wheel in dist/).
#   - `.override` of a callPackage result: lib/customisation.nix (makeOverridable).
#   - python.withPackages and python.sitePackages: pkgs/development/interpreters/python/
#     with-packages.nix and passthrufun.nix.
#   - fetchFromGitHub { owner; repo; tag; hash; }: pkgs/build-support/fetchgithub/default.nix.
#   - lib.fileset.toSource: lib/fileset/default.nix.
#   - runCommand: pkgs/build-support/trivial-builders/default.nix.
#   - torch's withNvshmem: pkgs/development/python-modules/torch/source/default.nix (see
#     ../pkgs/torch-nvshmem.nix).
{ pkgs
, system
, # import ../pkgs { inherit pkgs; } for this system
  ours
, plan ? import ./nvshmem-matrix-plan.nix { inherit system; }
, # the flake's commit (self.rev; null for a dirty tree): the record's `commit`
  commit ? null
,
}:
let
  inherit (pkgs) lib;
  sandbox = import ./gpu-sandbox.nix;
  deepEpLib = import ../pkgs/deep-ep/lib.nix;

  py = ours.deepEpPython;
  torchNvshmem = import ../pkgs/torch-nvshmem.nix py.torch;
  torch = if torchNvshmem == null then py.torch else py.torch.override { withNvshmem = false; };
  pythonEnv = py.python.withPackages (ps: [ torch ps.numpy ps.pytest ps.pip ]);

  pinned = deepEpLib.sourceFor plan.deepEpVersion;
  deepEpSrc = pkgs.fetchFromGitHub { inherit (pinned) owner repo tag hash; };

  # The runner and what it runs: python/scripts (runner, conformance script and adapter),
  # python/tests (our GPU tests), checks/nvshmem-maps.py (its preflight).
  src = lib.fileset.toSource { root = ../.; fileset = lib.fileset.unions [ ../python/scripts ../python/tests ./nvshmem-maps.py ]; };

  # One wheel for every release, as published: packages.deepep-kernels-python (NVSHMEM_DIR = the
  # default `nvshmem`) with cubins for every other CUDA 13 release of the plan as well; each check
  # preloads its release and the wheel follows it.
  base = ours.packages.deepep-kernels-python;
  kernelsPython = base.override {
    extraNvshmem = map (e: ours.packages.${e.nvshmemAttr}) (lib.filter (e: e.version != base.nvshmem.version) plan.checks);
  };

  check = entry:
    let
      nvshmem = ours.packages.${entry.nvshmemAttr};
      deepEp = if entry.deepEp then ours.mkDeepEp { inherit nvshmem; oneNvshmem = "rebuild-torch"; } else null;
      args = plan.runnerArgs {
        inherit entry;
        nvshmem = "${nvshmem}";
        wheel = "${kernelsPython.dist}";
        deepEpSrc = "${deepEpSrc}";
        deepEpSite = if deepEp == null then null else "${deepEp}/${py.python.sitePackages}";
        inherit commit;
      };
    in
    pkgs.runCommand "deepep-${entry.name}"
      (sandbox.env // {
        requiredSystemFeatures = [ "cuda" ];
        nativeBuildInputs = [ pythonEnv ];
        PYTHON = "${pythonEnv}/bin/python";
        # DeepEP's tests/utils.py init_dist and our launcher: loopback only in the sandbox.
        MASTER_ADDR = "127.0.0.1";
        LD_LIBRARY_PATH = "/run/opengl-driver/lib";
        passthru = { inherit entry nvshmem kernelsPython deepEp pythonEnv deepEpSrc; runnerArgs = args; };
        meta.description = "NVSHMEM ${entry.version}: ${lib.concatStringsSep ", " entry.suites} suites of python/scripts/nvshmem-matrix.sh on the builder's GPUs${lib.optionalString (entry.why != "") " (${entry.why})"}";
      })
      ''
        set -euo pipefail
        mkdir -p "$out"
        ${sandbox.requireGpu}
        export HOME="$TMPDIR"
        cp -r ${src} repo
        chmod -R u+w repo
        cd repo
        echo ${lib.escapeShellArg entry.why} > "$out/left-out.txt"
        bash python/scripts/nvshmem-matrix.sh ${lib.escapeShellArgs args} \
          --record "$out/record.json" --out "$out/logs"
      '';
in
builtins.listToAttrs (map (e: { inherit (e) name; value = check e; }) plan.checks)
