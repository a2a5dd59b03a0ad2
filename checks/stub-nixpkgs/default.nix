# `import nixpkgs { system; config; }` for the stub (config is accepted and ignored).
{ system, config ? { } }:
assert builtins.isAttrs config;
import ./pkgs.nix { inherit system; }
