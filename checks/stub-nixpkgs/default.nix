# `import nixpkgs { system; config; }` for the stub (of config, only cudaSupport is read).
{ system, config ? { } }:
assert builtins.isAttrs config;
import ./pkgs.nix { inherit system; cudaSupport = config.cudaSupport or false; }
