# gdrdrv, GDRCopy's kernel module, for one kernel and one nvidia driver. Use through
#   config.boot.kernelPackages.callPackage ./gdrdrv.nix { nvidia_x11 = config.hardware.nvidia.package; }
# (the NixOS module does this). It needs nv-p2p.h from the driver's kernel sources; those are
# taken from NVIDIA's open-gpu-kernel-modules at the driver's version (nvidia_x11.open.src),
# so the module is built for the *open* flavour (NVIDIA_IS_OPENSOURCE=y) and loads only next
# to the open kernel modules (hardware.nvidia.open = true), which DMA-BUF needs anyway.
# gdrcopy's Makefile probes /usr/src and /lib/modules; every variable it would probe is
# passed explicitly because neither exists in the build sandbox.
{ lib
, stdenv
, fetchFromGitHub
, kernel
, kernelModuleMakeFlags ? kernel.makeFlags
, kmod
, nvidia_x11
,
}:
let
  source = import ./source.nix { inherit fetchFromGitHub; };
  nvidiaSrc =
    if nvidia_x11 ? open && nvidia_x11.open ? src then nvidia_x11.open.src
    else throw "gdrdrv: nvidia driver ${nvidia_x11.version or "?"} has no open kernel module sources (nvidia_x11.open); use a driver >= 515 with hardware.nvidia.open = true.";
  kdir = "${kernel.dev}/lib/modules/${kernel.modDirVersion}/build";
  flag = b: if b then "y" else "n";
in
stdenv.mkDerivation {
  pname = "gdrdrv";
  version = "${source.version}-${kernel.version}";
  inherit (source) src;

  # makeFlags is used as a bash array in buildPhase.
  __structuredAttrs = true;
  strictDeps = true;

  nativeBuildInputs = kernel.moduleBuildDependencies;
  nativeInstallCheckInputs = [ kmod ];

  hardeningDisable = [ "pic" "format" ];

  makeFlags = kernelModuleMakeFlags ++ [
    "-C"
    kdir
    "NVIDIA_SRC_DIR=${nvidiaSrc}/kernel-open/nvidia"
    "NVIDIA_IS_OPENSOURCE=y"
    "HAVE_VM_FLAGS_SET=${flag (lib.versionAtLeast kernel.version "6.3")}"
    "HAVE_PROC_OPS=${flag (lib.versionAtLeast kernel.version "5.6")}"
  ];

  # M= must be absolute; kbuild then builds gdrdrv.ko and nv-p2p-dummy.ko (the latter only
  # satisfies modpost and is not installed).
  buildPhase = ''
    runHook preBuild
    make "''${makeFlags[@]}" M="$PWD/src/gdrdrv" -j$NIX_BUILD_CORES modules
    runHook postBuild
  '';

  installPhase = ''
    runHook preInstall
    install -Dm444 src/gdrdrv/gdrdrv.ko "$out/lib/modules/${kernel.modDirVersion}/extra/gdrdrv.ko"
    runHook postInstall
  '';

  # The module must be the GDRCopy release we package and built for this kernel.
  doInstallCheck = true;
  installCheckPhase = ''
    runHook preInstallCheck
    ko="$out/lib/modules/${kernel.modDirVersion}/extra/gdrdrv.ko"
    got=$(modinfo -F version "$ko")
    [ "$got" = "${source.version}" ] || { echo "gdrdrv.ko reports version '$got', expected ${source.version}" >&2; exit 1; }
    vermagic=$(modinfo -F vermagic "$ko")
    case "$vermagic" in
      "${kernel.modDirVersion} "*) ;;
      *) echo "gdrdrv.ko vermagic '$vermagic' does not start with ${kernel.modDirVersion}" >&2; exit 1 ;;
    esac
    runHook postInstallCheck
  '';

  # A kernel module must not drag store paths into the system closure (stdenv's strip removes
  # the debug sections that would name the kernel and driver sources).
  allowedReferences = [ ];

  passthru = { inherit nvidia_x11; gdrcopyVersion = source.version; };

  meta = {
    description = "GDRCopy kernel-mode driver (gdrdrv ${source.version}) for Linux ${kernel.version}, open nvidia flavour";
    homepage = "https://github.com/NVIDIA/gdrcopy";
    license = with lib.licenses; [ mit gpl2Only ];
    platforms = [ "x86_64-linux" "aarch64-linux" ];
  };
}
