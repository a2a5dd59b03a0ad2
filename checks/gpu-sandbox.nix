# What every GPU check (checks/gpu.nix, checks/deep-ep-gpu.nix) shares: the environment of a
# GPU build sandbox and a first build step that fails clearly when the builder advertises the
# "cuda" system feature without mounting the GPU (programs.nix-required-mounts, docs/nix.md).
{
  env = {
    # NVLink SHARP multicast is not available in every sandbox/VM; NVSHMEM and NCCL must not try it.
    NVSHMEM_DISABLE_NVLS = "1";
    NCCL_NVLS_ENABLE = "0";
    # The sandbox network is loopback only.
    NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME = "lo";
    NCCL_SOCKET_IFNAME = "lo";
  };
  requireGpu = ''
    if ! ls /dev/nvidia0 >/dev/null 2>&1; then
      echo "no /dev/nvidia0 in the build sandbox: this builder advertises the 'cuda' feature but does not" >&2
      echo "mount the GPU; see docs/nix.md (programs.nix-required-mounts)." >&2
      exit 1
    fi
  '';
}
