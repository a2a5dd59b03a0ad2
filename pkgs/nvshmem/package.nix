# NVSHMEM from NVIDIA's prebuilt artifacts: one builder for every entry of the generated release
# data (releases.nix), from the NVIDIA redist tarball (preferred) or the PyPI wheel.
#
#   nvshmem                                  3.4.5, CUDA 13, NVIDIA tarball
#   nvshmem.override { version = "3.6.5"; }  another release (CUDA 13 where it exists, else 12)
#   nvshmem.override { cudaMajor = "12"; source = "pypi"; }
#
# A combination the data does not have (3.3.9 + CUDA 13, a PyPI-only release with
# source = "nvidia", ...) is an evaluation error naming what exists (see ./lib.nix).
#
# Run-time wiring (NVSHMEM opens most of its dependencies with dlopen, invisible to
# autoPatchelfHook): every ELF file gets RUNPATH entries for
#   $ORIGIN                the bootstrap and transport plugins beside libnvshmem_host
#   /run/opengl-driver/lib libcuda.so.1 / libnvidia-ml.so.1 (autoAddDriverRunpath)
#   rdma-core              libibverbs.so.1, libmlx5.so.1 (IB transports, IBGDA)
#   gdrcopy (optional)     libgdrapi.so.2 (CPU-assisted IBGDA with the gdrcopy backend)
#   nccl (optional)        libnccl.so.2 (NVSHMEM's NCCL collectives)
# The MPI/OpenSHMEM/PMIx/libfabric/UCX plugins keep their DT_NEEDED entries unresolved: the
# unique-id bootstrap with P2P/IBGDA transports needs none of them (see autoPatchelfIgnoreMissingDeps).
{ lib
, stdenv
, fetchurl
, runCommand
, autoPatchelfHook
, autoAddDriverRunpath
, unzip
, binutils
, rdma-core
, cudaPackages_12 ? null
, cudaPackages_13 ? null
, # GDRCopy user-space library (this repository's pkgs/gdrcopy); null leaves it out.
  gdrcopy ? null
, releases ? import ./releases.nix
, version ? (import ./lib.nix).defaultVersion
, # "12" | "13" | null (null: 13 where the release has it, else 12)
  cudaMajor ? null
, # "nvidia" | "pypi" | null (null: the NVIDIA tarball where one exists, else the wheel)
  source ? null
, withNccl ? true
, withGdrcopy ? gdrcopy != null
,
}:
let
  nvshmemLib = import ./lib.nix;

  sel = nvshmemLib.select {
    inherit releases version cudaMajor source;
    system = stdenv.hostPlatform.system;
  };

  cudaPackages =
    let
      byMajor = { "12" = cudaPackages_12; "13" = cudaPackages_13; };
      chosen = byMajor.${sel.cudaMajor};
    in
    if chosen == null then
      throw "NVSHMEM ${sel.version} for CUDA ${sel.cudaMajor} needs cudaPackages_${sel.cudaMajor}, which this nixpkgs does not have; use cudaMajor = \"${if sel.cudaMajor == "13" then "12" else "13"}\" or a newer nixpkgs."
    else chosen;

  isWheel = sel.source == "pypi";

  # Directories NVSHMEM dlopens from; appended to every RUNPATH.
  runtimeLibraryDirs =
    [ "${lib.getLib rdma-core}/lib" ]
    ++ lib.optional withGdrcopy "${lib.getLib gdrcopy}/lib"
    ++ lib.optional withNccl "${lib.getLib cudaPackages.nccl}/lib";

  license = import ./license.nix;
in
stdenv.mkDerivation (finalAttrs: {
  pname = "libnvshmem";
  inherit (sel) version;

  src = fetchurl
    {
      inherit (sel.artifact) url hash;
    } // lib.optionalAttrs isWheel {
    # fetchurl would name the store path after the URL's last component anyway; be explicit
    # because wheel file names carry the platform tags we match on in tests.
    name = sel.artifact.filename;
  };

  __structuredAttrs = true;
  strictDeps = true;

  outputs = [ "out" "lib" "dev" "static" ] ++ lib.optional (!isWheel) "bin";
  # dev propagates the libraries (not `out`, which links back to dev: outputs must not form a cycle).
  propagatedBuildOutputs = [ "lib" "static" ];

  nativeBuildInputs = [ autoPatchelfHook autoAddDriverRunpath ] ++ lib.optional isWheel unzip;

  buildInputs = [
    (lib.getLib stdenv.cc.cc)
    (lib.getLib rdma-core)
    (lib.getLib cudaPackages.cuda_cudart)
  ] ++ lib.optional withGdrcopy (lib.getLib gdrcopy)
  ++ lib.optional withNccl (lib.getLib cudaPackages.nccl);

  # Extra RUNPATH entries for every shared object, added after autoPatchelf (which replaces
  # RUNPATH) and autoAddDriverRunpath have run; "$ORIGIN" is literal.
  extraRunpath = lib.concatStringsSep ":" ([ "$ORIGIN" ] ++ runtimeLibraryDirs);

  autoPatchelfIgnoreMissingDeps = [
    # Provided by the driver at run time (autoAddDriverRunpath adds its directory).
    "libcuda.so.1"
    "libnvidia-ml.so.1"
    # Optional bootstrap/transport plugins and NVIDIA's MPI-based perftests.
    "libmpi.so.40"
    "liboshmem.so.40"
    "libpmix.so.2"
    "libfabric.so.1"
    "libucp.so.0"
    "libucs.so.0"
    "libuct.so.0"
    "libucm.so.0"
  ];

  dontConfigure = true;
  dontBuild = true;
  # Keep NVIDIA's binaries as shipped apart from the RUNPATH edits.
  dontStrip = true;


  installPhase = ''
    runHook preInstall

    for required in include lib/libnvshmem_device.a; do
      if [ ! -e "$required" ]; then
        echo "NVSHMEM ${sel.version} (${sel.source}): $required missing from the archive" >&2
        exit 1
      fi
    done

    mkdir -p "$lib/lib" "$static/lib" "$dev"
    cp -r include "$dev/include"

    for f in lib/*; do
      case "$f" in
        lib/cmake) mkdir -p "$NIX_BUILD_TOP/stash" && cp -r "$f" "$NIX_BUILD_TOP/stash/cmake" ;;
        *.a | *.bc) cp -a "$f" "$static/lib/" ;;
        *) cp -a "$f" "$lib/lib/" ;;
      esac
    done

    # Unversioned names for linking with -lnvshmem_host (the wheel ships only .so.3).
    for so in "$lib"/lib/lib*.so.*; do
      [ -e "$so" ] || continue
      base="''${so%%.so.*}.so"
      [ -e "$base" ] || ln -s "$(basename "$so")" "$base"
    done

    ${lib.optionalString (!isWheel) ''
      mkdir -p "$bin"
      if [ -d bin ]; then cp -r bin "$bin/bin"; else mkdir -p "$bin/bin"; fi
    ''}

    mkdir -p "$out/share/doc/nvshmem"
    for f in LICENSE* License* ../../*.dist-info/licenses/*; do
      if [ -f "$f" ]; then cp "$f" "$out/share/doc/nvshmem/"; fi
    done

    runHook postInstall
  '';

  # Two steps that must run after the hooks registered by nativeBuildInputs (autoPatchelf
  # replaces RUNPATH; autoAddDriverRunpath adds the driver directory); hooks appended to
  # postFixupHooks here run after those.
  #  1. Append extraRunpath to every shared object: dlopen from a library searches that
  #     library's own RUNPATH, so the host library and each plugin need it.
  #  2. Make `out` the full prefix (include/, lib/, bin/, lib/cmake) that NVSHMEM_DIR points
  #     at. Linking only now means no library was patched to find a dependency through
  #     `out`, which would make the outputs reference each other in a cycle.
  preFixup = ''
    nvshmemAddRunpath() {
      local so
      for so in "$lib"/lib/*.so*; do
        if [ -f "$so" ] && [ ! -L "$so" ] && isELF "$so"; then
          patchelf --add-rpath "$extraRunpath" "$so"
        fi
      done
    }
    nvshmemLinkPrefix() {
      ln -s "$dev/include" "$out/include"
      mkdir -p "$out/lib"
      for f in "$lib"/lib/* "$static"/lib/*; do ln -s "$f" "$out/lib/"; done
      if [ -d "$NIX_BUILD_TOP/stash/cmake" ]; then cp -r "$NIX_BUILD_TOP/stash/cmake" "$out/lib/cmake"; fi
      ${lib.optionalString (!isWheel) ''ln -s "$bin/bin" "$out/bin"''}
    }
    postFixupHooks+=(nvshmemAddRunpath nvshmemLinkPrefix)
  '';

  passthru = {
    inherit (sel) cudaMajor source releaseDate;
    inherit cudaPackages;
    # For LD_LIBRARY_PATH outside Nix-built binaries (GPU checks, devShell).
    libraryPath = lib.makeLibraryPath ([ finalAttrs.finalPackage.lib ] ++ lib.optional withNccl cudaPackages.nccl);
    tests.layout = runCommand "libnvshmem-${sel.version}-layout-test"
      {
        nativeBuildInputs = [ binutils ];
        nvshmem = finalAttrs.finalPackage;
        expectedRunpath = lib.concatStringsSep ":" runtimeLibraryDirs;
      } ''
      set -eu
      for f in include/nvshmem.h include/nvshmemx.h lib/libnvshmem_device.a lib/libnvshmem_host.so lib/libnvshmem_host.so.3; do
        [ -e "$nvshmem/$f" ] || { echo "missing $f in $nvshmem" >&2; exit 1; }
      done
      checked=0
      for so in "$nvshmem"/lib/libnvshmem_host.so.3 "$nvshmem"/lib/nvshmem_transport_*.so.* "$nvshmem"/lib/nvshmem_bootstrap_*.so.*; do
        [ -e "$so" ] || continue
        # DT_RUNPATH, or DT_RPATH where autoPatchelf found nothing to set and kept NVIDIA's.
        runpath=$(readelf -d "$(readlink -f "$so")" | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]/\2/p')
        for want in '$ORIGIN' /run/opengl-driver/lib $(echo "$expectedRunpath" | tr ':' ' '); do
          case ":$runpath:" in
            *":$want:"*) ;;
            *) echo "$so: RUNPATH '$runpath' lacks $want" >&2; exit 1 ;;
          esac
        done
        checked=$((checked + 1))
      done
      [ "$checked" -ge 2 ] || { echo "expected the host library and at least one plugin, checked $checked" >&2; exit 1; }
      touch "$out"
    '';
  };

  meta = {
    description = "NVIDIA NVSHMEM ${sel.version} for CUDA ${sel.cudaMajor} (${if isWheel then "PyPI wheel" else "redist tarball"})";
    homepage = "https://developer.nvidia.com/nvshmem";
    inherit license;
    platforms = nvshmemLib.systems;
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
  };
}
  // lib.optionalAttrs isWheel {
  # A wheel is a zip; its files live under nvidia/nvshmem/. (The tarball uses stdenv's unpack.)
  unpackPhase = ''
    runHook preUnpack
    unzip -q "$src" -d wheel
    if [ ! -d wheel/nvidia/nvshmem/lib ]; then
      echo "unexpected wheel layout: no nvidia/nvshmem/lib in $src" >&2
      exit 1
    fi
    cd wheel/nvidia/nvshmem
    runHook postUnpack
  '';
})
