# `import nixpkgs { system; config; }` for the stub. Like nixpkgs, the package set carries the
# config it was given as `config` (checks/default.nix reads config.allowUnfreePredicate; the
# package set reads config.cudaSupport).
{ system, config ? { } }:
assert builtins.isAttrs config;
import ./pkgs.nix { inherit system; cudaSupport = config.cudaSupport or false; } // { inherit config; }
