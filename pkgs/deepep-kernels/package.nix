# The kernels crate (DeepEP-equivalent dispatch/combine; binaries deepep-bench and
# deepep-gpu-tests) built with nixpkgs' CUDA toolkit. kernels/build.rs reads exactly two
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
  toolkitMajor = cudaPackages.cudaMajorVersion or "unknown";
  src = import ../workspace-src.nix { inherit lib; } [ ];

  # The toolkit layout build.rs expects under CUDA_HOME.
  cudaHome = import ../cuda-home.nix {
    inherit lib symlinkJoin cudaPackages;
    name = "deepep-cuda-home-${cudaPackages.cudaMajorMinorVersion or "unknown"}";
  };

  runtimeLibraryDirs =
    [ "${lib.getLib cudaPackages.cuda_nvrtc}/lib" "${lib.getLib cudaPackages.nccl}/lib" ]
    ++ lib.optional (nvshmem != null) "${lib.getLib nvshmem}/lib";
in
assert nvshmem == null || nvshmem.cudaMajor == toolkitMajor
  || throw "deepep-kernels: NVSHMEM ${nvshmem.version} is the CUDA ${nvshmem.cudaMajor} build but cudaPackages is CUDA ${toolkitMajor}; pass cudaPackages = nvshmem.cudaPackages (or an NVSHMEM of the toolkit's major).";
rustPlatform.buildRustPackage {
  pname = "deepep-kernels" + lib.optionalString (nvshmem == null) "-no-nvshmem";
  version = (lib.importTOML ../../Cargo.toml).workspace.package.version;
  inherit src;

  cargoLock.lockFile = ../../Cargo.lock;
  cargoBuildFlags = [ "-p" "deepep-kernels" ];
  cargoTestFlags = [ "-p" "deepep-kernels" ];

  # cuda_nvcc's setup hook points nvcc at a host compiler it supports.
  nativeBuildInputs = [ cudaPackages.cuda_nvcc autoAddDriverRunpath ];

  env = {
    CUDA_HOME = "${cudaHome}";
    NVSHMEM_DIR = if nvshmem == null then "" else "${nvshmem}";
    # nixpkgs' nvcc resolves its default include path from its own package, not from the
    # symlinkJoin; name the joined include/ (cudart, CCCL) explicitly (build.rs appends these).
    DEEPEP_NVCC_FLAGS = "-I${cudaHome}/include";
  };

  postFixup = ''
    for exe in "$out"/bin/*; do
      if isELF "$exe"; then
        patchelf --add-rpath "${lib.concatStringsSep ":" runtimeLibraryDirs}" "$exe"
      fi
    done
  '';

  passthru = {
    inherit nvshmem cudaPackages cudaHome;
  };

  meta = {
    description = "DeepEP-equivalent expert-parallel dispatch/combine kernels${lib.optionalString (nvshmem == null) " (without NVSHMEM)"}";
    license = with lib.licenses; [ mit asl20 ];
    mainProgram = "deepep-bench";
    platforms = [ "x86_64-linux" "aarch64-linux" ];
  };
}
