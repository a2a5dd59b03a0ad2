//! `deepep-nix`: pin NVSHMEM releases from upstream, render Nix data, verify and install
//! releases, and check a host (`doctor`).

pub mod doctor;
