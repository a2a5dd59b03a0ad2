# GENERATED FILE, DO NOT EDIT.
# Rendered by `deepep-nix render` from the lock pkgs/nvshmem/releases.json
# (sha256 80d7f0dc0df28e41a8d5bb40ee2e1c8e44d749dccd35956ab2895b95d09f5029); `deepep-nix lock` refreshes the lock and renders this file.
#
# NVSHMEM releases >= 3.3.9: version -> system -> CUDA major -> source -> fetch
# arguments. `nvidia` is NVIDIA's redist tarball, `pypi` the PyPI wheel; a key is absent where
# the artifact does not exist or is not pinned. `hash` is the flat SRI hash of the file (for
# `fetchurl`); `size` is in bytes, null when upstream does not record it.
{
  "3.3.9" = {
    releaseDate = "2025-06-26";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.3.9_cuda12-archive.tar.xz"; hash = "sha256-YsbGg8WmM4aUFSDkAcQZ8CmZADIcECWQbX5O3S49TJs="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/16/eb/627abc1863df836111121070d21a719d659a2ccd513a6ab4fad6505a39c4/nvidia_nvshmem_cu12-3.3.9-py3-none-manylinux_2_29_aarch64.whl"; hash = "sha256-LeQ8v+VZ4WuOPLd3uV8f4t3Vws/XlBSwnPnPCZ/roro="; size = 124419114; filename = "nvidia_nvshmem_cu12-3.3.9-py3-none-manylinux_2_29_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.3.9_cuda12-archive.tar.xz"; hash = "sha256-cqeI71cjow2IgrGT8KUT9FTsruOrWiJaXEPbedQz72Y="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/bf/f9/dcb91a671d5643ca132e4c8377982ab5c2cadc3a60957e08e30d678bfb81/nvidia_nvshmem_cu12-3.3.9-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-lboemBicBW61NyvTVatxSzdBoD5t4eMvFn9SQP2WfF8="; size = 124606673; filename = "nvidia_nvshmem_cu12-3.3.9-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.3.20" = {
    releaseDate = "2025-08-04";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.3.20_cuda12-archive.tar.xz"; hash = "sha256-WQAfGLzxX6tsAiWyGYZcTCwquo92fc4KoyEamC0W+KY="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/92/9d/3dd98852568fb845ec1f7902c90a22b240fe1cbabda411ccedf2fd737b7b/nvidia_nvshmem_cu12-3.3.20-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-CwuWDaOEIhJ1jk+kaWuU8SkJCzDlEi/qPFNFkWVFz/A="; size = 124484616; filename = "nvidia_nvshmem_cu12-3.3.20-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.3.20_cuda13-archive.tar.xz"; hash = "sha256-SjDzdG6j1UhE8tkRkpisVDftif+HJPm5vsEISvII7dU="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/71/d7/579701ccea900ec220b1a71a9f75eba2237824db7331cc90cdf9e07ac11b/nvidia_nvshmem_cu13-3.3.20-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-1AgY/W8SZ8MG3wb5Q7ZrS5WlVPG43H2oHgIyJm+GiUU="; size = 55864769; filename = "nvidia_nvshmem_cu13-3.3.20-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.3.20_cuda12-archive.tar.xz"; hash = "sha256-dXRstC611auvROEo2SOKFiO2TNTUm8LE2O+cYI1Gx+E="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/3b/6c/99acb2f9eb85c29fc6f3a7ac4dccfd992e22666dd08a642b303311326a97/nvidia_nvshmem_cu12-3.3.20-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-0A8m0/my48MGW+iV4wWdZHnqXGOKPzjJ/sSbG53XweU="; size = 124657145; filename = "nvidia_nvshmem_cu12-3.3.20-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.3.20_cuda13-archive.tar.xz"; hash = "sha256-AJYGYmfEUR8aV+dzBeLVEocD1pAWcicdUW3JpUzylZY="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/74/5a/2828774452da00043753412b2517bd76bbc4a0912b1569f887d5d041f73a/nvidia_nvshmem_cu13-3.3.20-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-6dS9agHmonRZA7W3NH/OWw3d7g25WVD7oxPdR8aZC1s="; size = 56063072; filename = "nvidia_nvshmem_cu13-3.3.20-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.3.24" = {
    releaseDate = "2025-08-22";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.3.24_cuda12-archive.tar.xz"; hash = "sha256-oazw0jnLLpVEmZHkS1wu2Wu+UIFFQAH1K+wuKVPdwyw="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/ca/ce/6b73d2c3cdeb2202a4a79115e543087ca024306c4d290fffd5cfc8d5009d/nvidia_nvshmem_cu12-3.3.24-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-+GZuTSrf/oRsJkqDYmO1P6XXtyXwxQjja0DD1PlmXio="; size = 138990167; filename = "nvidia_nvshmem_cu12-3.3.24-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.3.24_cuda13-archive.tar.xz"; hash = "sha256-weefrl3+5buHO23tcuAeEEh1oY2oKFd7XOdn0wkYxdY="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/b1/7e/b8797780e442eabd9046cd6eb54100b8d0cb047ebc2f70931710cb03bcfe/nvidia_nvshmem_cu13-3.3.24-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-KK6CpNFLMiuTQJU13mLfa3uD9PdnLKl/yJEHwtQM4sI="; size = 60168129; filename = "nvidia_nvshmem_cu13-3.3.24-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.3.24_cuda12-archive.tar.xz"; hash = "sha256-jJwrtLhZrYELGrmCPxtkZ8WPqHnM2HvKKYqBS1Tg5fM="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/ac/49/7e1e3e98f5b8ae79f21260f9a90d8d985e5ad67b69b90b09456fc3c01a18/nvidia_nvshmem_cu12-3.3.24-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-ADKDHA7E/cZMO9ja6uWI9mR+5K/DN2xYcSGFRqysDoE="; size = 139158697; filename = "nvidia_nvshmem_cu12-3.3.24-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.3.24_cuda13-archive.tar.xz"; hash = "sha256-su2TKAWChE4c8itCm+RHTJeytg06qWHSVFGziDks+vU="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/6f/e9/8530afb8ed38d16bbc89cec80a4dd6a52dbf59bc93e546c3658cfa8b1f9b/nvidia_nvshmem_cu13-3.3.24-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-wU0JVxaX0uV8sHnI2uyIqxxoyzWGUyv71IhhJaCDObc="; size = 60390470; filename = "nvidia_nvshmem_cu13-3.3.24-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.4.5" = {
    releaseDate = "2025-09-06";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.4.5_cuda12-archive.tar.xz"; hash = "sha256-IcHv5nd9v8u8kkRLQgqrOZ9bVZAoTOCfHM2Ow1FrGSw="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/1d/6a/03aa43cc9bd3ad91553a88b5f6fb25ed6a3752ae86ce2180221962bc2aa5/nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-C0g2P8aWTe3kSAKUNMar7WxeN/gjy0PDvN5+z8BFfhU="; size = 138936938; filename = "nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.4.5_cuda13-archive.tar.xz"; hash = "sha256-CA4spt9GOl8/X1Cjkj711JFQODc0NkmpIssXcYaJ/AY="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/dc/0f/05cc9c720236dcd2db9c1ab97fff629e96821be2e63103569da0c9b72f19/nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-bcKhl/OOXQN2rVLNGio2F9PNwVD9WWb0rum867HWj+k="; size = 60215947; filename = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda12-archive.tar.xz"; hash = "sha256-BYy63cT/hka40b2TIuk8kOrlTIbhrIki8g2KVaf6i34="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/b5/09/6ea3ea725f82e1e76684f0708bbedd871fc96da89945adeba65c3835a64c/nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-BC8lAPJMAh24oGxe7CU5An1XRg4cGnYgVaZVT3LDab0="; size = 139103095; filename = "nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.4.5_cuda13-archive.tar.xz"; hash = "sha256-GPEoB8I7xbJwWBrx+br9VANp2ng+VXFxVYiHYj13hCw="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/3c/35/a9bf80a609e74e3b000fef598933235c908fcefcef9026042b8e6dfde2a9/nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-KQ8KLulMnzaHoCUC87kpmp+f6Cbm0Ch+4YSC541JW4A="; size = 60412546; filename = "nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.5.19" = {
    releaseDate = "2026-01-02";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.5.19_cuda12-archive.tar.xz"; hash = "sha256-qLf+cd9wQm8SV0hmumoWektN7JNUa1QOEJbfg4YD4Tk="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/c7/1b/06a698b584b67670e7f108381ecdf680d3a497c0567f5183644034f4212e/nvidia_nvshmem_cu12-3.5.19-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-Mz2R9oA4U58gpZHvTVzuJahdRAU3sxgJxOQq4XAPzM4="; size = 152515031; filename = "nvidia_nvshmem_cu12-3.5.19-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.5.19_cuda13-archive.tar.xz"; hash = "sha256-LBzhOGseCMebqpTvWo5E2MdBXPrUNA9SLcT450euADg="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/4e/62/d0835400d6d93474ed0b4655411eed2e807b8a1a8bb1e3a0e128e5209a63/nvidia_nvshmem_cu13-3.5.19-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-U0QK6Y6t072D/IdceT1zfizmGGMnWZQqMtTPsYFMCnQ="; size = 72222179; filename = "nvidia_nvshmem_cu13-3.5.19-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.5.19_cuda12-archive.tar.xz"; hash = "sha256-+6Vcufch9j6E180yyNeQ19SkTQzpTuHq0SpG/g57ypE="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/64/b9/6ab941001c23cfb43499b5b0b7417b0bb4dfba3a29ffa2b06985422dad50/nvidia_nvshmem_cu12-3.5.19-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-8pojxe51Rh7ENC4XdX+eAQNprajrDUQQcASdt4fZ5Rs="; size = 152681200; filename = "nvidia_nvshmem_cu12-3.5.19-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.5.19_cuda13-archive.tar.xz"; hash = "sha256-6lWCfg5aCPX1Upm0v48oPn/z50wca+1UC3x1F+K7y3M="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/c8/0f/28e11b20c47e8b67d108c6895f4e3eba05071df16bc5bd2e11a572918330/nvidia_nvshmem_cu13-3.5.19-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-D3NChdOgSCTBPp4sEWnbuBi+nLCBneaTiaqgZ7jRjJM="; size = 72433982; filename = "nvidia_nvshmem_cu13-3.5.19-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.5.21" = {
    releaseDate = "2026-02-27";
    aarch64-linux = {
      "12" = {
        pypi = { url = "https://files.pythonhosted.org/packages/4a/0a/8b1fb3d6d4271d3fba11c029c1326c8f3e8c971058d545ecfb428b6e7327/nvidia_nvshmem_cu12-3.5.21-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-+cgVdF+KEFZ/vyXVodUHn3eNZ+lCduWFo3Bvvam0kLs="; size = 152481001; filename = "nvidia_nvshmem_cu12-3.5.21-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/44/48/55705c0a9c6c5cfed0fcc4729d001570b36e3ff4b19bb8516c1c5b767890/nvidia_nvshmem_cu13-3.5.21-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-tsL33IyPMITgoj5JWwIKMMbLr04WdFAIYLy2XHmoyz0="; size = 72192841; filename = "nvidia_nvshmem_cu13-3.5.21-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        pypi = { url = "https://files.pythonhosted.org/packages/44/6a/cf1265d48719852f5144055ff611d9e71678a9b29afb7ace72bf248a0cd8/nvidia_nvshmem_cu12-3.5.21-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-DlG1K714+IlqdmdwGsQOPnpPD4BwPMznWzBMGPNZ1z8="; size = 152643745; filename = "nvidia_nvshmem_cu12-3.5.21-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/e1/0a/3963b15c1e51d197490fad1856b9dc372b141ef96fefe8661744b11021b9/nvidia_nvshmem_cu13-3.5.21-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-F7N2yl+Rcm43laqIjceitI5kLXvCEMcTVBFN24ST2nE="; size = 72405079; filename = "nvidia_nvshmem_cu13-3.5.21-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.6.5" = {
    releaseDate = "2026-03-24";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.6.5_cuda12-archive.tar.xz"; hash = "sha256-HLuJIhwqpF8G1uzq6KxD54BraRfeB6OVqD4okOu0pGg="; size = 191788340; };
        pypi = { url = "https://files.pythonhosted.org/packages/fb/da/bd8ae5201f8c5751ece31fe4fe489ece10fbcf5fcc1a595855b6459b6d6e/nvidia_nvshmem_cu12-3.6.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-ezhSH/hM38aNozYP4knPur/gXumqJxRYhXR2EksDpCA="; size = 153109548; filename = "nvidia_nvshmem_cu12-3.6.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.6.5_cuda13-archive.tar.xz"; hash = "sha256-Fqb/GJM+fJo2m9UiD54iAeGGy00EIAGqXrI0glG0v6k="; size = null; };
        pypi = { url = "https://files.pythonhosted.org/packages/83/6b/4c642d2cce57c8bd32043b4a608b6acc8cd0579c2f53af9a7ef9e1e1ccca/nvidia_nvshmem_cu13-3.6.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-lKoBSUkL5ljPlZRc6fFrqQqQ7b1qVkNm+Zbq10lvLyI="; size = 71726240; filename = "nvidia_nvshmem_cu13-3.6.5-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.6.5_cuda12-archive.tar.xz"; hash = "sha256-lZBIqJAASP15p/kdI8zpaVswMJ5qXcs5RN3PFsZrZD0="; size = 190224128; };
        pypi = { url = "https://files.pythonhosted.org/packages/9e/da/36fa8307cc40889307fed415d70b67d35ec330ffce889a9c03cf8f616cfa/nvidia_nvshmem_cu12-3.6.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-+G2zXxztIaeQ+iVdyufbiZi/hlWpXnbAM6ZXQZCzmOQ="; size = 153270920; filename = "nvidia_nvshmem_cu12-3.6.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.6.5_cuda13-archive.tar.xz"; hash = "sha256-wG1EqhXu0BKZNmUJeI2vF0RW1JLflMimFnZsQ7gZr6s="; size = 128835020; };
        pypi = { url = "https://files.pythonhosted.org/packages/5d/7b/2ab033584a3339552472ac8d79543c503a0e06dd0d082448b06697e7f716/nvidia_nvshmem_cu13-3.6.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-QAGqvHLq0y7MPJrdPGeBvvy3Gty+KG1/WVYELmhmjHA="; size = 71952588; filename = "nvidia_nvshmem_cu13-3.6.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.7.0" = {
    releaseDate = "2026-06-10";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.7.0_cuda12-archive.tar.xz"; hash = "sha256-uC4vD5yzQPUwyhaTB/veIotgsUd3E76wTvtKBoSG0e0="; size = 318546912; };
        pypi = { url = "https://files.pythonhosted.org/packages/29/4f/2d705ab9a090fe946dc2be0a3c30f9241e99c49058d2f9c269459b445edc/nvidia_nvshmem_cu12-3.7.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-BkJs1CEJOmNSnZCpXlfd+ITJykP5MBbXonuQPwoKyu0="; size = 230116748; filename = "nvidia_nvshmem_cu12-3.7.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/8c/e0/1285daedb2f320f1e5a73c36bf416e6906016f3a32f240531ec713422629/nvidia_nvshmem_cu13-3.7.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-PKmm3CBbZZKEDSlL6tNh4BNmIKjIfwRGZAEFfM8LlfI="; size = 135254149; filename = "nvidia_nvshmem_cu13-3.7.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.7.0_cuda12-archive.tar.xz"; hash = "sha256-fGWhUfotVdJWUP2902hGeUJ0P2Tzo+ZvAe82xV5oyVU="; size = 316315948; };
        pypi = { url = "https://files.pythonhosted.org/packages/3e/85/1c12e849e4d50624e75496378a3fb168389f768d3ec7cb694fba873ff9a8/nvidia_nvshmem_cu12-3.7.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-ymQ8uHohTA962Dlt73R63KoMjfsMt+UBIzisOw12QEs="; size = 230322323; filename = "nvidia_nvshmem_cu12-3.7.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.7.0_cuda13-archive.tar.xz"; hash = "sha256-+VTtkfonD0uQU5HgPYCPYMc7iU2I7wquhlkW1oU1O4w="; size = 241795868; };
        pypi = { url = "https://files.pythonhosted.org/packages/93/09/2de17f86c0a94401687d8f62fc35499bb894455ca05150fa7bb6b41ea1e6/nvidia_nvshmem_cu13-3.7.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-DSQFtVmor/185NrrcgLocszm2xTfKrOXiU6iTtv1Rz4="; size = 135495717; filename = "nvidia_nvshmem_cu13-3.7.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.7.1" = {
    releaseDate = "2026-06-30";
    aarch64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-sbsa/libnvshmem-linux-sbsa-3.7.1_cuda12-archive.tar.xz"; hash = "sha256-eCULhxugkx0qRLzIjsfWA0Vdeq3z42uJOXiynCiQ3hg="; size = 317660792; };
        pypi = { url = "https://files.pythonhosted.org/packages/d8/9a/a60b98b629e3b7c4ef6385b08c0e169f2048382c75476f377da54b83a8ca/nvidia_nvshmem_cu12-3.7.1-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-feg/KqK1hXC0BYVD/Tw+mSwZ+WVxOA1G7JsA4AYsYBU="; size = 229879072; filename = "nvidia_nvshmem_cu12-3.7.1-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/14/2f/472974dd368031048e23f00eb0761732b594622a66d7ddae592d9728ba6e/nvidia_nvshmem_cu13-3.7.1-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-I71kmusFGKOA7WSb2+CQy7rJWqJLgDiJBFTe3Vz1E1A="; size = 135080181; filename = "nvidia_nvshmem_cu13-3.7.1-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.7.1_cuda12-archive.tar.xz"; hash = "sha256-vVhkLPcTxLT99iHMYfxv7VqspDRtpqI+Sn5+uQg6/O0="; size = 317038956; };
        pypi = { url = "https://files.pythonhosted.org/packages/61/a2/d1d065914f1860782171c6bd2e5eabcbe4488c66352b468569a6b69d4bf6/nvidia_nvshmem_cu12-3.7.1-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-+sqHF8Mh8IjTwXSQ+/xoK6whSYboC5fiMsWulPkAxFw="; size = 230087166; filename = "nvidia_nvshmem_cu12-3.7.1-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        nvidia = { url = "https://developer.download.nvidia.com/compute/nvshmem/redist/libnvshmem/linux-x86_64/libnvshmem-linux-x86_64-3.7.1_cuda13-archive.tar.xz"; hash = "sha256-y7/O9MWfOjbguntc09Qw5pLxV2USbARjh55RAZAmelc="; size = 233276624; };
        pypi = { url = "https://files.pythonhosted.org/packages/01/00/867006cd5626ed608fce8bf4227bfd3e1d25216abe1d110bb299fecf79b3/nvidia_nvshmem_cu13-3.7.1-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-0KxsNNd9dSjHLw5Q7WoDoZZwqMbQ3IxnoG92hQJpj5o="; size = 135321350; filename = "nvidia_nvshmem_cu13-3.7.1-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.7.2" = {
    releaseDate = "2026-07-17";
    aarch64-linux = {
      "12" = {
        pypi = { url = "https://files.pythonhosted.org/packages/88/a1/9ca9cc3338217311cee21f7ba795dad4f38b7a279a6da7d3d549258f60b1/nvidia_nvshmem_cu12-3.7.2-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-mEld4wmU8UAaEsyBWP+svq2kRXn1QYXXVmU4FGgFb6o="; size = 229963056; filename = "nvidia_nvshmem_cu12-3.7.2-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/81/11/1767ef120299972822a43aceffbc81ac813aad2089d817e36e4e12aa4c9c/nvidia_nvshmem_cu13-3.7.2-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-DnSDCLngqKjYGFk1Pz5smPvoWoX2UqkVorpgFJoL0SQ="; size = 135174619; filename = "nvidia_nvshmem_cu13-3.7.2-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        pypi = { url = "https://files.pythonhosted.org/packages/63/03/cde130e3ff706784f9efd47204f299b15113ea08203e98a556603dac245d/nvidia_nvshmem_cu12-3.7.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-ArbTSC2Q6ouiFLxAA2Ipf1cyV3Y5kKmMmEbsXHhqcic="; size = 230171132; filename = "nvidia_nvshmem_cu12-3.7.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/4f/4a/037dfbbafc96ad1828ef62326f27970cae2c0eb271cf5b8e6922f32a7427/nvidia_nvshmem_cu13-3.7.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-uaT4Q8YrXd7YrTP9bSIOAH3NOfBs7lSSkvW6FM5MI1w="; size = 135397797; filename = "nvidia_nvshmem_cu13-3.7.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
  "3.8.0" = {
    releaseDate = "2026-09-22";
    aarch64-linux = {
      "12" = {
        pypi = { url = "https://files.pythonhosted.org/packages/92/62/ec1c9a367ede1ac030b5c2fa37caeaf33c6841beb9c3665497e8bbf70194/nvidia_nvshmem_cu12-3.8.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-MTukHIqs8D+VJMqD3bLGLns9gvca+BWjXjc589ZEUrI="; size = 280599580; filename = "nvidia_nvshmem_cu12-3.8.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/49/a3/a17ee2e50d4cdf0a18716d8ded8be8248430f768c87f6807d431681645c2/nvidia_nvshmem_cu13-3.8.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; hash = "sha256-gSAXUCT1KmQyPPxdZF6VrHNF8e4kOpmNFAzhkWMoUpQ="; size = 181881399; filename = "nvidia_nvshmem_cu13-3.8.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"; };
      };
    };
    x86_64-linux = {
      "12" = {
        pypi = { url = "https://files.pythonhosted.org/packages/42/1d/3ffe6972761c9e77d6bf3cc15d0cea27ac23341de5436e091c6c965c3886/nvidia_nvshmem_cu12-3.8.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-suV2DWFYrv57t0NI1RKLsbRqfdH9S3seb+VbSweIj3A="; size = 280800183; filename = "nvidia_nvshmem_cu12-3.8.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
      "13" = {
        pypi = { url = "https://files.pythonhosted.org/packages/74/5d/674525ba89232e9f7ae71f393ee97a7855e82728099ebda4c377901300e2/nvidia_nvshmem_cu13-3.8.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; hash = "sha256-gaTR9mZUPm00320v+UDH2hQ1404YaqtvPCtIhhtk7zg="; size = 182092449; filename = "nvidia_nvshmem_cu13-3.8.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"; };
      };
    };
  };
}
