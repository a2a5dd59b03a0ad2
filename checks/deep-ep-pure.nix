# Pure tests of the DeepEP package rules (pkgs/deep-ep/lib.nix) and pairing data
# (pkgs/deep-ep/pairings.json, which `deepep-nix doctor` embeds too: its side of the same tests is
# generator/src/doctor/deepep.rs `pairing_data_*` and generator/tests/doctor.rs
# `deepep_pairing_check_applies_every_rule_of_pairings_json`); merged into checks/pure.nix's
# tests, so Debian's Nix 2.8 runs them in CI. Same shape: name = { expr; expected; }.
let
  d = import ../pkgs/deep-ep/lib.nix;
  data = d.pairings;
  json = builtins.fromJSON (builtins.readFile ../pkgs/deep-ep/pairings.json);
  nvshmemReleases = import ../pkgs/nvshmem/releases.nix;
  nvshmemLib = import ../pkgs/nvshmem/lib.nix;

  inherit (builtins) all attrNames filter length match replaceStrings tryEval;

  fails = e: !(tryEval (builtins.deepSeq e e)).success;
  matches = re: s: s != null && match re s != null;

  # What the package throws for a pairing (package.nix throws pairingProblem when not null).
  refuse = deepep: nvshmem: knownFixes:
    let p = d.pairingProblem { inherit deepep nvshmem knownFixes; };
    in if p == null then "accepted" else throw p;

  status = nvshmem: d.pairingStatus { deepep = "1.2.1"; inherit nvshmem; };

  # Whether `s` contains `part` (no regex: the texts hold brackets and parentheses).
  contains = part: s: s != null && replaceStrings [ part ] [ "" ] s != s;
  rcRule = rules: builtins.head (filter (r: r.id == "rc-qp-layout-3.5.19") rules);
  # pairings.json with the RC rule's NVSHMEM range moved to 3.6.0 and its fix text changed:
  # what an edit of the file does to the package (the doctor's test edits a copy the same way).
  edited = json // {
    broken = map
      (r: if r.id == "rc-qp-layout-3.5.19" then r // { nvshmem = { atLeast = "3.6.0"; }; fix = "EDITED FIX"; } else r)
      json.broken;
  };
  version = v: matches "[0-9]+\\.[0-9]+\\.[0-9]+" v;
  range = r: r != { } && all (k: k == "atLeast" || k == "atMost") (attrNames r) && all (k: version r.${k}) (attrNames r);
in
{
  # ---- pairing data
  deepEpPairingDataWellFormed = {
    expr = all
      (r: r ? id && r ? why && r ? fix && r ? modes && r ? deepep && r ? nvshmem
        && length r.sources >= 1
        # upstream threads, or this project's own GPU records (kernels/results/)
        && all (s: matches "https://github.com/.*" s || matches "kernels/results/[^ ]+[.]json.*" s) r.sources)
      data.broken;
    expected = true;
  };
  # What the doctor's parser also demands (it rejects the file otherwise): ranges of only
  # atLeast/atMost (a misspelt bound would silently be open here), X.Y.Z versions, known modes
  # and the doctor's own found/fix texts.
  deepEpPairingDataReadableByTheDoctor = {
    expr = map
      (r: {
        inherit (r) id;
        ok = range r.deepep && range r.nvshmem
          && all (m: builtins.elem m [ "intranode" "low-latency" "internode" ]) r.modes
          && r.doctor.found != "" && r.doctor.fix != ""
          && (!(r ? fixedAfter) || version r.fixedAfter.deepep && r.fixedAfter.commit != "");
      })
      data.broken;
    expected = map (r: { inherit (r) id; ok = true; }) json.broken;
  };
  # lib.nix reads pkgs/deep-ep/pairings.json, the file the doctor embeds: no second copy.
  deepEpPairingsAreTheJsonFile = { expr = data == json; expected = true; };
  # The refusal's text is the JSON entry's: why, fix and every source.
  deepEpRefusalTextIsTheJsonEntry = {
    expr =
      let
        r = rcRule json.broken;
        msg = d.pairingProblem { deepep = "1.2.1"; nvshmem = "3.5.19"; };
      in
      map (part: contains part msg) ([ r.why "Fix: ${r.fix}." ''rule "${r.id}" in pkgs/deep-ep/pairings.json'' ] ++ r.sources);
    expected = [ true true true true true true true true ];
  };
  # An edit of the JSON changes what is refused and the message (lib.nix takes the data as an
  # argument for this; the package uses the file).
  deepEpEditedJsonChangesTheRefusal = {
    expr = [
      (d.pairingStatus { deepep = "1.2.1"; nvshmem = "3.5.22"; data = edited; })
      (d.pairingStatus { deepep = "1.2.1"; nvshmem = "3.6.0"; data = edited; })
      (contains "Fix: EDITED FIX." (d.pairingProblem { deepep = "1.2.1"; nvshmem = "3.6.0"; data = edited; }))
      (d.pairingStatus { deepep = "1.2.1"; nvshmem = "3.5.19"; })
    ];
    expected = [ "untested" "broken" true "broken" ];
  };
  # The pinned source's NVSHMEM minimum and the rule refusing older NVSHMEM agree.
  deepEpSourceMinimumMatchesTheRule = {
    expr = map (v: status v) [ "3.3.8" data.sources."1.2.1".nvshmemMinimum ];
    expected = [ "broken" "untested" ];
  };
  deepEpPinnedSourceIsTheTagWithItsNarHash = {
    expr = data.sources."1.2.1";
    expected = { owner = "deepseek-ai"; repo = "DeepEP"; tag = "v1.2.1"; hash = "sha256-xURR3uBAwKjDTNEG9p/vRRhH4Ldiz/u6kD/a+DPn5/Q="; nvshmemMinimum = "3.3.9"; };
  };
  deepEpRcQpRuleCitesTheUpstreamThreads = {
    expr = map (n: builtins.any (s: matches ".*${n}.*" s) (builtins.head (filter (r: r.id == "rc-qp-layout-3.5.19") data.broken)).sources)
      [ "DeepEP/issues/553" "DeepEP/pull/564" "DeepEP/issues/764" "DeepEP/pull/696" "vllm/pull/58159" ];
    expected = [ true true true true true ];
  };

  # ---- the refusal and the accepted pairings
  deepEp121WithNvshmem3519Refused = { expr = fails (refuse "1.2.1" "3.5.19" [ ]); expected = true; };
  deepEp121WithNvshmem345Accepted = { expr = refuse "1.2.1" "3.4.5" [ ]; expected = "accepted"; };
  deepEpRefusalNamesTheFix = {
    expr =
      let msg = d.pairingProblem { deepep = "1.2.1"; nvshmem = "3.6.5"; }; in
      map (re: matches re msg) [
        "deep-ep: DeepEP 1.2.1 with NVSHMEM 3.6.5 is a known-broken pairing for internode and low-latency.*"
        ".*Fix: pin NVSHMEM <= 3.4.5 \\(nvshmem_3_4_5.*"
        ".*DeepEP PR #564.*PR #696.*knownFixes = [[] \"rc-qp-layout-3.5.19\" []].*"
        ".*withNvshmem = false.*"
      ];
    expected = [ true true true true ];
  };
  # Every NVSHMEM release in this repository's data, against DeepEP 1.2.1: refused from 3.5.19 on
  # (a rule wins over a `good` entry), good where pairings.json records a GPU run (3.4.5 at least,
  # the release-matrix runs add more), untested otherwise.
  deepEp121AgainstEveryNvshmemRelease = {
    expr = map (v: { inherit v; s = status v; }) (nvshmemLib.versions nvshmemReleases);
    expected = map
      (v: {
        inherit v;
        s =
          if builtins.compareVersions v "3.5.19" >= 0 then "broken"
          else if builtins.any (g: g.deepep == "1.2.1" && g.nvshmem == v) json.good then "good"
          else "untested";
      })
      (nvshmemLib.versions nvshmemReleases);
  };
  deepEpDefaultNvshmemIsKnownGood = { expr = status nvshmemLib.defaultVersion; expected = "good"; };
  deepEpKnownFixLiftsTheRule = {
    expr = [ (refuse "1.2.1" "3.7.2" [ "rc-qp-layout-3.5.19" ]) (d.pairingStatus { deepep = "1.2.1"; nvshmem = "3.7.2"; knownFixes = [ "rc-qp-layout-3.5.19" ]; }) ];
    expected = [ "accepted" "untested" ];
  };
  deepEpKnownFixesNeedAnotherSource = {
    expr = [
      (matches ".*knownFixes = [[] \"rc-qp-layout-3.5.19\" []] but the source is the pinned release.*" (d.knownFixesProblem { knownFixes = [ "rc-qp-layout-3.5.19" ]; customSource = false; }))
      (d.knownFixesProblem { knownFixes = [ "rc-qp-layout-3.5.19" ]; customSource = true; })
      (d.knownFixesProblem { knownFixes = [ ]; customSource = false; })
    ];
    expected = [ true null null ];
  };
  deepEpNewerDeepEpNotCoveredByTheRule = { expr = status "3.6.5" == "broken" && d.pairingStatus { deepep = "1.3.0"; nvshmem = "3.6.5"; } == "untested"; expected = true; };
  deepEpNvshmemBelowMinimumRefused = { expr = fails (refuse "1.2.1" "3.3.8" [ ]); expected = true; };
  deepEpRangeBoundsInclusive = {
    expr = map (v: d.inRange v { atLeast = "3.5.19"; atMost = "3.6.5"; }) [ "3.4.5" "3.5.19" "3.6.5" "3.7.0" "3.5.9" ];
    expected = [ false true true false false ];
  };
  deepEpUnpinnedVersionNeedsSrc = {
    expr = [ (d.sourceProblem "1.2.1") (matches ".*no pinned source for DeepEP 9.9.9.*pass src = .*" (d.sourceProblem "9.9.9")) ];
    expected = [ null true ];
  };

  # ---- TORCH_CUDA_ARCH_LIST
  deepEpArchFromNixpkgsKeeps90AndNewer = {
    expr = d.archPlan { capabilities = [ "10.0" "7.5" "9.0" "8.6" "12.0" ]; withNvshmem = true; fromNixpkgs = true; };
    expected = { problem = null; archList = "9.0;10.0;12.0"; disableSm90Features = false; dropped = [ "7.5" "8.6" ]; droppedUnsupported = [ ]; };
  };
  deepEpArchHopperSpecific = {
    expr = (d.archPlan { capabilities = [ "9.0a" ]; withNvshmem = true; fromNixpkgs = true; }).archList;
    expected = "9.0a";
  };
  deepEpArchNixpkgsWithoutHopperRefused = {
    expr = matches "deep-ep: none of nixpkgs' CUDA capabilities \\(\"8.0\", \"8.6\"\\) is 9.0 or newer.*config.cudaCapabilities.*"
      (d.archPlan { capabilities = [ "8.6" "8.0" ]; withNvshmem = true; fromNixpkgs = true; }).problem;
    expected = true;
  };
  deepEpArchExplicitSm80NeedsNoNvshmem = {
    expr = [
      (matches ".*DISABLE_SM90_FEATURES=1.*withNvshmem = false.*" (d.archPlan { capabilities = [ "8.0" "9.0" ]; withNvshmem = true; fromNixpkgs = false; }).problem)
      (d.archPlan { capabilities = [ "8.0" "9.0" ]; withNvshmem = false; fromNixpkgs = false; })
    ];
    expected = [ true { problem = null; archList = "8.0;9.0"; disableSm90Features = true; dropped = [ ]; droppedUnsupported = [ ]; } ];
  };
  deepEpArchBelow80Refused = {
    expr = matches ".*below 8.0 \\(\"7.5\"\\).*" (d.archPlan { capabilities = [ "7.5" ]; withNvshmem = false; fromNixpkgs = false; }).problem;
    expected = true;
  };
  deepEpArchEmptyRefused = { expr = (d.archPlan { capabilities = [ ]; withNvshmem = false; fromNixpkgs = false; }).problem != null; expected = true; };

  # torch's extension builder rejects what its allowlist lacks ("Unknown CUDA arch"); nixpkgs'
  # torch no longer narrows its capabilities to that list (7dec1fd5), so nixpkgs' entries it would
  # reject are dropped (f-suffixed family targets, 11.0), explicit ones refused.
  deepEpArchKeepsWhatTorchsExtensionBuilderAccepts = {
    expr = d.archPlan { capabilities = [ "8.9" "9.0" "10.0" "10.0f" "10.3" "11.0" "12.0" "12.1" ]; withNvshmem = true; fromNixpkgs = true; accepted = d.torchAcceptedArches "2.13.0"; };
    expected = { problem = null; archList = "9.0;10.0;10.3;12.0;12.1"; disableSm90Features = false; dropped = [ "8.9" "10.0f" "11.0" ]; droppedUnsupported = [ "10.0f" "11.0" ]; };
  };
  deepEpArchTorchBefore28HasNo103Or121 = {
    expr = (d.archPlan { capabilities = [ "9.0" "10.0" "10.3" "12.1" ]; withNvshmem = true; fromNixpkgs = true; accepted = d.torchAcceptedArches "2.7.1"; }).archList;
    expected = "9.0;10.0";
  };
  deepEpArchExplicitEntryTorchRejectsRefused = {
    expr = map (c: (d.archPlan { capabilities = c; withNvshmem = true; fromNixpkgs = false; accepted = d.torchAcceptedArches "2.9.1"; }).problem) [ [ "9.0" "11.0" ] [ "9.0a" "10.0+PTX" ] ];
    expected = [
      "deep-ep: torch's extension builder (torch.utils.cpp_extension) stops with \"Unknown CUDA arch\" for \"11.0\" in TORCH_CUDA_ARCH_LIST; it accepts ${builtins.concatStringsSep ", " (map (a: "\"${a}\"") (d.torchAcceptedArches "2.9.1"))} (each also with \"+PTX\"); remove them from cudaCapabilities."
      null
    ];
  };
  deepEpArchNothingTorchAcceptsRefused = {
    expr = matches "deep-ep: none of nixpkgs' CUDA capabilities from 9.0 up \\(\"11.0\"\\) is one torch's extension builder accepts.*"
      (d.archPlan { capabilities = [ "8.0" "11.0" ]; withNvshmem = true; fromNixpkgs = true; accepted = d.torchAcceptedArches "2.9.1"; }).problem;
    expected = true;
  };
  deepEpTorchAllowlistByVersion = {
    expr = map (v: d.torchAcceptedArches v != null && builtins.elem "12.1" (d.torchAcceptedArches v)) [ "2.7.1" "2.8.0" "2.9.1" "2.13.0" ];
    expected = [ false true true true ];
  };

  # ---- versions as nixpkgs' libnvshmem spells them ("3.6.5-0")
  deepEpReleaseVersionStripsTheTagSuffix = {
    expr = map d.releaseVersion [ "3.6.5-0" "3.4.5" "1.2.1+29d31c0" ];
    expected = [ "3.6.5" "3.4.5" "1.2.1" ];
  };
  deepEpNixpkgsSpellingsPairLikeTheRelease = {
    expr = map (v: status v) [ "3.4.5-0" "3.6.5-0" "3.5.19-0" ];
    expected = [ "good" "broken" "broken" ];
  };

  # ---- one NVSHMEM per process
  # DeepEP 1.2.1 with nixpkgs' torch (NVSHMEM 3.6.5: known broken) -> torch rebuilt without
  # NVSHMEM; with PyPI-style torch at 3.4.5 (known good) -> built against torch's, no rebuild;
  # torch without NVSHMEM -> ours; intranode only -> none.
  deepEpOneNvshmemPlans = {
    expr = map
      (t:
        let p = d.oneNvshmemPlan ({ who = "deep-ep"; withNvshmem = true; ours = "3.4.5"; } // t // (if t ? torchNvshmem then { torchPairing = status t.torchNvshmem; } else { }));
        in { inherit (p) use rebuildTorch problem; })
      [{ torchNvshmem = "3.6.5-0"; } { torchNvshmem = "3.4.5"; } { } { torchNvshmem = "3.6.5-0"; mode = "rebuild-torch"; } { torchNvshmem = "3.4.5"; mode = "rebuild-torch"; }];
    expected = [
      { use = "ours"; rebuildTorch = true; problem = null; }
      { use = "torch"; rebuildTorch = false; problem = null; }
      { use = "ours"; rebuildTorch = false; problem = null; }
      { use = "ours"; rebuildTorch = true; problem = null; }
      { use = "ours"; rebuildTorch = true; problem = null; }
    ];
  };
  deepEpOneNvshmemTorchModeRefusesABrokenPairing = {
    expr =
      let p = d.oneNvshmemPlan { who = "deep-ep"; withNvshmem = true; ours = "3.4.5"; torchNvshmem = "3.6.5-0"; torchPairing = "broken"; torchProblem = d.pairingProblem { deepep = "1.2.1"; nvshmem = "3.6.5-0"; }; mode = "torch"; };
      in map (part: contains part p.problem) [ "oneNvshmem = \"torch\", but torch links NVSHMEM 3.6.5, a known-broken pairing" "rule \"rc-qp-layout-3.5.19\"" "oneNvshmem = \"rebuild-torch\"" "hours" ];
    expected = [ true true true true ];
  };
  deepEpOneNvshmemOtherRefusals = {
    expr = map (a: (d.oneNvshmemPlan ({ who = "deep-ep"; withNvshmem = true; ours = "3.4.5"; } // a)).problem != null) [{ mode = "torch"; } { mode = "sometimes"; } { mode = "torch"; torchNvshmem = "3.4.5"; torchPairing = "good"; }];
    expected = [ true true false ];
  };
  deepEpOneNvshmemIntranodeOnlyLoadsNone = {
    expr = (d.oneNvshmemPlan { who = "deep-ep"; withNvshmem = false; torchNvshmem = "3.6.5-0"; }).use;
    expected = "none";
  };
  # Every torch build ./pairings.json records, against DeepEP 1.2.1's default.
  deepEpTorchNvshmemBuildsPlanned = {
    expr = map (b: { inherit (b) id; plan = (d.oneNvshmemPlan { who = "deep-ep"; withNvshmem = true; ours = "3.4.5"; torchNvshmem = b.nvshmem; torchPairing = status b.nvshmem; }).use; }) d.torchNvshmemBuilds;
    expected = [{ id = "nixpkgs-torch-withNvshmem"; plan = "ours"; } { id = "pypi-torch-2.11-to-2.14-cu13"; plan = "torch"; } { id = "pypi-torch-2.15-nightly-cu13"; plan = "ours"; }];
  };
  deepEpTorchNvshmemBuildsWellFormed = {
    expr = all (b: b ? id && b ? torch && version b.nvshmem && length b.sources >= 1 && all (s: matches "https://github.com/.*" s) b.sources) d.torchNvshmemBuilds;
    expected = true;
  };

  # ---- what nixpkgs decides: meta.broken, not an evaluation error
  deepEpBrokenConditions = {
    expr = map (a: builtins.attrNames (d.brokenConditions a)) [
      { torchCudaSupport = false; torchCudaMajor = null; }
      { torchCudaSupport = true; torchCudaMajor = "13"; torchVersion = "2.9.1"; torchBroken = [ "Unsupported CUDA version" ]; }
      { torchCudaSupport = true; torchCudaMajor = "12"; nvshmemVersion = "3.4.5"; nvshmemCudaMajor = "13"; }
      { torchCudaSupport = true; torchCudaMajor = "13"; nvshmemVersion = "3.4.5"; nvshmemCudaMajor = "13"; }
    ];
    expected = [
      [ (d.cudaProblem { torchCudaSupport = false; torchCudaMajor = null; }) ]
      [ "deep-ep: nixpkgs marks torch 2.9.1 broken here (\"Unsupported CUDA version\"; torch.brokenConditions); a torch that predates nixpkgs' CUDA 13 support lists \"Unsupported CUDA version\": use a nixpkgs whose torch builds for this CUDA major, or an NVSHMEM and torch of a major it supports (e.g. nvshmem_3_4_5_cuda12 with cudaPackages_12.pkgs)." ]
      [ (d.cudaProblem { torchCudaSupport = true; torchCudaMajor = "12"; nvshmemVersion = "3.4.5"; nvshmemCudaMajor = "13"; }) ]
      [ ]
    ];
  };

  # ---- one CUDA major for torch, DeepEP and NVSHMEM
  deepEpCudaMajorsAgree = {
    expr = d.cudaProblem { torchCudaSupport = true; torchCudaMajor = "13"; nvshmemVersion = "3.4.5"; nvshmemCudaMajor = "13"; };
    expected = null;
  };
  deepEpCudaMajorMismatchRefused = {
    expr = d.cudaProblem { torchCudaSupport = true; torchCudaMajor = "12"; nvshmemVersion = "3.4.5"; nvshmemCudaMajor = "13"; };
    expected = "deep-ep: torch is built for CUDA 12 but NVSHMEM 3.4.5 for CUDA 13; DeepEP, torch and NVSHMEM must share one CUDA major: use nvshmem_3_4_5_cuda12 or a torch from cudaPackages_13.pkgs (nixpkgs manual, \"Using cudaPackages.pkgs\").";
  };
  deepEpTorchWithoutCudaRefused = {
    expr = matches ".*without CUDA.*cudaSupport = true.*" (d.cudaProblem { torchCudaSupport = false; torchCudaMajor = null; });
    expected = true;
  };
  deepEpNoNvshmemOnlyNeedsTorchCuda = { expr = d.cudaProblem { torchCudaSupport = true; torchCudaMajor = "12"; }; expected = null; };
}
