{
  description = "Reproducible DeepEP-style expert-parallel communication: every NVSHMEM release pinned, GDRCopy and gdrdrv, a NixOS module for IBGDA, and EP kernels checked on GPUs";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: lib.genAttrs systems f;

      # Unfree licences our own nixpkgs instance accepts: NVIDIA's CUDA redistributables, NVSHMEM,
      # and the driver packages the NixOS VM test builds. Consumers of the overlay or the module
      # keep their own nixpkgs config (they need to allow the same).
      unfreeLicenses = [ lib.licenses.nvidiaCuda.shortName lib.licenses.nvidiaCudaRedist.shortName (import ./pkgs/nvshmem/license.nix).shortName ];
      # The driver packages' pnames, as nixpkgs names them (checks/default.nix, unfree-names):
      # pkgs/os-specific/linux/nvidia-x11/generic.nix "nvidia-x11", or "nvidia-dc" for the
      # datacenter drivers; settings.nix "nvidia-settings"; persistenced.nix "nvidia-persistenced";
      # fabricmanager.nix "fabricmanager".
      unfreeNames = [ "nvidia-x11" "nvidia-dc" "nvidia-settings" "nvidia-persistenced" "fabricmanager" ];
      allowUnfreePredicate = pkg:
        lib.elem (lib.getName pkg) unfreeNames
        || lib.all (l: (l.free or true) || lib.elem (l.shortName or "") unfreeLicenses) (lib.toList (pkg.meta.license or [ ]));

      pkgsFor = forAllSystems (system: import nixpkgs {
        inherit system;
        config = { inherit allowUnfreePredicate; };
      });

      ours = forAllSystems (system: import ./pkgs { pkgs = pkgsFor.${system}; });
    in
    {
      packages = forAllSystems (system: ours.${system}.packages // {
        default = ours.${system}.packages.deepep-nix;
      });

      devShells = forAllSystems (system:
        let
          pkgs = pkgsFor.${system};
          p = ours.${system}.packages;
          mkDevShell = { nvshmem, kernels }: pkgs.mkShell {
            packages = [
              pkgs.rustc
              pkgs.cargo
              pkgs.clippy
              pkgs.rustfmt
              kernels.cudaPackages.cuda_nvcc
              p.deepep-nix
            ] ++ lib.optional (nvshmem != null) nvshmem;
            CUDA_HOME = "${kernels.cudaHome}";
            # Empty = build the kernels without NVSHMEM (kernels/build.rs reads it that way).
            NVSHMEM_DIR = if nvshmem == null then "" else "${nvshmem}";
            shellHook =
              if nvshmem == null then ''
                echo "deepep-nix dev shell: CUDA ${kernels.cudaPackages.cudaMajorVersion or "?"} toolkit, without NVSHMEM (NVSHMEM_DIR is empty)"
              '' else ''
                export LD_LIBRARY_PATH="$NVSHMEM_DIR/lib''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                export PATH="$NVSHMEM_DIR/bin:$PATH"
                echo "deepep-nix dev shell: NVSHMEM ${nvshmem.version} for CUDA ${nvshmem.cudaMajor} (${nvshmem.source}), NVSHMEM_DIR=$NVSHMEM_DIR"
              '';
          };
        in
        {
          default = mkDevShell { inherit (p) nvshmem; kernels = p.deepep-kernels; };
          no-nvshmem = mkDevShell { nvshmem = null; kernels = p.deepep-kernels-no-nvshmem; };
        });

      nixosModules = {
        deepep = import ./modules/deepep.nix;
        default = self.nixosModules.deepep;
      };

      # Adds this flake's packages to a nixpkgs instance (built with that instance's config).
      # The nvshmem_<v>_cuda<M> names of combinations that do not exist are present too and
      # evaluate to an error that names what exists.
      overlays.default = final: prev:
        let s = import ./pkgs { pkgs = final; inherit (prev.stdenv.hostPlatform) system; };
        in s.missing // s.packages // { deepepGdrdrvFor = s.gdrdrvFor; };

      # Everything that needs no GPU (but network for sources, and KVM for the VM test).
      # GPU checks are in `gpuChecks`, so `nix flake check` works on CPU-only builders.
      checks = forAllSystems (system: import ./checks {
        pkgs = pkgsFor.${system};
        inherit nixpkgs system;
        ours = ours.${system};
        deepepModule = self.nixosModules.deepep;
        outputs = { packages = self.packages.${system}; devShells = self.devShells.${system}; gpuChecks = self.gpuChecks.${system}; };
      });

      # Run on a builder with the "cuda" system feature (docs/nix.md, "GPU runner"):
      #   nix build .#gpuChecks.x86_64-linux.kernels
      gpuChecks = forAllSystems (system: {
        kernels = ours.${system}.packages.deepep-kernels.gpuCheck;
      });

      formatter = forAllSystems (system: pkgsFor.${system}.nixpkgs-fmt);
    };
}
