# `import nixpkgs { system; config; }` for the stub. Like nixpkgs, the package set carries the
# config it was given as `config` (checks/default.nix reads config.allowUnfreePredicate; the
# package set reads config.cudaSupport).
# `torch` (stub only): which nixpkgs torch recipe is modelled, see ./pkgs.nix.
#
# Like nixpkgs' default.nix since 2025-08, this refuses a Nix without the features of
# ./minfeatures.nix (Nix older than 2.18, e.g. Debian 12's 2.8), so that CI cannot pass with a Nix
# that real nixpkgs would refuse. scopedImport passes this file's `builtins` on, so a test that
# evaluates this file with another builtins.nixVersion reaches the gate with it.
{ system, config ? { }, torch ? { } }:
let
  minfeatures = scopedImport { inherit builtins; } ./minfeatures.nix;
  version = if builtins ? nixVersion then builtins.nixVersion else "(no builtins.nixVersion)";
in
if minfeatures.missing != [ ] then
  abort ''
    checks/stub-nixpkgs, like nixpkgs, requires an implementation of Nix with the following features:
    ${builtins.concatStringsSep "\n" (map (f: "- ${f.description}") minfeatures.missing)}

    You are evaluating with Nix ${version}. Use a Nix >= 2.18: scripts/debian-nix.sh unpacks
    Debian 13's Nix 2.26 into target/tools/ without installing anything (docs/nix.md, "Which Nix").
  ''
else
  assert builtins.isAttrs config;
  import ./pkgs.nix { inherit system torch; cudaSupport = config.cudaSupport or false; } // { inherit config; }
