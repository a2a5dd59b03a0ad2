# The `deepep-nix` CLI: pins NVSHMEM releases (lock/render), verifies and installs them, and
# checks a host (`doctor`).
{ lib
, rustPlatform
,
}:
let
  src = import ../workspace-src.nix { inherit lib; } [
    # Embedded into the binary by generator/build.rs (lock --offline, releases, render work
    # without a checkout); the rendered file is what the generator's tests compare against.
    ../nvshmem/manifests
    ../nvshmem/releases.json
    ../nvshmem/releases.nix
    # The DeepEP x NVSHMEM pairing rules, embedded by the doctor (include_str! in
    # generator/src/doctor/deepep.rs); the same file pkgs/deep-ep/lib.nix reads.
    ../deep-ep/pairings.json
  ];
in
rustPlatform.buildRustPackage {
  pname = "deepep-nix";
  version = (lib.importTOML ../../Cargo.toml).workspace.package.version;
  inherit src;

  cargoLock.lockFile = ../../Cargo.lock;
  cargoBuildFlags = [ "-p" "deepep-nix" ];
  cargoTestFlags = [ "-p" "deepep-nix" ];

  meta = {
    description = "Pin, render, verify and install NVIDIA NVSHMEM releases; check a host for DeepEP-style EP";
    license = with lib.licenses; [ mit asl20 ];
    mainProgram = "deepep-nix";
    platforms = lib.platforms.linux;
  };
}
