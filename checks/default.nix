# `nix flake check` checks for one system. None needs a GPU (those are in gpuChecks); most need
# network for sources (NVIDIA tarballs, GitHub, crates), the VM test needs KVM.
#   pure                 checks/pure.nix (the same tests CI runs with Debian's Nix 2.8)
#   cuda-major           NVSHMEM, kernels, dev shells' nvcc, GPU check's NCCL: one CUDA major
#   module-stand-ins     the module over the NixOS stand-ins (checks/module), stand-in module system
#   module-coverage      every option the module defines or reads is declared by a sourced stand-in
#   module-lib-eval      the same cases through nixpkgs' lib.evalModules
#   unfree-names         the driver packages' real pnames are allowed as unfree, nothing else
#   module-nixos-eval    the module inside real NixOS (eval-config), several configurations
#   module-vm            NixOS VM boots with services.deepep (x86_64-linux only)
#   nvshmem-matrix-names the flake's gpuChecks hold one nvshmem-matrix-<v> per release of the plan
#   deepep-kernels-python-releases  our Python package with extraNvshmem: releases served, refusals
#   generator-reproducible  `deepep-nix lock --offline --check` / `render --check` on the repo
#   nvshmem-layout       the default NVSHMEM package's files and RUNPATHs
#   gdrdrv               gdrdrv built for nixpkgs' default kernel and production driver
#   gdrcopy, deepep-nix, deepep-kernels-no-nvshmem   package builds (with their own tests)
{ pkgs
, nixpkgs
, system
, ours
, deepepModule
, # this flake's packages, devShells and gpuChecks for `system`
  outputs
,
}:
let
  inherit (pkgs) lib;

  # A check whose work happens during evaluation: `value` must evaluate (it throws on failure);
  # the derivation records it.
  evalCheck = name: value:
    pkgs.runCommand name { result = builtins.toJSON value; passAsFile = [ "result" ]; } ''
      cp "$resultPath" "$out"
    '';

  hasNixos = builtins.pathExists "${nixpkgs}/nixos/lib/eval-config.nix";

  repoSrc = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [ ../pkgs/nvshmem ];
  };
in
{
  pure = evalCheck "deepep-pure-tests" (import ./pure.nix);

  # One CUDA major for NVSHMEM, the kernels, the dev shells' nvcc, the GPU check's NCCL.
  cuda-major = evalCheck "deepep-cuda-major" (import ./cuda-major.nix {
    inherit pkgs;
    inherit (ours) cudaMajor;
    inherit (outputs) packages devShells gpuChecks;
  });

  # The module over the NixOS stand-ins with the stand-in module system (what CI runs without
  # nixpkgs), and the stand-ins' option coverage and provenance.
  module-stand-ins = evalCheck "deepep-module-stand-ins" (import ./module/lib-eval.nix { lib = import ./module/mini-lib.nix; });
  module-coverage = evalCheck "deepep-module-coverage" (import ./module/coverage.nix { lib = import ./module/mini-lib.nix; });

  # The unfree packages the NixOS VM test and the HGX configuration pull in are allowed by our
  # nixpkgs instance under their real pnames (nixpkgs pkgs/os-specific/linux/nvidia-x11/:
  # generic.nix "nvidia-x11" / "nvidia-dc", settings.nix, persistenced.nix, fabricmanager.nix,
  # kernel-modules.nix "nvidia-kernel-modules": the proprietary modules, a derivation of their own
  # since nixpkgs PR #498612), and an unrelated unfree package is not.
  unfree-names = evalCheck "deepep-unfree-names" (
    let
      unfree = pname: { inherit pname; version = "1"; name = "${pname}-1"; meta.license = { free = false; shortName = "unfree"; }; };
      allowed = map (n: { name = n; allowed = pkgs.config.allowUnfreePredicate (unfree n); })
        [ "nvidia-x11" "nvidia-dc" "nvidia-settings" "nvidia-persistenced" "fabricmanager" "nvidia-kernel-modules" "some-other-unfree-package" ];
      wrong = lib.filter (a: a.allowed != (a.name != "some-other-unfree-package")) allowed;
    in
    if wrong == [ ] then allowed
    else throw "flake.nix allowUnfreePredicate: wrong answer for ${lib.concatMapStringsSep ", " (a: "${a.name} (${if a.allowed then "allowed" else "refused"})") wrong}"
  );



  # Every GPU check is also passthru.tests.<name>.gpuCheck (nixpkgs' path for GPU jobs, see
  # pkgs/default.nix), the same derivation as passthru.gpuCheck, needing the "cuda" feature.
  gpu-check-tests = evalCheck "deepep-gpu-check-tests" (
    let
      ps = outputs.packages;
      at = [
        { name = "deepep-kernels.tests.gpu-suite"; pkg = ps.deepep-kernels; test = ps.deepep-kernels.tests.gpu-suite or null; }
        { name = "deep-ep.tests.deepep-tests"; pkg = ps.deep-ep; test = ps.deep-ep.tests.deepep-tests or null; }
        { name = "deep-ep-no-nvshmem.tests.deepep-tests"; pkg = ps.deep-ep-no-nvshmem; test = ps.deep-ep-no-nvshmem.tests.deepep-tests or null; }
      ];
      bad = builtins.filter
        (t: t.test == null || !(t.test ? gpuCheck)
        || t.test.gpuCheck.drvPath != t.pkg.gpuCheck.drvPath
        || (t.test.gpuCheck.requiredSystemFeatures or [ ]) != [ "cuda" ])
        at;
    in
    if bad == [ ] then map (t: t.name) at
    else throw "passthru.tests.<name>.gpuCheck missing, not the package's gpuCheck, or without requiredSystemFeatures = [ \"cuda\" ]: ${toString (map (t: t.name) bad)}"
  );

  # The flake's per-release GPU checks are exactly the plan's (checks/nvshmem-matrix-plan.nix),
  # by name: the gpuChecks output wires in checks/nvshmem-matrix.nix. Names only (building them
  # needs a GPU runner).
  nvshmem-matrix-names = evalCheck "deepep-nvshmem-matrix-names" (
    let
      sorted = builtins.sort builtins.lessThan;
      want = sorted (map (c: c.name) (import ./nvshmem-matrix-plan.nix { inherit system; }).checks);
      got = sorted (builtins.filter (n: builtins.substring 0 15 n == "nvshmem-matrix-") (builtins.attrNames outputs.gpuChecks));
    in
    if got == want && want != [ ] then got
    else throw "gpuChecks.${system}: nvshmem-matrix checks [ ${toString got} ], expected [ ${toString want} ] (checks/nvshmem-matrix-plan.nix)"
  );

  # Our Python package with more NVSHMEM releases (extraNvshmem, what the nvshmem-matrix checks
  # build): the releases it must serve, the build's DEEPEP_NVSHMEM_RELEASES, and the refusals of
  # a release of another CUDA major, a release given twice and extras without `nvshmem`.
  deepep-kernels-python-releases = evalCheck "deepep-kernels-python-releases" (
    let
      ps = outputs.packages;
      base = ps.deepep-kernels-python;
      multi = base.override { extraNvshmem = [ ps.nvshmem_3_8_0_cuda13 ps.nvshmem_3_3_20_cuda13 ]; };
      refused = args: !(builtins.tryEval (base.override args).drvPath).success;
      got = {
        default = [ base.nvshmemReleases (base.env.DEEPEP_NVSHMEM_RELEASES or null) ];
        multi = [ multi.nvshmemReleases multi.env.DEEPEP_NVSHMEM_RELEASES ];
        refusals = map refused [
          { extraNvshmem = [ ps.nvshmem_3_8_0_cuda12 ]; }
          { extraNvshmem = [ ps.nvshmem ]; }
          { nvshmem = null; extraNvshmem = [ ps.nvshmem_3_8_0_cuda13 ]; }
        ];
      };
      want = {
        default = [ [ ps.nvshmem.version ] null ];
        multi = [ [ "3.3.20" ps.nvshmem.version "3.8.0" ] "${ps.nvshmem_3_8_0_cuda13}:${ps.nvshmem_3_3_20_cuda13}" ];
        refusals = [ true true true ];
      };
    in
    if got == want then got else throw "deepep-kernels-python with extraNvshmem: got ${builtins.toJSON got}, expected ${builtins.toJSON want}"
  );

  generator-reproducible = pkgs.runCommand "deepep-generator-reproducible"
    { nativeBuildInputs = [ ours.packages.deepep-nix ]; }
    ''
      cp -r ${repoSrc} repo
      chmod -R u+w repo
      deepep-nix lock --offline --check --repo repo
      deepep-nix render --check --repo repo
      touch "$out"
    '';

  nvshmem-layout = ours.packages.nvshmem.tests.layout;

  gdrdrv = ours.gdrdrvFor pkgs.linuxPackages pkgs.linuxPackages.nvidiaPackages.production;

  inherit (ours.packages) gdrcopy deepep-nix deepep-kernels-no-nvshmem;
}
# Checks that need the real nixpkgs (lib.evalModules, NixOS). checks/stub-nixpkgs, with which CI
# evaluates the flake offline (`nix flake check --no-build`), has neither; its absent nixos/
# directory is what tells the two apart.
// lib.optionalAttrs hasNixos {
  module-lib-eval = evalCheck "deepep-module-lib-eval" (import ./module/lib-eval.nix { inherit lib; });
  module-nixos-eval = evalCheck "deepep-module-nixos-eval" (import ./module/nixos-eval.nix {
    inherit nixpkgs system deepepModule;
  });
} // lib.optionalAttrs (hasNixos && system == "x86_64-linux") {
  module-vm = import ./vm.nix { inherit pkgs deepepModule; };
}
