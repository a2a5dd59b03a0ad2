#!/usr/bin/env bash
# The NVSHMEM release matrix runner (one release per run); the whole text is in
# python/scripts/nvshmem_matrix.py, or run with --help.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$here/nvshmem_matrix.py" "$@"
