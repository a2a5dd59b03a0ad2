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
      # fabricmanager.nix "fabricmanager"; and, since the proprietary kernel modules became a
      # derivation of their own (nixpkgs PR #498612: kernel-modules.nix at 37f8b96b, pname
      # "nvidia-kernel-modules" with the driver's unfree licence, `nvidia_x11.mod`), that one; the
      # open modules ("nvidia-open") are free.
      unfreeNames = [ "nvidia-x11" "nvidia-dc" "nvidia-settings" "nvidia-persistenced" "fabricmanager" "nvidia-kernel-modules" ];
      # torch with CUDA (packages.deep-ep) also needs cuDNN, cuSPARSELt and cuTENSOR (licence
      # names: nixpkgs pkgs/development/cuda-modules/_cuda/lib/licenses.nix).
      torchCudaLicenses = [ "cuDNN EULA" "cuSPARSELt EULA" "cuTENSOR EULA" ];
      allowUnfreePredicate = pkg:
        lib.elem (lib.getName pkg) unfreeNames
        || lib.all (l: (l.free or true) || lib.elem (l.shortName or "") (unfreeLicenses ++ torchCudaLicenses)) (lib.toList (pkg.meta.license or [ ]));

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
          # Python with torch (CUDA on, NVSHMEM's CUDA major) and DeepEP built against the one
          # NVSHMEM its process loads (`nvshmem`, or torch's: pkgs/deep-ep/package.nix,
          # oneNvshmem); DeepEP's tests run from a checkout:
          # python tests/test_intranode.py --num-processes 2
          deep-ep = pkgs.mkShell {
            packages = [ p.deep-ep.pythonEnv ];
            NVSHMEM_DIR = "${p.deep-ep.nvshmem}";
            shellHook = ''
              echo "deepep-nix DeepEP shell: deep_ep ${p.deep-ep.version} + torch ${p.deep-ep.torch.version}, NVSHMEM ${p.deep-ep.nvshmem.version} (CUDA ${p.deep-ep.cudaPackages.cudaMajorVersion}; ${p.deep-ep.oneNvshmem.why}), TORCH_CUDA_ARCH_LIST ${p.deep-ep.torchCudaArchList}"
            '';
          };
          # Python with torch (CUDA on, NVSHMEM's CUDA major) and our `deepep_kernels`
          # (packages.deepep-kernels-python's build: the kernels' toolkit and `nvshmem`), pytest;
          # python/tests run against it: cd python && python -m pytest tests --ignore=tests/gpu
          python =
            let env = ours.${system}.deepepKernelsPythonEnv;
            in pkgs.mkShell {
              packages = [ env ];
              # The binding prefers $NVSHMEM_DIR/lib; point it at the one NVSHMEM of this process.
              NVSHMEM_DIR = "${env.deepepKernels.nvshmem}";
              passthru = { inherit (env) deepepKernels torch oneNvshmem; };
              shellHook = ''
                echo "deepep-nix Python shell: deepep_kernels ${env.deepepKernels.version} + torch, NVSHMEM ${env.deepepKernels.nvshmem.version} (CUDA ${env.deepepKernels.nvshmem.cudaMajor}; ${env.oneNvshmem.why}); import deep_ep via the shim: docs/python.md"
              '';
            };
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
        in s.missing // s.packages // {
          deepepGdrdrvFor = s.gdrdrvFor;
          # python3Packages.deep-ep (every Python's package set): DeepEP against this flake's
          # `nvshmem` (or torch's, one NVSHMEM per process), with that package set's torch, which
          # needs config.cudaSupport = true and NVSHMEM's CUDA major; otherwise the package is
          # meta.broken with the reason in passthru.brokenConditions, as nixpkgs' own deep-ep
          # (meta.broken = !cudaSupport), so evaluating the set never throws.
          pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
            # python3Packages.deepep-kernels: our `deepep_kernels` (python/), built in that set
            # with the kernels' toolkit and NVSHMEM (pkgs/default.nix mkDeepepKernelsPython).
            (pyFinal: _: {
              deep-ep = pyFinal.callPackage ./pkgs/deep-ep/package.nix { inherit (final) nvshmem; };
              deepep-kernels = s.mkDeepepKernelsPython pyFinal;
            })
          ];
        };

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
      #   nix build .#gpuChecks.x86_64-linux.deep-ep
      #   nix build .#gpuChecks.x86_64-linux.nvshmem-matrix-3_8_0
      gpuChecks = forAllSystems (system: {
        kernels = ours.${system}.packages.deepep-kernels.gpuCheck;
        # DeepEP's tests/test_intranode.py and tests/test_low_latency.py against packages.deep-ep.
        deep-ep = ours.${system}.packages.deep-ep.gpuCheck;
        deep-ep-no-nvshmem = ours.${system}.packages.deep-ep-no-nvshmem.gpuCheck;
      }
      # One per NVSHMEM release of the lock with a CUDA 13 build (nvshmem-matrix-3_3_20 ...
      # nvshmem-matrix-3_8_0): python/scripts/nvshmem-matrix.sh with that release, our wheel and
      # DeepEP built against it (checks/nvshmem-matrix.nix, docs/nix.md "Per-release GPU checks").
      // import ./checks/nvshmem-matrix.nix { pkgs = pkgsFor.${system}; inherit system; ours = ours.${system}; commit = self.rev or null; });

      formatter = forAllSystems (system: pkgsFor.${system}.nixpkgs-fmt);
    };
}
