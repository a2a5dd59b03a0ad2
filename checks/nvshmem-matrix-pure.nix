# Pure tests of the per-release GPU checks' plan (./nvshmem-matrix-plan.nix, used by
# ./nvshmem-matrix.nix for the flake's gpuChecks.<system>."nvshmem-matrix-<v>"); merged into
# checks/pure.nix's tests, so Debian's Nix 2.8 runs them in CI. Same shape: name = { expr; expected; }.
# The expected releases are read from the lock itself (pkgs/nvshmem/releases.json), not from the
# release data or helpers the plan uses.
let
  plan = system: import ./nvshmem-matrix-plan.nix { inherit system; };
  x86 = plan "x86_64-linux";
  arm = plan "aarch64-linux";
  lock = builtins.fromJSON (builtins.readFile ../pkgs/nvshmem/releases.json);
  nvshmemLib = import ../pkgs/nvshmem/lib.nix;
  releases = import ../pkgs/nvshmem/releases.nix;
  deepEpLib = import ../pkgs/deep-ep/lib.nix;
  pairings = builtins.fromJSON (builtins.readFile ../pkgs/deep-ep/pairings.json);

  inherit (builtins) attrNames compareVersions elem filter head length map replaceStrings sort;

  # CUDA 13 releases of the lock for a system, oldest first.
  cuda13 = system: sort (a: b: compareVersions a b < 0)
    (map (r: r.version) (filter (r: elem "13" (attrNames (r.systems.${system} or { }))) lock.releases));
  names = p: map (c: c.name) p.checks;
  byVersion = p: v: head (filter (c: c.version == v) p.checks);
  under = replaceStrings [ "." ] [ "_" ];
  args = p: v: p.runnerArgs { entry = byVersion p v; nvshmem = "/nix/store/nvshmem-${v}"; wheel = "/nix/store/wheel-${v}"; deepEpSrc = "/nix/store/deepep-src"; deepEpSite = "/nix/store/deep-ep-${v}/site"; commit = "0123456789abcdef0123456789abcdef01234567"; };
  # pairings.json with the RC-QP rule starting at 3.7.0 instead of 3.5.19: the plan follows the data.
  edited = pairings // {
    broken = map (r: if r.id == "rc-qp-layout-3.5.19" then r // { nvshmem = { atLeast = "3.7.0"; }; } else r) pairings.broken;
  };
  editedPlan = import ./nvshmem-matrix-plan.nix { system = "x86_64-linux"; pairings = edited; };
in
{
  # One check per CUDA 13 release of the lock, named after it, and nothing else.
  nvshmemMatrixOneCheckPerCuda13ReleaseX86 = {
    expr = names x86;
    expected = map (v: "nvshmem-matrix-${under v}") (cuda13 "x86_64-linux");
  };
  nvshmemMatrixOneCheckPerCuda13ReleaseAarch64 = {
    expr = names arm;
    expected = map (v: "nvshmem-matrix-${under v}") (cuda13 "aarch64-linux");
  };
  # From 3.3.20 (the first CUDA 13 build) to 3.8.0; 3.3.9 has CUDA 12 builds only.
  nvshmemMatrixSpansTheLock = {
    expr = [ (head x86.checks).version (elem "nvshmem-matrix-3_3_9" (names x86)) (elem "nvshmem-matrix-3_8_0" (names x86)) (length x86.checks >= 10) ];
    expected = [ "3.3.20" false true true ];
  };
  # Each check uses the package attribute of its own release, CUDA 13, and that attribute exists.
  nvshmemMatrixUsesTheReleasesOwnPackage = {
    expr = map (c: { inherit (c) version nvshmemAttr cudaMajor; exists = elem c.nvshmemAttr (map (p: p.name) (nvshmemLib.attrPlan releases "x86_64-linux")); }) x86.checks;
    expected = map (v: { version = v; nvshmemAttr = "nvshmem_${under v}_cuda13"; cudaMajor = "13"; exists = true; }) (cuda13 "x86_64-linux");
  };
  # The runner gets that release, our wheel and DeepEP built against it (a build: the runner
  # builds nothing), DeepEP's test files, the suites, ranks and the commit.
  nvshmemMatrixRunnerArgs345 = {
    expr = args x86 "3.4.5";
    expected = [
      "--nvshmem"
      "/nix/store/nvshmem-3.4.5"
      "--wheel"
      "/nix/store/wheel-3.4.5"
      "--deep-ep-site"
      "/nix/store/deep-ep-3.4.5/site"
      "--deep-ep-tests"
      "/nix/store/deepep-src"
      "--suites"
      "ours,conformance,deep-ep"
      "--ranks"
      "2 4"
      "--commit"
      "0123456789abcdef0123456789abcdef01234567"
    ];
  };
  # 3.8.0: DeepEP 1.2.1 is refused by pairings.json (RC-QP layout, >= 3.5.19), so no deep-ep suite
  # and no DeepEP site; our package and DeepEP's tests on it still run. Without a commit (a dirty
  # tree), none is passed.
  nvshmemMatrixRunnerArgs380 = {
    expr = [
      (x86.runnerArgs { entry = byVersion x86 "3.8.0"; nvshmem = "/nix/store/nvshmem-3.8.0"; wheel = "/nix/store/wheel-3.8.0"; deepEpSrc = "/nix/store/deepep-src"; })
      (byVersion x86 "3.8.0").why
    ];
    expected = [
      [ "--nvshmem" "/nix/store/nvshmem-3.8.0" "--wheel" "/nix/store/wheel-3.8.0" "--deep-ep-tests" "/nix/store/deepep-src" "--suites" "ours,conformance" "--ranks" "2 4" ]
      "the deep-ep suite is left out: pkgs/deep-ep/pairings.json refuses DeepEP 1.2.1 with NVSHMEM 3.8.0, so packages.deep-ep is not built against it"
    ];
  };
  # The deep-ep suite runs exactly where the DeepEP package accepts the pairing.
  nvshmemMatrixDeepEpSuiteWhereThePackageBuilds = {
    expr = map (c: { inherit (c) version; deepEp = elem "deep-ep" c.suites; }) x86.checks;
    expected = map (v: { version = v; deepEp = deepEpLib.pairingStatus { deepep = "1.2.1"; nvshmem = v; } != "broken"; }) (cuda13 "x86_64-linux");
  };
  nvshmemMatrixFollowsThePairingData = {
    # 3.5.19 stays out: the 3.5 link rule (ibgda-state-defined-in-host-code-3.5) still refuses it.
    expr = map (v: elem "deep-ep" (byVersion editedPlan v).suites) [ "3.4.5" "3.5.19" "3.6.5" "3.7.0" "3.8.0" ];
    expected = [ true false true false false ];
  };
}
