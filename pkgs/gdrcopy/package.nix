# GDRCopy user-space library (libgdrapi.so.2, dlopened by NVSHMEM's IB transports for the
# CPU-assisted IBGDA path) and its test/benchmark tools (gdrcopy_sanity, gdrcopy_copybw, ...).
# The kernel module is ./gdrdrv.nix (it depends on the kernel and the nvidia driver).
{ lib
, stdenv
, fetchFromGitHub
, symlinkJoin
, autoAddDriverRunpath
, which
, cudaPackages
, # The tools need nvcc and the CUDA driver stub; the library alone does not.
  withTools ? true
,
}:
let
  source = import ./source.nix { inherit fetchFromGitHub; };

  # The layout the tests' Makefile expects under CUDA=...: bin/nvcc, include/, lib/stubs/libcuda.so.
  cudaRoot = import ../cuda-home.nix {
    inherit lib symlinkJoin cudaPackages;
    name = "gdrcopy-cuda-root";
  };
in
stdenv.mkDerivation {
  pname = "gdrcopy";
  inherit (source) version src;

  __structuredAttrs = true;
  strictDeps = true;

  nativeBuildInputs = [ which autoAddDriverRunpath ]
    ++ lib.optional withTools cudaPackages.cuda_nvcc;

  postPatch = ''
    patchShebangs config_arch scripts
  '';

  makeFlags = [
    "prefix=${placeholder "out"}"
    # Instead of ./config_arch, which compiles and runs a probe with a bare `gcc`.
    "GDRAPI_ARCH=${if stdenv.hostPlatform.isAarch64 then "ARM64" else "X86"}"
  ] ++ lib.optionals withTools [
    "CUDA=${cudaRoot}"
    # Command-line variables override the Makefile's own search list (which probes /usr).
    "CUDA_LIB=-L${cudaRoot}/lib -L${cudaRoot}/lib/stubs"
    "NVCCFLAGS=-std=c++17"
  ];

  buildFlags = [ "lib" ] ++ lib.optional withTools "exes";
  installTargets = [ "lib_install" ] ++ lib.optional withTools "exes_install";

  enableParallelBuilding = true;

  doInstallCheck = true;
  installCheckPhase = ''
    runHook preInstallCheck
    test -e "$out/lib/libgdrapi.so.2"
    test -e "$out/include/gdrapi.h"
    ${lib.optionalString withTools ''test -x "$out/bin/gdrcopy_sanity"''}
    runHook postInstallCheck
  '';

  passthru = { inherit cudaPackages cudaRoot; };

  meta = {
    description = "Low-latency GPU memory copy library based on GPUDirect RDMA (library${lib.optionalString withTools " and tools"})";
    homepage = "https://github.com/NVIDIA/gdrcopy";
    license = lib.licenses.mit;
    platforms = [ "x86_64-linux" "aarch64-linux" ];
  };
}
