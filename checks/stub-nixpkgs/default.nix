# `import nixpkgs { system; config; }` for the stub. Like nixpkgs, the package set carries the
# config it was given as `config` (checks/default.nix reads config.allowUnfreePredicate; the
# package set reads config.cudaSupport).
# `torch` (stub only): which nixpkgs torch recipe is modelled, see ./pkgs.nix.
{ system, config ? { }, torch ? { } }:
assert builtins.isAttrs config;
import ./pkgs.nix { inherit system torch; cudaSupport = config.cudaSupport or false; } // { inherit config; }
