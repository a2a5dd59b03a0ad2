# A stand-in for nixpkgs, for CI machines that cannot download nixpkgs. Used only as
#   nix flake show --override-input nixpkgs path:$PWD/checks/stub-nixpkgs
# (scripts/nix-checks.sh). It provides a small `lib` and package stubs whose derivations build
# nothing, so the flake's outputs, attribute names and plumbing (selection of NVSHMEM releases,
# overrides, fetchurl of every pinned artifact) can be evaluated offline. It proves nothing about
# nixpkgs' real attributes or builders. Self-contained on purpose: a path: input is copied alone.
{
  outputs = { self }: {
    lib = import ./lib.nix;
    legacyPackages = self.lib.genAttrs [ "x86_64-linux" "aarch64-linux" ] (system: import ./. { inherit system; });
  };
}
