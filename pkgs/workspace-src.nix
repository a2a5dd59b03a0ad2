# The Cargo workspace as a store path, with only the files cargo needs (so editing docs or Nix
# files does not rebuild the Rust packages). `extra` adds paths one crate needs beyond its own
# directory (the generator embeds pkgs/nvshmem/manifests). Every workspace member's manifest must be
# there, or cargo refuses the workspace.
{ lib }:
extra:
let
  root = ../.;
in
lib.fileset.toSource {
  inherit root;
  fileset = lib.fileset.unions ([
    (root + "/Cargo.toml")
    (root + "/Cargo.lock")
    (root + "/generator")
    (root + "/kernels")
    # A workspace member: cargo reads every member's manifest even when building another crate.
    (root + "/python/Cargo.toml")
    (root + "/python/src")
  ] ++ extra);
}
