# NVSHMEM's licence in nixpkgs' `meta.license` shape (no nixpkgs needed, so the flake's
# allowUnfreePredicate and the pure checks can name it too).
{
  shortName = "NVSHMEM SLA";
  fullName = "NVIDIA NVSHMEM Software License Agreement";
  url = "https://docs.nvidia.com/nvshmem/api/sla.html";
  free = false;
  redistributable = false;
}
