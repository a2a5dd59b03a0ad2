# The kernels crate (DeepEP-equivalent dispatch/combine) and its harness crate (binaries
# deepep-bench and deepep-gpu-tests, kernels/harness) built with nixpkgs' CUDA toolkit. kernels/build.rs reads exactly two
# variables: CUDA_HOME (a toolkit root with bin/nvcc) and NVSHMEM_DIR (a prefix with include/
# and lib/libnvshmem_device.a; empty = build without the NVSHMEM kernels, like DeepEP's
# DISABLE_NVSHMEM). `nvshmem = null` gives that second variant.
#
# cudaPackages is the toolkit (nvcc, cudart, NVRTC, NCCL); it has no default, because
# callPackage would fill it from the package set (pkgs.cudaPackages) instead of from nvshmem:
# pass it (pkgs/default.nix passes the one CUDA major of the default outputs). It must be
# NVSHMEM's CUDA major: cubins linked against libnvshmem_device.a of another major are broken.
#
# The binaries load libcuda, NVRTC, NCCL and libnvshmem_host at run time (dlopen from the
# executable searches the executable's RUNPATH), so their RUNPATH gets the driver directory
# and the library directories of exactly the packages they were built against.
{ lib
, rustPlatform
, symlinkJoin
, autoAddDriverRunpath
, nvshmem ? null
, cudaPackages
,
}:
let
  src = import ../workspace-src.nix { inherit lib; } [ ];
  build = import ../kernels-build-env.nix {
    inherit lib symlinkJoin cudaPackages nvshmem;
    who = "deepep-kernels";
    fix = "pass cudaPackages = nvshmem.cudaPackages (or an NVSHMEM of the toolkit's major).";
  };
in
rustPlatform.buildRustPackage {
  pname = "deepep-kernels" + lib.optionalString (nvshmem == null) "-no-nvshmem";
  version = (lib.importTOML ../../Cargo.toml).workspace.package.version;
  inherit src;

  cargoLock.lockFile = ../../Cargo.lock;
  # The binaries live in deepep-kernels-harness (kernels/harness), which depends on
  # deepep-kernels, so building it builds the library and its cubins too. nixpkgs appends
  # these flags to `cargo build` / `cargo test` (pkgs/build-support/rust/hooks/
  # cargo-build-hook.sh, cargo-check-hook.sh).
  cargoBuildFlags = [ "-p" "deepep-kernels-harness" ];
  cargoTestFlags = [ "-p" "deepep-kernels" "-p" "deepep-kernels-harness" ];

  # cuda_nvcc's setup hook points nvcc at a host compiler it supports.
  nativeBuildInputs = [ cudaPackages.cuda_nvcc autoAddDriverRunpath ];

  inherit (build) env;

  postFixup = ''
    for exe in "$out"/bin/*; do
      if isELF "$exe"; then
        patchelf --add-rpath "${build.runtimeRpath}" "$exe"
      fi
    done
  '';

  passthru = {
    inherit nvshmem cudaPackages;
    inherit (build) cudaHome;
  };

  meta = {
    description = "DeepEP-equivalent expert-parallel dispatch/combine kernels${lib.optionalString (nvshmem == null) " (without NVSHMEM)"}";
    license = with lib.licenses; [ mit asl20 ];
    mainProgram = "deepep-bench";
    platforms = [ "x86_64-linux" "aarch64-linux" ];
  };
}
