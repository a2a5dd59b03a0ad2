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
# Each check has a `...Problem` form returning null or the message (tests read the text). The
# package throws the ones that refuse a configuration the caller chose (a pairing, knownFixes,
# explicit capabilities); what the surrounding nixpkgs decides (torch without CUDA, a torch
# nixpkgs marks broken, torch and NVSHMEM of different CUDA majors) becomes meta.broken with the
# reason in passthru.brokenConditions, the nixpkgs way (brokenConditions below).
let
  inherit (builtins) compareVersions concatStringsSep elem filter head listToAttrs match sort;

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

  # The release a version string names: nixpkgs' cudaPackages.libnvshmem carries the git tag's
  # "-0" ("3.6.5-0", pkgs/development/cuda-modules/packages/libnvshmem.nix), and
  # compareVersions "3.4.5-0" "3.4.5" is 1, so a rule's `atMost = "3.4.5"` would miss it.
  releaseVersion = v: let m = match "([0-9]+([.][0-9]+)*).*" v; in if m == null then v else head m;

  # The broken-pairing rules that cover (deepep, nvshmem), minus those the source fixes.
  brokenRules = { deepep, nvshmem, knownFixes ? [ ], data ? pairings }:
    let d = releaseVersion deepep; n = releaseVersion nvshmem;
    in filter (r: inRange d r.deepep && inRange n r.nvshmem && !(elem r.id knownFixes)) data.broken;

  # "broken" | "good" (run on hardware, ./pairings.json `good`) | "untested" (no rule refuses it).
  pairingStatus = { deepep, nvshmem, knownFixes ? [ ], data ? pairings }:
    if brokenRules { inherit deepep nvshmem knownFixes data; } != [ ] then "broken"
    else if filter (g: g.deepep == releaseVersion deepep && g.nvshmem == releaseVersion nvshmem) data.good != [ ] then "good"
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

  # What torch's extension builder accepts in TORCH_CUDA_ARCH_LIST: DeepEP's setup.py builds
  # through torch.utils.cpp_extension, whose _get_cuda_arch_flags raises "Unknown CUDA arch (X)
  # or GPU not supported" for anything outside its allowlist (each entry also with "+PTX").
  # nixpkgs' torch no longer narrows its cudaCapabilities to that list (torch/source/default.nix
  # at 7dec1fd5: gpuTargetString = flags.cudaCapabilities, "its Python JIT allowlist is a
  # separate interface"), so entries such as 10.0f, 11.0 or 10.3 can reach us.
  #   torch < 2.8: pytorch torch/utils/cpp_extension.py at 0011ec5c (read here).
  #   torch >= 2.8: v2.8.0's list as nixpkgs quotes it (torch/source/default.nix at 6b516b42,
  #     "https://github.com/pytorch/pytorch/blob/v2.8.0/torch/utils/cpp_extension.py#L2411-L2414");
  #     also used for newer torch until a newer list is read (a newer torch accepting more only
  #     costs those entries; the build also asks the torch it has, see package.nix preBuild).
  torchExtensionArches = [
    {
      torch = { atMost = "2.7.99"; };
      arches = [ "3.5" "3.7" "5.0" "5.2" "5.3" "6.0" "6.1" "6.2" "7.0" "7.2" "7.5" "8.0" "8.6" "8.7" "8.9" "9.0" "9.0a" "10.0" "10.0a" "10.1" "10.1a" "12.0" "12.0a" ];
      source = "pytorch/pytorch torch/utils/cpp_extension.py at 0011ec5c5d6171a395bb339b873343a4cdfebd18 (_get_cuda_arch_flags)";
    }
    {
      torch = { atLeast = "2.8.0"; };
      arches = [ "3.5" "3.7" "5.0" "5.2" "5.3" "6.0" "6.1" "6.2" "7.0" "7.2" "7.5" "8.0" "8.6" "8.7" "8.9" "9.0" "9.0a" "10.0" "10.0a" "10.1" "10.1a" "10.3" "10.3a" "12.0" "12.0a" "12.1" "12.1a" ];
      source = "pytorch v2.8.0 torch/utils/cpp_extension.py, as quoted in nixpkgs pkgs/development/python-modules/torch/source/default.nix at 6b516b42dd0f19e2ab9c9dd391cd40752a9dc096";
    }
  ];

  # The allowlist for a torch version ("2.9.1"; null: no filtering).
  torchAcceptedArches = torchVersion:
    if torchVersion == null then null
    else
      let hits = filter (e: inRange (releaseVersion torchVersion) e.torch) torchExtensionArches;
      in if hits == [ ] then null else (head hits).arches;

  # TORCH_CUDA_ARCH_LIST from CUDA capabilities ("9.0", "9.0a", "10.0", ...).
  #   fromNixpkgs = true: the list is nixpkgs' configured/default one (cudaPackages.flags /
  #     config.cudaCapabilities, or torch.cudaCapabilities); DeepEP's SM90 kernels cannot target
  #     the older entries, so only 9.0 and newer are kept (as nixpkgs' own nccl-ep does), and of
  #     those only what torch's extension builder accepts (`accepted`, torchAcceptedArches).
  #   fromNixpkgs = false: the caller asked for exactly these; nothing is dropped silently.
  #     Capabilities below 9.0 build with DISABLE_SM90_FEATURES=1 (DeepEP's A100 path), which
  #     DeepEP allows only without NVSHMEM; below 8.0 DeepEP does not build. Entries torch's
  #     builder would reject are refused here with the list it accepts.
  # Returns { problem = null | "..."; archList; disableSm90Features; dropped; droppedUnsupported; }.
  archPlan = { capabilities, withNvshmem, fromNixpkgs, accepted ? null }:
    let
      sorted = sort (a: b: compareVersions a b < 0) capabilities;
      # "9.0+PTX" is accepted when "9.0" is.
      base = c: let m = match "(.*)[+]PTX" c; in if m == null then c else head m;
      ok = c: accepted == null || elem (base c) accepted;
      sm90 = filter (c: atLeast c "9.0") sorted;
      below90 = filter (c: !(atLeast c "9.0")) sorted;
      below80 = filter (c: !(atLeast c "8.0")) sorted;
      unsupported = filter (c: !(ok c)) (if fromNixpkgs then sm90 else sorted);
      kept = if fromNixpkgs then filter ok sm90 else sorted;
      disableSm90Features = !fromNixpkgs && below90 != [ ];
      problem =
        if sorted == [ ] then
          "deep-ep: the CUDA capability list is empty; set cudaCapabilities = [ \"9.0\" ] (Hopper) or config.cudaCapabilities in your nixpkgs."
        else if fromNixpkgs && sm90 == [ ] then
          "deep-ep: none of nixpkgs' CUDA capabilities (${quoteAll sorted}) is 9.0 or newer, which DeepEP's kernels need; set config.cudaCapabilities = [ \"9.0\" ] (or newer) in your nixpkgs, or pass cudaCapabilities = [ ... ] with withNvshmem = false for an SM80 intranode-only build."
        else if fromNixpkgs && kept == [ ] then
          "deep-ep: none of nixpkgs' CUDA capabilities from 9.0 up (${quoteAll sm90}) is one torch's extension builder accepts (${quoteAll (filter (c: atLeast c "9.0") accepted)}); set config.cudaCapabilities to include one of those, or pass cudaCapabilities = [ ... ]."
        else if !fromNixpkgs && below80 != [ ] then
          "deep-ep: DeepEP does not build for CUDA capabilities below 8.0 (${quoteAll below80}); remove them from cudaCapabilities."
        else if !fromNixpkgs && unsupported != [ ] then
          "deep-ep: torch's extension builder (torch.utils.cpp_extension) stops with \"Unknown CUDA arch\" for ${quoteAll unsupported} in TORCH_CUDA_ARCH_LIST; it accepts ${quoteAll accepted} (each also with \"+PTX\"); remove them from cudaCapabilities."
        else if disableSm90Features && withNvshmem then
          "deep-ep: cudaCapabilities contains ${quoteAll below90} (below 9.0): DeepEP then builds with DISABLE_SM90_FEATURES=1, which it allows only without NVSHMEM; use only 9.0 and newer, or .override { withNvshmem = false; } (intranode only)."
        else null;
    in
    {
      inherit problem disableSm90Features;
      archList = concatStringsSep ";" kept;
      dropped = if fromNixpkgs then below90 ++ unsupported else [ ];
      droppedUnsupported = if fromNixpkgs then unsupported else [ ];
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

  # What the surrounding nixpkgs decided that leaves no working DeepEP: { "<reason>" = true; }
  # for each that holds, like nixpkgs' torch passthru.brokenConditions; the package sets
  # meta.broken = brokenConditions != { } instead of throwing, as nixpkgs' own
  # python3Packages.deep-ep does for a torch without CUDA (meta.broken = !cudaSupport,
  # pkgs/development/python-modules/deep-ep/default.nix at 72f16858).
  #   torchBroken   the names of torch.brokenConditions that hold (nixpkgs' torch before its
  #                 CUDA 13 enablement lists "Unsupported CUDA version" for CUDA 13:
  #                 torch/source/default.nix at 6b516b42 accepts majors 11 and 12 only)
  brokenConditions = { torchCudaSupport, torchCudaMajor, torchVersion ? "?", torchBroken ? [ ], nvshmemVersion ? null, nvshmemCudaMajor ? null }:
    let
      cuda = cudaProblem { inherit torchCudaSupport torchCudaMajor nvshmemVersion nvshmemCudaMajor; };
      reasons = (if cuda == null then [ ] else [ cuda ])
        ++ (if torchBroken == [ ] then [ ] else [
        "deep-ep: nixpkgs marks torch ${torchVersion} broken here (${quoteAll torchBroken}; torch.brokenConditions); a torch that predates nixpkgs' CUDA ${if torchCudaMajor == null then "" else torchCudaMajor} support lists \"Unsupported CUDA version\": use a nixpkgs whose torch builds for this CUDA major, or an NVSHMEM and torch of a major it supports (e.g. nvshmem_3_4_5_cuda12 with cudaPackages_12.pkgs)."
      ]);
    in
    listToAttrs (map (r: { name = r; value = true; }) reasons);

  # One NVSHMEM per process. torch built with NVSHMEM (nixpkgs' torch with withNvshmem, its
  # cudaPackages.libnvshmem; PyPI torch with the nvidia-nvshmem wheel) maps its
  # libnvshmem_host.so.3 at `import torch`; an extension that needs that SONAME then gets torch's
  # copy, and one dlopened by path is a second copy. So the device code must be built against
  # torch's NVSHMEM, or torch must link none. Which one, for DeepEP or our binding:
  #   who            "deep-ep" | "deepep-kernels-python" (messages)
  #   withNvshmem    whether the extension has NVSHMEM device code
  #   ours           the version of this repository's NVSHMEM asked for
  #   torchNvshmem   the version torch links, or null
  #   torchPairing   pairingStatus of (the extension, torchNvshmem): "broken" | "good" | "untested"
  #   torchProblem   pairingProblem's text for it (when broken)
  #   mode           "auto": torch's NVSHMEM when its pairing is not broken (no rebuild), else
  #                  torch without NVSHMEM (torch.override { withNvshmem = false; }: a rebuild of
  #                  torch, hours); "torch": torch's NVSHMEM or refuse; "rebuild-torch": ours,
  #                  with torch rebuilt without NVSHMEM.
  # Returns { use = "none" | "ours" | "torch"; rebuildTorch; problem; why; }.
  oneNvshmemModes = [ "auto" "torch" "rebuild-torch" ];
  oneNvshmemPlan = { who, withNvshmem, ours ? null, torchNvshmem ? null, torchPairing ? "untested", torchProblem ? null, mode ? "auto" }:
    let
      plan = use: rebuildTorch: why: { inherit use rebuildTorch why; problem = null; };
      refuse = problem: { use = "none"; rebuildTorch = false; why = ""; inherit problem; };
      t = if torchNvshmem == null then "" else releaseVersion torchNvshmem;
      rebuildCost = "torch.override { withNvshmem = false; }: torch rebuilt from source, hours, as no binary cache holds that variant";
    in
    if !(elem mode oneNvshmemModes) then
      refuse "${who}: oneNvshmem = \"${mode}\" is not one of ${quoteAll oneNvshmemModes}."
    else if !withNvshmem then
      plan "none" false "${who} is built without NVSHMEM and loads none${if torchNvshmem == null then "" else "; torch's NVSHMEM ${t} is the only one in the process"}"
    else if torchNvshmem == null then
      (if mode == "torch" then
        refuse "${who}: oneNvshmem = \"torch\" but this torch links no NVSHMEM (nixpkgs' torch does with withNvshmem, by default with CUDA); use oneNvshmem = \"auto\"."
      else plan "ours" false "torch links no NVSHMEM; ${who} loads NVSHMEM ${ours}, the one its device code was built with")
    else if mode == "rebuild-torch" then
      plan "ours" true "torch links NVSHMEM ${t}; it is rebuilt without (${rebuildCost}) so that ${who} loads only NVSHMEM ${ours}"
    else if torchPairing != "broken" then
      plan "torch" false "torch links NVSHMEM ${t} (${if torchPairing == "good" then "a known-good pairing" else "no known-broken pairing"} with ${who}); ${who} is built against that same library, so the process maps one libnvshmem_host.so.3"
    else if mode == "torch" then
      refuse "${who}: oneNvshmem = \"torch\", but torch links NVSHMEM ${t}, a known-broken pairing:\n${torchProblem}\nOne NVSHMEM per process instead: oneNvshmem = \"rebuild-torch\" (${rebuildCost})."
    else
      plan "ours" true "torch links NVSHMEM ${t}, a known-broken pairing with ${who}; torch is rebuilt without NVSHMEM (${rebuildCost}) so that ${who} loads only NVSHMEM ${ours}";

  # The torch builds ./pairings.json records (`torchNvshmem`).
  torchNvshmemBuilds = pairings.torchNvshmem;
}
