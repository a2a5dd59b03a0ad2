# The GDRCopy release both the library (package.nix) and the kernel module (gdrdrv.nix) are
# built from; they must match (gdrdrv refuses libgdrapi versions it does not know).
# 2.6: DMA-BUF mmap backend, builds on current kernels (2.5.2 fixed >= 6.15).
{ fetchFromGitHub }:
let
  version = "2.6";
in
{
  inherit version;
  src = fetchFromGitHub {
    owner = "NVIDIA";
    repo = "gdrcopy";
    tag = "v${version}";
    hash = "sha256-Waq/Of0LcLDqyaWaU47lorJcG30CijcdTsvf9nMqgrg=";
  };
}
