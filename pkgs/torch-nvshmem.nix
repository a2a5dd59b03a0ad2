# The NVSHMEM a torch package links, or null: (import ./torch-nvshmem.nix) torch.
#
# nixpkgs' torch has withNvshmem ? (cudaSupport && cudaPackages.libnvshmem.meta.available),
# exports it as env.USE_NVSHMEM and puts cudaPackages.libnvshmem among its CUDA build inputs
# (pkgs/development/python-modules/torch/source/default.nix at 7dec1fd5); torch from before that
# change (e.g. 6b516b42, torch 2.9.1) has none of them and links no NVSHMEM. Either answer of
# the pinned revision is read from the package itself, never assumed. The result is torch's
# own cudaPackages.libnvshmem (pname "libnvshmem", version like "3.6.5-0": the git tag's).
torch:
let
  cudaSupport = torch.cudaSupport or false;
  flag = torch.env.USE_NVSHMEM or torch.USE_NVSHMEM or null;
  links =
    if flag != null then flag == "1" || flag == true
    else builtins.any (p: builtins.isAttrs p && (p.pname or null) == "libnvshmem") (torch.buildInputs or [ ]);
in
if cudaSupport && links && torch ? cudaPackages && torch.cudaPackages ? libnvshmem
then torch.cudaPackages.libnvshmem
else null
