# Pure rules for the DeepEP package (pkgs/deep-ep/package.nix): which DeepEP x NVSHMEM pairings
# are refused (data in ./pairings.json), which CUDA capabilities become TORCH_CUDA_ARCH_LIST, and
# whether torch, DeepEP and NVSHMEM share one CUDA major. Builtins only (no nixpkgs), so
# checks/deep-ep-pure.nix runs them with Debian's Nix 2.8.
#
# ./pairings.json is the one copy of the pairing data: `deepep-nix doctor` embeds the same file
# (generator/src/doctor/deepep.rs, include_str!) for its deepep.pairing check. Its schema is in
# its `comment` field and docs/deepep.md ("The pairing data"). Version ranges: `atLeast` /
# `atMost` are inclusive, absent = unbounded; versions compare with builtins.compareVersions
# (3.3.9 < 3.3.20), as the doctor's X.Y.Z ordering does.
#
# Each check has a `...Problem` form returning null or the message (tests read the text) and is
# thrown by the package when not null.
let
  inherit (builtins) compareVersions concatStringsSep elem filter sort;

  quoteAll = xs: concatStringsSep ", " (map (x: "\"${x}\"") xs);
  atLeast = v: min: compareVersions v min >= 0;
in
rec {
  # The fetchFromGitHub sources, the broken-pairing rules and the pairings run on hardware.
  pairings = builtins.fromJSON (builtins.readFile ./pairings.json);

  defaultVersion = "1.2.1";

  # Inclusive range { atLeast?; atMost?; }; absent bounds are open.
  inRange = v: r:
    (!(r ? atLeast) || compareVersions v r.atLeast >= 0)
    && (!(r ? atMost) || compareVersions v r.atMost <= 0);

  # The broken-pairing rules that cover (deepep, nvshmem), minus those the source fixes.
  brokenRules = { deepep, nvshmem, knownFixes ? [ ], data ? pairings }:
    filter (r: inRange deepep r.deepep && inRange nvshmem r.nvshmem && !(elem r.id knownFixes)) data.broken;

  # "broken" | "good" (run on hardware, ./pairings.json `good`) | "untested" (no rule refuses it).
  pairingStatus = { deepep, nvshmem, knownFixes ? [ ], data ? pairings }:
    if brokenRules { inherit deepep nvshmem knownFixes data; } != [ ] then "broken"
    else if filter (g: g.deepep == deepep && g.nvshmem == nvshmem) data.good != [ ] then "good"
    else "untested";

  # null, or why DeepEP `deepep` built with the NVSHMEM kernels against NVSHMEM `nvshmem` is
  # refused, with the fix and the sources.
  pairingProblem = { deepep, nvshmem, knownFixes ? [ ], data ? pairings }:
    let rules = brokenRules { inherit deepep nvshmem knownFixes data; };
    in
    if rules == [ ] then null
    else
      concatStringsSep "\n" (map
        (r: ''
          deep-ep: DeepEP ${deepep} with NVSHMEM ${nvshmem} is a known-broken pairing for ${concatStringsSep " and " r.modes} (rule "${r.id}" in pkgs/deep-ep/pairings.json).
          ${r.why}
          Fix: ${r.fix}.
          Intranode only instead: .override { withNvshmem = false; }.
          Sources:
            ${concatStringsSep "\n  " r.sources}'')
        rules);

  # knownFixes is a claim about a source other than the pinned release (which has none of the
  # fixes: that is why the rules exist); without src or patches it would only hide a rule.
  knownFixesProblem = { knownFixes, customSource }:
    if knownFixes == [ ] || customSource then null
    else "deep-ep: knownFixes = [ ${quoteAll knownFixes} ] but the source is the pinned release, which has none of them; pass the fixed source as src (or its patches as patches) together with knownFixes.";

  # The fetchFromGitHub arguments of a pinned DeepEP release, or null.
  sourceFor = version: pairings.sources.${version} or null;

  sourceProblem = version:
    if sourceFor version != null then null
    else "deep-ep: no pinned source for DeepEP ${version} in pkgs/deep-ep/pairings.json (pinned: ${quoteAll (builtins.attrNames pairings.sources)}); pass src = <a DeepEP source> together with version, or add the release to `sources`.";

  # TORCH_CUDA_ARCH_LIST from CUDA capabilities ("9.0", "9.0a", "10.0", ...).
  #   fromNixpkgs = true: the list is nixpkgs' configured/default one (cudaPackages.flags /
  #     config.cudaCapabilities, or torch.cudaCapabilities); DeepEP's SM90 kernels cannot target
  #     the older entries, so only 9.0 and newer are kept (as nixpkgs' own nccl-ep does).
  #   fromNixpkgs = false: the caller asked for exactly these; nothing is dropped silently.
  #     Capabilities below 9.0 build with DISABLE_SM90_FEATURES=1 (DeepEP's A100 path), which
  #     DeepEP allows only without NVSHMEM; below 8.0 DeepEP does not build.
  # Returns { problem = null | "..."; archList; disableSm90Features; dropped; }.
  archPlan = { capabilities, withNvshmem, fromNixpkgs }:
    let
      sorted = sort (a: b: compareVersions a b < 0) capabilities;
      sm90 = filter (c: atLeast c "9.0") sorted;
      below90 = filter (c: !(atLeast c "9.0")) sorted;
      below80 = filter (c: !(atLeast c "8.0")) sorted;
      kept = if fromNixpkgs then sm90 else sorted;
      disableSm90Features = !fromNixpkgs && below90 != [ ];
      problem =
        if sorted == [ ] then
          "deep-ep: the CUDA capability list is empty; set cudaCapabilities = [ \"9.0\" ] (Hopper) or config.cudaCapabilities in your nixpkgs."
        else if fromNixpkgs && sm90 == [ ] then
          "deep-ep: none of nixpkgs' CUDA capabilities (${quoteAll sorted}) is 9.0 or newer, which DeepEP's kernels need; set config.cudaCapabilities = [ \"9.0\" ] (or newer) in your nixpkgs, or pass cudaCapabilities = [ ... ] with withNvshmem = false for an SM80 intranode-only build."
        else if !fromNixpkgs && below80 != [ ] then
          "deep-ep: DeepEP does not build for CUDA capabilities below 8.0 (${quoteAll below80}); remove them from cudaCapabilities."
        else if disableSm90Features && withNvshmem then
          "deep-ep: cudaCapabilities contains ${quoteAll below90} (below 9.0): DeepEP then builds with DISABLE_SM90_FEATURES=1, which it allows only without NVSHMEM; use only 9.0 and newer, or .override { withNvshmem = false; } (intranode only)."
        else null;
    in
    {
      inherit problem disableSm90Features;
      archList = concatStringsSep ";" kept;
      dropped = if fromNixpkgs then below90 else [ ];
    };

  # torch must have CUDA, and with NVSHMEM the same CUDA major as the NVSHMEM build.
  #   torchCudaMajor    torch.cudaPackages.cudaMajorVersion, or null without CUDA
  #   nvshmemCudaMajor  null when building without NVSHMEM
  cudaProblem = { torchCudaSupport, torchCudaMajor, nvshmemVersion ? null, nvshmemCudaMajor ? null }:
    if !torchCudaSupport then
      "deep-ep: the torch given is built without CUDA; use a nixpkgs with config.cudaSupport = true (e.g. pkgs.pkgsCuda.python3Packages) for torch and deep-ep."
    else if nvshmemCudaMajor != null && nvshmemCudaMajor != torchCudaMajor then
      "deep-ep: torch is built for CUDA ${torchCudaMajor} but NVSHMEM ${nvshmemVersion} for CUDA ${nvshmemCudaMajor}; DeepEP, torch and NVSHMEM must share one CUDA major: use nvshmem_${builtins.replaceStrings [ "." ] [ "_" ] nvshmemVersion}_cuda${torchCudaMajor} or a torch from cudaPackages_${nvshmemCudaMajor}.pkgs (nixpkgs manual, \"Using cudaPackages.pkgs\")."
    else null;
}
